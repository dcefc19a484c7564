"""The two local teacher backends side by side: the same 20 distill requests to each, in one run.

The requests are the rewrite pipeline's first two stages on 10 Emma paragraphs (chapter X on, not
the texts the demo's eval chunks): 10 ``reflection`` requests (text) and 10 ``refinement``
requests (JSON, with ``distill/prompts/refinement.schema.json``). So that both backends get
byte-identical requests, every refinement request carries the reflection the llama.cpp backend
wrote first (the transformers backend's own reflections would make its refinement prompts
differ). Each backend is sent the requests through the real teacher client (``TeacherPool``,
a fresh answer store each, nothing from a cache), with the settings its recipe uses: llama.cpp
with ``structured_output: json_object_schema`` (the schema as a grammar), ``transformers serve``
with ``none`` (it does not constrain decoding).

Reported per backend: wall seconds, requests/s, completion tokens/s, and the share of
refinement answers that are valid by the schema as returned (``json.loads`` + jsonschema, no
repair). The issue's target: llama.cpp at >= 5x the completion tokens/s of transformers serve,
and 100% schema-valid on the JSON stage.

    python bench/local_teacher.py [--docs 10] [--threads 2] [--max-tokens 128]

Writes ``bench_out/local_teacher.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from metachunk.distill.prompts import load_prompt, load_schema  # noqa: E402

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.local_teacher import LocalTeacher, llama_cpp_available  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402
from metachunk.store import AnswerStore  # noqa: E402
from metachunk.structured import is_valid  # noqa: E402
from metachunk.teacher import TeacherConfig, TeacherPool  # noqa: E402


def emma_jobs(n: int) -> list[dict]:
    """``n`` paragraphs of 200-700 characters from chapter X on, each with its neighbours as context."""
    rows = [json.loads(line) for line in resolve("data:gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8")]
    start = next(i for i, r in enumerate(rows) if r["chapter"] == "VOLUME I. CHAPTER X")
    jobs = []
    for i in range(start + 1, len(rows) - 1):
        if 200 <= len(rows[i]["text"]) <= 700:
            context = "\n\n".join(r["text"] for r in rows[i - 1 : i + 2])
            jobs.append({"chunk": rows[i]["text"], "context": context})
        if len(jobs) == n:
            break
    return jobs


async def send(teacher: LocalTeacher, requests: list[tuple[str, dict]], max_tokens: int, store_dir: Path):
    """Send ``requests`` ((stage, prompt values)) to ``teacher``; the answers and the wall time."""
    block = {
        "model": teacher.model, "serve_preset": teacher.serve_preset, "base_url": teacher.base_url,
        "temperature": 0.0, "max_tokens": max_tokens, "concurrency": 2, "timeout": 900, "max_retries": 1,
    }  # fmt: skip
    cfgs = {
        "reflection": TeacherConfig(**block, stop=["\n\n"]),
        "refinement": TeacherConfig(**block, structured_output=teacher.structured_output),
    }
    pool = TeacherPool(cfgs, {}, AnswerStore(store_dir / "answers.sqlite"))

    async def one(request):
        stage, values = request
        prompt = load_prompt(stage, "en")
        return await pool[stage].complete(prompt.messages(**values), prompt.sha256, 0, load_schema(stage))

    started = time.perf_counter()
    result = await pool.map(requests, one, desc=f"{teacher.backend}", unit="req")
    return result.results, time.perf_counter() - started


def measure(backend: str, requests: list[tuple[str, dict]], args, tmp: Path) -> dict:
    schema = load_schema("refinement")
    print(f"\n== {backend}: starting the server", flush=True)
    started = time.perf_counter()
    with LocalTeacher(
        "smollm2", backend=backend, threads=args.threads, log=tmp / f"{backend}.log"
    ) as teacher:
        ready = time.perf_counter() - started
        answers, seconds = asyncio.run(send(teacher, requests, args.max_tokens, tmp / backend))
    completion = sum(a.completion_tokens for a in answers)
    valid = []
    for (stage, _), a in zip(requests, answers):
        if stage != "refinement":
            continue
        try:
            valid.append(a.ok and is_valid(json.loads(a.text), schema))
        except ValueError:
            valid.append(False)
    row = {
        "backend": backend,
        "server": teacher.describe(),
        "structured_output": teacher.structured_output,
        "ready_seconds": round(ready, 1),
        "requests": len(answers),
        "failed": sum(not a.ok for a in answers),
        "cut_at_max_tokens": sum(a.finish_reason == "length" for a in answers),
        "seconds": round(seconds, 1),
        "requests_per_s": round(len(answers) / seconds, 3),
        "completion_tokens": completion,
        "completion_tokens_per_s": round(completion / seconds, 2),
        "schema_valid": f"{sum(valid)}/{len(valid)}",
        "schema_valid_share": round(sum(valid) / len(valid), 3),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=10, help="Emma paragraphs: 2 requests each (default 10)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per server (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="completion limit per request")
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "local_teacher.json")
    args = parser.parse_args()
    if not llama_cpp_available():
        sys.exit(
            "bench/local_teacher.py: llama-cpp-python is not installed: pip install 'metachunk[llamacpp]'"
        )
    jobs = emma_jobs(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Pass 1 (llama.cpp only): the reflections that every refinement request carries.
        reflections = [("reflection", job) for job in jobs]
        print("== the reflections the refinement requests carry (llama.cpp, not counted)", flush=True)
        with LocalTeacher("smollm2", backend="llama.cpp", threads=args.threads) as teacher:
            answers, _ = asyncio.run(send(teacher, reflections, args.max_tokens, tmp / "pass1"))
        requests = reflections + [
            ("refinement", {**job, "reflection": a.text or "NONE"}) for job, a in zip(jobs, answers)
        ]
        rows = [measure(backend, requests, args, tmp) for backend in ("llama.cpp", "transformers")]
    fast, slow = rows
    ratio = fast["completion_tokens_per_s"] / max(slow["completion_tokens_per_s"], 1e-9)
    report = {
        "requests": len(requests),
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "rows": rows,
        "completion_tokens_per_s_ratio": round(ratio, 2),
        "requests_per_s_ratio": round(fast["requests_per_s"] / max(slow["requests_per_s"], 1e-9), 2),
    }
    print(
        f"\n{'backend':<13} {'req':>4} {'s':>7} {'req/s':>7} {'compl tok':>9} {'tok/s':>7} {'schema-valid':>12}"
    )
    for r in rows:
        print(
            f"{r['backend']:<13} {r['requests']:>4} {r['seconds']:>7} {r['requests_per_s']:>7} "
            f"{r['completion_tokens']:>9} {r['completion_tokens_per_s']:>7} {r['schema_valid']:>12}"
        )
    print(
        f"llama.cpp / transformers serve: {ratio:.2f}x completion tokens/s (target >= 5x), "
        f"{report['requests_per_s_ratio']:.2f}x requests/s; schema-valid {fast['schema_valid']} (target 100%)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"bench/local_teacher.py: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
