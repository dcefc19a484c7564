"""MSP speed: batched pair scoring with a reused instruction KV cache vs one forward per pair.

Issue requirement: "batched pair mode against one call per sentence, at identical decisions. The
instruction part of the prompt is the same for every pair. Compute its KV once and reuse it; this
is where the CPU gain is. Target: >=2x on CPU, >=5x on GPU."

What is compared, on the same consecutive-sentence pairs:

* **single**: ``[scorer.margin_single(a, b) for a, b in pairs]``: one full forward pass over
  instruction + pair + template tail per pair, no cache reuse (what a naive loop does).
* **batched B**: ``scorer.margins(pairs, batch_size=B)``: the instruction's KV cache is computed
  once (its cost is included, once per pass over the pairs) and only the pair tokens are run, up
  to B pairs per forward pass (``margins`` sorts pairs by length and closes a batch early rather
  than pad it by more than ``metachunk.chunking.msp.MAX_PADDING``). ``B=1`` isolates the prefix-reuse gain;
  larger B adds batching; "pad eff" = real / padded pair tokens, "passes" the forward passes of a
  round and "rows" the largest of them (on a GPU a batch may pad past that share by up to
  ``metachunk.chunking.msp.GPU_PASS_TOKENS`` tokens, to save passes). ``--compare-pass-tokens 0,4096``
  adds variants ``batchedB@0`` and ``batchedB@4096`` at the headline B with other allowances, to
  check that estimate.

Timing is fair on a noisy shared machine: a warm-up first, then ``--reps`` rounds. A round is one
pass over all pairs per variant, cut into blocks of ``--block`` pairs; every block is scored by
all variants back to back in a rotating order, so a change in machine load hits all of them
alike, and a variant's round time is the sum over blocks. Blocks are consecutive runs of the
pairs sorted by length (the order ``margins`` sorts into), so with ``--block`` a multiple of B a
round runs the same batches, and padding, as one ``margins(pairs, B)`` call (up to where a
block edge cuts a batch). The headline uses each variant's best (minimum) round; the median is
printed too. Decisions are then taken from the margins of both paths with the same θ (fixed
``--theta``, default 0, and dynamic = mean of past margins, as
:func:`metachunk.chunking.msp.msp_decisions` does) and compared: identical decisions / total, plus the
largest ``|margin_batched - margin_single|``. PASS needs the target speed-up at
``--headline-batch`` (default 8, ``msp_decisions``' default on CPU; on a GPU its default is sized from free
memory) and all decisions identical.

``--check-dtype float32`` takes the decisions PASS judges from a second, untimed pass (one call per
pair and ``margins`` at the headline B) with the model cast to that dtype. A random model's margins
are differences of token probabilities near 1/vocab, about 1e-7 apart, which bf16 arithmetic moves
by as much: there a flipped decision says nothing about the batched path, and fp32 says whether it
is right. The timed dtype's decisions are still reported (``identical_decisions_timed``).

Pairs: the sentences of the first Emma paragraphs (``--lang en``, SmolLM2 by default;
``data:gutenqa-emma/paragraphs.jsonl``) or of the first CRUD news articles (``--lang zh``,
Gemma-3-270m by default: a base model without a chat template, which MarginScorer prompts as plain
completion; ``data:crud-news/news.jsonl``, ``metachunk data fetch crud-news`` once), joined with blank lines into one
document and split with :func:`metachunk.chunking.sentences.split_sentences`; the first ``--pairs``
consecutive pairs are used. The same script runs on a GPU (``--device cuda``, the default when
one is available; the model dtype then defaults to bf16, see ``--dtype``).

Default run (64 pairs, batch sizes 1,4,8,16, 2 rounds, SmolLM2 on one CPU thread): ~4 minutes.
Results: ``bench_out/msp_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402

DEFAULT_MODEL = {"en": "smollm2", "zh": "gemma3-270m"}


def build_pairs(lang: str, n_pairs: int) -> list[tuple[str, str]]:
    """The first ``n_pairs`` consecutive-sentence pairs of Emma (en) or of the CRUD news (zh)."""
    from metachunk.chunking.sentences import split_sentences

    if lang == "en":
        path, key = resolve("data:gutenqa-emma/paragraphs.jsonl"), "text"
    else:
        path, key = resolve("data:crud-news/news.jsonl"), "text"
    texts: list[str] = []
    sentences: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)[key])
            doc = "\n\n".join(texts)
            spans = split_sentences(doc, lang)
            if len(spans) > n_pairs:
                sentences = [doc[s.start : s.end].strip() for s in spans]
                break
        else:
            doc = "\n\n".join(texts)
            sentences = [doc[s.start : s.end].strip() for s in split_sentences(doc, lang)]
    pairs = list(zip(sentences[:-1], sentences[1:]))
    return pairs[:n_pairs]


def decisions(margins, theta: float, dynamic: bool) -> list[bool]:
    """Keep-together decisions in order, with msp_decisions' Threshold rule."""
    from metachunk.chunking.msp import Threshold

    th = Threshold(theta, dynamic)
    return [th.decide(float(m)) for m in margins]


def same_decisions(margins, reference, theta: float, dynamic: bool) -> int:
    """How many decisions taken from ``margins`` equal those taken from ``reference``."""
    return sum(
        x == y for x, y in zip(decisions(margins, theta, dynamic), decisions(reference, theta, dynamic))
    )


def parse_variant(name: str) -> tuple[int | None, int | None]:
    """``single`` -> (None, None); ``batched64`` -> (64, None); ``batched64@0`` -> (64, 0): the rows
    per pass and the padding a pass may add (``pass_tokens`` of `MarginScorer.plan`; None: the device's default)."""
    if name == "single":
        return None, None
    rows, _, pass_tokens = name.removeprefix("batched").partition("@")
    return int(rows), int(pass_tokens) if pass_tokens else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lang", choices=("en", "zh"), default="en", help="en: Emma paragraphs; zh: CRUD news")
    ap.add_argument(
        "--model", default=None, help="preset or HF dir (default: smollm2 for en, gemma3-270m for zh)"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="model dtype (auto: bfloat16 on a GPU or a CPU with native bf16, AMX or AVX-512 BF16; else float32)",
    )
    ap.add_argument(
        "--prompt", default="table6", choices=("table6", "table7", "released"), help="MSP prompt variant"
    )
    ap.add_argument("--pairs", type=int, default=64, help="number of sentence pairs (default 64)")
    ap.add_argument("--batch-sizes", default="1,4,8,16", help="comma-separated batch sizes for margins()")
    ap.add_argument(
        "--headline-batch", type=int, default=8, help="batch size judged against the target (default 8)"
    )
    ap.add_argument(
        "--compare-pass-tokens",
        default="",
        help="comma-separated padding allowances (tokens a pass may pad past 10%%) to time at the headline "
        "batch beside the device's default, e.g. 0,4096 (variants batchedB@T)",
    )
    ap.add_argument("--reps", type=int, default=2, help="timed rounds per variant (default 2)")
    ap.add_argument(
        "--block",
        type=int,
        default=32,
        help="pairs per interleaving block (default 32; a multiple of the batch sizes, see docstring)",
    )
    ap.add_argument("--theta", type=float, default=0.0, help="fixed θ for the decision comparison")
    ap.add_argument(
        "--check-dtype",
        default=None,
        help="dtype of an untimed pass whose decisions PASS judges (default: the timed pass's; see docstring)",
    )
    ap.add_argument("--target", type=float, default=None, help="speed-up target (default 2 on CPU, 5 on GPU)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: OMP_NUM_THREADS)"
    )
    ap.add_argument("--strict", action="store_true", help="exit with status 1 when the target is missed")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "msp_speed.json"), help="JSON result path")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from metachunk.chunking.msp import MarginScorer, load_msp_prompt

    from metachunk.models import attention_of, default_device, load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    model_name = args.model or DEFAULT_MODEL[args.lang]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    headline = args.headline_batch if args.headline_batch in batch_sizes else max(batch_sizes)
    target = args.target or (5.0 if device.startswith("cuda") else 2.0)

    pairs = build_pairs(args.lang, args.pairs)
    model, tokenizer = load_causal_lm(model_name, device=device, dtype=args.dtype)
    prompt = load_msp_prompt(args.prompt, args.lang)
    scorer = MarginScorer(model, tokenizer, prompt)
    n_prefix = len(scorer.prefix_ids)
    suffix_lens = [len(scorer.pair_ids(a, b)) for a, b in pairs]
    mean_suffix = statistics.mean(suffix_lens)
    print(
        f"model={model_name} device={device} dtype={model.dtype} threads={torch.get_num_threads()} "
        f"lang={args.lang} pairs={len(pairs)}"
    )
    print(
        f"instruction prefix: {n_prefix} tokens; pair suffix: mean {mean_suffix:.1f}, "
        f"min {min(suffix_lens)}, max {max(suffix_lens)} tokens; "
        f"token ratio (prefix+suffix)/suffix = {(n_prefix + mean_suffix) / mean_suffix:.2f}"
    )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def run_single(block: list[tuple[str, str]]) -> tuple[float, np.ndarray]:
        sync()
        t0 = time.perf_counter()
        out = np.array([scorer.margin_single(a, b) for a, b in block])
        sync()
        return time.perf_counter() - t0, out

    batched_scorer = scorer

    def run_batched(
        block: list[tuple[str, str]], b: int, pass_tokens: int | None, first: bool
    ) -> tuple[float, np.ndarray]:
        nonlocal batched_scorer
        if first:  # a fresh scorer: its one-off instruction forward is charged once per pass over the pairs
            batched_scorer = MarginScorer(model, tokenizer, prompt)
        sync()
        t0 = time.perf_counter()
        out = batched_scorer.margins(block, batch_size=b, pass_tokens=pass_tokens)
        sync()
        return time.perf_counter() - t0, out

    # Warm-up: allocator, kernels, lazy init.
    warm = pairs[: min(4, len(pairs))]
    for a, b in warm[:2]:
        scorer.margin_single(a, b)
    for b in batch_sizes:
        scorer.margins(warm, batch_size=b)

    # Every round is one pass over all pairs per variant, cut into blocks: each block is scored by
    # every variant back to back (the order rotates), so a change in machine load hits all variants
    # alike instead of whichever happened to run during it.
    variants = ["single"] + [f"batched{b}" for b in batch_sizes]
    variants += [f"batched{headline}@{int(t)}" for t in args.compare_pass_tokens.split(",") if t.strip()]
    # Blocks are consecutive runs of the pairs sorted by suffix length, the order margins() sorts
    # all pairs into: with a block size that is a multiple of the batch size, a round runs exactly
    # the batches of one margins(pairs) call (same rows, same padding), just timed in pieces.
    by_length = sorted(range(len(pairs)), key=lambda i: suffix_lens[i])
    block_idx = [by_length[i : i + args.block] for i in range(0, len(pairs), args.block)]
    blocks = [[pairs[i] for i in idx] for idx in block_idx]
    position = np.concatenate([np.asarray(idx) for idx in block_idx])
    times: dict[str, list[float]] = {v: [] for v in variants}
    margins: dict[str, np.ndarray] = {}
    step = 0
    for rep in range(args.reps):
        spent = dict.fromkeys(variants, 0.0)
        parts: dict[str, list[np.ndarray]] = {v: [] for v in variants}
        for k, block in enumerate(blocks):
            order = variants[step % len(variants) :] + variants[: step % len(variants)]
            order = order if step % 2 == 0 else order[::-1]
            step += 1
            for v in order:
                if v == "single":
                    dt, m = run_single(block)
                else:
                    dt, m = run_batched(block, *parse_variant(v), first=k == 0)
                spent[v] += dt
                parts[v].append(m)
        for v in variants:
            times[v].append(spent[v])
            margins[v] = np.empty(len(pairs))
            margins[v][position] = np.concatenate(parts[v])  # back to document order
        print(
            f"  round {rep + 1}: " + ", ".join(f"{v} {spent[v]:.1f} s" for v in variants),
            flush=True,
        )

    ref = margins["single"]
    best_single = min(times["single"])
    rows = []
    print()
    print(
        f"{'variant':<15} {'best s':>8} {'median s':>9} {'ms/pair':>8} {'speedup':>8} {'pad eff':>8} {'passes':>7} {'rows':>5} "
        f"{'max|dm|':>9} {'same θ=' + format(args.theta, 'g'):>9} {'same dyn':>9}"
    )
    for v in variants:
        best, med = min(times[v]), statistics.median(times[v])
        b, pass_tokens = parse_variant(v)
        diff = float(np.max(np.abs(margins[v] - ref))) if len(ref) else 0.0
        same_fixed = same_decisions(margins[v], ref, args.theta, False)
        same_dyn = same_decisions(margins[v], ref, args.theta, True)
        pad, n_passes, widest = 1.0, len(pairs), 1
        if b is not None:  # margins() sorts and batches within each block it is given
            batches = []  # each pass's pair lengths
            for idx in block_idx:
                lengths = [suffix_lens[i] for i in idx]
                batches += [[lengths[j] for j in batch] for batch in scorer.plan(lengths, b, pass_tokens)]
            padded = sum(len(batch) * max(batch) for batch in batches)
            pad, n_passes, widest = sum(suffix_lens) / padded, len(batches), max(map(len, batches))
        row = {
            "variant": v,
            "batch_size": b,
            "pass_tokens": pass_tokens,  # None: the device's default (GPU_PASS_TOKENS on a GPU, 0 on CPU)
            "times_s": times[v],
            "best_s": best,
            "median_s": med,
            "ms_per_pair": 1000 * best / len(pairs),
            "speedup_best": best_single / best,
            "speedup_median": statistics.median(times["single"]) / med,
            "speedup_per_round": [s / t for s, t in zip(times["single"], times[v])],
            "padding_efficiency": pad,
            "forward_passes": n_passes,  # per round, the prefix's own pass not counted
            "largest_batch": widest,
            "max_abs_margin_diff": diff,
            "same_decisions_fixed": same_fixed,
            "same_decisions_dynamic": same_dyn,
        }
        rows.append(row)
        print(
            f"{v:<15} {best:8.2f} {med:9.2f} {row['ms_per_pair']:8.1f} {row['speedup_best']:7.2f}x "
            f"{pad:8.2f} {n_passes:7d} {widest:5d} {diff:9.2e} {same_fixed:>4}/{len(pairs):<4} {same_dyn:>4}/{len(pairs):<4}"
        )

    head = next(r for r in rows if r["batch_size"] == headline and r["pass_tokens"] is None)
    best_row = max((r for r in rows if r["batch_size"] is not None), key=lambda r: r["speedup_best"])
    identical_timed = head["same_decisions_fixed"] == head["same_decisions_dynamic"] == len(pairs)
    check = None
    timed_dtype = str(model.dtype)
    if args.check_dtype:
        if args.check_dtype == "float32" and (attention_of(model) or "").startswith("flash_attention"):
            model.set_attn_implementation("sdpa")  # flash-attention refuses float32
        model.to(getattr(torch, args.check_dtype))
        check_scorer = MarginScorer(model, tokenizer, prompt)
        single = np.array([check_scorer.margin_single(a, b) for a, b in pairs])
        batched = check_scorer.margins(pairs, batch_size=headline)
        check = {
            "dtype": str(model.dtype),
            "batch_size": headline,
            "max_abs_margin_diff": float(np.max(np.abs(batched - single))) if len(pairs) else 0.0,
            "same_decisions_fixed": same_decisions(batched, single, args.theta, False),
            "same_decisions_dynamic": same_decisions(batched, single, args.theta, True),
        }
    judged = check or head
    identical = judged["same_decisions_fixed"] == judged["same_decisions_dynamic"] == len(pairs)
    passed = head["speedup_best"] >= target and identical
    result = {
        "bench": "msp_speed",
        "model": model_name,
        "device": device,
        "dtype": timed_dtype,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "lang": args.lang,
        "prompt": args.prompt,
        "n_pairs": len(pairs),
        "prefix_tokens": n_prefix,
        "suffix_tokens_mean": mean_suffix,
        "reps": args.reps,
        "block": args.block,
        "theta": args.theta,
        "target_speedup": target,
        "headline_batch_size": headline,
        "headline_speedup": head["speedup_best"],
        "best_batch_size": best_row["batch_size"],
        "best_variant": best_row["variant"],
        "best_speedup": best_row["speedup_best"],
        "identical_decisions": identical,
        "identical_decisions_timed": identical_timed,
        "decision_check": check,
        "pass": passed,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print()
    at = f" in {check['dtype'].removeprefix('torch.')} (untimed)" if check else ""
    print(
        f"MSP speed: batched (B={headline}, prefix KV reused) vs one call per pair = "
        f"{head['speedup_best']:.2f}x (median {head['speedup_median']:.2f}x; best {best_row['variant']}: "
        f"{best_row['speedup_best']:.2f}x), decisions identical{at} {judged['same_decisions_fixed']}/{len(pairs)} "
        f"(θ={args.theta:g}) and {judged['same_decisions_dynamic']}/{len(pairs)} (dynamic), "
        f"max|Δmargin| {judged['max_abs_margin_diff']:.1e} -> {'PASS' if passed else 'FAIL'} (target >= {target:g}x "
        f"on {device}) [{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}]"
    )
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"msp_speed: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
