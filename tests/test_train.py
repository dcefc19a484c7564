"""SFT with TRL on CPU: config errors, completion-only label masking, a short real run."""

import json
import shutil
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train" / "cpu_smoke.yaml"


def test_invalid_configs_fail_before_any_model_loads(tmp_path, capsys):
    from metachunk.train.sft import main

    bad_dtype = ["--config", str(RECIPE), "--dataset_name", str(tmp_path), "--dtype", "float8"]
    assert main(bad_dtype + ["--output_dir", str(tmp_path / "o")]) == 2
    assert "field 'dtype'" in capsys.readouterr().err
    assert (
        main(["--config", str(RECIPE), "--dataset_name", str(tmp_path), "--output_dir", str(tmp_path / "o")])
        == 2
    )
    assert "has no data/ dir" in capsys.readouterr().err
    assert (
        main(["--config", str(RECIPE), "--learning_rte", "1e-5"]) == 2
    )  # TRL's parser names an unknown flag
    assert "--learning_rte" in capsys.readouterr().err


def test_evaluation_without_validation_rows_is_a_config_error(sft_dataset, tmp_path, capsys):
    from metachunk.train.sft import main

    sft_dataset = Path(shutil.copytree(sft_dataset, tmp_path / "ds"))  # the fixture is shared: edit a copy
    report = sft_dataset / "build_report.json"
    stats = json.loads(report.read_text())
    report.write_text(json.dumps({**stats, "rows": {**stats["rows"], "validation": 0}}))
    argv = ["--config", str(RECIPE), "--dataset_name", str(sft_dataset), "--output_dir", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "field 'eval_strategy' is 'steps'" in capsys.readouterr().err


def test_prompt_tokens_are_masked_and_completion_tokens_trained(sft_dataset, tiny_model_dir):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = load_dataset(str(sft_dataset), split="train").select_columns(["prompt", "completion"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=SFTConfig(
            output_dir=str(sft_dataset.parent / "t"),
            use_cpu=True,
            report_to="none",
            max_length=None,
            activation_checkpointing=True,  # TRL's default, under transformers' current name
        ),
        train_dataset=rows,
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    rendered = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)
    prompt_len = len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert all(label == -100 for label in labels[:prompt_len])  # every prompt token is masked
    trained = [t for t, label in zip(ids, labels) if label != -100]
    assert labels[prompt_len:] == ids[prompt_len:] and trained
    assert tokenizer.decode(trained).startswith(rows[0]["completion"][0]["content"])


def test_cpu_smoke_recipe_trains_saves_and_plots(sft_dataset, tiny_model_dir, tmp_path):
    from metachunk.train.sft import main
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "3", "--max_length", "4096"]  # fmt: skip
    assert main(argv) == 0
    log = json.loads((out / "train_log.json").read_text())
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "model.safetensors").exists()
    # validation during training (eval_steps 2), TensorBoard by default, the facts the card is written from
    assert [e["step"] for e in log if "eval_loss" in e][:1] == [2]
    assert list(out.glob("runs/**/events.out.tfevents.*")), "no TensorBoard event file"
    facts = json.loads((out / "metachunk_run.json").read_text())
    assert facts["global_steps"] == 3 and facts["final_train_loss"] == losses[-1]
    assert facts["final_eval_loss"] == [e["eval_loss"] for e in log if "eval_loss" in e][-1]
    assert facts["hyperparameters"]["learning_rate"] == 1e-5 and facts["dataset_report"]["task"] == "rewrite"
    AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)


def test_metachunk_train_is_python_m_train(tmp_path, capsys):
    from metachunk.cli import main

    assert main(["train", "--config", str(RECIPE), "--dataset_name", str(tmp_path)]) == 2
    assert "has no data/ dir" in capsys.readouterr().err


def test_lora_trains_merges_and_reloads(sft_dataset, tiny_model_dir, tmp_path):
    import torch
    from metachunk.train.sft import main
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "2", "--max_length", "4096", "--use_peft", "true",
            "--lora_r", "4", "--learning_rate", "1e-2"]  # fmt: skip
    assert main(argv) == 0
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    merged = PeftModel.from_pretrained(base, out).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", use_safetensors=True)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    changed = [
        name
        for name, weight in reloaded.state_dict().items()
        if not torch.equal(weight, original.state_dict()[name])
    ]
    assert changed  # the adapter was trained and merged into the base weights


def test_resume_after_a_kill_continues_steps_and_losses(sft_dataset, tiny_model_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from metachunk.train.sft import whole_checkpoint

    steps = 30

    def argv(out):
        return [sys.executable, "-m", "metachunk.train", "--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir),
                "--dataset_name", str(sft_dataset), "--output_dir", str(out), "--max_steps", str(steps),
                "--max_length", "4096", "--save_strategy", "steps", "--save_steps", "2"]  # fmt: skip

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    whole = subprocess.run(
        argv(tmp_path / "whole"), cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = {
        e["step"]: e["loss"]
        for e in json.loads((tmp_path / "whole" / "train_log.json").read_text())
        if "loss" in e
    }

    out = tmp_path / "killed"
    run = subprocess.Popen(argv(out), cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not whole_checkpoint(out / "checkpoint-4"):
        assert run.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert not (out / "train_log.json").exists()  # it really died mid-run

    resumed = subprocess.run(argv(out) + ["--resume_from_checkpoint", "latest"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    import re

    resumed_at = int(re.search(r"resuming from \S+checkpoint-\d+ at step (\d+)", resumed.stderr).group(1))
    assert 4 <= resumed_at < steps  # continued from the newest checkpoint, not from step 1
    log = json.loads((out / "train_log.json").read_text())
    logged_steps = [e["step"] for e in log if "loss" in e]
    assert logged_steps == list(range(1, steps + 1))  # every step once: the history carries over
    losses = {e["step"]: e["loss"] for e in log if "loss" in e}
    for step in range(resumed_at + 1, steps + 1):  # the same batches and weights as the uninterrupted run
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step


def test_an_empty_training_set_is_nothing_to_do_not_a_crash(sft_dataset, tmp_path, capsys):
    """Exit status 5 (EXIT_EMPTY), no checkpoint: `metachunk run` records the stage as empty."""
    from metachunk.train.sft import main

    from metachunk.artifacts import EXIT_EMPTY

    sft_dataset = Path(shutil.copytree(sft_dataset, tmp_path / "ds"))
    report = sft_dataset / "build_report.json"
    report.write_text(json.dumps({**json.loads(report.read_text()), "rows": {"train": 0, "validation": 0}}))
    out = tmp_path / "o"
    assert (
        main(["--config", str(RECIPE), "--dataset_name", str(sft_dataset), "--output_dir", str(out)])
        == EXIT_EMPTY
    )
    assert "nothing to train" in capsys.readouterr().err
    assert not out.exists()
