"""``python -m train --config recipes/train/cpu_smoke.yaml``, also under ``deepspeed`` / ``accelerate launch``."""

import sys

from train.sft import main

sys.exit(main())
