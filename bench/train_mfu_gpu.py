"""Training MFU on one GPU (H200): full fine-tuning of a Qwen2.5-0.5B-shaped model on padding-free packed batches.

Self-contained (torch, transformers, and TRL's fused LM head if TRL is installed); no data, no checkpoint: the model
is randomly initialised from a ``Qwen2Config`` shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4,864, vocabulary 151,936, tied embeddings), bf16 weights (as ``dtype: bfloat16`` + ``bf16: true`` in
our recipes), AdamW (fused on CUDA), flash_attention_2 when ``flash_attn`` is importable, else flex_attention
on CUDA, else sdpa. Without flash-attn, flex_attention is the varlen path: transformers turns the packed
``position_ids`` into a ``BlockMask`` (``transformers.masking_utils.flex_attention_mask``), and flex attention skips
the blocks it masks out whole (https://docs.pytorch.org/docs/stable/nn.attention.flex_attention.html), where sdpa
computes the whole row's attention under a dense block-diagonal mask.

Batches: one padding-free row per step, as TRL's collator builds it with ``packing``/``padding_free``: sequences of
random lengths (uniform in ``--min-len``..``--max-len``, an SFT-like mix) concatenated up to exactly
``--tokens`` tokens (the last one cut to fit, so every step has the same shape), ``position_ids`` restarting at 0
for each sequence and the varlen boundaries ``cu_seq_lens_q/k`` + ``max_length_q/k`` (what flash-attention uses; with
flex_attention or sdpa, transformers builds a block-diagonal causal mask from the ``position_ids``). The loss is the next-token
cross-entropy on every token but each sequence's first (TRL's padding-free labels), through TRL's fused LM head
(``add_fused_lm_head``: no ``(tokens, vocab)`` logits tensor) when TRL is importable, else the model's own loss.

Measured: ``--warmup`` steps (default 5), then ``--steps`` (default 30) timed with CUDA events around the whole
step (forward, backward, optimizer step, zero_grad).

FLOPs per step, the formula (model FLOPs: recomputation, if any, is not counted; neither are the masked-out
attention blocks). It is ``metachunk.train.throughput.ModelShape``, the one the trainer's own throughput callback
logs with, so this bench and a ``metachunk train`` run count alike; for this bench's full fine-tune of a model
without sliding-window layers it reads:

    dense     = 6 * (N - H) * T + 6 * H * S
                                   N = parameters in matmuls: every non-embedding weight + the LM head
                                   (vocab x hidden; with tied embeddings the shared matrix counts once, as the
                                   head: the embedding lookup does no FLOPs); H = the head's; T = tokens in the
                                   step; S = tokens the head scores (all but each sequence's first)
    attention = 6 * layers * heads * head_dim * sum_i L_i^2
                                   causal attention inside each packed sequence i of length L_i: forward QK^T and
                                   AV are 2 * L^2 * head_dim FLOPs per head with the causal half only, backward 2x
    MFU       = (dense + attention) / step_time / peak

Peak: the device's dense bf16 tensor-core peak from the trainer's table (``metachunk.train.throughput.peak_tflops``,
by ``torch.cuda.get_device_name()``: 989 TFLOP/s for an H200 or H100 SXM; ``--peak-tflops`` to set it). Prints
tokens/s, TFLOP/s, MFU, and the peak GPU memory.

A 32K-token step is ~109 TFLOP of model FLOPs (97 dense + ~12 attention): ~0.3 s at 40% MFU. The figures measured
on an H200 (sdpa, flex_attention, 32K and 64K tokens) are on docs/performance.md. ``--tiny`` (3 steps) runs anywhere.

    python bench/train_mfu_gpu.py                     # H200: 35 steps of 32K tokens after model init
    python bench/train_mfu_gpu.py --tokens 65536      # a bigger packed step
    python bench/train_mfu_gpu.py --tiny              # any machine (CPU here): a tiny config, 3 steps, a smoke run

Results: ``bench_out/train_mfu_gpu.json`` (``train_mfu_tiny.json`` with ``--tiny``).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

from metachunk.artifacts import write_json

ROOT = Path(__file__).resolve().parents[1]

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=1024)  # fmt: skip


def packed_batch(lengths: list[int], vocab: int, device, rng: random.Random):
    """One padding-free row: TRL's collator output for sequences of these lengths."""
    import torch

    total = sum(lengths)
    ids = torch.tensor([rng.randrange(vocab) for _ in range(total)], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[position_ids == 0] = -100  # no prediction across a sequence boundary (as TRL's collator does)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = {"input_ids": ids[None], "position_ids": position_ids[None], "labels": labels[None],
             "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}  # fmt: skip
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def draw_lengths(tokens: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(lo, hi), tokens - sum(lengths)))
    return lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tiny", action="store_true", help="tiny config, 3 steps after 1 warm-up: a smoke run anywhere"
    )
    ap.add_argument("--steps", type=int, help="timed steps (default 30; 3 with --tiny)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 5; 1 with --tiny)")
    ap.add_argument(
        "--tokens", type=int, help="tokens per step, one packed row (default 32768; 512 with --tiny)"
    )
    ap.add_argument("--min-len", type=int, help="shortest sequence (default 256; 16 with --tiny)")
    ap.add_argument("--max-len", type=int, help="longest sequence (default 4096; 128 with --tiny)")
    ap.add_argument(
        "--attn",
        help="attention (default on CUDA: flash_attention_2 if flash_attn is importable, else flex_attention; sdpa on CPU)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="weights dtype (default bfloat16)")
    ap.add_argument("--device", help="default cuda if available, else cpu")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--peak-tflops",
        type=float,
        help="peak dense TFLOP/s for MFU (default: the GPU's dense bf16 peak by its name; none on CPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON result path (default bench_out/train_mfu_gpu.json or _tiny.json)")
    args = ap.parse_args(argv)

    import torch
    from metachunk.train.throughput import ModelShape
    from metachunk.train.throughput import peak_tflops as peak_of
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.utils import is_flash_attn_2_available

    from metachunk.models import attention_of

    def d(full, tiny):
        return tiny if args.tiny else full

    steps, warmup = args.steps or d(30, 3), args.warmup if args.warmup is not None else d(5, 1)
    tokens, lo, hi = args.tokens or d(32768, 512), args.min_len or d(256, 16), args.max_len or d(4096, 128)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.attn:
        attn = args.attn
    elif cuda:
        attn = "flash_attention_2" if is_flash_attn_2_available() else "flex_attention"
    else:
        attn = "sdpa"
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else (peak_of(name) if cuda else None)

    shape = TINY if args.tiny else QWEN25_05B
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_parameters={"rope_type": "default",
                         "rope_theta": 1_000_000.0}, tie_word_embeddings=True, use_cache=False)  # fmt: skip
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    model.train()
    assert attention_of(model) == attn, attention_of(model)
    init_s = time.perf_counter() - t0
    try:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        fused = True
    except ImportError:
        fused = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    n_params = sum(p.numel() for p in model.parameters())
    model_shape = ModelShape.of(model)
    n_matmul = model_shape.matmul_params

    rng = random.Random(args.seed)
    lengths_per_step = [draw_lengths(tokens, lo, hi, rng) for _ in range(warmup + steps)]
    # built before the timed steps
    batches = [packed_batch(lengths, config.vocab_size, device, rng) for lengths in lengths_per_step]

    def step(batch):
        out = model(**batch, fused_lm_head=True) if fused else model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for batch in batches[:warmup]:
        step(batch)
    sync()
    times, losses = [], []
    for batch in batches[warmup:]:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(batch))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            losses.append(step(batch))
            times.append(time.perf_counter() - t)
    losses = [float(x) for x in losses]

    timed = lengths_per_step[warmup:]
    total_s = sum(times)
    n_tokens = sum(sum(b) for b in timed)
    # the head scores every token but each sequence's first (labels[position_ids == 0] = -100, shifted)
    scored = n_tokens - sum(len(b) for b in timed)
    dense, attention = model_shape.flops(n_tokens, sum(n * n for b in timed for n in b), scored)
    flops = dense + attention
    tflops = flops / total_s / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    print(
        f"{'tiny Qwen2' if args.tiny else 'Qwen2.5-0.5B-shaped'} ({n_params / 1e6:.1f}M params, {n_matmul / 1e6:.1f}M in "
        f"matmuls), random init, {args.dtype}, {attn}, {'TRL fused LM head' if fused else 'model loss'}, on {name}; "
        f"init {init_s:.1f} s"
    )
    print(
        f"{steps} steps after {warmup} warm-up, {tokens:,} tokens per step (one padding-free row of "
        f"{sum(len(b) for b in timed) / len(timed):.1f} sequences of {lo}-{hi} tokens on average)"
    )
    print(
        f"step {total_s / len(times) * 1000:.1f} ms (min {min(times) * 1000:.1f}), {n_tokens / total_s:,.0f} tokens/s, "
        f"{tflops:.2f} TFLOP/s model FLOPs (attention {attention / flops:.1%} of them)"
        + (
            f", MFU {mfu:.1%} of {peak_tflops:g} TFLOP/s"
            if mfu is not None
            else ", MFU n/a (no peak known for this device: --peak-tflops)"
        )
        + (f"; peak GPU memory {peak_mem:.1f} GiB" if peak_mem is not None else "")
    )
    print(f"loss first/last timed step: {losses[0]:.3f} / {losses[-1]:.3f}")
    if cuda and attn not in ("flash_attention_2", "flex_attention"):
        print(
            f"note: {attn} attends the whole {tokens:,}-token row under a block-diagonal mask (the masked blocks are "
            "computed, not counted as model FLOPs): use --attn flex_attention, or install flash-attn for the varlen kernel"
        )
    result = {
        "bench": "train_mfu_gpu", "tiny": args.tiny, "device": name, "attn_implementation": attn, "dtype": args.dtype,
        "fused_lm_head": fused, "config": shape, "params": n_params, "matmul_params": n_matmul, "steps": steps,
        "warmup": warmup, "tokens_per_step": tokens, "min_len": lo, "max_len": hi, "step_s": times,
        "tokens_per_s": n_tokens / total_s, "flops_dense": dense, "flops_attention": attention, "tflops": tflops,
        "peak_tflops": peak_tflops, "mfu": mfu, "peak_memory_gib": peak_mem, "losses": losses,
        "formula": "MFU = (6*(N-H)*T + 6*H*S + 6*layers*heads*head_dim*sum(L_i^2)) / step_time / peak",
    }  # fmt: skip
    out = Path(
        args.out or ROOT / "bench_out" / ("train_mfu_tiny.json" if args.tiny else "train_mfu_gpu.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(f"[{out}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
