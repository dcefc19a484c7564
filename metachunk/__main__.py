"""``python -m metachunk``: the ``metachunk`` command."""

import sys

from metachunk.cli import main

sys.exit(main())
