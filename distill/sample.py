"""``metachunk data sample``: pick training documents and chunks for distillation (Appendix H.2).

"We randomly select 20K long documents from the non-test documents and apply the PPL Chunking
[...] for preliminary segmentation. Subsequently, we strategically sample text chunks of varying
lengths from each document." Here:

1. Documents of at least ``min_doc_chars`` characters, not all whitespace, are drawn from the
   training pool with a seeded RNG (``n_docs``, capped by what the pool has), and kept in pool order.
2. They are PPL-chunked by the chunking engine (any preset or local model dir).
3. Each document contributes ``chunks_per_doc`` chunks. Chunk lengths are stratified: the
   buckets (``bucket_edges``, in characters) take turns, in a seeded order, so that across the
   sample every length bucket is about equally represented; a document without a chunk in its
   bucket gives the chunk from the nearest bucket it has.

The output is what ``metachunk distill rewrite|summary`` reads: ``chunks.jsonl`` with every
chunk of each sampled document (the context of related-chunk retrieval) and a ``selected`` list of
the sampled chunk indices, plus ``documents.jsonl`` and ``sample.json`` (the counts). The same
seed, pool and model give the same output.

The pool is streamed twice (which documents are long, then those drawn), so memory does not grow
with it. The PPL chunking goes through the corpus-scale path (`metachunk.chunking.shards`) into
``OUT/ppl/``: shard by shard, resumed by a rerun after a crash, with ``--workers`` processes, under
torchrun, or on Ray (``--engine ray``).
"""

from __future__ import annotations

import bisect
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from metachunk import config
from metachunk.artifacts import SCHEMA_VERSION, AtomicWriter, OutputSet, append_run_log, jsonl_line
from metachunk.command import Reads, Result
from metachunk.config import block, option
from metachunk.sources import BadRows, finish_rejects, read_documents


@dataclass
class SampleConfig:
    pool: Path = option(None, "training pool JSONL ({id, text}) from `metachunk data prepare-crud`")
    out: Path = option(None, "output dir: chunks.jsonl, documents.jsonl, sample.json")
    n_docs: int = option(20_000, "documents to draw (capped by the pool)")
    min_doc_chars: int = option(300, "only documents at least this long are drawn ('long documents')")
    chunks_per_doc: int = option(1, "chunks sampled per document")
    min_chunk_chars: int = option(50, "chunks shorter than this are never sampled (too little to rewrite)")
    bucket_edges: list[int] | None = option(
        None, "chunk length bucket edges in characters; default 100, 200, 400, 800"
    )
    seed: int = option(0, "seed for the document draw and the chunk choice")
    model: str = option("gemma3-270m", "PPL chunking model: preset name or local HF dir")
    lang: str = option("auto", "document language", choices=["auto", "zh", "en"])
    threshold: float = option(0.0, "PPL threshold θ (Meta-Chunking §3.1.1)")
    target_len: int | None = option(None, "merge PPL meta-chunks towards this length (dynamic merging)")
    len_unit: str | None = option(None, "unit of target_len", choices=["char", "word", "token"])
    batch_size: int = option(8, "sequences per forward pass while chunking")
    device: str | None = option(None, "torch device; default cuda when available, else cpu", runtime=True)
    workers: int | None = option(
        None, "PPL chunking worker processes (default one per visible GPU on GPU, else 1)", runtime=True
    )
    threads_per_worker: int | None = option(None, "torch threads per chunking worker", runtime=True)
    engine: str = option(
        "local",
        "PPL chunking engine: local processes, or ray (a Ray Data actor pool)",
        choices=["local", "ray"],
        runtime=True,
    )
    ray_address: str | None = option(None, "--engine ray: the cluster to join", runtime=True)
    progress: bool = option(True, "show a progress bar", runtime=True)
    bad_rows: BadRows = block(BadRows, "what a bad pool row does", prefix="")

    def __post_init__(self):
        config.check_choices(self)
        if self.pool is None or self.out is None:
            raise ValueError("fields 'pool' and 'out' are required")
        if self.n_docs < 1 or self.chunks_per_doc < 1:
            raise ValueError("'n_docs' and 'chunks_per_doc' must be >= 1")
        for name in ("target_len", "batch_size", "workers", "threads_per_worker"):  # as `chunk` checks them
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"'{name}' must be >= 1, got {getattr(self, name)}")
        if self.threshold != self.threshold:  # nan: as `chunk` refuses it, before the pool is read
            raise ValueError("'threshold' must be a number, got nan")
        if any(edge < 1 for edge in self.edges) or len(set(self.edges)) != len(self.edges):
            raise ValueError(f"'bucket_edges' must be distinct lengths >= 1, got {self.bucket_edges}")

    @property
    def edges(self) -> list[int]:
        return sorted(self.bucket_edges or [100, 200, 400, 800])


def bucket_names(edges: list[int]) -> list[str]:
    bounds = [0, *edges]
    return [f"{a}-{b}" for a, b in zip(bounds, edges)] + [f"{edges[-1]}+"]


def choose_chunks(
    lengths: list[int], wanted: list[int], edges: list[int], rng: random.Random, min_chars: int = 0
) -> list[int]:
    """Indices of chunks for the ``wanted`` buckets: a random chunk of each bucket, else of the
    nearest bucket the document has; never the same chunk twice, never one under ``min_chars``."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n < min_chars:
            continue
        by_bucket.setdefault(bisect.bisect_right(edges, n), []).append(i)
    chosen: list[int] = []
    for bucket in wanted:
        available = sorted(by_bucket, key=lambda b: (abs(b - bucket), b))
        for b in available:
            free = [i for i in by_bucket[b] if i not in chosen]
            if free:
                chosen.append(rng.choice(free))
                break
    return sorted(chosen)


def sample(cfg: SampleConfig) -> dict:
    """Draw, chunk and sample; writes the output dir and returns the report."""
    from metachunk.chunking.pipeline import ChunkConfig
    from metachunk.chunking.run import run_sharded
    from metachunk.chunking.shards import read_chunk_records

    started = time.perf_counter()
    out = Path(cfg.out)
    rejects = cfg.bad_rows.rejects(out)
    # A whitespace-only document is one blank chunk, nothing a teacher could rewrite: never drawn.
    long_positions = [
        k
        for k, d in enumerate(
            read_documents(cfg.pool, rejects=rejects, max_row_bytes=cfg.bad_rows.max_row_bytes)
        )
        if len(d.text) >= cfg.min_doc_chars and not d.text.isspace()
    ]
    pool_size = len(long_positions)
    rng = random.Random(cfg.seed)
    picked = {long_positions[i] for i in rng.sample(range(pool_size), min(cfg.n_docs, pool_size))}
    del long_positions
    n_docs = 0
    # The drawn documents, chunks.jsonl and sample.json are replaced together at the end: drawn here to a
    # staging file (the chunker's input), so that a chunking that fails leaves the last sample whole, not
    # new documents beside old chunks whose offsets point into other texts.
    drawn = out / ".documents.drawn.jsonl"
    with AtomicWriter(drawn) as docs_file:
        for k, d in enumerate(
            read_documents(cfg.pool, rejects=rejects, max_row_bytes=cfg.bad_rows.max_row_bytes)
        ):
            if k in picked:
                docs_file.write(jsonl_line({"id": d.id, "text": d.text}))
                n_docs += 1

    chunk_cfg = ChunkConfig(
        input=drawn,
        output=out / "ppl",
        method="ppl",
        model=cfg.model,
        lang=cfg.lang,
        threshold=cfg.threshold,
        target_len=cfg.target_len,
        len_unit=cfg.len_unit,
        batch_size=cfg.batch_size,
        device=cfg.device,
        workers=cfg.workers,
        threads_per_worker=cfg.threads_per_worker,
        engine=cfg.engine,
        ray_address=cfg.ray_address,
    )
    chunk_manifest = run_sharded(chunk_cfg, progress=cfg.progress, restart_if_changed=True)
    if not chunk_manifest["complete"]:  # a torchrun rank that finished before the others
        return {"complete": False, "chunks_dir": str(out / "ppl")}

    n_buckets = len(cfg.edges) + 1
    # Buckets take turns across documents, in a seeded order: stratified, not dictated by the pool.
    turns = list(range(n_buckets))
    rng.shuffle(turns)
    sampled_buckets: Counter = Counter()
    n_chunks = n_selected = 0
    with OutputSet() as outputs:
        outputs.adopt(out / "documents.jsonl", drawn)
        chunks_file = outputs.open(out / "chunks.jsonl")
        for position, chunked in enumerate(read_chunk_records(out / "ppl")):
            wanted = [
                turns[(position * cfg.chunks_per_doc + j) % n_buckets] for j in range(cfg.chunks_per_doc)
            ]
            lengths = [len(c["text"]) for c in chunked["chunks"]]
            selected = choose_chunks(lengths, wanted, cfg.edges, rng, cfg.min_chunk_chars)
            for i in selected:
                sampled_buckets[bisect.bisect_right(cfg.edges, lengths[i])] += 1
            record = {
                "schema_version": SCHEMA_VERSION,
                "id": chunked["id"],
                "method": "ppl",
                "chunks": chunked["chunks"],
                "selected": selected,
            }
            chunks_file.write(jsonl_line(record))
            n_chunks += len(chunked["chunks"])
            n_selected += len(selected)
        names = bucket_names(cfg.edges)
        report = {
            "schema_version": SCHEMA_VERSION,
            "command": "data sample",
            "config": config.computed(cfg),  # what decides the sample; how it ran goes to runs.jsonl
            "pool_long_documents": pool_size,
            "documents": n_docs,
            "chunks": n_chunks,
            "selected_chunks": n_selected,
            "selected_by_length": {names[b]: sampled_buckets.get(b, 0) for b in range(n_buckets)},
        }
        rejected = finish_rejects(rejects, "data sample")
        if rejected is not None:
            report["rejects"] = rejected
        outputs.commit(out / "sample.json", report)
    how = config.runtime(cfg)
    append_run_log(out, {"command": "data sample", **how, "seconds": round(time.perf_counter() - started, 2)})
    return report


def print_report(report: dict, file=None) -> None:
    file = file or sys.stdout
    print(
        f"sampled {report['documents']} of {report['pool_long_documents']} long documents, "
        f"{report['chunks']} chunks, {report['selected_chunks']} selected; by length (chars): "
        + ", ".join(f"{k} {v}" for k, v in report["selected_by_length"].items()),
        file=file,
    )


# ---- `metachunk data sample` ---------------------------------------------------------------------

CONFIG = SampleConfig


def run(cfg: SampleConfig) -> Result:
    report = sample(cfg)
    print_report(report)
    print(f"{cfg.out}: chunks.jsonl (with 'selected'), documents.jsonl, sample.json", file=sys.stderr)
    keys = ("pool_long_documents", "documents", "chunks", "selected_chunks")
    return Result.with_rejects({k: report.get(k) for k in keys}, report.get("rejects"))


def inputs(cfg: SampleConfig) -> Reads:
    return Reads.of(paths=[cfg.pool], models=[cfg.model])


def outputs(cfg: SampleConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
