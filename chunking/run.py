"""``metachunk chunk``: the command, over :mod:`metachunk.chunking.shards`.

``-o FILE.jsonl`` writes one file and ``FILE.meta.json``; ``-o DIR`` writes a dataset folder of
shards and ``manifest.json``, resumable. Both are one implementation
(:func:`metachunk.chunking.shards.chunk_corpus`: a file is the one-shard plan), so every method
(moc and lumber too) and every option (``--rewrite``/``--summarize``, ``--plot``,
``--mean-chunk-chars``) works with either.
"""

from __future__ import annotations

from metachunk.chunking.pipeline import ChunkConfig
from metachunk.chunking.shards import chunk_corpus, reads

from metachunk.command import Reads, Result

CONFIG = ChunkConfig


def run(cfg: ChunkConfig) -> Result:
    manifest = chunk_corpus(cfg)
    return Result(summary=summary(manifest))


def summary(manifest: dict) -> dict:
    """A run's counts, from the manifest it wrote: documents, chunks and mean length; the fitted
    ``target_len``; MoC's windows, PPL fallbacks and stand-ins; what the students added."""
    out = {
        k: v
        for k, v in manifest.get("summary", {}).items()
        if k in ("documents", "chunks", "mean_chunk_chars")
    }
    blocks = manifest.get("run", {}).get("workers_report") or [manifest]  # a folder: one per worker
    fit = manifest.get("length_fit") or manifest.get("run", {}).get("length_fit")
    if fit:
        out["target_len"] = fit["target_len"]
    mocs = [b["moc"] for b in blocks if "moc" in b]
    if mocs:
        out.update(windows=sum(m.get("windows") or 0 for m in mocs),
                   ppl_fallbacks=sum((m.get("fallback") or {}).get("windows") or 0 for m in mocs),
                   stand_ins=len(mocs[0].get("stand_ins") or {}))  # fmt: skip
    for task, run in (blocks[0].get("students") or {}).items():
        out[task] = (
            f"'{run.get('field')}' on {sum(b['students'][task].get('chunks') or 0 for b in blocks)} chunks"
        )
    return out


def inputs(cfg: ChunkConfig) -> Reads:
    return reads(cfg)


def teachers(cfg: ChunkConfig) -> dict[str, str]:
    """LumberChunker's teacher blocks' model names (the other methods ask no teacher)."""
    if cfg.method != "lumber":
        return {}
    return {name: str(block.get("model")) for name, block in (cfg.lumber.teachers or {}).items()}


def served(config: dict, teacher) -> dict:
    """The recipe with LumberChunker's teacher blocks (flat ``teachers:`` or under ``lumber:``)
    pointed at a served local teacher."""
    from metachunk.teacher import point_at

    config = dict(config)
    if config.get("teachers"):
        config["teachers"] = {k: point_at(b, teacher) for k, b in config["teachers"].items()}
    if (config.get("lumber") or {}).get("teachers"):
        blocks = config["lumber"]["teachers"]
        config["lumber"] = {
            **config["lumber"],
            "teachers": {k: point_at(b, teacher) for k, b in blocks.items()},
        }
    return config


def outputs(cfg: ChunkConfig) -> list:
    """The chunks, and the score plots' folder."""
    return [cfg.output, *([cfg.plot] if cfg.plot else [])]
