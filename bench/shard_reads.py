"""How long a chunk run spends reading its input, shard by shard, for each input layout.

A ``.jsonl`` file seeks to each shard's checkpoint; a ``.jsonl.gz`` file cannot seek, and a parquet
file cannot seek inside a row group. A worker's consecutive shards follow on from where the last one
stopped (`metachunk.sources.DocumentSource.documents`); a shard read out of order (another worker
took the ones between) starts again from its checkpoint. This reads every shard of one corpus in
order (one worker) and every other shard (one of two workers, the out-of-order case), per layout,
and writes ``bench_out/shard_reads/results.json``.

    python bench/shard_reads.py                  # 100,000 documents, 391 shards: about a minute
    python bench/shard_reads.py --documents 20000
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

from metachunk.artifacts import write_json
from metachunk.sources import DocumentSource

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench_out" / "shard_reads"


def corpus(folder: Path, n: int) -> dict[str, Path]:
    """The same ``n`` documents as .jsonl, .jsonl.gz and single-row-group parquet (pandas' default)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"d{i}", "text": f"Emma {i} was handsome, clever and rich. " * 4} for i in range(n)]
    paths = {"jsonl": folder / "c.jsonl", "jsonl.gz": folder / "c.jsonl.gz", "parquet": folder / "c.parquet"}
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    paths["jsonl"].write_text(lines)
    with gzip.open(paths["jsonl.gz"], "wt") as f:
        f.write(lines)
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"], row_group_size=n)
    return paths


def read_shards(path: Path, shards: int, step: int) -> tuple[float, int]:
    """Seconds to read every ``step``-th shard in order, and the documents read."""
    source = DocumentSource(path)
    index = source.scan()
    n = index.documents
    started, read = time.perf_counter(), 0
    for i in range(0, shards, step):
        read += sum(1 for _ in source.documents(i * n // shards, (i + 1) * n // shards, index))
    return time.perf_counter() - started, read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.documents < 256:
        print("shard_reads: --documents must be >= 256 (a shard's default size)", file=sys.stderr)
        return 2
    shards = -(-args.documents // 256)
    paths = corpus(OUT / "corpus", args.documents)
    results = {"documents": args.documents, "shards": shards, "layouts": {}}
    for layout, path in paths.items():
        in_order, _ = read_shards(path, shards, 1)
        every_other, _ = read_shards(path, shards, 2)
        results["layouts"][layout] = {
            "in_order_s": round(in_order, 2),
            "every_other_shard_s": round(every_other, 2),
        }
        print(f"{layout:>9}: every shard in order {in_order:6.2f} s; every other shard {every_other:6.2f} s")
    write_json(OUT / "results.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
