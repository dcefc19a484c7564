"""The memory a distill run's jobs hold: ``read_jobs`` over 100 documents of 40,000 characters in
470-character chunks (8,600 chunks, 3.8 MiB of text) at the default 8,000-character context, measured
with tracemalloc, and written to ``bench_out/distill_jobs_memory/results.json``.

    python bench/distill_jobs_memory.py
"""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

from metachunk.distill.config import DistillConfig
from metachunk.distill.pipelines import read_jobs

from metachunk.artifacts import write_json

OUT = Path(__file__).resolve().parents[1] / "bench_out" / "distill_jobs_memory"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    docs, chunks = OUT / "docs.jsonl", OUT / "chunks.jsonl"
    with docs.open("w") as d, chunks.open("w") as c:
        for i in range(100):
            text = ("Emma Woodhouse was handsome, clever and rich. " * 900)[:40000]
            d.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
            spans = [{"text": text[k : k + 470], "start": k, "end": min(k + 470, len(text))}
                     for k in range(0, len(text), 470)]  # fmt: skip
            c.write(json.dumps({"id": f"d{i}", "chunks": spans}) + "\n")
    teacher = {"model": "m", "base_url": "http://127.0.0.1:9/v1"}
    cfg = DistillConfig(task="rewrite", chunks=chunks, documents=docs, out=OUT / "run", lang="en",
                        teachers=dict.fromkeys(("reflection", "refinement", "completion"), teacher))  # fmt: skip
    tracemalloc.start()
    jobs = read_jobs(cfg)
    held, peak = tracemalloc.get_traced_memory()
    result = {"jobs": len(jobs), "corpus_mib": round(100 * 40000 / 2**20, 1),
              "held_mib": round(held / 2**20, 1), "peak_mib": round(peak / 2**20, 1)}  # fmt: skip
    print(f"{result['jobs']} jobs over {result['corpus_mib']} MiB of text: {result['held_mib']} MiB held, "
          f"{result['peak_mib']} MiB at peak")  # fmt: skip
    write_json(OUT / "results.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
