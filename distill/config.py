"""``metachunk distill``'s config: `DistillConfig`, its ``moc:`` block and each task's
teacher stages. Its own module, so that the driver (`metachunk.distill.run`) and the tasks
(`metachunk.distill.pipelines`, `metachunk.distill.moc`) all import it and none of them
imports another to learn a config's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.moc import DEFAULT_PLACEHOLDER, PLACEHOLDERS

from metachunk import config
from metachunk.config import option
from metachunk.sources import BadRows
from metachunk.teacher import Price, TeacherConfig

# Each task's teacher stages; `moc` (distill/moc.py) asks one teacher to chunk raw text (MoC Table 6).
STAGES = {
    "rewrite": ("reflection", "refinement", "completion"),
    "summary": ("summary_global", "summary_local", "summary_fuse"),
}
TASK_STAGES = {**STAGES, "moc": ("moc_chunk",)}


@dataclass
class MocDistillOptions:
    """``distill moc``'s own options (distill/moc.py, MoC §3.2.1 and Appendix A.3): a block of
    `DistillConfig`, ``moc: {window_tokens: 512}`` or ``moc_window_tokens: 512`` in a recipe,
    ``--moc-window-tokens 512`` on the command line, spelled as ``chunk --method moc`` spells the
    same settings (``--moc-placeholder``, ``--moc-max-ratio``)."""

    tokenizer: str = option(
        "gemma3-270m", "moc: tokenizer (preset or local HF dir) that measures windows in tokens"
    )
    window_tokens: int = option(
        1024, "moc: longest window of text per teacher request, cut at a paragraph or sentence end"
    )
    max_ratio: float = option(
        0.1, "moc: a returned chunk further than this share of its length (edits) from the text is flagged"
    )
    sample_chars: int = option(1024, "moc: router/expert samples of about this many characters, whole chunks")
    placeholder: str = option(
        DEFAULT_PLACEHOLDER,
        "moc: what stands for a chunk's middle in expert targets",
        choices=list(PLACEHOLDERS),
    )
    head_chars: int = option(10, "moc: characters of a chunk's start kept in its expert target")
    tail_chars: int = option(10, "moc: characters of a chunk's end kept in its expert target")


@dataclass
class DistillConfig:
    task: str = option(
        None,
        "which pipeline this recipe drives (set by `distill rewrite|summary|moc`; `distill status` needs it, "
        "or a recipe that says it)",
        choices=["rewrite", "summary", "moc"],
    )
    chunks: Path = option(
        None, "chunks JSONL from `metachunk chunk` or `metachunk data sample` (not used by moc)"
    )
    documents: Path = option(
        None, "the documents those chunks index into (moc: the documents to chunk): JSONL with id and text"
    )
    out: Path = option(
        None,
        "run directory: TASK.jsonl (one record per chunk; moc: per document), TASK.meta.json, runs.jsonl "
        "(one line per attempt), answers.sqlite",
    )
    cache: Path | None = option(
        None,
        "answer store (SQLite, append-only); default OUT/answers.sqlite. Safe to share between runs, "
        "also running at once: a request another process is sending is waited for, never paid twice",
    )
    teachers: dict[str, TeacherConfig] | None = option(
        None,
        "one teacher block per stage (rewrite: reflection, refinement, completion; summary: "
        "summary_global, summary_local, summary_fuse; moc: moc_chunk)",
    )
    prices: dict[str, Price] | None = option(None, "USD per 1M prompt/completion tokens, by model name")
    lang: str = option("auto", "prompt language; auto detects it per document", choices=["auto", "zh", "en"])
    context: str = option(
        "document",
        "context given with each chunk: the document around it, or its most similar chunks",
        choices=["document", "related"],
    )
    context_top_k: int = option(4, "related context: how many of the document's other chunks")
    max_context_chars: int = option(
        8000, "longest context; a longer document is cut to a window around the chunk"
    )
    embedder: str = option("minilm", "related context: sentence embedder preset or local dir")
    threshold: float = option(7.0, "rewrite: keep refinement items scoring at least this (scores are 1-10)")
    parse_retries: int = option(2, "ask again this many times when an answer is empty or unparseable")
    limit: int | None = option(None, "only the first N chunks (moc: documents)")
    bad_rows: BadRows = config.block(BadRows, "what a bad chunks record or document row does", prefix="")
    max_cost: float | None = option(
        None,
        "stop cleanly before the total spend on this answer store passes USD: every run, past and "
        "running at once in other processes, counts (exit status 3)",
    )
    max_failure_rate: float = option(
        0.25,
        "exit with status 4 when more than this share of the records failed (a run where every record "
        "failed always does); the failed records are still written, and a rerun retries transport failures",
    )
    dry_run: bool = option(False, "print calls, estimated tokens and cost; send and write nothing")
    export_batch: Path | None = option(
        None,
        "teachers in mode: batch: write this round's requests as Batch API JSONL here (for `vllm run-batch`) "
        "instead of submitting them, and stop; rerun with --import-batch RESULTS for the next round",
    )
    import_batch: list[Path] | None = option(
        None, "store the answers of Batch API result files (vllm run-batch's output) before the run"
    )
    progress: bool = option(True, "show a progress bar", runtime=True)
    moc: MocDistillOptions = config.block(
        MocDistillOptions,
        "moc: windows, cleaning and samples (flat keys and flags: moc_window_tokens, ...)",
        prefix="moc_",
    )

    # The spellings before the moc block took chunk's prefix: refused, naming the new key.
    RENAMED = {"tokenizer": "moc_tokenizer", "window_tokens": "moc_window_tokens", "max_edit_ratio": "moc_max_ratio",
               "sample_chars": "moc_sample_chars", "placeholder": "moc_placeholder", "head_chars": "moc_head_chars",
               "tail_chars": "moc_tail_chars"}  # fmt: skip

    def __post_init__(self):
        config.check_choices(self)
        self.teachers = self.teachers or {}
        self.prices = self.prices or {}
        required = (
            ("task", "documents", "out") if self.task == "moc" else ("task", "chunks", "documents", "out")
        )
        for name in required:
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        moc = self.moc
        if self.task == "moc" and (
            moc.window_tokens < 16 or moc.sample_chars < 1 or min(moc.head_chars, moc.tail_chars) < 1
        ):
            raise ValueError(
                "moc_window_tokens must be >= 16; moc_sample_chars, moc_head_chars, moc_tail_chars >= 1"
            )
        if not 0 <= moc.max_ratio < 1:
            raise ValueError("'moc_max_ratio' must be in [0, 1)")
        if not 0 <= self.max_failure_rate <= 1:
            raise ValueError("'max_failure_rate' must be in [0, 1]")
        if self.max_cost is not None and not self.max_cost >= 0:  # nan fails this too; inf: no cap
            raise ValueError(f"'max_cost' must be a number of dollars >= 0, got {self.max_cost}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"'limit' must be >= 1, got {self.limit}")
        if self.parse_retries < 0:
            raise ValueError(f"'parse_retries' must be >= 0, got {self.parse_retries}")
        if self.max_context_chars < 1:
            raise ValueError(f"'max_context_chars' must be >= 1, got {self.max_context_chars}")
        if not math.isfinite(self.threshold):  # NaN would keep no item, silently
            raise ValueError(f"'threshold' must be a number, got {self.threshold}")
        modes = {t.get("mode", "online") if isinstance(t, dict) else t.mode for t in self.teachers.values()}
        if (self.import_batch or self.export_batch) and modes == {"online"}:  # else ignored, and paid online
            raise ValueError("--import-batch and --export-batch are for teachers in 'mode: batch'; every teacher "
                             "of this recipe is online")  # fmt: skip
        missing = [s for s in TASK_STAGES[self.task] if s not in self.teachers]
        if missing:
            raise ValueError(f"field 'teachers' lacks a block for stage(s) {', '.join(missing)}")
        # Blocks for the other task's stages are allowed: one recipe can drive both pipelines.
        known = {stage for stages in TASK_STAGES.values() for stage in stages}
        extra = sorted(set(self.teachers) - known)
        if extra:
            raise ValueError(f"field 'teachers' has block(s) for unknown stage(s) {', '.join(extra)}")
        self.teachers = {stage: self.teachers[stage] for stage in TASK_STAGES[self.task]}
        if self.cache is None:
            self.cache = Path(self.out) / "answers.sqlite"
