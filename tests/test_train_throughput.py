"""The trainer's own throughput: FLOPs of a step against a hand count, real tokens of padded and packed
batches, and the log lines, manifest and card of a real CPU run of the smoke recipe."""

from __future__ import annotations

import json
import re

import pytest
from metachunk.train.throughput import ModelShape, ThroughputCallback, batch_counts, peak_tflops
from test_train import RECIPE


def _qwen2(tie: bool, meta: bool = False, **shape):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, tie_word_embeddings=tie)
    with torch.device("meta" if meta else "cpu"):
        return Qwen2ForCausalLM(config)


SMALL = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=32)  # fmt: skip


@pytest.mark.parametrize("tie", [True, False])
def test_flops_of_a_small_config_against_a_hand_count(tie):
    """Hidden 8, 2 layers, 2 heads of 4 (1 KV head), MLP 16, vocabulary 32. Per layer: q_proj 8x8 + 8 bias = 72,
    k_proj 8x4 + 4 = 36, v_proj 36, o_proj 8x8 = 64, gate/up/down 3 x 8x16 = 384, two RMSNorms 2 x 8 = 16: 608.
    Two layers 1,216, final norm 8: 1,224 parameters in the blocks. The LM head 32x8 = 256 is a matmul; the
    input embedding (the same 256 when tied, another 256 when not) is a lookup: N = 1,224 + 256 = 1,480 either
    way, though the model holds 1,480 parameters tied and 1,736 untied.

    One step: a packed row of two sequences, 3 and 2 tokens (T = 5, sum of squares 9 + 4 = 13):
    dense = 6 x 1,480 x 5 = 44,400; attention = 6 x 2 layers x 2 heads x 4 x 13 = 1,248. With 2 of the 5 tokens
    scored (a completion-only loss), the head's 256 count for those 2 only: 6 x 1,224 x 5 + 6 x 256 x 2 = 39,792."""
    model = _qwen2(tie, **SMALL)
    assert sum(p.numel() for p in model.parameters()) == (1480 if tie else 1736)
    shape = ModelShape.of(model)
    assert shape == ModelShape(matmul_params=1480, layers=2, heads=2, head_dim=4, head_params=256)
    assert shape.flops(tokens=5, sum_sq_lengths=13) == (44_400, 1_248)
    assert shape.flops(tokens=5, sum_sq_lengths=13, scored=2) == (39_792, 1_248)

    # per device and against a peak: two ranks, 0.5 s, a made-up 1e-9 TFLOP/s peak (45,648 FLOPs over 0.5 s and
    # 2 devices = 45,648 FLOP/s per device = 4.5648e-8 TFLOP/s, 45.648 x the peak)
    callback = ThroughputCallback(peak=1e-9)
    callback.shape, callback.world = shape, 2
    rates = callback.rates(tokens=5, sum_sq_lengths=13, seconds=0.5)
    assert rates["tokens_per_second"] == 10 and rates["tokens_per_second_per_device"] == 5
    assert rates["tflops"] == pytest.approx(4.5648e-8) and rates["mfu"] == pytest.approx(45.648)


def test_flops_of_the_qwen25_05b_shape_against_a_hand_count():
    """Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4,864, vocabulary 151,936, tied).
    Per layer: q 896x896 + 896 = 803,712; k and v 896x128 + 128 = 114,816 each; o 896x896 = 802,816;
    MLP 3 x 896 x 4,864 = 13,074,432; norms 1,792: 14,912,384. 24 layers 357,897,216, final norm 896, embedding
    = LM head 151,936 x 896 = 136,134,656: N = 494,032,768 (the model's published 0.49B). A 32K-token step of 8
    sequences of 4,096: dense 6 x N x 32,768 = 97.13 TFLOP, attention 6 x 24 x 14 x 64 x 8 x 4,096^2 = 17.32 TFLOP.
    Built on the meta device: no memory."""
    model = _qwen2(True, meta=True, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)  # fmt: skip
    shape = ModelShape.of(model)
    assert shape == ModelShape(
        matmul_params=494_032_768, layers=24, heads=14, head_dim=64, head_params=136_134_656
    )
    dense, attention = shape.flops(tokens=32_768, sum_sq_lengths=8 * 4096**2)
    assert dense == 6 * 494_032_768 * 32_768 == 97_130_794_450_944
    assert attention == 6 * 24 * 14 * 64 * 8 * 4096**2 == 17_317_308_137_472


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA H800", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A800-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA A40", 150.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", None),  # not in the table: no MFU rather than a guess
        ("Tesla V100-SXM2-32GB", None),  # no bf16 tensor cores
        ("cpu (x86_64)", None),
    ],
)
def test_dense_bf16_peaks_by_device_name(name, peak):
    assert peak_tflops(name) == peak


def test_real_tokens_of_padded_and_packed_batches():
    """Three rows of 3, 5 and 2 tokens: 10 real tokens, squares 9 + 25 + 4 = 38, however TRL's collator batches
    them; the padding of a padded batch counts for nothing. Scored: the targets the loss reads after the shift,
    each row's first token predicting nothing: 2 + 4 + 1 = 7; with a completion-only loss, the completion's."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    def counts(batch, **kw):
        names = ("input_ids", "attention_mask", "position_ids", "labels")
        return batch_counts(**{k: batch[k] for k in names if k in batch}, **kw).tolist()

    rows = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2)]
    padded = DataCollatorForLanguageModeling(pad_token_id=0)(rows)
    assert padded["input_ids"].shape == (3, 5) and int((padded["attention_mask"] == 0).sum()) == 5
    assert counts(padded) == [10, 38, 7]
    left = padded["attention_mask"].flip(-1)  # left padding: the same rows, the pads in front
    assert batch_counts(input_ids=padded["input_ids"], attention_mask=left).tolist() == [
        10,
        38,
        10,
    ]  # no labels

    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    assert "attention_mask" not in flat and flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert counts(flat) == [10, 38, 7]  # TRL masks each packed sequence's first label

    # bfd packing: rows of 3 and 5 in one packed sequence, the row of 2 in another (TRL's seq_lengths)
    packed = [
        {"input_ids": list(range(1, 9)), "seq_lengths": [3, 5]},
        {"input_ids": [1, 2], "seq_lengths": [2]},
    ]
    pack = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(packed)
    assert counts(pack) == [10, 38, 7]

    # completion-only: the prompt's labels are -100 (TRL's "labels" column), so only 1 + 2 + 1 targets are scored
    prompts = [{"input_ids": list(range(1, n + 1)), "labels": [-100] * (n - k) + list(range(n - k + 1, n + 1))}
               for n, k in ((3, 1), (5, 2), (2, 1))]  # fmt: skip
    assert counts(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(prompts)) == [10, 38, 4]
    flat_labels = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(prompts)["labels"]
    shifted = batch_counts(
        input_ids=flat["input_ids"], position_ids=flat["position_ids"], shift_labels=flat_labels[..., 1:]
    )
    assert shifted.tolist() == [10, 38, 4]  # already shifted labels, as a caller may pass them

    # no mask and no positions: each row is one sequence of its whole length
    assert batch_counts(input_ids=torch.ones(2, 4, dtype=torch.long)).tolist() == [8, 32, 8]


def test_cpu_smoke_run_logs_throughput_and_records_it(sft_dataset, tiny_model_dir, tmp_path, capsys):
    """A real run of the CPU smoke recipe: every training log line carries tokens/s and TFLOP/s (no MFU: no peak
    for a CPU), TensorBoard gets them, and the summary (steps 2-3, after 1 warm-up step) is in the manifest and
    the exported model card. The real tokens are TRL's own count (its cumulative ``num_tokens``)."""
    from metachunk.train.export import ExportConfig, export
    from metachunk.train.sft import main
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(sft_dataset),
            "--output_dir", str(out), "--max_steps", "3", "--max_length", "4096", "--save_strategy", "steps",
            "--save_steps", "2"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err

    log = json.loads((out / "train_log.json").read_text())
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2, 3]  # logging_steps 1
    for entry in steps:
        assert entry["tokens_per_second"] > 0 and entry["tflops"] > 0 and "mfu" not in entry
    # the printed log lines (the Trainer's, one per log) carry them too
    lines = [line for line in printed.splitlines() if "'loss'" in line]
    assert len(lines) == 3 and all("'tokens_per_second'" in x and "'tflops'" in x for x in lines)
    assert not any("'mfu'" in x for x in lines)

    facts = json.loads((out / "metachunk_run.json").read_text())
    summary = facts["throughput"]
    assert summary["steps"] == [2, 3] and summary["warmup_steps"] == 1 and summary["world_size"] == 1
    assert (
        summary["device"].startswith("cpu") and summary["mfu"] is None and summary["peak_memory_gib"] is None
    )
    num_tokens = {e["step"]: e["num_tokens"] for e in steps}  # TRL's running count of the real tokens
    assert summary["tokens"] == num_tokens[3] - num_tokens[1] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shape = ModelShape.of(model)
    n, head, scored = shape.matmul_params, shape.head_params, summary["tokens_scored"]
    assert summary["matmul_params"] == n and summary["head_params"] == head > 0
    assert 0 < scored < summary["tokens"]  # the smoke recipe's loss reads the completions only
    assert summary["flops_dense"] == 6 * (n - head) * summary["tokens"] + 6 * head * scored
    flops = summary["flops_dense"] + summary["flops_attention"]
    assert summary["tflops_per_device"] == pytest.approx(flops / summary["seconds"] / 1e12, rel=1e-3)
    assert summary["tokens_per_second"] == pytest.approx(summary["tokens"] / summary["seconds"], rel=1e-3)
    line = re.search(r"train: throughput over steps 2-3 \(after 1 warm-up step\): ([\d,.]+) tokens/s, (\S+) TFLOP/s "
                     r"per device on 1 x cpu \(.*\), MFU n/a", captured.err)  # fmt: skip
    assert line, captured.err[-2000:]
    assert float(line.group(2)) == summary["tflops_per_device"]

    # TensorBoard got the keys: the callback runs before the reporters
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in out.glob("runs/**/events.out.tfevents.*")}
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/tokens_per_second", "train/tflops"} <= set(scalars)

    card = (
        export(ExportConfig(checkpoint=out, out=tmp_path / "export"), progress=lambda m: None).out
        / "README.md"
    )
    text = card.read_text()
    assert f"| training throughput (tokens/s, all devices) | {summary['tokens_per_second']:,.1f} |" in text
    assert f"| model TFLOP/s per device | {summary['tflops_per_device']:.4g} |" in text
    assert "| MFU | n/a: no dense bf16 peak known for cpu" in text
    # an export of checkpoint-2 is not vouched for by the speed of steps 2-3
    early = export(
        ExportConfig(checkpoint=out / "checkpoint-2", out=tmp_path / "early"), progress=lambda m: None
    ).out
    text = (early / "README.md").read_text()
    assert "training throughput" not in text and "| optimizer steps | 2 |" in text


def test_flops_under_lora_count_the_frozen_weights_forward_and_input_gradient_only():
    """SMALL (N = 1,480, H = 256) with LoRA of rank 1 on q_proj and v_proj: per layer q's A 1x8 and B 8x1 (16)
    and v's A 1x8 and B 4x1 (12), two layers: Nt = 56 trainable, the head frozen (Ht = 0), N = 1,480 + 56 =
    1,536. A frozen weight costs 4 FLOPs a token (forward 2, its input's gradient 2), a trainable one 6: T = 5,
    S = 2 gives dense = (4 x (1,536 - 256) + 2 x 56) x 5 + 4 x 256 x 2 = 26,160 + 2,048 = 28,208."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_qwen2(True, **SMALL), LoraConfig(r=1, target_modules=["q_proj", "v_proj"]))
    shape = ModelShape.of(model)
    assert (shape.matmul_params, shape.head_params) == (1536, 256)
    assert (shape.trainable_params, shape.trainable_head_params) == (56, 0)
    assert shape.flops(tokens=5, sum_sq_lengths=13, scored=2)[0] == 28_208
    assert ModelShape.of(_qwen2(True, **SMALL)).trainable_params is None  # a full fine-tune: 6N, as before


def test_sliding_window_layers_count_only_the_keys_in_their_window():
    """SMALL with a window of 2 on its second layer (Qwen2's max_window_layers 1). The packed row of 3 and 2
    tokens: full attention reads 1 + 3 + 5 + 1 + 3 = 13 (sum of 2p + 1); a window of 2 reads
    2 x min(p + 1, 2) - 1 = 1 + 3 + 3 + 1 + 3 = 11. Attention = 6 x 2 heads x 4 x (13 + 11) = 1,152."""
    import torch

    model = _qwen2(True, **SMALL, use_sliding_window=True, sliding_window=2, max_window_layers=1)
    shape = ModelShape.of(model)
    assert shape.windows == (2,) and shape.window_sizes == (2,)
    row = batch_counts(position_ids=torch.tensor([[0, 1, 2, 0, 1]]), windows=shape.window_sizes).tolist()
    assert row == [5, 13, 5, 11]
    padded = batch_counts(attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), windows=(2,)).tolist()
    assert padded == [5, 13, 5, 11]  # the same two sequences as padded rows
    assert batch_counts(input_ids=torch.ones(1, 3, dtype=torch.long), windows=(2,)).tolist() == [3, 9, 3, 7]
    assert shape.flops(tokens=5, sum_sq_lengths=13, windowed=(11,))[1] == 1_152
    with pytest.raises(ValueError, match="sliding windows"):
        shape.flops(tokens=5, sum_sq_lengths=13)
