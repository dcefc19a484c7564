"""A chunk folder's bookkeeping per shard, at corpus scale: seconds and manifest bytes per shard as
the shards done grow (``chunking/shards.py``, `ShardedOutput`).

A corpus of 10M documents makes ~39K shards of 256 documents. Each finished shard is entered
under the folder's lock; if that entry rewrote a manifest listing every done shard, the cost of the
k-th entry would grow with k and the run's with the square of the shards, and on a multi-GPU run
every worker would wait on that lock. This bench commits ``--shards`` tiny shards through the real
`ShardedOutput` (open, commit, finish: the temp files, renames, fsyncs and lock the chunk command
uses), with no model, and reports:

* seconds per shard over the first and the last tenth of the shards (flat means linear in all);
* how many times the manifest was rewritten, and the bytes those rewrites wrote, beside the final
  manifest's size (found by watching the manifest's inode after each commit: every write renames a
  new file in, so this works for any version of the code).

    python bench/shard_manifest.py --shards 20000 [--folder DIR]

The folder defaults to a temp dir under the working directory (the disk a real run writes to,
not a tmpfs); fsync times depend on it, so compare runs on one disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from metachunk.chunking.shards import ShardedOutput, ShardPlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=20000)
    ap.add_argument("--folder", default=None, help="where the folder goes (default: a temp dir here)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.folder or ".", prefix="shard_manifest.") as tmp:
        plan = ShardPlan(documents=256 * args.shards, shards=args.shards)
        head = {"fingerprint": "bench", "fingerprint_of": {"config": "bench"},
                "shards": {"count": args.shards, "format": "jsonl"}}  # fmt: skip
        out = ShardedOutput(tmp, plan, "jsonl")
        out.open(head, overwrite=False)
        manifest = Path(tmp) / "manifest.json"
        inode, rewrites, written = manifest.stat().st_ino, 0, 0
        seconds = []
        data = b'{"id": "doc", "chunks": []}\n'
        stats = {"documents": 256, "chunks": 3000, "chunk_chars": 1_800_000}
        for i in range(args.shards):
            t = time.perf_counter()
            out.commit(i, data, stats)
            seconds.append(time.perf_counter() - t)
            st = manifest.stat()
            if st.st_ino != inode:
                inode, rewrites, written = st.st_ino, rewrites + 1, written + st.st_size
        t = time.perf_counter()
        final = out.finish({"bench": True}, {})
        finish_s = time.perf_counter() - t
        assert final["complete"] and len(final["shards"]["done"]) == args.shards
        size = manifest.stat().st_size
    tenth = max(1, args.shards // 10)
    result = {
        "shards": args.shards,
        "seconds": round(sum(seconds) + finish_s, 2),
        "ms_per_shard_first_tenth": round(1000 * sum(seconds[:tenth]) / tenth, 3),
        "ms_per_shard_last_tenth": round(1000 * sum(seconds[-tenth:]) / tenth, 3),
        "finish_s": round(finish_s, 3),
        "manifest_rewrites": rewrites,
        "manifest_bytes_written": written,
        "final_manifest_bytes": size,
        "written_over_final": round(written / size, 1),
        "cpu": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
