"""``python -m metachunk.train --config recipes/train/cpu_smoke.yaml``, also under ``deepspeed`` / ``accelerate launch``."""

import sys

from metachunk.train.sft import main

sys.exit(main())
