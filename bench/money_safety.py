"""Money safety, measured: spend against the cap for every way an endpoint bills, reruns under the
same cap, and two runs started together on one answer store.

Each scenario runs the real CLI (``python -m metachunk.cli distill rewrite``) in subprocesses
against the loopback server (``tests/support/loopback_server.py``, ``--billing``) on real texts: the first
Emma paragraphs and the first CRUD news articles (cut to 600 characters), one chunk per document
(``data:gutenqa-emma/paragraphs.jsonl`` and ``data:crud-news/news.jsonl``: ``metachunk data fetch
crud-news`` once).
Prices are $10 per 1M tokens each way; the cap is ``--cap`` (default $0.10).

1. Per billing mode (``byte``: a token per prompt byte, ``none``: no usage at all, ``low``: a token
   per 16 bytes, ``quarter``: a token per 4 body bytes): one run under the cap, then ``--reruns``
   reruns under the same cap. Reported: the store's spend after the first run and after the
   reruns, the requests each sent, and the bound the README states (concurrency x the largest
   single request's cost).
2. Two identical runs started together on one store (``quarter`` billing, no cap): requests the
   server received more than once (the double-send count, which must be 0), then the same under
   the cap with ``byte`` billing: their combined spend.

    python bench/money_safety.py [--cap 0.1] [--reruns 3] [--docs 40]

Writes ``bench_out/money_safety.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # support.loopback_server: test and bench infrastructure

from support.loopback_server import serve_in_subprocess  # noqa: E402

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402

PRICES = {"loopback": {"input": 10.0, "output": 10.0}}
ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'
REPLIES = {'"score"': ITEMS}
CONCURRENCY = 8


def texts(n: int) -> list[str]:
    emma = [
        json.loads(line)["text"]
        for line in resolve("data:gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8")
    ]
    news = []
    with resolve("data:crud-news/news.jsonl").open(encoding="utf-8") as f:
        for line in f:
            news.append(json.loads(line)["text"][:600])
            if len(news) >= n // 2:
                break
    return [t for t in emma if len(t) > 200][: n - n // 2] + news


def make_recipe(root: Path, base_url: str, docs: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with (root / "documents.jsonl").open("w") as d, (root / "chunks.jsonl").open("w") as c:
        for i, text in enumerate(docs):
            d.write(json.dumps({"id": f"d{i}", "text": text}, ensure_ascii=False) + "\n")
            c.write(json.dumps({"id": f"d{i}", "chunks": [{"text": text, "start": 0, "end": len(text)}]},
                               ensure_ascii=False) + "\n")  # fmt: skip
    block = {"model": "loopback", "base_url": base_url, "max_tokens": 64, "concurrency": CONCURRENCY,
             "timeout": 10.0, "max_retries": 1}  # fmt: skip
    recipe = {"task": "rewrite", "documents": str(root / "documents.jsonl"), "chunks": str(root / "chunks.jsonl"),
              "out": str(root / "run"), "progress": False, "prices": PRICES,
              "teachers": {s: dict(block) for s in ("reflection", "refinement", "completion")}}  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True), encoding="utf-8")
    return path


def cli(recipe: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config", str(recipe), *flags]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def store_totals(path: Path) -> dict:
    db = sqlite3.connect(path)
    try:
        spent, most, rows = db.execute(
            "SELECT COALESCE(SUM(cost), 0), COALESCE(MAX(cost), 0), COUNT(*) FROM answers"
        ).fetchone()
        try:
            (estimated,) = db.execute("SELECT COALESCE(SUM(usage_estimated), 0) FROM answers").fetchone()
        except sqlite3.OperationalError:  # a store from before answers without usage were counted
            estimated = None
    finally:
        db.close()
    return {"spent": spent, "largest_request": most, "rows": rows, "usage_estimated_rows": estimated}


def billing_scenario(tmp: Path, billing: str, docs: list[str], cap: float, reruns: int) -> dict:
    with serve_in_subprocess(latency=0.02, replies=REPLIES, billing=billing) as server:
        recipe = make_recipe(tmp / billing, server.base_url, docs)
        first = cli(recipe, "--max-cost", str(cap))
        _, err = first.communicate(timeout=600)
        after_first = store_totals(tmp / billing / "run" / "answers.sqlite")
        sent_first = server.stats()["requests"]
        codes = [first.returncode]
        for _ in range(reruns):
            again = cli(recipe, "--max-cost", str(cap))
            again.communicate(timeout=600)
            codes.append(again.returncode)
        after = store_totals(tmp / billing / "run" / "answers.sqlite")
        sent = server.stats()["requests"]
    stop_line = next((x for x in err.splitlines() if "max-cost" in x), "")
    return {
        "billing": billing,
        "cap": cap,
        "exit_codes": codes,
        "spent_first_run": round(after_first["spent"], 6),
        "requests_first_run": sent_first,
        "spent_after_reruns": round(after["spent"], 6),
        "requests_on_reruns": sent - sent_first,
        "stated_bound": round(cap + CONCURRENCY * after["largest_request"], 6),
        "usage_estimated_rows": after["usage_estimated_rows"],
        "rows": after["rows"],
        "stop_message": stop_line,
    }


def shared_store_scenario(tmp: Path, billing: str, docs: list[str], cap: float | None) -> dict:
    name = f"shared-{billing}"
    with serve_in_subprocess(latency=0.05, replies=REPLIES, billing=billing) as server:
        recipe = make_recipe(tmp / name, server.base_url, docs)
        store = tmp / name / "shared.sqlite"
        flags = ["--cache", str(store)] + (["--max-cost", str(cap)] if cap is not None else [])
        runs = [cli(recipe, *flags, "--out", str(tmp / name / f"run{n}")) for n in (1, 2)]
        codes = [p.wait(timeout=600) for p in runs]
        stats = server.stats()
    totals = store_totals(store)
    return {
        "billing": billing,
        "cap": cap,
        "exit_codes": codes,
        "requests": stats["requests"],
        "distinct_requests": len(stats["by_key"]),
        "sent_more_than_once": sum(1 for n in stats["by_key"].values() if n > 1),
        "combined_spent": round(totals["spent"], 6),
        "stated_bound": None if cap is None else round(cap + 2 * CONCURRENCY * totals["largest_request"], 6),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=float, default=0.1, help="--max-cost of every run, USD")
    p.add_argument("--reruns", type=int, default=3, help="reruns under the same cap")
    p.add_argument("--docs", type=int, default=40, help="documents (half Emma, half CRUD), one chunk each")
    p.add_argument("--out", default=str(REPO / "bench_out" / "money_safety.json"))
    args = p.parse_args()
    docs = texts(args.docs)
    with tempfile.TemporaryDirectory(prefix="money-safety-") as tmp:
        billing = [
            billing_scenario(Path(tmp), b, docs, args.cap, args.reruns)
            for b in ("byte", "none", "low", "quarter")
        ]
        shared = [shared_store_scenario(Path(tmp), "quarter", docs, None),
                  shared_store_scenario(Path(tmp), "byte", docs, args.cap)]  # fmt: skip
    print(f"{'billing':<8} {'cap $':>6} {'spent run 1':>11} {'req run 1':>9} {'spent after':>11} "
          f"{'req reruns':>10} {'bound $':>8} {'estimated':>9}  exit codes")  # fmt: skip
    for r in billing:
        print(f"{r['billing']:<8} {r['cap']:>6} {r['spent_first_run']:>11.4f} {r['requests_first_run']:>9} "
              f"{r['spent_after_reruns']:>11.4f} {r['requests_on_reruns']:>10} {r['stated_bound']:>8.4f} "
              f"{r['usage_estimated_rows']!s:>9}  {r['exit_codes']}")  # fmt: skip
    for r in shared:
        print(f"two runs on one store ({r['billing']}, cap {r['cap']}): {r['requests']} requests for "
              f"{r['distinct_requests']} distinct, {r['sent_more_than_once']} sent more than once; combined "
              f"spend ${r['combined_spent']:.4f}; exit codes {r['exit_codes']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"billing": billing, "shared_store": shared})
    print(f"wrote {out}")


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"money_safety: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
