"""DeepSpeed ZeRO on CPU: config validation, and a 2-process ZeRO-3 run that matches one process."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from metachunk.train.distributed import validate_deepspeed_config
from support.fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train" / "cpu_smoke.yaml"
DS = ROOT / "recipes" / "deepspeed"


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_shipped_deepspeed_configs_validate(name):
    cfg = validate_deepspeed_config(DS / name)
    assert cfg["zero_optimization"]["stage"] in (2, 3)


def _write(tmp_path, cfg, name="ds.json") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda c: "{not json", "not JSON"),
        (lambda c: {**c, "zero_optimization": {}}, "zero_optimization.stage"),
        (lambda c: c | {"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        (
            lambda c: c | {"zero_optimization": {"stage": 3}},
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
        (
            lambda c: (
                c | {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
            ),
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
        (lambda c: c | {"train_batch_size": 16}, "train_batch_size"),
        (lambda c: c | {"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu"),
        (lambda c: c | {"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
    ],
)
def test_bad_deepspeed_configs_name_file_and_key(tmp_path, change, key):
    good = json.loads((DS / "zero3.json").read_text())
    path = _write(tmp_path, change(good), "bad_ds.json")
    with pytest.raises(ValueError) as e:
        validate_deepspeed_config(path)
    assert str(path) in str(e.value) and key in str(e.value)


def test_sft_config_check_rejects_a_bad_deepspeed_config(tmp_path, sft_dataset, capsys):
    from metachunk.train.sft import main

    bad = _write(tmp_path, {"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}, "bad_ds.json")
    argv = ["--config", str(RECIPE), "--dataset_name", str(sft_dataset), "--output_dir", str(tmp_path / "o"),
            "--deepspeed", str(bad)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bad_ds.json" in err and "stage3_gather_16bit_weights_on_model_save" in err
    not_json = _write(tmp_path, "{not json", "broken.json")  # caught before SFTConfig reads it
    assert main(argv[:-1] + [str(not_json)]) == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and "not JSON" in err


def test_accelerate_deepspeed_config_is_checked_too(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from metachunk.train.distributed import check_deepspeed

    bad = _write(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}, "acc.json")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(bad))
    with pytest.raises(ValueError, match="acc.json.*gradient_accumulation_steps"):
        check_deepspeed(SimpleNamespace(deepspeed=None))
    # A deepspeed field (recipe or flag) naming another config than the accelerate config's: the Trainer would run
    # the field's and ignore the launch's, so it is refused; the same config, by any path, is fine.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(DS / "zero2.json"))
    with pytest.raises(
        ValueError, match=r"field 'deepspeed' is \S+zero3.json but the accelerate config names \S+zero2"
    ):
        check_deepspeed(SimpleNamespace(deepspeed=str(DS / "zero3.json")))
    check_deepspeed(SimpleNamespace(deepspeed=str(DS / "zero2.json")))
    check_deepspeed(
        SimpleNamespace(deepspeed=str(_write(tmp_path, (DS / "zero2.json").read_text(), "copy.json")))
    )


def _losses(out: Path) -> list[float]:
    return [e["loss"] for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero3_two_cpu_processes_match_one_process(sft_dataset, tiny_model_dir, tmp_path):
    """ZeRO-3 on 2 CPU ranks x 1 row = 1 plain process x 2 rows: same global batch, same losses.

    Both runs seed the sampler alike (``--seed 0 --data_seed 0``) and the distributed sampler hands
    rank r the r-th row of each global batch, so every step sees the same two rows. The recipe's
    warm-up makes step 1's learning rate 0, so steps 1 and 2 are losses of the initial weights and
    step 3 follows one AdamW step. The recipe is float32 all through (bf16: false): measured, the two
    runs differ by <= 6.5e-8 relative; rel 1e-5 leaves a 150x margin and would catch bf16, which
    TRL's SFTConfig turns on when a recipe leaves it unset (9.6e-5 relative then, and bf16 weights
    saved). About 30 s on 2 cores; the very first run on a machine JIT-compiles DeepSpeed's shm comm
    op into ~/.cache/torch_extensions (~85 s then).
    """
    common = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
              "--max_steps", "3", "--max_length", "4096", "--seed", "0", "--data_seed", "0"]  # fmt: skip
    # PYTHONFAULTHANDLER: a rank that aborts as it exits (see sft.end_process_group) prints every thread's stack
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    ds_out, port = tmp_path / "zero3", free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), "--module", "metachunk.train", *common,
           "--output_dir", str(ds_out), "--per_device_train_batch_size", "1",
           "--deepspeed", str(DS / "zero3.json"), "--ddp_backend", "gloo"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # DeepSpeed's CPU all-reduce ran over shared memory, and its buffers did not outlive the run
    # (train.distributed.unlink_allreduce_buffer)
    assert "ShareMemCommBuilder" in done.stdout + done.stderr or "shm_comm" in done.stdout + done.stderr
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))

    one_out = tmp_path / "single"
    cmd = [sys.executable, "-m", "metachunk.train", *common, "--output_dir", str(one_out),
           "--per_device_train_batch_size", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]

    zero3, single = _losses(ds_out), _losses(one_out)
    assert len(zero3) == len(single) == 3
    assert zero3 == pytest.approx(single, rel=1e-5)

    # the trainer's throughput counts the real tokens of every rank: TRL's own count (gathered over the ranks), and
    # the same tokens, parameters and FLOPs as one process fed the same batches
    counted = {}
    for out, world in ((ds_out, 2), (one_out, 1)):
        throughput = json.loads((out / "metachunk_run.json").read_text())["throughput"]
        num_tokens = {
            e["step"]: e["num_tokens"]
            for e in json.loads((out / "train_log.json").read_text())
            if "loss" in e
        }
        assert throughput["world_size"] == world and throughput["steps"] == [2, 3]
        assert throughput["tokens"] == num_tokens[3] - num_tokens[1] > 0
        counted[world] = [
            throughput[k] for k in ("tokens", "tokens_scored", "matmul_params", "head_params", "flops_dense")
        ]
    assert counted[2] == counted[1]  # and ZeRO-3's partitioned weights counted whole (ds_numel)

    import torch
    from transformers import AutoModelForCausalLM

    # the gathered weights (stage3_gather_16bit_weights_on_model_save): float32, as trained
    model = AutoModelForCausalLM.from_pretrained(ds_out, use_safetensors=True, dtype="auto")
    assert all(p.numel() > 0 and p.dtype == torch.float32 for p in model.parameters())
    precision = json.loads((ds_out / "metachunk_run.json").read_text())["precision"]
    assert precision == {"dtype": "float32", "bf16": False, "fp16": False, "autocast": None, "bf16_given": True,
                         "saved_dtype": "float32"}  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero2_trains_a_bf16_model_with_fp32_gradient_accumulation(sft_dataset, tiny_model_dir, tmp_path):
    """The shipped ZeRO-2 config asks DeepSpeed to accumulate gradients in fp32 (`data_types`), as the 3B
    recipes' bf16 runs over 32 micro-batches need: a bf16 model under it trains (CPU, 2 micro-batches a step)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    for shipped in ("zero2.json", "zero3.json", "zero3_offload.json"):  # the offload one lacked it
        assert json.loads((DS / shipped).read_text())["data_types"] == {"grad_accum_dtype": "fp32"}, shipped
    out = tmp_path / "bf16"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
           "--module", "metachunk.train", "--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir),
           "--dataset_name", str(sft_dataset), "--max_steps", "2", "--max_length", "4096", "--output_dir", str(out),
           "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--bf16", "true",
           "--dtype", "bfloat16", "--deepspeed", str(DS / "zero2.json"), "--ddp_backend", "gloo"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
