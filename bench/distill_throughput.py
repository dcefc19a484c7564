"""Teacher client throughput: our TeacherPool against the bare ``openai.AsyncOpenAI`` client.

Issue requirement: against the loopback server (fixed latency, 200 ms by default, no capacity
limit), sustain >= 0.85 of the ideal rate (in flight / latency) at 64 requests in flight over
>= 2,000 requests, with client CPU per request no higher than the bare openai client's, measured
side by side in the same run. Also report the resume cost: the time for a rerun to skip 10,000
answered requests.

What is compared, against one loopback server (``tests/support/loopback_server.py``, its own process):

* **bare**: ``openai.AsyncOpenAI`` (default ``max_retries``), a plain ``asyncio.Semaphore(64)``,
  ``await client.chat.completions.create(model=..., messages=..., max_tokens=...)``.
* **ours**: a :class:`~metachunk.teacher.TeacherPool` with one stage, ``concurrency=64``, no
  rpm/tpm limit and no price, over a fresh :class:`~metachunk.store.AnswerStore` in a temp dir
  (every answer is committed to SQLite before ``complete()`` returns). Its HTTP transport is
  openai's aiohttp one (``openai.DefaultAioHttpClient``), which ``metachunk.teacher`` always uses.
* **ours+limits**: the same with rpm/tpm limits set far too high to bind, a price table and a
  ``max_cost`` that is never reached: token buckets, budget reservations and cost accounting all
  run on every request.
* **ours+stream**: ours with ``stream: true``: every answer comes as SSE chunks (with
  ``include_usage``) that the client assembles into one chat completion. Target: within 10% of
  ours' req/s.

Every request has distinct messages (a system prompt and a ~1.5 KB user text that differs per
request), so nothing is a cache hit; the server's ``/stats`` confirms that each run sent exactly
its requests. Both sides start all requests at once (``asyncio.gather``) and let the semaphore
(bare: ours; ours: the endpoint's own) keep 64 in flight. The default 2,048 requests are 32
whole waves of 64, so a perfect client could reach the ideal rate.

Each measured run is a fresh child process (a fresh interpreter: no garbage, connections or
store left over from the previous variant; its import time is not measured). A run does `--warmup` (128)
warm-up requests (they open the 64 connections), then times the measured requests: wall time
(``perf_counter``) and client CPU (``time.process_time()`` of the child: the server is another
process). Runs go in rounds, the order reversed every other round (bare, ours, ours+limits, then
ours+limits, ours, bare, ...) so that neither side is systematically favoured by drift in machine
load; each variant's best req/s and lowest CPU per request over the rounds are the headline, the
median req/s is printed too.

Resume: a second loopback server without latency answers ``--resume-requests`` (10,000) requests
through a TeacherPool into a new store (a child process). Another child then does what a rerun
does: opens the same store file anew, builds a new TeacherPool and calls ``complete()`` on the
same requests in turn; the time includes opening the store. The server must receive no request.

    python bench/distill_throughput.py                          # ~1.5 minutes on 2 cores
    python bench/distill_throughput.py --rounds 3 --requests 4096 --latency 0.1

Results: ``bench_out/distill_throughput.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metachunk.artifacts import write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.loopback_server: test and bench infrastructure

MODEL = "teacher-model"
VARIANTS = ("bare", "ours", "ours+limits", "ours+stream")
SYSTEM_PROMPT = (
    "You split documents into semantically coherent chunks for retrieval. Read the text and answer "
    "with the numbers of the sentences that start a new chunk, separated by commas."
)
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will more can "
    "said who them some could time into only do after very two first over new than about these years "
    "retrieval document chunk sentence boundary model teacher language context paragraph section topic "
    "river market village council harbour winter letter morning evening garden history science music"
).split()


def make_messages(i: int, size: int) -> list[dict]:
    """Request ``i``'s messages: the same system prompt, a distinct user text of about ``size`` bytes."""
    rng = random.Random(i)
    words, length = [], 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Document {i}:\n" + " ".join(words)},
    ]


def teacher_config(args, with_limits: bool, stream: bool = False):
    from metachunk.teacher import TeacherConfig

    limits = {"rpm": 1e9, "tpm": 1e12} if with_limits else {}
    return TeacherConfig(
        model=MODEL,
        base_url=args.base_url,
        max_tokens=args.max_tokens,
        concurrency=args.in_flight,
        stream=stream,
        **limits,
    )


# ---------------------------------------------------------------------------------------------
# Child processes: one measured run each


async def run_bare(args, warmup: list, measured: list) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="EMPTY")
    slots = asyncio.Semaphore(args.in_flight)

    async def one(messages):
        async with slots:
            response = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=args.max_tokens
            )
        return response.choices[0].message.content

    await asyncio.gather(*(one(m) for m in warmup))
    cpu0, t0 = time.process_time(), time.perf_counter()
    contents = await asyncio.gather(*(one(m) for m in measured))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await client.close()
    assert all(c.startswith("answer ") for c in contents), "bare: unexpected answer"
    return {"wall_s": wall, "cpu_s": cpu}


async def run_ours(args, warmup: list, measured: list, with_limits: bool, stream: bool = False) -> dict:
    from metachunk.store import AnswerStore
    from metachunk.teacher import Price, TeacherPool

    with tempfile.TemporaryDirectory(prefix="distill_throughput_") as tmp:
        store = AnswerStore(Path(tmp) / "answers.sqlite")
        prices = {MODEL: Price(input=0.5, output=1.5)} if with_limits else {}
        max_cost = 1e9 if with_limits else None
        pool = TeacherPool({"stage": teacher_config(args, with_limits, stream)}, prices, store, max_cost)
        teacher = pool["stage"]
        await asyncio.gather(*(teacher.complete(m, "bench") for m in warmup))
        cpu0, t0 = time.process_time(), time.perf_counter()
        answers = await asyncio.gather(*(teacher.complete(m, "bench") for m in measured))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await pool.close()
        assert all(a.ok and not a.cached and a.text.startswith("answer ") for a in answers), (
            "ours: bad answer"
        )
        assert len(store) == len(warmup) + len(measured), "ours: not every answer was stored"
        if with_limits:
            assert pool.budget.paid > 0 and store.claims_held() == 0, "ours+limits: budget not settled"
        store.close()
    return {"wall_s": wall, "cpu_s": cpu}


async def run_fill(args, messages: list) -> dict:
    """Answer every request into the store at ``args.store`` (the first run, before the rerun)."""
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherPool

    store = AnswerStore(args.store)
    pool = TeacherPool({"stage": teacher_config(args, False)}, {}, store)
    teacher = pool["stage"]
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(teacher.complete(m, "bench") for m in messages))
    wall = time.perf_counter() - t0
    await pool.close()
    assert all(a.ok and not a.cached for a in answers), "fill: bad answer"
    store.close()
    return {"wall_s": wall, "sent": pool.sent}


async def run_resume(args, messages: list) -> dict:
    """A rerun: open the store anew and ask for every request again; all must come from the store."""
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherPool

    t0 = time.perf_counter()
    store = AnswerStore(args.store)
    pool = TeacherPool({"stage": teacher_config(args, False)}, {}, store)
    opened = time.perf_counter() - t0
    teacher = pool["stage"]
    answers = [await teacher.complete(m, "bench") for m in messages]
    wall = time.perf_counter() - t0
    await pool.close()
    store.close()
    assert all(a.ok and a.cached for a in answers), "resume: an answer was not served from the store"
    return {"wall_s": wall, "open_s": opened, "sent": pool.sent, "cached": teacher.cached}


def worker(args) -> None:
    if args.worker in ("fill", "resume"):
        messages = [make_messages(i, args.message_bytes) for i in range(args.resume_requests)]
        run = run_fill if args.worker == "fill" else run_resume
        result = asyncio.run(run(args, messages))
    else:
        # Ids never repeat across runs (the same server sees every run), so nothing is a cache hit
        # for the server's counters either.
        base = args.run_id * (args.warmup + args.requests)
        warmup = [make_messages(base + i, args.message_bytes) for i in range(args.warmup)]
        measured = [make_messages(base + args.warmup + i, args.message_bytes) for i in range(args.requests)]
        if args.worker == "bare":
            result = asyncio.run(run_bare(args, warmup, measured))
        else:
            limits, stream = args.worker == "ours+limits", args.worker == "ours+stream"
            result = asyncio.run(run_ours(args, warmup, measured, with_limits=limits, stream=stream))
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# Parent


def child(args, name: str, out: str, base_url: str, **extra) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--out", out, "--base-url", base_url]
    for key in ("requests", "warmup", "in_flight", "message_bytes", "max_tokens", "resume_requests"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(cmd, check=True)
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency", type=float, default=0.2, help="server latency per request, seconds")
    p.add_argument(
        "--in-flight", type=int, default=64, help="requests in flight (and TeacherConfig.concurrency)"
    )
    p.add_argument("--requests", type=int, default=2048, help="measured requests per run")
    p.add_argument("--warmup", type=int, default=128, help="requests before the measured ones, not counted")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant; order reversed every other round")
    p.add_argument("--variants", default=",".join(VARIANTS), help="any of " + ", ".join(VARIANTS))
    p.add_argument("--message-bytes", type=int, default=1500, help="size of each user message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument(
        "--resume-requests", type=int, default=10_000, help="answered requests a rerun skips; 0: skip"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    p.add_argument("--run-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from support.loopback_server import serve_in_subprocess

    variants = args.variants.split(",")
    ideal = args.in_flight / args.latency
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    tmp = tempfile.mkdtemp(prefix="distill_throughput_")
    print(
        f"loopback latency {args.latency * 1000:.0f} ms, {args.in_flight} in flight, ideal {ideal:.0f} req/s; "
        f"{args.requests} requests per run after {args.warmup} warm-up, {args.rounds} rounds; "
        "ours over the aiohttp transport",
        flush=True,
    )
    with serve_in_subprocess(latency=args.latency) as server:
        run_id = 0
        for r in range(args.rounds):
            for name in variants if r % 2 == 0 else variants[::-1]:
                before_stats = server.stats()
                before, streams_before = before_stats["requests"], before_stats.get("streams", 0)
                res = child(args, name, os.path.join(tmp, f"{name}-{r}.json"), server.base_url, run_id=run_id)
                run_id += 1
                after = server.stats()
                sent = after["requests"] - before
                assert sent == args.warmup + args.requests, f"{name}: server saw {sent} requests"
                if name == "ours+stream":
                    res["streams"] = after.get("streams", 0) - streams_before
                    assert res["streams"] == sent, f"{name}: {res['streams']} of {sent} answers streamed"
                res["req_per_s"] = args.requests / res["wall_s"]
                res["cpu_ms_per_req"] = 1000 * res["cpu_s"] / args.requests
                runs[name].append(res)
                print(
                    f"[round {r + 1}] {name:<12} {res['req_per_s']:7.1f} req/s ({res['req_per_s'] / ideal:.3f} "
                    f"of ideal), {res['cpu_ms_per_req']:.3f} ms CPU/request",
                    flush=True,
                )

    resume = None
    if args.resume_requests:
        store = os.path.join(tmp, "resume.sqlite")
        with serve_in_subprocess(latency=0.0) as server:
            fill = child(args, "fill", os.path.join(tmp, "fill.json"), server.base_url, store=store)
            before = server.stats()["requests"]
            resume = child(args, "resume", os.path.join(tmp, "resume.json"), server.base_url, store=store)
            resume["server_requests"] = server.stats()["requests"] - before
        assert resume["server_requests"] == 0 and resume["sent"] == 0, "resume sent requests"
        assert resume["cached"] == args.resume_requests
        resume["fill_wall_s"] = fill["wall_s"]
        resume["us_per_request"] = 1e6 * resume["wall_s"] / args.resume_requests
        resume["store_bytes"] = os.path.getsize(store)

    summary = {
        "args": {
            k: v for k, v in vars(args).items() if k not in ("worker", "out", "base_url", "run_id", "store")
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "ideal_req_per_s": ideal,
        "ours_transport": "aiohttp",
        "variants": {},
        "resume": resume,
    }
    print(
        f"\n{'variant':<12} {'best req/s':>10} {'of ideal':>9} {'median':>8} {'wall s':>7} {'ms CPU/req':>10}"
    )
    print("-" * 60)
    for name, rs in runs.items():
        best = max(rs, key=lambda x: x["req_per_s"])
        row = {
            "best_req_per_s": best["req_per_s"],
            "median_req_per_s": statistics.median(x["req_per_s"] for x in rs),
            "ratio_to_ideal": best["req_per_s"] / ideal,
            "best_wall_s": best["wall_s"],
            "cpu_ms_per_req": min(x["cpu_ms_per_req"] for x in rs),
            "runs": rs,
        }
        summary["variants"][name] = row
        print(
            f"{name:<12} {row['best_req_per_s']:>10.1f} {row['ratio_to_ideal']:>9.3f} "
            f"{row['median_req_per_s']:>8.1f} {row['best_wall_s']:>7.2f} {row['cpu_ms_per_req']:>10.3f}"
        )

    bare = summary["variants"].get("bare")
    for name in ("ours", "ours+limits"):
        ours = summary["variants"].get(name)
        if ours is None:
            continue
        verdict = ours["ratio_to_ideal"] >= 0.85
        line = f"{name}: {ours['ratio_to_ideal']:.3f} of ideal (target 0.85)"
        if bare:
            speed = ours["best_req_per_s"] / bare["best_req_per_s"]
            cpu = ours["cpu_ms_per_req"] / bare["cpu_ms_per_req"]
            verdict = verdict and ours["cpu_ms_per_req"] <= bare["cpu_ms_per_req"]
            line += (
                f", {speed:.2f}x bare req/s, CPU/request {ours['cpu_ms_per_req']:.3f} ms vs bare "
                f"{bare['cpu_ms_per_req']:.3f} ms ({cpu:.2f}x)"
            )
            ours["vs_bare"] = {"req_per_s": speed, "cpu_per_req": cpu}
        ours["pass"] = verdict
        print(f"{line}: {'PASS' if verdict else 'FAIL'}")
    plain, streamed = summary["variants"].get("ours"), summary["variants"].get("ours+stream")
    if plain and streamed:
        ratio = streamed["best_req_per_s"] / plain["best_req_per_s"]
        streamed["vs_ours"] = {
            "req_per_s": ratio,
            "cpu_per_req": streamed["cpu_ms_per_req"] / plain["cpu_ms_per_req"],
        }
        streamed["pass"] = ratio >= 0.9
        print(
            f"ours+stream: {streamed['best_req_per_s']:.1f} req/s against ours' {plain['best_req_per_s']:.1f} "
            f"({ratio:.3f}; target >= 0.9), CPU/request {streamed['cpu_ms_per_req']:.3f} ms vs "
            f"{plain['cpu_ms_per_req']:.3f} ms: {'PASS' if streamed['pass'] else 'FAIL'}"
        )
    if resume:
        print(
            f"resume: skipping {args.resume_requests:,} answered requests took {resume['wall_s']:.2f} s "
            f"({resume['us_per_request']:.0f} µs each), of which opening the store "
            f"{resume['open_s'] * 1000:.0f} ms; the server received {resume['server_requests']} requests"
        )
    (ROOT / "bench_out").mkdir(exist_ok=True)
    write_json((ROOT / "bench_out" / "distill_throughput.json"), summary)
    print("wrote bench_out/distill_throughput.json")


if __name__ == "__main__":
    main()
