"""``bench/gpu_check.sh --dry-run`` and ``bench/gpu_train_check.sh --dry-run``: the GPU machine's prepared
scripts run on CPU, every step (random models, PPL and MSP speed, training MFU, a 1- and 2-worker chunk
run; the 3B recipe's launches under deepspeed and accelerate, kill -9 and resume, export and rewriting), so
they cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
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
        "engine_profile",
        "scoring_parity",
        "rewrite_speed",
    ):
        assert f"== {step}:" in summary
    assert "FAILED" not in summary
    assert "1 and 2 workers wrote identical shards" in summary
    # MSP's decisions are judged in fp32: a random model's bf16 margins sit at bf16's noise
    msp = json.loads((tmp_path / "msp_speed.json").read_text())
    assert msp["decision_check"]["dtype"] == "torch.float32" and msp["identical_decisions"]
    # what the node had before any install: the NODE_FREEZE of the next `make wheelhouse`
    assert any(line.startswith("torch==") for line in (tmp_path / "node-freeze.txt").read_text().splitlines())


def test_gpu_train_check_dry_run_launches_the_3b_recipe_every_way_on_cpu(tmp_path):
    """The 3B recipe on a tiny model over gloo: ZeRO-2 and ZeRO-3 through `deepspeed`'s runner, `accelerate
    launch` with the shipped ZeRO-2 config, packed and padded, kill -9 then resume, export and rewriting; each
    run's throughput recorded by the trainer."""
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_TRAIN_PORT_BASE": str(free_port())}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_train_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    assert "FAILED" not in summary
    for step in (
        "zero2",
        "zero3",
        "resume",
        "accelerate",
        "zero2_packed",
        "zero2_padded",
        "export",
        "rewrite_speed",
    ):
        assert f"== {step}:" in summary
    resume = json.loads((tmp_path / "resume" / "train_resume.json").read_text())
    assert resume["pass"] and resume["resumed_at"] >= resume["kill_after_step"]
    assert (tmp_path / "resume" / "train_resume.png").stat().st_size > 0
    for run in ("zero2", "zero3", "accelerate", "zero2_packed", "zero2_padded"):
        throughput = json.loads((tmp_path / run / "metachunk_run.json").read_text())["throughput"]
        assert throughput["tokens"] > 0 and throughput["tflops_per_device"] > 0, run
        assert f"   {run}: " in summary
    stages = {run: json.loads((tmp_path / run / "metachunk_run.json").read_text())["hyperparameters"]["deepspeed"]
              for run in ("zero2", "zero3", "accelerate")}  # fmt: skip
    assert stages["zero3"].endswith("zero3.json") and stages["accelerate"].endswith("zero2.json")
    assert (
        "== a 20,000-row rewriter set, 3 epochs of " in summary
    )  # the GPU-hours estimate, from zero2's rate
    assert "torch==" in (tmp_path / "node-freeze.txt").read_text()


def test_gpu_check_steps_run_a_share_of_the_list(tmp_path):
    """GPU_CHECK_STEPS names the steps to run (a device command is cut at 10 minutes): the model they need is
    built, nothing else runs, and the skipped chunk steps are not reported as a failed comparison.
    GPU_CHECK_RESULTS gets what the device machine can bring back: a few small files, no folder, no model."""
    results = tmp_path / "results"
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "GPU_CHECK_RESULTS": str(results),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GPU_CHECK_STEPS": "scoring_parity"}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    assert [line.split(":")[0] for line in summary.splitlines() if line.startswith("== ")] == [
        "== random_model",
        "== scoring_parity",
    ]
    back = sorted(path.name for path in results.iterdir())
    assert back == ["node-freeze.txt", "node.txt", "reports.tar.gz", "summary.txt"]
    assert (results / "summary.txt").read_text() == summary
    with tarfile.open(results / "reports.tar.gz") as tar:
        names = tar.getnames()
    assert "./scoring_parity.log" in names and "./scoring_parity.json" in names
    assert not [name for name in names if "random-" in name]


def test_a_training_command_builds_only_the_models_its_steps_train(tmp_path):
    """GPU_TRAIN_STEPS=export with a carried set needs neither random model (the 3B is ~6 GB to write on the
    node); a spent budget skips every step it reaches and says so, so the summary lists exactly those."""
    dataset = tmp_path / "sft"
    dataset.mkdir()
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_TRAIN_STEPS": "export", "GPU_TRAIN_DATASET": str(dataset), "GPU_CHECK_BUDGET": "1"}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_train_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert proc.returncode == 1, summary + proc.stderr[-2000:]
    reached = [line.split(":")[0] for line in summary.splitlines() if line.startswith("== ") and ": " in line]
    assert reached[0] == "== export" and not [name for name in reached if "random_" in name], summary


def test_a_step_past_the_commands_budget_is_skipped_and_said(tmp_path):
    """GPU_CHECK_BUDGET: a device command is killed at its limit, so a step that would start with less than the
    publish's margin left is skipped, said in the summary, and the results still come back."""
    results = tmp_path / "results"
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "GPU_CHECK_RESULTS": str(results),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GPU_CHECK_STEPS": "scoring_parity",
           "GPU_CHECK_BUDGET": "1"}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    summary = (tmp_path / "work" / "summary.txt").read_text()
    assert proc.returncode == 1, summary + proc.stderr[-2000:]
    assert summary.count("SKIPPED: the command's budget (GPU_CHECK_BUDGET=1 s) is spent") == 2, summary
    assert "ok in" not in summary and not (tmp_path / "work" / "random-tiny").exists()
    assert (results / "summary.txt").read_text() == summary


def test_gpu_check_stops_with_a_clear_error_where_the_package_is_not_installed(tmp_path):
    # A fresh GPU machine before `pip install`: an interpreter without the package or its dependencies.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages, no install
    python.chmod(0o755)
    env = {
        **os.environ,
        "GPU_CHECK_DIR": str(tmp_path / "out"),
        "GPU_CHECK_RESULTS": str(tmp_path / "results"),
        "PYTHON": str(python),
    }
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "install the package first" in proc.stderr
    assert "Traceback" not in proc.stderr
    # what the node had comes back even so: the freeze for the wheelhouse that would install it
    assert (tmp_path / "results" / "node-freeze.txt").is_file()


def test_the_wheelhouse_install_puts_the_build_requirement_in_first(tmp_path):
    # DeepSpeed's sdist builds without isolation, with the node's own setuptools: where the folder carries
    # one (wheelhouse.json's build_requires), it goes in before metachunk[train]; where pip fails, exit 2.
    calls = tmp_path / "calls.txt"
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$@" >> {calls}; '
        f'case "$*" in *FAIL*) exit 1;; esac; exit 0; fi\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()

    def install(build_requires):
        (wheels / "wheelhouse.json").write_text(json.dumps({"build_requires": build_requires}))
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PY": str(python), "GPU_CHECK_WHEELHOUSE": str(wheels)}
        return subprocess.run(["bash", "-c", f"source {ROOT / 'bench' / 'steps.sh'} && install_from_wheelhouse"],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip

    assert install(["setuptools>=70.1"]).returncode == 0
    first, second, third = calls.read_text().splitlines()
    assert first == f"-m pip install --no-index --find-links {wheels} setuptools>=70.1"
    assert second == f"-m pip install --no-index --find-links {wheels} --no-build-isolation metachunk[train]"
    # then the carried metachunk again, alone: a warm machine's copy of the same version is replaced
    assert third == f"-m pip install --no-index --find-links {wheels} --no-deps --force-reinstall metachunk"

    assert install([]).returncode == 0
    assert len(calls.read_text().splitlines()) == 2

    proc = install(["FAIL>=1"])
    assert proc.returncode == 2 and "the install of FAIL>=1" in proc.stderr
    assert len(calls.read_text().splitlines()) == 1  # metachunk[train] not tried


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


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeTrace:
    """What bench/ppl_profile.py reads of a torch.profiler trace: operator averages, and the device's
    events (``device_type`` CUDA) with their time ranges in µs."""

    def __init__(self, kernels: list[tuple[float, float]]):
        from torch.autograd import DeviceType

        self.kernels = [
            SimpleNamespace(device_type=DeviceType.CUDA, time_range=SimpleNamespace(start=a, end=b))
            for a, b in kernels
        ]
        self.cpu = [
            SimpleNamespace(device_type=DeviceType.CPU, time_range=SimpleNamespace(start=0.0, end=1e6))
        ]

    def events(self):
        return self.cpu + self.kernels

    def key_averages(self):
        return [
            SimpleNamespace(
                key="aten::mm", count=len(self.kernels), self_device_time_total=1.0, self_cpu_time_total=2.0
            )
        ]


def test_the_engine_profile_tells_launches_from_host_work_from_a_busy_gpu():
    profile = load_bench("ppl_profile")
    # two streams' kernels overlap: covered once
    assert profile.union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert profile.gaps([(0, 10), (5, 15), (20, 30)]) == [5]

    # 100 kernels of 5 µs, 5 µs apart: half the wall idle, all of it in short gaps
    launches = profile.read_trace(
        FakeTrace([(10 * k, 10 * k + 5) for k in range(100)]), 1000.0, 20.0, 4, True
    )
    assert launches["kernels"] == 100 and launches["kernels_per_batch"] == 25
    assert launches["gpu_busy_share"] == 0.5 and launches["kernel_us_median"] == 5
    assert launches["short_gaps"] == 99 and launches["long_gaps"] == 0
    assert launches["verdict"].startswith("launch-bound")

    # 10 kernels of 50 µs, 1 ms apart: the GPU waits for the host between batches
    host = profile.read_trace(
        FakeTrace([(1050 * k, 1050 * k + 50) for k in range(10)]), 10_500.0, 20.0, 10, True
    )
    assert host["long_gaps"] == 9 and host["verdict"].startswith("host-bound")

    busy = profile.read_trace(FakeTrace([(0, 950), (951, 1000)]), 1000.0, 20.0, 1, True)
    assert busy["gpu_busy_share"] == 0.999 and busy["verdict"].startswith("bound by the GPU's work")

    on_cpu = profile.read_trace(FakeTrace([]), 1000.0, 20.0, 1, False)
    assert "verdict" not in on_cpu and on_cpu["top_ops"]


def test_the_parity_check_fails_where_a_plan_leaves_a_token_unscored():
    import numpy as np

    parity = load_bench("scoring_parity")
    nan = float("nan")
    reference = [np.array([nan, 1.0, 2.0, 3.0]), np.array([nan, 4.0]), np.array([nan])]
    assert parity.max_nll_diff([x.copy() for x in reference], reference) == 0.0
    assert parity.max_nll_diff([reference[0] + 1e-4, reference[1], reference[2]], reference) == pytest.approx(
        1e-4
    )
    holed = np.array([nan, 1.0, nan, nan])  # nanmax alone saw no difference here
    assert parity.max_nll_diff([holed, reference[1], reference[2]], reference) == float("inf")
    assert parity.max_nll_diff([reference[0], np.array([nan, nan]), reference[2]], reference) == float("inf")


def test_the_pass_flops_count_from_the_models_shape_alone():
    # chunk's worker counts a 7B's FLOPs on the meta device (no weights): the same count as the loaded
    # model's, tied head included; the attention's key count in closed form equals the loop it replaced.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    speed = load_bench("ppl_speed")
    for n, span in [(0, 4), (1, 4), (3, 4), (4, 4), (9, 4), (5000, 2048)]:
        assert speed.keys_attended(n, span) == sum(min(t + 1, span) for t in range(n))
    for tied in (True, False):
        config = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      tie_word_embeddings=tied)  # fmt: skip
        real = AutoModelForCausalLM.from_config(config)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        lengths = [3, 700, 5000]
        assert speed.exact_pass_flops(meta, lengths, 2048) == speed.exact_pass_flops(real, lengths, 2048)
        head = 64 * 1000
        params = sum(p.numel() for p in real.parameters()) - head + (head if tied else 0)
        assert speed.exact_pass_flops(real, [1], 2048) == 2.0 * params + 4.0 * 64 * 2 * 1
        # the plain-pass FLOP count: the body on every token processed, the head (once, tied or not) on the scored
        body = params - head
        assert (
            speed.plain_flops(meta, 10, 7)
            == speed.plain_flops(real, 10, 7)
            == 2.0 * body * 10 + 2.0 * head * 7
        )
    # the engine's window plan at max_context 4: 5 tokens in windows [0, 4) and [2, 5); 10 in [0, 4), [2, 6),
    # [4, 8), [6, 10); a 1-token document scores nothing
    assert speed.window_counts([1, 5, 10], 4) == {"processed": 4 + 3 + 16, "scored": 0 + 4 + 9}


def test_plain_batched_scores_each_token_once_from_its_own_window(tiny_model_dir):
    """bench's plain-batched pass, the baseline the engine is measured against: its targets (built
    with tensor ops under a mask) are every token but the first, each scored once from the window that
    owns it, across padded batches and head chunks that split rows; checked against one forward per
    window and a sum by hand."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    speed = load_bench("ppl_speed")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    docs = [
        "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years. " * k
        for k in (1, 3, 6)
    ]
    window, stride = 24, 10
    nll, counts = speed.plain_batched(model, tok, docs, window=window, stride=stride, budget=60, head_rows=7)
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert counts["doc_tokens"] == [len(x) for x in ids] and counts["scored"] == sum(len(x) - 1 for x in ids)
    assert counts["batches"] > 1 and counts["windows"] > len(docs)
    with torch.inference_mode():
        for k, x in enumerate(ids):
            expected, start = 0.0, 0
            while True:
                end = min(start + window, len(x))
                logp = torch.log_softmax(model(input_ids=torch.tensor([x[start:end]])).logits[0].float(), -1)
                # target t, predicted at position t - 1; a later window's first window - stride are context
                for t in range(start + (window - stride if start else 1), end):
                    expected -= logp[t - 1 - start, x[t]].item()
                if end == len(x):
                    break
                start += stride
            assert nll[k] == pytest.approx(expected, rel=1e-5), k
