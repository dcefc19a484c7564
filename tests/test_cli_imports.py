"""Building the CLI parser (what ``metachunk --help`` does) imports no heavy package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "openai", "datasketch", "transformers", "datasets", "trl", "deepspeed", "aiohttp", "scipy")


def test_build_parser_imports_no_heavy_package():
    code = (
        "import metachunk.cli as c; c.build_parser(); import sys; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"
