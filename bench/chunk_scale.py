"""Corpus-scale chunking: worker scaling, memory against corpus size, and resume after kill -9.

Every run is ``metachunk chunk CORPUS -o DIR/`` in a child process (``python -m metachunk.cli``),
so what is timed and measured is exactly what a user runs. Results: ``bench_out/chunk_scale.json``.

* **Scaling.** The same ``--docs`` CRUD articles (default 40), PPL-chunked with ``--model``
  (default Gemma-3-270m) in ``--dtype`` (default bfloat16), 8 shards: ``--workers 1`` then
  ``--workers 2``, one thread each (``--threads-per-worker 1``). Wall time of the whole command,
  model loads included (each worker loads its own). Target on this 2-core machine: >= 1.7x. The
  two folders must hold identical shards.
* **Memory.** Peak RSS (``ru_maxrss`` of the child, from ``os.wait4``) of a ``sentence`` run, so
  that only the input and output path is measured, on a corpus of ``--mem-docs`` documents
  (default 1,000 and 10,000: Emma's paragraphs, cycled, with unique ids). Target: largest /
  smallest <= 1.1x.
* **Resume.** PPL with SmolLM2 on 60 Emma paragraphs, 12 shards: one uninterrupted run, then the
  same command killed (SIGKILL) at a random moment (seeded, between 25% and 75% of the first
  run's wall time) and run again. Printed: the shards done at the kill, the documents the killed
  run had scored but not saved (its progress bar's count minus the documents of the done shards:
  what the rerun scores again), the rerun's documents chunked, the seconds the rerun took to find
  what to skip (scan + fingerprint + shard hashes), and whether the folder is byte-identical to
  the uninterrupted one.

Data: ``data:crud-news/news.jsonl`` (``metachunk data fetch crud-news`` once) and
``data:gutenqa-emma/paragraphs.jsonl`` (ships with metachunk).

    python bench/chunk_scale.py                     # all three, about 10 minutes on a 2-core CPU
    python bench/chunk_scale.py --only memory --mem-docs 10000,100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from metachunk.chunking.shards import shards_done

from metachunk.artifacts import InputError, read_run_log, write_json
from metachunk.named_data import resolve

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench_out" / "chunk_scale"
MIB = 2**20


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def crud_articles(n: int) -> list[dict]:
    rows = []
    with resolve("data:crud-news/news.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows.append({"id": row["id"], "text": row["text"]})
            if len(rows) == n:
                break
    return rows


def emma_paragraphs() -> list[str]:
    with resolve("data:gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def chunk(args: list[str], out: Path, env: dict | None = None) -> tuple[float, int, str]:
    """``(wall seconds, peak RSS bytes, stderr)`` of one ``metachunk chunk`` child."""
    cmd = [sys.executable, "-m", "metachunk.cli", "chunk", *map(str, args), "-o", str(out), "--overwrite"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"chunk_scale: {' '.join(cmd)} failed:\n{stderr[-2000:]}")
    return wall, usage.ru_maxrss * 1024, stderr


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("train-*"))}


def bench_scaling(args) -> dict:
    src = write_jsonl(OUT / "inputs" / f"crud{args.docs}.jsonl", crud_articles(args.docs))
    common = [src, "--method", "ppl", "--model", args.model, "--dtype", args.dtype, "--shards", 8,
              "--threads-per-worker", 1]  # fmt: skip
    results = {}
    for workers in (1, 2):
        wall, rss, _ = chunk(
            [*common, "--workers", workers], OUT / f"scaling_w{workers}", {"OMP_NUM_THREADS": "1"}
        )
        results[workers] = wall
        print(f"scaling: {workers} worker(s) x 1 thread: {wall:.1f} s", flush=True)
    identical = shard_bytes(OUT / "scaling_w1") == shard_bytes(OUT / "scaling_w2")
    ratio = results[1] / results[2]
    print(f"scaling: 2 workers / 1 worker = {ratio:.2f}x (target >= 1.7x); shards identical: {identical}")
    return {"documents": args.docs, "model": args.model, "dtype": args.dtype, "seconds_1_worker": round(results[1], 1),
            "seconds_2_workers": round(results[2], 1), "speedup": round(ratio, 2), "identical": identical}  # fmt: skip


def bench_memory(args) -> dict:
    paragraphs = emma_paragraphs()
    sizes = [int(x) for x in args.mem_docs.split(",")]
    rows = []
    for n in sizes:
        src = write_jsonl(OUT / "inputs" / f"emma{n}.jsonl",
                          ({"id": f"p{k}", "text": paragraphs[k % len(paragraphs)]} for k in range(n)))  # fmt: skip
        wall, rss, _ = chunk([src, "--method", "sentence", "--target-len", 120], OUT / f"memory_{n}")
        rows.append({"documents": n, "input_mib": round(src.stat().st_size / MIB, 1),
                     "peak_rss_mib": round(rss / MIB, 1), "seconds": round(wall, 1)})  # fmt: skip
        print(f"memory: {n} documents ({rows[-1]['input_mib']} MiB): peak RSS {rows[-1]['peak_rss_mib']} MiB, "
              f"{wall:.1f} s", flush=True)  # fmt: skip
    ratios = {}
    for a, b in zip(rows, rows[1:]):  # each size against the one before: 10K/1K, 100K/10K
        ratio = b["peak_rss_mib"] / a["peak_rss_mib"]
        ratios[f"{b['documents']}/{a['documents']}"] = round(ratio, 3)
        print(
            f"memory: peak RSS {b['documents']} / {a['documents']} documents = {ratio:.3f}x (target <= 1.1x)"
        )
    return {"runs": rows, "ratios": ratios}


def bench_resume(args) -> dict:
    paragraphs = [p for p in emma_paragraphs() if len(p) > 400][:60]
    src = write_jsonl(
        OUT / "inputs" / "emma60.jsonl", ({"id": f"p{k}", "text": p} for k, p in enumerate(paragraphs))
    )
    common = [src, "--method", "ppl", "--model", "smollm2", "--shards", 12, "--emit-sentences"]
    whole, killed = OUT / "resume_whole", OUT / "resume_killed"
    wall, _, _ = chunk(common, whole)
    print(f"resume: uninterrupted run {wall:.1f} s", flush=True)
    kill_at = random.Random(args.seed).uniform(0.25, 0.75) * wall
    cmd = [
        sys.executable,
        "-m",
        "metachunk.cli",
        "chunk",
        *map(str, common),
        "-o",
        str(killed),
        "--overwrite",
    ]
    log = OUT / "resume_killed.stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stderr=err)
        time.sleep(kill_at)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = shards_done(killed)  # the manifest's and the journal's: a kill -9 leaves both
    done_docs = sum(e["documents"] for e in done.values())
    counts = [int(m) for m in re.findall(r"\| (\d+)/\d+ \[", log.read_text(errors="replace"))]
    scored = max(counts, default=0)
    lost = max(0, scored - done_docs)
    rerun_cmd = [c for c in cmd if c != "--overwrite"]
    started = time.perf_counter()
    rerun = subprocess.run(rerun_cmd, capture_output=True, text=True)
    rerun_wall = time.perf_counter() - started
    if rerun.returncode != 0:
        sys.exit(f"chunk_scale: the rerun failed:\n{rerun.stderr[-2000:]}")
    run = read_run_log(killed)[-1]
    identical = shard_bytes(killed) == shard_bytes(whole)
    print(
        f"resume: killed at {kill_at:.1f} s with {len(done)} of 12 shards done ({done_docs} documents); "
        f"the killed run had scored {scored}, so {lost} documents are scored again (bound: one 5-document shard "
        f"per worker); the rerun chunked {run['documents_chunked']} documents in {rerun_wall:.1f} s, its skip "
        f"check took {run['resume_check_seconds']:.2f} s; byte-identical to the uninterrupted run: {identical}"
    )
    return {"uninterrupted_seconds": round(wall, 1), "killed_at_seconds": round(kill_at, 1),
            "shards_done_at_kill": len(done), "documents_saved_at_kill": done_docs,
            "documents_scored_at_kill": scored, "documents_rescored": lost,
            "rerun_documents_chunked": run["documents_chunked"], "rerun_seconds": round(rerun_wall, 1),
            "skip_check_seconds": run["resume_check_seconds"], "identical": identical}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["scaling", "memory", "resume"], action="append")
    ap.add_argument("--docs", type=int, default=40, help="CRUD articles for the scaling run")
    ap.add_argument("--model", default="gemma3-270m", help="scaling run's PPL model")
    ap.add_argument("--dtype", default="bfloat16", help="scaling run's dtype")
    ap.add_argument("--mem-docs", default="1000,10000", help="corpus sizes for the memory run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moment")
    args = ap.parse_args()
    parts = args.only or ["scaling", "memory", "resume"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    for name in parts:
        results[name] = {"scaling": bench_scaling, "memory": bench_memory, "resume": bench_resume}[name](args)
    out = ROOT / "bench_out" / "chunk_scale.json"
    write_json(out, {"cpus": os.cpu_count(), **results})
    print(f"wrote {out}")


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"chunk_scale: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
