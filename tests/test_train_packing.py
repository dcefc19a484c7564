"""Packing and padding-free SFT on CPU: same per-token loss as a padded batch, and a short real run.

A padding-free batch (TRL's ``padding_free``, also what ``packing`` with the bfd strategy gives) is one
flattened row per micro-batch, its rows told apart only by ``position_ids`` restarting at 0. With sdpa and eager,
transformers 5 turns those into a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``), so
no row attends to another: the completion tokens' log-probs are those of the padded batch.
"""

import json
import math

import pytest
from test_train import RECIPE


def _trainer(rows, model_dir, out, attn, **config):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    # activation_checkpointing: TRL's default, under transformers' current name (no FutureWarning)
    args = SFTConfig(
        output_dir=str(out), use_cpu=True, report_to="none", activation_checkpointing=True, **config
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(model_dir)
    )
    return trainer


def _completion_log_probs(trainer, batch):
    """Log-prob of every completion token, in batch order, through the forward training uses (TRL's fused head)."""
    import torch

    model = trainer.model.eval()
    with torch.no_grad():
        out = model(**batch, fused_lm_head=True, use_cache=False)
    return out.log_probs[out.label_mask]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_and_packed_batches_give_the_padded_losses(sft_dataset, tiny_model_dir, tmp_path, attn):
    import torch
    from datasets import load_dataset

    rows = load_dataset(str(sft_dataset), split="train").select_columns(["prompt", "completion"])
    rows = rows.filter(lambda row: len(row["completion"][0]["content"]) < 1000)  # not the ~3,000-word row
    rows = rows.select(range(5))  # eager builds a float mask of (sum of the lengths)^2: keep it small
    padded = _trainer(rows, tiny_model_dir, tmp_path / "p", attn, max_length=4096)
    flat = _trainer(rows, tiny_model_dir, tmp_path / "f", attn, padding_free=True, max_length=None)
    packed = _trainer(rows, tiny_model_dir, tmp_path / "k", attn, packing=True, max_length=4096)

    # every row in one batch: padded (n x longest), flattened (1 x sum), bfd-packed sequences (flattened too)
    n = len(padded.train_dataset)
    assert n == len(flat.train_dataset) == len(rows) == 5
    b_pad = padded.data_collator([padded.train_dataset[i] for i in range(n)])
    b_flat = flat.data_collator([flat.train_dataset[i] for i in range(n)])
    b_pack = packed.data_collator([packed.train_dataset[i] for i in range(len(packed.train_dataset))])
    assert b_pad["input_ids"].shape[0] == n and (b_pad["attention_mask"] == 0).any()  # there is padding
    real_tokens = int(b_pad["attention_mask"].sum())
    assert "attention_mask" not in b_flat and b_flat["input_ids"].shape == (1, real_tokens)
    assert int((b_flat["position_ids"] == 0).sum()) == n  # n sequences, positions restart at 0
    assert len(packed.train_dataset) < n  # bfd put several rows into one sequence
    assert sum(map(len, packed.train_dataset["seq_lengths"])) == n

    lp_pad = _completion_log_probs(padded, b_pad)
    lp_flat = _completion_log_probs(flat, b_flat)
    lp_pack = _completion_log_probs(packed, b_pack)
    # the same completion tokens carry the loss
    assert lp_pad.numel() == lp_flat.numel() == lp_pack.numel() > 0
    # same rows in the same order: token by token
    torch.testing.assert_close(lp_flat, lp_pad, atol=1e-4, rtol=0)
    # bfd reorders the rows: the per-token loss sums
    assert math.isclose(lp_pack.sum().item(), lp_pad.sum().item(), rel_tol=1e-6, abs_tol=1e-4)
    assert math.isclose(lp_flat.sum().item(), lp_pad.sum().item(), rel_tol=1e-6, abs_tol=1e-4)

    # Control: the same flattened row with an all-ones attention_mask, the positions kept. transformers then
    # does not look for packed sequences and the rows attend to each other; the test sees it.
    leaky = dict(b_flat, attention_mask=torch.ones_like(b_flat["input_ids"]))
    lp_leaky = _completion_log_probs(flat, leaky)
    assert (lp_leaky - lp_pad).abs().max().item() > 1e-3


def _run(argv, capsys):
    from metachunk.train.sft import main

    status = main(argv)
    return status, capsys.readouterr().err


def test_packing_trains_two_steps(sft_dataset, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "packed"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "2", "--max_length", "1024", "--packing", "true",
            "--per_device_train_batch_size", "2", "--eval_steps", "1"]  # fmt: skip
    status, err = _run(argv, capsys)
    assert status == 0, err[-2000:]
    assert "rows packed into" in err and "padding-free batches with sdpa" in err
    log = json.loads((out / "train_log.json").read_text())
    losses = [e["loss"] for e in log if "loss" in e]
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert evals and all(math.isfinite(x) and x > 0 for x in evals)  # the validation set is packed too
    facts = json.loads((out / "metachunk_run.json").read_text())
    hyper = facts["hyperparameters"]
    assert hyper["packing"] is True and hyper["packing_strategy"] == "bfd"
    from datasets import load_dataset

    n_rows = load_dataset(str(sft_dataset), split="train").num_rows
    over = facts["rows_over_max_length"]["train"]  # the ~3,000-word row: dropped, where bfd would cut it
    assert over == 1 and facts["rows"] == n_rows - over and facts["global_steps"] == 2  # rows, not sequences
    assert f"{n_rows - over} rows packed into " in err


def test_padding_free_without_packing_trains_two_steps(sft_dataset, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "flat"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "2", "--max_length", "None", "--padding_free", "true",
            "--per_device_train_batch_size", "3", "--eval_strategy", "no"]  # fmt: skip
    status, err = _run(argv, capsys)
    assert status == 0, err[-2000:]
    losses = [e["loss"] for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert "padding-free batches with sdpa" in err and "computed densely" in err  # the cost is said


def test_only_the_attentions_that_compute_the_whole_square_are_warned_about():
    """sdpa and eager compute a flattened row's whole square; the 3B recipes' flex_attention skips the masked
    blocks and flash-attention's varlen kernel never sees them, so they get no note."""
    from types import SimpleNamespace

    from metachunk.train.sft import dense_attention_note

    flat = SimpleNamespace(padding_free=False, packing=True, packing_strategy="bfd")
    assert "computed densely" in dense_attention_note("sdpa", flat)
    assert "computed densely" in dense_attention_note("eager", flat)
    for impl in ("flex_attention", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"):
        assert dense_attention_note(impl, flat) is None
    padded = SimpleNamespace(padding_free=False, packing=False, packing_strategy="bfd")
    assert dense_attention_note("sdpa", padded) is None


def test_wrong_packing_configs_fail_before_any_model_loads(tmp_path, capsys):
    (tmp_path / "ds" / "data").mkdir(parents=True)
    # the model is never loaded: the config fails first
    base = ["--config", str(RECIPE), "--dataset_name", str(tmp_path / "ds"), "--output_dir", str(tmp_path / "o"),
            "--model_name_or_path", str(tmp_path / "no-such-model")]  # fmt: skip
    # the recipe's max_length (1024) would not be enforced
    status, err = _run(base + ["--padding_free", "true"], capsys)
    assert status == 2 and "set max_length: null" in err
    status, err = _run(base + ["--packing", "true", "--attn_implementation", "my_kernel"], capsys)
    assert status == 2 and "cannot keep the rows of a packed / padding-free batch apart" in err
    # use_cpu, and liger-kernel is not installed
    status, err = _run(base + ["--use_liger_kernel", "true"], capsys)
    assert status == 2 and "field 'use_liger_kernel' needs a CUDA GPU" in err
    # flex_attention would keep the rows apart, but PyTorch has no backward for it on CPU
    status, err = _run(base + ["--packing", "true", "--attn_implementation", "flex_attention"], capsys)
    assert status == 2 and "flex_attention has no backward on CPU" in err
