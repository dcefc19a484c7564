"""``bench/gpu_check.sh --dry-run``: the GPU machine's one prepared script runs on CPU, every step
(random model, PPL and MSP speed, training MFU, a 1- and 2-worker chunk run), so it cannot rot
between the rare sessions that have a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    for step in (
        "random_model",
        "ppl_speed",
        "msp_speed",
        "train_mfu",
        "chunk_1_workers",
        "chunk_2_workers",
        "plain_vs_engine_tiny",
        "scoring_parity",
        "rewrite_speed",
    ):
        assert f"== {step}:" in summary
    assert "FAILED" not in summary
    assert "1 and 2 workers wrote identical shards" in summary


def test_gpu_check_stops_with_a_clear_error_where_the_package_is_not_installed(tmp_path):
    # A bare checkout on PYTHONPATH has metachunk but no metachunk.chunking (pyproject's package-dir
    # maps the top-level folders in), which is what a fresh GPU machine has before `pip install -e .`.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages, no install
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "install the package first" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_version_has_one_home():
    # importlib.metadata.version("metachunk") raises in a checkout that was never installed; the
    # package's __version__ already falls back, so every other module reads that.
    callers = [
        str(path.relative_to(ROOT))
        for folder in ("metachunk", "chunking", "distill", "train", "eval")
        for path in (ROOT / folder).rglob("*.py")
        if 'version("metachunk")' in path.read_text(encoding="utf-8")
    ]
    assert callers == ["metachunk/__init__.py"]
