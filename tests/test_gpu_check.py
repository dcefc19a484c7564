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
    for step in ("random_model", "ppl_speed", "msp_speed", "train_mfu", "chunk_1_workers", "chunk_2_workers"):
        assert f"== {step}:" in summary
    assert "FAILED" not in summary
    assert "1 and 2 workers wrote identical shards" in summary
