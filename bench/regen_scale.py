"""A paper-sized regeneration against loopback servers: 20,000 chunks x (rewrite 3 + summary 3)
= 120,000 teacher requests, through the real ``metachunk distill`` CLI, side by side at two sizes.

Setup: 4 loopback servers (``tests/support/loopback_server.py``, each its own process) at
``--latency`` (200 ms), one teacher block per stage naming all four (``base_urls``), 64 in flight
each: the ideal rate is 4 x 64 / 0.2 s = 1,280 requests/s. Each chunk is its own ~300-character
document (distinct texts: no request is a cache hit). Every run is a child process; measured from
``os.wait4``: wall time, client CPU (user + system), peak RSS; plus the answer store's size.

1. **Online at two sizes:** ``--small`` chunks (2,000: 12K requests) and ``--chunks`` (20,000:
   120K requests): requests/s against the ideal, CPU per request, peak RSS ratio (target <= 1.3x).
2. **Resume:** ``distill rewrite`` on the large set, killed (SIGKILL) once 60% of its requests
   have arrived, then rerun: the rerun's wall time and how many answered requests were sent
   again (target 0; only requests in flight at the kill may arrive twice).
3. **Batch mode** over the same large set (``mode: batch`` against the same servers' Batch API,
   no latency there): the cost against online (prices: 2 / 8 USD per 1M tokens, batch_discount
   0.5) and the rounds.

    python bench/regen_scale.py                         # about 15 minutes on 2 cores
    python bench/regen_scale.py --chunks 4000 --small 400   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from metachunk.artifacts import read_run_log, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "bench_out" / "regen_scale"
MIB = 2**20
PRICE = {"input": 2.0, "output": 8.0}
ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'
WORDS = (
    "Emma",
    "Highbury",
    "Hartfield",
    "Knightley",
    "Weston",
    "Randalls",
    "Harriet",
    "Elton",
    "Bates",
    "Churchill",
)


def write_chunks(root: Path, n: int) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    docs, chunks = root / "documents.jsonl", root / "chunks.jsonl"
    with docs.open("w") as d, chunks.open("w") as c:
        for i in range(n):
            names = " and ".join(WORDS[(i + k) % len(WORDS)] for k in range(3))
            text = (f"Passage {i}. {names} met at noon on day {i % 365}; they talked of the weather, of the "
                    f"ball at the Crown, and of letter number {i}, which nobody had expected to arrive so soon.")  # fmt: skip
            d.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
            c.write(
                json.dumps({"id": f"d{i}", "chunks": [{"text": text, "start": 0, "end": len(text)}]}) + "\n"
            )
    return docs, chunks


def recipe(root: Path, task: str, urls: list[str], docs: Path, chunks: Path, mode: str = "online") -> Path:
    import yaml

    block = {"model": "loopback", "base_urls": urls, "max_tokens": 64, "concurrency": 64, "timeout": 30.0,
             "max_retries": 2, "mode": mode, "batch_poll_seconds": 0.2}  # fmt: skip
    stages = {"rewrite": ("reflection", "refinement", "completion"),
              "summary": ("summary_global", "summary_local", "summary_fuse")}[task]  # fmt: skip
    cfg = {"task": task, "documents": str(docs), "chunks": str(chunks), "out": str(root / "run"), "lang": "en",
           "progress": False, "prices": {"loopback": PRICE}, "cache": str(root / "run" / "answers.sqlite"),
           "teachers": {s: dict(block) for s in stages}}  # fmt: skip
    path = root / f"{task}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_child(cmd: list[str]) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, -9):
        sys.exit(f"regen_scale: {' '.join(cmd)} exited {code}:\n{err[-2000:]}")
    return {"seconds": time.perf_counter() - started, "cpu": usage.ru_utime + usage.ru_stime,
            "rss_mib": usage.ru_maxrss / 1024, "exit": code}  # fmt: skip


def distill(task_recipe: Path, task: str, extra: list[str] | None = None) -> dict:
    return run_child([sys.executable, "-m", "metachunk.cli", "distill", task, "--config", str(task_recipe),
                      *(extra or [])])  # fmt: skip


def total_requests(servers) -> int:
    return sum(s.stats()["requests"] for s in servers)


def online(servers, n: int, label: str) -> dict:
    root = OUT / label
    docs, chunks = write_chunks(root, n)
    urls = [s.base_url for s in servers]
    before = total_requests(servers)
    runs = {t: distill(recipe(root, t, urls, docs, chunks), t) for t in ("rewrite", "summary")}
    sent = total_requests(servers) - before
    seconds = sum(r["seconds"] for r in runs.values())
    cpu = sum(r["cpu"] for r in runs.values())
    store = (root / "run" / "answers.sqlite").stat().st_size
    row = {"chunks": n, "requests": sent, "seconds": round(seconds, 1), "req_per_s": round(sent / seconds, 1),
           "cpu_ms_per_request": round(1000 * cpu / sent, 2), "peak_rss_mib": round(max(r["rss_mib"] for r in runs.values()), 1),
           "store_mib": round(store / MIB, 1)}  # fmt: skip
    print(f"online {label}: {n} chunks, {sent} requests in {seconds:.1f} s = {row['req_per_s']} req/s "
          f"({row['req_per_s'] / 1280:.3f} of the ideal 1,280), {row['cpu_ms_per_request']} ms CPU/request, "
          f"peak RSS {row['peak_rss_mib']} MiB, store {row['store_mib']} MiB", flush=True)  # fmt: skip
    return row


def resume(servers, n: int) -> dict:
    root = OUT / "resume"
    docs, chunks = write_chunks(root, n)
    path = recipe(root, "rewrite", [s.base_url for s in servers], docs, chunks)
    before = {id(s): dict(s.stats()["by_key"]) for s in servers}
    target = int(0.6 * 3 * n)
    cmd = [sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config", str(path)]
    base = total_requests(servers)
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while total_requests(servers) - base < target and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = total_requests(servers) - base
    rerun = distill(path, "rewrite")
    again = 0
    for s in servers:
        old = before[id(s)]
        again += sum(max(0, c - old.get(k, 0) - 1) for k, c in s.stats()["by_key"].items())
    print(f"resume: killed at {at_kill} of {3 * n} requests (60%); the rerun took {rerun['seconds']:.1f} s and "
          f"{again} requests arrived twice (only those in flight at the kill may: at most 4 x 64 = 256)", flush=True)  # fmt: skip
    return {"requests_at_kill": at_kill, "rerun_seconds": round(rerun["seconds"], 1), "sent_twice": again}


def batch(servers, n: int, online_cost: float) -> dict:
    root = OUT / "batch"
    docs, chunks = write_chunks(root, n)
    urls = [servers[0].base_url]  # a Batch API is one endpoint's
    runs = {t: distill(recipe(root, t, urls, docs, chunks, mode="batch"), t) for t in ("rewrite", "summary")}
    cost, rounds, batches = 0.0, 0, 0
    for t in ("rewrite", "summary"):
        summary = next(r for r in reversed(read_run_log(root / "run")) if r["command"] == f"distill {t}")
        cost += summary["paid"]
        rounds += summary["batch"]["rounds"]
        batches += summary["batch"]["batches"]
    seconds = sum(r["seconds"] for r in runs.values())
    ratio = cost / online_cost if online_cost else float("nan")
    print(f"batch: {n} chunks in {seconds:.1f} s, {rounds} rounds, {batches} batches, ${cost:.4f} against "
          f"${online_cost:.4f} online = {ratio:.3f}x", flush=True)  # fmt: skip
    return {"seconds": round(seconds, 1), "rounds": rounds, "batches": batches, "cost": round(cost, 6),
            "online_cost": round(online_cost, 6), "cost_ratio": round(ratio, 3)}  # fmt: skip


def paid(label: str) -> float:
    runs = read_run_log(OUT / label / "run")  # every attempt paid its own share
    return sum(r["paid"] for r in runs if r["command"] in ("distill rewrite", "distill summary"))


def main() -> None:
    from support.loopback_server import serve_in_subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=20_000)
    ap.add_argument("--small", type=int, default=2_000)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument(
        "--only", choices=["online", "resume", "batch"], action="append", help="run only these parts"
    )
    args = ap.parse_args()
    parts = args.only or ["online", "resume", "batch"]
    import shutil

    shutil.rmtree(OUT, ignore_errors=True)
    results = {}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_in_subprocess(latency=args.latency, replies={'"score"': ITEMS}))
                   for _ in range(4)]  # fmt: skip
        if "online" in parts or "batch" in parts:
            results["small"] = online(servers, args.small, "small")
            results["large"] = online(servers, args.chunks, "large")
            ratio = results["large"]["peak_rss_mib"] / results["small"]["peak_rss_mib"]
            print(f"peak RSS {results['large']['requests']} / {results['small']['requests']} requests = {ratio:.2f}x "
                  "(target <= 1.3x)", flush=True)  # fmt: skip
            results["rss_ratio"] = round(ratio, 3)
        if "resume" in parts:
            results["resume"] = resume(servers, args.chunks)
        if "batch" in parts:
            results["batch"] = batch(servers, args.chunks, paid("large"))
    out = ROOT / "bench_out" / "regen_scale.json"
    write_json(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
