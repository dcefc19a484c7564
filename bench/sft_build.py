"""SFT dataset build: rows/s and peak RSS of ``metachunk data build-sft`` at 2K and 20K records.

Issue requirement: "Scale: 20K rows must build in bounded memory (streaming, no whole-corpus lists
of model outputs). Report rows/s."

What is measured: ``metachunk.distill.sft.build_sft`` (the whole ``build-sft rewrite`` path: read records,
filters, decontamination against test documents, exact / near-duplicate rows, the student chat
template twice per row for the token lengths, parquet shards, card, histogram) on synthetic
inputs. The bench measures the builder's throughput and memory, not data quality: the texts are
meaningless and every record passes every filter.

Synthetic inputs, written by the parent into a temp dir (seeded, so every run builds the same):

* documents: ~700 characters each (the real CRUD articles are ~700), "sentences" of pseudo-random
  Chinese characters drawn from GB2312's 3,755 level-1 (most common) hanzi, minus the few that
  occur in the refusal / preface / stage-markup filters, so that no record is dropped by chance;
  the 5-gram shingles of two documents practically never overlap;
* records (``rewrite.jsonl``): one or two chunks per document (runs of whole sentences, about half
  a document each), each a distilled record as ``distill`` writes it: status ok, lang zh,
  ``context_spans`` the whole document, output = a short prefix + the chunk (keeps the content),
  three teacher stages with usage and cost;
* test documents: 100 other documents of the same kind, for the decontamination index.

Every size runs in a fresh child process (this script re-invoked with ``--child``). The child
imports everything the build needs (datasets, pyarrow, transformers, matplotlib, datasketch), loads
and warms the tokenizer once, frees it, and records its RSS: the baseline. It then runs
``build_sft`` (timed: wall seconds, and ``stats["timing"]["rows_per_s"]``) and reads its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the process-lifetime peak, also read at the
baseline) and its RSS at the end. Only after that does it check the result: the dataset dir loads
with ``datasets.load_dataset(dir)`` (cache in the temp dir) and has exactly one row per record.
A wrapper around ``metachunk.distill.card.plot_token_lengths`` (which build_sft calls right after the last
record) also reads ``ru_maxrss`` when the record loop ends ("loop"), separating the streaming part
from what follows: the histogram and the card, whose split sizes are measured by reading one
parquet shard at a time (up to ``shard_rows`` = 10,000 rows, so bounded by the shard size, not by
the number of rows).

The parent prints rows/s and peak - baseline for each size, the ratio of the two memory deltas and
the marginal memory per extra record. Target: bounded memory, i.e. the 20K build's extra memory far
below 10x the 2K build's (10x means memory grows with every row, as a list of outputs would);
"far below" is read as < 5x (``--target``). It cannot be ~1x: the builder keeps a small state per
row by design (the near-duplicate index of kept chunks: a MinHash LSH entry of ~6 KB plus the chunk
text, exact hashes, token lengths, document ids; the documents themselves only as a window of 256, the
records coming in their order).

The figures, and where a row's time goes: docs/performance.md (Measured numbers).

Tokenizer: the ``smollm2`` preset (a local dir). The real student is Qwen2.5-3B, whose tokenizer
is not available offline. SmolLM2's byte-level BPE has few Chinese tokens (~2.5 tokens per
character on this text; Qwen2.5's vocabulary holds the common hanzi as single tokens, so about one
per character or fewer, not measured here), so its chat template sees more tokens than the real one
would (~2,950 prompt + ~840 completion tokens per row), and ``--max-length`` defaults to 8192 here
(4096 in build-sft) so that no row is dropped as too long; rows/s is pessimistic for the
tokenizer part.

    python bench/sft_build.py                          # 2,000 and 20,000 records; ~4 minutes on 2 cores
    python bench/sft_build.py --sizes 1000,5000        # a quick run

Results: ``bench_out/sft_build.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metachunk.artifacts import write_json

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
# Characters of metachunk.distill.sft_rows's refusal / preface / stage-markup patterns: left out of the alphabet,
# so that a random text never matches one of them (a dropped row would change the row count).
FILTER_CHARS = set("抱歉对不起作为一个人工智能我无法能以下是好的改写后摘要缺失补充")
OUTPUT_PREFIX = "据报道，"
N_TEST_DOCS = 100


# --------------------------------------------------------------------------------------- inputs


def alphabet() -> list[str]:
    """GB2312 level-1 hanzi (rows 16-55: the 3,755 most common characters), minus FILTER_CHARS."""
    chars = []
    for hi in range(0xB0, 0xD8):
        for lo in range(0xA1, 0xFF):
            if hi == 0xD7 and lo > 0xF9:  # row 55 ends at 0xD7F9
                break
            chars.append(bytes([hi, lo]).decode("gb2312"))
    return [c for c in chars if c not in FILTER_CHARS]


def make_sentences(rng: random.Random, chars: list[str], n_chars: int) -> list[str]:
    """Sentences of 8-30 random characters (a comma inside some), ending with "。", ~n_chars in all."""
    sentences, total = [], 0
    while total < n_chars:
        n = rng.randint(8, 30)
        body = "".join(rng.choices(chars, k=n))
        if n > 16:
            cut = rng.randint(5, n - 5)
            body = body[:cut] + "，" + body[cut:]
        sentences.append(body + "。")
        total += len(sentences[-1])
    return sentences


def make_record(doc_id: str, doc: str, start: int, end: int, index: int, line: int) -> dict:
    chunk = doc[start:end]
    stage = {"status": "ok", "teacher": "teacher-model", "prompt_sha256": "ab" * 32,
             "usage": {"prompt_tokens": 900 + line % 97, "completion_tokens": 300}, "cost": 0.0004}  # fmt: skip
    return {
        "schema_version": 1,
        "task": "rewrite",
        "doc_id": doc_id,
        "chunk_index": index,
        "start": start,
        "end": end,
        "text": chunk,
        "lang": "zh",
        "context_spans": [[0, len(doc)]],
        "status": "ok",
        "reason": "",
        "output": OUTPUT_PREFIX + chunk,
        "stages": {s: dict(stage) for s in ("reflection", "refinement", "completion")},
    }


def write_inputs(tmp: Path, n_records: int, seed: int) -> dict:
    """documents.jsonl, rewrite.jsonl (n_records records) and test_documents.jsonl, streamed to disk."""
    chars = alphabet()
    rng = random.Random(f"sft-build-{seed}")
    n_docs = 0
    doc_chars = 0
    with (
        (tmp / "documents.jsonl").open("w", encoding="utf-8") as docs_f,
        (tmp / "rewrite.jsonl").open("w", encoding="utf-8") as rec_f,
    ):
        written = 0
        while written < n_records:
            doc_id = f"doc-{n_docs:06d}"
            sentences = make_sentences(rng, chars, rng.randint(620, 780))
            doc = "".join(sentences)
            offsets = [0]
            for s in sentences:
                offsets.append(offsets[-1] + len(s))
            half = len(sentences) // 2
            if rng.random() < 0.5 or written + 1 == n_records:  # one chunk: a run of ~half the sentences
                a = rng.randint(0, len(sentences) - half)
                spans = [(a, a + half)]
            else:  # two chunks: the first half and the second half
                spans = [(0, half), (half, len(sentences))]
            docs_f.write(json.dumps({"id": doc_id, "text": doc}, ensure_ascii=False) + "\n")
            for index, (a, b) in enumerate(spans):
                record = make_record(doc_id, doc, offsets[a], offsets[b], index, written)
                rec_f.write(json.dumps(record, ensure_ascii=False) + "\n")
                written += 1
            n_docs += 1
            doc_chars += len(doc)
    test_rng = random.Random(f"sft-build-test-{seed}")
    with (tmp / "test_documents.jsonl").open("w", encoding="utf-8") as f:
        for i in range(N_TEST_DOCS):
            text = "".join(make_sentences(test_rng, chars, test_rng.randint(620, 780)))
            f.write(json.dumps({"id": f"test-{i:04d}", "text": text}, ensure_ascii=False) + "\n")
    return {
        "records": n_records,
        "documents": n_docs,
        "mean_doc_chars": round(doc_chars / n_docs, 1),
        "records_bytes": (tmp / "rewrite.jsonl").stat().st_size,
        "documents_bytes": (tmp / "documents.jsonl").stat().st_size,
    }


# ---------------------------------------------------------------------------------------------- child


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ru_maxrss() -> int:
    """Peak RSS of this process so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(args: argparse.Namespace) -> None:
    import gc

    rss_start = current_rss()
    # Everything build_sft imports, and one tokenizer load + chat-template render (compiles the
    # Jinja template), so that the baseline holds the fixed costs and the delta is the build's own.
    import datasets  # noqa: F401
    import datasketch  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import metachunk.distill.card
    import metachunk.distill.corpus  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    from metachunk.distill.sft import BuildSftConfig, build_sft
    from transformers import AutoTokenizer

    from metachunk.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(args.tokenizer)))
    tokenizer.apply_chat_template([{"role": "user", "content": "你好"}], tokenize=True)
    del tokenizer
    gc.collect()
    rss_baseline = current_rss()
    ru_baseline = ru_maxrss()

    # RSS when the record loop is over: build_sft calls plot_token_lengths right after closing the
    # shard writers, so a wrapper around it marks the end of the streaming part. What follows
    # (histogram, card, which reads one parquet shard at a time to measure split sizes) is bounded by
    # the shard size, not by the number of rows.
    loop_end = {}
    plot = metachunk.distill.card.plot_token_lengths

    def marked_plot(*a, **k):
        loop_end.update(rss=current_rss(), peak=ru_maxrss())
        return plot(*a, **k)

    metachunk.distill.card.plot_token_lengths = marked_plot

    tmp = Path(args.tmp)
    cfg = BuildSftConfig(
        task="rewrite",
        distilled=tmp / "rewrite.jsonl",
        out=tmp / "dataset",
        documents=tmp / "documents.jsonl",
        test_documents=tmp / "test_documents.jsonl",
        cards_dir=tmp / "cards",
        tokenizer=args.tokenizer,
        max_length=args.max_length,
    )
    t0 = time.perf_counter()
    stats = build_sft(cfg, progress=False)
    wall = time.perf_counter() - t0
    peak = ru_maxrss()
    rss_end = current_rss()

    # Verification, after the measurements (loading the dataset costs memory of its own).
    from datasets import load_dataset
    from metachunk.distill.sft_rows import features

    ds = load_dataset(str(cfg.out), cache_dir=str(tmp / "hf_cache"))
    loaded = {split: ds[split].num_rows for split in ds}
    print(
        json.dumps(
            {
                "records": args.records,
                "input_records": stats["input_records"],
                "rows": stats["rows"],
                "filters": stats["filters"],
                "rows_per_s": stats["timing"]["rows_per_s"],
                "build_seconds": stats["timing"]["seconds"],
                "wall_s": wall,
                "token_lengths": {k: stats["token_lengths"][k] for k in ("prompt", "completion")},
                "rss_start": rss_start,
                "rss_baseline": rss_baseline,  # after imports + tokenizer load: the baseline
                "ru_maxrss_baseline": ru_baseline,
                "peak": peak,  # ru_maxrss after the build
                "rss_end": rss_end,
                "rss_loop_end": loop_end.get("rss"),  # after the last record, before histogram + card
                "peak_loop_end": loop_end.get("peak"),
                "loaded_rows": loaded,
                "features_ok": all(ds[s].features == features() for s in ds),
                "shards": sorted(p.name for p in (cfg.out / "data").iterdir()),
            }
        ),
        flush=True,
    )


# --------------------------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, n_records: int, tmp: Path) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--records",
        str(n_records),
        "--tmp",
        str(tmp),
        "--tokenizer",
        args.tokenizer,
        "--max-length",
        str(args.max_length),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    process_s = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child for {n_records} records failed with status {proc.returncode}")
    res = json.loads(lines[-1])
    res["process_s"] = process_s
    return res


def build_dataset(out: Path, n: int, args) -> int:
    """``build-sft rewrite`` of ``n`` synthetic records into ``out`` (the inputs in a temp dir)."""
    from metachunk.distill.sft import BuildSftConfig, build_sft

    with tempfile.TemporaryDirectory(prefix="sft_build_") as tmp:
        tmp = Path(tmp)
        write_inputs(tmp, n, args.seed)
        cfg = BuildSftConfig(task="rewrite", distilled=tmp / "rewrite.jsonl", out=out, documents=tmp / "documents.jsonl",
                             test_documents=tmp / "test_documents.jsonl", cards_dir=tmp / "cards",
                             tokenizer=args.tokenizer, max_length=args.max_length)  # fmt: skip
        stats = build_sft(cfg, progress=False)
    print(f"sft_build: {n} records -> {out} ({json.dumps(stats.get('rows', {}))} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2000,20000", help="records per build (default 2000,20000)")
    ap.add_argument(
        "--tokenizer", default="smollm2", help="student tokenizer, preset or dir (default smollm2)"
    )
    ap.add_argument(
        "--max-length", type=int, default=8192, help="build-sft --max-length (default 8192, see above)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs")
    ap.add_argument(
        "--target", type=float, default=5.0, help="largest memory-delta ratio counted as bounded (default 5)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (inputs and built datasets)")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "sft_build.json"), help="JSON result path")
    ap.add_argument(
        "--dataset-out",
        type=Path,
        help="build one dataset of the first size's records into this folder and stop, nothing measured: "
        "a training run's input with CRUD-like lengths (bench/gpu_train_check.sh)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--records", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        child(args)
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.dataset_out:
        return build_dataset(args.dataset_out, sizes[0], args)
    if len(sizes) < 2:
        ap.error("--sizes needs at least two sizes")
    print(
        f"build-sft rewrite on synthetic zh records; tokenizer={args.tokenizer} max_length={args.max_length} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} (one fresh process per size)",
        flush=True,
    )
    results = []
    for n in sizes:
        tmp = Path(tempfile.mkdtemp(prefix=f"sft_build_{n}_"))
        try:
            t0 = time.perf_counter()
            inputs = write_inputs(tmp, n, args.seed)
            gen_s = time.perf_counter() - t0
            res = run_child(args, n, tmp)
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        res["inputs"] = {**inputs, "generate_s": round(gen_s, 2), "dir": str(tmp) if args.keep else None}
        total = sum(res["rows"].values())
        loaded = sum(res["loaded_rows"].values())
        res["ok"] = total == loaded == n and res["input_records"] == n and res["features_ok"]
        results.append(res)
        print(
            f"  {n:>6} records ({inputs['documents']} documents, {inputs['records_bytes'] / MIB:.1f} MiB of "
            f"records): {total} rows in {res['wall_s']:.1f} s, {res['rows_per_s']} rows/s, peak "
            f"{res['peak'] / MIB:.0f} MiB; load_dataset: {res['loaded_rows']} "
            f"{'OK' if res['ok'] else 'MISMATCH (expected ' + str(n) + ')'}",
            flush=True,
        )

    print()
    print(
        f"{'records':>8} {'rows':>7} {'wall s':>7} {'rows/s':>7} {'base MiB':>9} {'peak MiB':>9} "
        f"{'peak-base':>9} {'loop-base':>9} {'end-base':>9} {'prompt tok':>10} {'compl tok':>9}"
    )
    for r in results:
        rows = sum(r["rows"].values())
        print(
            f"{r['records']:>8} {rows:>7} {r['wall_s']:>7.1f} {r['rows_per_s']:>7.1f} "
            f"{r['rss_baseline'] / MIB:>9.0f} {r['peak'] / MIB:>9.0f} {(r['peak'] - r['rss_baseline']) / MIB:>9.1f} "
            f"{(r['peak_loop_end'] - r['rss_baseline']) / MIB:>9.1f} {(r['rss_end'] - r['rss_baseline']) / MIB:>9.1f} "
            f"{r['token_lengths']['prompt']['mean']:>10} {r['token_lengths']['completion']['mean']:>9}"
        )
    print(
        "  base: RSS after imports + tokenizer load; peak: ru_maxrss after the build; loop: ru_maxrss when the\n"
        "  last record is written (before histogram + card); end: RSS after the build"
    )
    small, large = results[0], results[-1]
    scale = large["records"] / small["records"]
    extra = large["records"] - small["records"]
    d_small = max(small["peak"] - small["rss_baseline"], 1)
    d_large = large["peak"] - large["rss_baseline"]
    ratio = d_large / d_small
    per_row = (d_large - d_small) / max(extra, 1)
    loop_small = max(small["peak_loop_end"] - small["rss_baseline"], 1)
    loop_large = large["peak_loop_end"] - large["rss_baseline"]
    loop_ratio = loop_large / loop_small
    loop_per_row = (loop_large - loop_small) / max(extra, 1)
    bounded = ratio < args.target
    print()
    print(
        f"rows/s: {small['rows_per_s']} ({small['records']} records) vs {large['rows_per_s']} "
        f"({large['records']} records), ratio {large['rows_per_s'] / small['rows_per_s']:.2f}"
    )
    print(
        f"(peak - base)({large['records']}) / (peak - base)({small['records']}) = "
        f"{d_large / MIB:.1f} / {d_small / MIB:.1f} MiB = {ratio:.2f}x for {scale:.0f}x the records "
        f"(marginal {per_row / 1024:.1f} KiB per extra record); target far below 10x (< {args.target:g}x): "
        f"{'bounded' if bounded else 'NOT bounded'}"
    )
    print(
        f"record loop only: {loop_large / MIB:.1f} / {loop_small / MIB:.1f} MiB = {loop_ratio:.2f}x "
        f"(marginal {loop_per_row / 1024:.1f} KiB per extra record: near-duplicate index, document ids, "
        "hashes, token lengths)"
    )
    if small["ru_maxrss_baseline"] > small["rss_baseline"] + 16 * MIB:
        print(
            f"  note: the peak before the build ({small['ru_maxrss_baseline'] / MIB:.0f} MiB) was above the "
            "baseline, so small deltas are upper bounds"
        )
    result = {
        "bench": "sft_build",
        "tokenizer": args.tokenizer,
        "max_length": args.max_length,
        "seed": args.seed,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "memory_delta_ratio": ratio,
        "marginal_bytes_per_record": per_row,
        "loop_memory_delta_ratio": loop_ratio,
        "loop_marginal_bytes_per_record": loop_per_row,
        "target_ratio_below": args.target,
        "bounded": bounded,
        "all_rows_ok": all(r["ok"] for r in results),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(
        f"build-sft: {large['rows_per_s']} rows/s at {large['records']} records; extra memory "
        f"{ratio:.2f}x for {scale:.0f}x the records -> {'bounded' if bounded else 'NOT bounded'}; "
        f"rows {'OK' if result['all_rows_ok'] else 'MISMATCH'} [{out}]"
    )
    return 0 if result["all_rows_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
