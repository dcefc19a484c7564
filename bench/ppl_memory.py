"""PPL scoring memory: peak RSS for a 20K- and a 200K-character document.

Issue requirement: "peak RSS for documents of 20K and 200K characters. Target: ratio <=1.5" and
"Peak memory must not grow with document length beyond the window."

What is measured: the PPL chunking path, ``split_sentences`` -> ``score_documents`` (token NLL in
sliding windows of ``--max-context`` tokens, default 4096, batched, LM head in slices), on one
document per size. Documents are the first N characters of Emma's paragraphs joined by blank
lines (``--lang en``, SmolLM2 by default; ``data:gutenqa-emma/paragraphs.jsonl``) or of the CRUD news
articles joined the same way (``--lang zh``, Gemma-3-270m by default; ``data:crud-news/news.jsonl``,
``metachunk data fetch crud-news`` once); the smaller document is a prefix of the larger one.

Every size runs in a fresh child process (this script re-invoked with ``--child``), so the numbers
are independent and the parent, which never imports torch, adds nothing to them. The child loads
the model, runs a tiny warm-up forward (the weights are memory-mapped and only become resident
when first used), records its RSS ("load"), resets the kernel's peak-RSS mark (``VmHWM``, via
``/proc/self/clear_refs``; where that is not possible a sampling thread is the fallback), splits
and scores the document, and reports as JSON: peak RSS during scoring (the reset ``VmHWM``, and
the sampled maximum), the process-lifetime ``ru_maxrss``, tokens, windows and seconds. The parent
prints a table and two ratios, each against the target <= 1.5:

* ``peak(largest) / peak(smallest)``: the issue's ratio of whole-process peaks (model included);
  this one decides PASS/FAIL;
* ``(peak - load)`` of the largest over that of the smallest: the memory that scoring itself adds,
  which should depend on the window and batch shape only ("must not grow with document length").
  It is sensitive to the C allocator: with glibc's default, dynamic mmap threshold, freed
  activation buffers stay on the heap and RSS creeps up over the first few batches before it
  levels off (measured: +180 MiB over 4 batches, then flat), so ``peak - load`` moves by ~100 MiB
  from run to run and tends to read higher for a document with many batches. ``--mmap-threshold 1048576``
  (sets ``MALLOC_MMAP_THRESHOLD_`` in the children) takes that out of the comparison.

Cost: scoring runs at ~100-160 tokens/s on one shared CPU thread with SmolLM2 and 4096-token
windows (every window after the first re-reads 2048 tokens of context), so the default run
(20K chars ~ 4.7K tokens, 200K chars ~ 47K tokens) takes about 9 minutes on one CPU thread.
``--sizes 20000,40000`` (~2 minutes) or a smaller ``--max-context`` give a quick run. Chinese
tokenizes at ~0.75 tokens per character with Gemma-3, which scores ~50 tokens/s on one thread: use small
sizes there (``--lang zh --sizes 2000,8000 --max-context 1024`` takes ~3 minutes).
Results: ``bench_out/ppl_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402

CORPUS = {"en": "data:gutenqa-emma/paragraphs.jsonl", "zh": "data:crud-news/news.jsonl"}
DEFAULT_MODEL = {"en": "smollm2", "zh": "gemma3-270m"}
MIB = 2**20


def build_document(lang: str, n_chars: int) -> str:
    """The first ``n_chars`` characters of Emma (en) or the CRUD news (zh), texts joined by blank lines."""
    with open(resolve(CORPUS[lang]), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    parts, total = [], 0
    while total < n_chars:  # the corpus is repeated if it is shorter than asked (it is not by default)
        for t in texts:
            parts.append(t)
            total += len(t) + 2
            if total >= n_chars:
                break
    return "\n\n".join(parts)[:n_chars]


# ---------------------------------------------------------------------------------------------- child


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm() -> int | None:
    """Peak RSS in bytes since start or the last reset, from /proc/self/status."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    """Samples RSS every ``interval`` seconds and keeps the maximum."""

    def __init__(self, interval: float = 0.02):
        super().__init__(daemon=True)
        self.interval, self.peak, self._halt = interval, current_rss(), threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, current_rss())
            self._halt.wait(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, current_rss())
        return self.peak


def child(args: argparse.Namespace) -> None:
    import gc
    import resource

    import torch
    from metachunk.chunking.ppl import score_documents
    from metachunk.chunking.sentences import split_sentences

    from metachunk.engine.scoring import plan_windows, token_nll
    from metachunk.models import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    rss_start = current_rss()
    doc = build_document(args.lang, args.size)
    t0 = time.perf_counter()
    model, tokenizer = load_causal_lm(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    rss_from_pretrained = current_rss()
    # Weights are memory-mapped and become resident only when first used (~+500 MiB for SmolLM2 on
    # the first forward pass), so "after load" is taken after a tiny warm-up that touches them all;
    # otherwise peak - load would count the model's own pages as scoring memory.
    token_nll(model, [tokenizer(doc[:400], add_special_tokens=False)["input_ids"][:32]], max_context=64)
    gc.collect()
    rss_load = current_rss()
    ru_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    scored = [0]
    hwm_reset = reset_peak_rss()
    sampler = RssSampler(args.sample_interval)
    sampler.start()
    t0 = time.perf_counter()
    sentences = split_sentences(doc, args.lang)
    t1 = time.perf_counter()
    ppl = score_documents(
        model,
        tokenizer,
        [doc],
        [sentences],
        max_context=args.max_context,
        on_batch=lambda n: scored.__setitem__(0, scored[0] + n),
    )[0]
    t2 = time.perf_counter()
    sampled_peak = sampler.stop()
    hwm = vm_hwm() if hwm_reset else None
    n_tokens = scored[0] + 1  # every token but the first is scored exactly once
    print(
        json.dumps(
            {
                "size_chars": len(doc),
                "sentences": len(sentences),
                "tokens": n_tokens,
                "windows": len(plan_windows(n_tokens, args.max_context)),
                "finite_ppl": int(sum(1 for p in ppl if p == p)),
                "rss_start": rss_start,
                "rss_from_pretrained": rss_from_pretrained,  # before the warm-up forward
                "rss_load": rss_load,  # model loaded and warmed up: the baseline of peak - load
                "ru_maxrss_after_load": ru_load,
                "peak_hwm": hwm,  # VmHWM reset after load: exact peak during split + scoring
                "peak_sampled": sampled_peak,
                "peak": hwm if hwm is not None else sampled_peak,
                "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "load_s": load_s,
                "split_s": t1 - t0,
                "score_s": t2 - t1,
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )


# --------------------------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, size: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--size",
        str(size),
        "--lang",
        args.lang,
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-context",
        str(args.max_context),
        "--sample-interval",
        str(args.sample_interval),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child for size {size} failed with status {proc.returncode}")
    res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--sizes", default="20000,200000", help="document sizes in characters (default 20000,200000)"
    )
    ap.add_argument("--lang", choices=("en", "zh"), default="en", help="en: Emma paragraphs; zh: CRUD news")
    ap.add_argument(
        "--model", default=None, help="preset or HF dir (default: smollm2 for en, gemma3-270m for zh)"
    )
    ap.add_argument("--max-context", type=int, default=4096, help="scoring window in tokens (default 4096)")
    ap.add_argument("--device", default="cpu", help="device for the model (default cpu: RSS is host memory)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="model dtype (auto: bfloat16 on a GPU or a CPU with native bf16, AMX or AVX-512 BF16; else float32)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the child")
    ap.add_argument("--target", type=float, default=1.5, help="maximum allowed ratio (default 1.5)")
    ap.add_argument("--sample-interval", type=float, default=0.02, help="RSS sampling period in seconds")
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ (bytes) in the children: a fixed glibc mmap threshold, so\n"
        "freed large buffers go back to the OS at once (default: the allocator's own, dynamic one)",
    )
    ap.add_argument(
        "--strict", action="store_true", help="exit with status 1 when either ratio misses the target"
    )
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "ppl_memory.json"), help="JSON result path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or DEFAULT_MODEL[args.lang]

    if args.child:
        child(args)
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if len(sizes) < 2:
        ap.error("--sizes needs at least two sizes")
    resolve(CORPUS[args.lang])  # a missing dataset stops here, before the first child
    print(
        f"model={args.model} lang={args.lang} device={args.device} max_context={args.max_context} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
        f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'default'} (one fresh process per size)",
        flush=True,
    )
    results = []
    for size in sizes:
        res = run_child(args, size)
        results.append(res)
        print(
            f"  {size:>8} chars: {res['tokens']} tokens, {res['windows']} windows, "
            f"scored in {res['score_s']:.1f} s, peak {res['peak'] / MIB:.0f} MiB",
            flush=True,
        )

    print()
    print(
        f"{'chars':>8} {'tokens':>7} {'windows':>7} {'load MiB':>9} {'peak MiB':>9} {'peak-load':>9} "
        f"{'sampled':>8} {'ru_maxrss':>9} {'split s':>8} {'score s':>8} {'tok/s':>7}"
    )
    for r in results:
        print(
            f"{r['size_chars']:>8} {r['tokens']:>7} {r['windows']:>7} {r['rss_load'] / MIB:>9.0f} "
            f"{r['peak'] / MIB:>9.0f} {(r['peak'] - r['rss_load']) / MIB:>9.0f} {r['peak_sampled'] / MIB:>8.0f} "
            f"{r['ru_maxrss'] / MIB:>9.0f} {r['split_s']:>8.2f} {r['score_s']:>8.1f} "
            f"{r['tokens'] / r['score_s']:>7.0f}"
        )

    small, large = results[0], results[-1]
    peak_ratio = large["peak"] / small["peak"]
    growth_small = max(small["peak"] - small["rss_load"], 1)
    growth_ratio = (large["peak"] - large["rss_load"]) / growth_small
    print()
    print(
        f"peak({large['size_chars']}) / peak({small['size_chars']}) = {peak_ratio:.3f}  "
        f"{verdict(peak_ratio, args.target)} (<= {args.target:g})"
    )
    print(
        f"(peak-load)({large['size_chars']}) / (peak-load)({small['size_chars']}) = {growth_ratio:.3f}  "
        f"{verdict(growth_ratio, args.target)} (<= {args.target:g}; scoring memory vs document length)"
    )
    passed = peak_ratio <= args.target  # the target
    growth_passed = growth_ratio <= args.target
    if not growth_passed and not args.mmap_threshold:
        print(
            "  note: glibc's dynamic mmap threshold keeps freed activation buffers on the heap, so RSS\n"
            "  creeps up over the first few batches and then stays flat; a document with fewer batches\n"
            "  stops earlier on that curve. --mmap-threshold 1048576 takes the allocator out of the\n"
            "  comparison (measured: flat to the MiB from batch to batch)."
        )
    result = {
        "bench": "ppl_memory",
        "model": args.model,
        "lang": args.lang,
        "device": args.device,
        "max_context": args.max_context,
        "malloc_mmap_threshold": args.mmap_threshold,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "target": args.target,
        "peak_ratio": peak_ratio,
        "peak_minus_load_ratio": growth_ratio,
        "pass": passed,
        "pass_peak_minus_load": growth_passed,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(
        f"PPL memory: peak RSS {large['size_chars']} vs {small['size_chars']} chars = {peak_ratio:.2f}x "
        f"-> {'PASS' if passed else 'FAIL'} (target <= {args.target:g}); scoring memory (peak - load) "
        f"{growth_ratio:.2f}x -> {'PASS' if growth_passed else 'FAIL'} [{out}]"
    )
    return 1 if args.strict and not (passed and growth_passed) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"ppl_memory: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
