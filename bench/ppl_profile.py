"""Where the PPL engine's scoring time goes on a GPU, from a torch.profiler trace: do kernel launches cost?

CUDA graphs or ``torch.compile`` pay only where a profile says launches cost. This is that
profile. `metachunk.engine.scoring.token_nll` scores ``--docs`` documents once to warm up (cuBLAS, flex
attention's compiles), then again under ``torch.profiler`` with CPU and CUDA activity, and the script reads
the trace:

* **busy**: the union of the GPU's kernel intervals, as a share of the profiled wall time; the rest is time the
  GPU waited;
* **gaps** between consecutive kernels, split at ``--short-gap`` (default 20 µs): many short gaps are the
  launch overhead that CUDA graphs remove; long ones are host work between batches (planning, copying,
  the next batch's inputs), which graphs do not remove;
* **kernels**: how many, per batch, and their median and 10th-percentile duration (launch-bound work has
  kernels of a few µs);
* the top operators by GPU time (CPU time on a CPU), to ``--out`` as JSON and a table beside it.

The verdict line says which of the three bounds the run: the GPU's work (busy ≥ 0.9), launches (the short
gaps are the larger share of the idle time) or host work between batches. On a CPU (the dry run) there is no
device trace: it reports the top operators by CPU time and no verdict.

    python bench/ppl_profile.py --model DIR --device cuda --corpus crud --docs 1200 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from metachunk.artifacts import InputError, write_json
from metachunk.named_data import resolve

CORPUS = {"emma": "data:gutenqa-emma/paragraphs.jsonl", "crud": "data:crud-news/news.jsonl"}


def load_texts(corpus: str, n: int) -> list[str]:
    with resolve(CORPUS[corpus]).open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` intervals (kernels of several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle stretches between kernels: where no kernel of any stream runs."""
    out, end = [], None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            out.append(a - end)
        end = b if end is None else max(end, b)
    return out


def read_trace(prof, wall_us: float, short_gap_us: float, batches: int, device: bool) -> dict:
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    key = "self_device_time_total" if device else "self_cpu_time_total"
    top = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:15]
    report = {
        "wall_s": wall_us / 1e6,
        "batches": batches,
        "top_ops": [{"op": e.key, "calls": e.count, "self_us": getattr(e, key)} for e in top],
    }
    if not device:
        return report
    kernels = [
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
    ]
    if not kernels:
        return report | {"verdict": "no kernels in the trace"}
    busy = union_length(kernels)
    idle = gaps(kernels)
    short = sum(g for g in idle if g < short_gap_us)
    long = sum(g for g in idle if g >= short_gap_us)
    durations = sorted(b - a for a, b in kernels)
    busy_share = busy / wall_us
    if busy_share >= 0.9:
        verdict = "bound by the GPU's work: launches do not cost here"
    elif short > long:
        verdict = "launch-bound: short gaps between kernels are most of the idle time (CUDA graphs may pay)"
    else:
        verdict = (
            "host-bound between batches: long gaps are most of the idle time (graphs would not remove them)"
        )
    return report | {
        "gpu_busy_s": busy / 1e6,
        "gpu_busy_share": busy_share,
        "kernels": len(kernels),
        "kernels_per_batch": len(kernels) / max(1, batches),
        "kernel_us_median": statistics.median(durations),
        "kernel_us_p10": durations[len(durations) // 10],
        "short_gaps_s": short / 1e6,
        "short_gaps": sum(1 for g in idle if g < short_gap_us),
        "long_gaps_s": long / 1e6,
        "long_gaps": sum(1 for g in idle if g >= short_gap_us),
        "short_gap_us": short_gap_us,
        "verdict": verdict,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model dir or preset")
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--corpus", choices=sorted(CORPUS), default="crud")
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument(
        "--short-gap", type=float, default=20.0, help="µs: a gap shorter than this is launch overhead"
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON report; the table goes beside it (.txt)")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from metachunk.engine.scoring import token_nll
    from metachunk.models import default_device, load_causal_lm

    try:
        texts = load_texts(args.corpus, args.docs)
    except InputError as e:
        print(f"ppl_profile: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
    device = args.device or default_device()
    on_gpu = device.startswith("cuda")
    model, tok = load_causal_lm(args.model, device=device, dtype=args.dtype)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    token_nll(
        model, ids, max_context=args.max_context
    )  # warm-up: library setup and compiles are not the plan's
    sync()
    batches = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        token_nll(model, ids, max_context=args.max_context, on_batch=batches.append)
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    report = read_trace(prof, wall_us, args.short_gap, len(batches), on_gpu)
    report |= {"device": device, "model": str(args.model), "docs": len(ids), "tokens": sum(map(len, ids)),
               "dtype": str(next(model.parameters()).dtype)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    args.out.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=25))

    print(f"profile: {report['docs']} documents, {report['tokens']:,} tokens, {report['batches']} batches, "
          f"{report['wall_s']:.3f} s on {device} ({report['dtype']})")  # fmt: skip
    if "gpu_busy_share" in report:
        print(f"  GPU busy {report['gpu_busy_s']:.3f} s ({report['gpu_busy_share']:.0%}); "
              f"{report['kernels']:,} kernels ({report['kernels_per_batch']:.0f} per batch, median "
              f"{report['kernel_us_median']:.1f} µs, p10 {report['kernel_us_p10']:.1f} µs); idle: "
              f"{report['short_gaps']:,} gaps < {args.short_gap:g} µs = {report['short_gaps_s']:.3f} s, "
              f"{report['long_gaps']:,} longer = {report['long_gaps_s']:.3f} s")  # fmt: skip
    if "verdict" in report:
        print(f"  verdict: {report['verdict']}")
    for row in report["top_ops"][:5]:
        print(f"  {row['op']}: {row['calls']} calls, {row['self_us'] / 1e3:.1f} ms self")


if __name__ == "__main__":
    main()
