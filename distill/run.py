"""``metachunk distill rewrite|summary|status``: read chunks, ask the teachers, write records.

The answer store is the source of truth; ``OUT/TASK.jsonl`` is a view of it, rebuilt in full by
every run (answered requests come from the store, so a rerun after a crash or a parser change
costs nothing but the requests that never got an answer). ``--dry-run`` and ``status`` replay the
pipeline against the store without a network client: whatever is answered is read, and the first
unanswered request of each chunk is counted, with the calls after it estimated.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from chunking.moc import DEFAULT_PLACEHOLDER, PLACEHOLDERS
from chunking.students import (  # the students' context, shared with the chunker's inference
    CONTEXT_SEPARATOR,
    context_from_spans,  # noqa: F401  (re-exported)
    related_chunks,
    window_span,
)
from distill.pipelines import STAGES, ChunkJob, StageRunner, estimate_pending, rewrite, summary
from distill.prompts import load_prompt
from metachunk import config
from metachunk.artifacts import SCHEMA_VERSION, InputError, OutputPair, jsonl_line, read_documents
from metachunk.config import option
from metachunk.store import AnswerStore
from metachunk.teacher import EndpointUnreachable, Price, TeacherConfig, TeacherPool

# Each task's teacher stages; `moc` (distill/moc.py) asks one teacher to chunk raw text (MoC Table 6).
TASK_STAGES = {**STAGES, "moc": ("moc_chunk",)}


@dataclass
class DistillConfig:
    task: str = option(None, "which pipeline this recipe drives", choices=["rewrite", "summary", "moc"])
    chunks: Path = option(
        None, "chunks JSONL from `metachunk chunk` or `metachunk data sample` (not used by moc)"
    )
    documents: Path = option(
        None, "the documents those chunks index into (moc: the documents to chunk): JSONL with id and text"
    )
    out: Path = option(
        None, "run directory: TASK.jsonl (one record per chunk), TASK.meta.json, answers.sqlite"
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
    dry_run: bool = option(False, "print calls, estimated tokens and cost; send nothing")
    progress: bool = option(True, "show a progress bar")
    # MoC dataset distillation (distill/moc.py, MoC §3.2.1 and Appendix A.3)
    tokenizer: str = option(
        "gemma3-270m", "moc: tokenizer (preset or local HF dir) that measures windows in tokens"
    )
    window_tokens: int = option(
        1024, "moc: longest window of text per teacher request, cut at a paragraph or sentence end"
    )
    max_edit_ratio: float = option(
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
        if self.task == "moc" and (
            self.window_tokens < 16 or self.sample_chars < 1 or min(self.head_chars, self.tail_chars) < 1
        ):
            raise ValueError("window_tokens must be >= 16; sample_chars, head_chars, tail_chars >= 1")
        if not 0 <= self.max_edit_ratio < 1:
            raise ValueError("'max_edit_ratio' must be in [0, 1)")
        if not 0 <= self.max_failure_rate <= 1:
            raise ValueError("'max_failure_rate' must be in [0, 1]")
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


# ---------------------------------------------------------------------------------------- inputs


def read_jobs(cfg: DistillConfig) -> list[ChunkJob]:
    """Chunks to distil, checked against their documents; the context of each is built here."""
    from chunking.sentences import detect_lang

    docs = {d.id: d.text for d in read_documents(cfg.documents)}
    jobs, related = [], []
    path = Path(cfg.chunks)
    if not path.is_file():
        raise InputError(path, "no such file")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                doc_id, chunks = str(record["id"]), record["chunks"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(
                    path, f"expected a chunks record with 'id' and 'chunks' ({e})", number
                ) from None
            if doc_id not in docs:
                raise InputError(path, f"document {doc_id!r} is not in {cfg.documents}", number)
            text = docs[doc_id]
            # Every chunk is checked, not only the selected ones: related context reads them all.
            if not isinstance(chunks, list):
                raise InputError(path, "'chunks' must be a list of {text, start, end} objects", number)
            for i, c in enumerate(chunks):
                if not isinstance(c, dict):
                    raise InputError(
                        path, f"chunks[{i}] must be an object with 'text', 'start', 'end'", number
                    )
                for key in ("text", "start", "end"):
                    if key not in c:
                        raise InputError(path, f"chunks[{i}]: missing field {key!r}", number)
                if not isinstance(c["text"], str):
                    raise InputError(path, f"chunks[{i}]: 'text' must be a string", number)
                for key in ("start", "end"):
                    if isinstance(c[key], bool) or not isinstance(c[key], int):
                        raise InputError(
                            path, f"chunks[{i}]: {key!r} must be an integer, got {c[key]!r}", number
                        )
                if not 0 <= c["start"] <= c["end"] <= len(text):
                    raise InputError(
                        path,
                        f"chunks[{i}]: {c['start']}:{c['end']} is outside the document (0:{len(text)})",
                        number,
                    )
                if text[c["start"] : c["end"]] != c["text"]:
                    raise InputError(
                        path,
                        f"chunks[{i}]: text differs from the document at {c['start']}:{c['end']}",
                        number,
                    )
            lang = detect_lang(text) if cfg.lang == "auto" else cfg.lang
            selected = record.get("selected", list(range(len(chunks))))
            if not isinstance(selected, list):
                raise InputError(path, "'selected' must be a list of chunk indices", number)
            for i in selected:
                # A negative index would silently pick a chunk from the end; a bool is not an index.
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(chunks):
                    valid = f"0-{len(chunks) - 1}" if chunks else "the record has no chunks"
                    raise InputError(path, f"'selected': {i!r} is not a chunk index ({valid})", number)
            for i in selected:
                c = chunks[i]
                left, right = window_span(len(text), c["start"], c["end"], cfg.max_context_chars)
                jobs.append(
                    ChunkJob(
                        doc_id, i, c["start"], c["end"], c["text"], lang, text[left:right], ((left, right),)
                    )
                )
                related.append(chunks)
                if cfg.limit is not None and len(jobs) >= cfg.limit:
                    break
            if cfg.limit is not None and len(jobs) >= cfg.limit:
                break
    if cfg.context == "related":
        jobs = with_related_context(jobs, related, cfg)
    return jobs


def window(text: str, start: int, end: int, limit: int) -> str:
    left, right = window_span(len(text), start, end, limit)
    return text[left:right]


def with_related_context(
    jobs: list[ChunkJob], all_chunks: list[list[dict]], cfg: DistillConfig
) -> list[ChunkJob]:
    """Long documents (Meta-Chunking §3.2.1 preprocessing): the context of a chunk is its
    ``context_top_k`` most similar chunks of the same document, in document order."""
    from metachunk.models import load_sentence_embedder

    embedder = load_sentence_embedder(cfg.embedder)
    by_doc: dict[str, list[dict]] = {}
    for job, chunks in zip(jobs, all_chunks):
        by_doc.setdefault(job.doc_id, chunks)
    vectors = {
        doc_id: embedder.encode([c["text"] for c in chunks], normalize_embeddings=True, convert_to_numpy=True)
        for doc_id, chunks in by_doc.items()
    }
    out = []
    for job in jobs:
        chunks, vecs = by_doc[job.doc_id], vectors[job.doc_id]
        top = related_chunks(vecs, job.index, cfg.context_top_k)
        context = CONTEXT_SEPARATOR.join(chunks[i]["text"] for i in top)[: cfg.max_context_chars]
        spans = tuple((chunks[i]["start"], chunks[i]["end"]) for i in top)
        out.append(ChunkJob(job.doc_id, job.index, job.start, job.end, job.text, job.lang, context, spans))
    return out


# ------------------------------------------------------------------------------------------ run


@dataclass
class RunResult:
    records: list[dict]
    seconds: float
    sent: int
    cached: int
    stopped: str = ""  # why the run stopped early: "budget", "unreachable", or "" when it went through
    jobs: list[ChunkJob] = field(default_factory=list)
    paid: float = 0.0  # billed to this run's requests
    spent: float = 0.0  # the whole answer store's spend when the run ended (every process)
    waited: int = 0  # answers another process on the store was paying for when this run wanted them
    unreachable: str = ""  # the one line saying which endpoint could not be reached


async def _drive(cfg: DistillConfig, jobs: list[ChunkJob], pool: TeacherPool, progress: bool) -> RunResult:
    from tqdm import tqdm

    runner = StageRunner(pool.stages, cfg.parse_retries)
    if cfg.task == "rewrite":
        work = lambda job, runner=runner: rewrite(job, runner, cfg.threshold)  # noqa: E731
    else:
        work = lambda job, runner=runner: summary(job, runner)  # noqa: E731
    records: list[dict | None] = [None] * len(jobs)
    queue = iter(enumerate(jobs))
    started = time.perf_counter()
    bar = tqdm(
        total=len(jobs), unit="chunk", desc=f"distill {cfg.task}", disable=not progress, dynamic_ncols=True
    )
    shown = [0.0]

    def show() -> None:
        now = time.perf_counter()
        if now - shown[0] < 0.5 and bar.n < bar.total:
            return
        shown[0] = now
        spent = pool.budget.paid
        tokens = sum(t.tokens_used for t in pool.stages.values())
        bar.set_postfix_str(
            f"{pool.sent / max(now - started, 1e-9):.1f} req/s, {tokens:,} tok, ${spent:.4f}", refresh=False
        )

    async def worker() -> None:
        for i, job in queue:  # one shared iterator: each job is taken by exactly one worker
            # No early return at the budget: each later job still asks, and the stages whose
            # reservation does not fit end pending, so the run sends everything that fits the cap.
            records[i] = await work(job)
            bar.update(1)
            show()

    # Chains are sequential, so keep about two chunks per request slot in flight.
    slots = sum(e.cfg.concurrency for e in pool.endpoints.values()) or 64
    workers = [asyncio.ensure_future(worker()) for _ in range(min(len(jobs), 2 * slots) or 1)]
    unreachable = ""
    try:
        await gather_or_stop(workers)
    except EndpointUnreachable as e:  # stop sending; what was answered is kept and written
        unreachable = str(e)
    finally:
        bar.close()
        await pool.close()
    stopped = "unreachable" if unreachable else "budget" if pool.budget.exhausted else ""
    # Chunks never started (or cut short) because the run stopped: replay them against the store,
    # sending nothing, so that the records still show every answer the store holds for them.
    unstarted = [i for i, record in enumerate(records) if record is None]
    replay = TeacherPool(cfg.teachers, cfg.prices, pool.store, offline=True)
    for i in unstarted:
        records[i] = await work(jobs[i], StageRunner(replay.stages, cfg.parse_retries))
        if records[i]["status"] == "pending":
            records[i]["reason"] = stopped
    cached = sum(t.cached for t in (*pool.stages.values(), *replay.stages.values()))
    return RunResult(records, time.perf_counter() - started, pool.sent, cached, stopped, jobs,
                     paid=pool.budget.paid, spent=pool.store.spent(), waited=pool.waited,
                     unreachable=unreachable)  # fmt: skip


async def gather_or_stop(workers: list[asyncio.Future]) -> None:
    """Wait for every worker; on the first error (or cancellation) cancel the rest, then raise it."""
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise


def run(cfg: DistillConfig, offline: bool = False) -> RunResult:
    """Run (or, offline, replay) the pipeline over every chunk; returns the records."""
    jobs = read_jobs(cfg)
    for stage in STAGES[cfg.task]:  # fail on a broken prompt file before anything is sent
        for lang in {j.lang for j in jobs}:
            load_prompt(stage, lang)
    store = AnswerStore(cfg.cache)
    try:
        pool = TeacherPool(cfg.teachers, cfg.prices, store, cfg.max_cost, offline=offline)
        return asyncio.run(_drive(cfg, jobs, pool, cfg.progress and not offline))
    finally:
        store.close()


def write_records(cfg: DistillConfig, result: RunResult) -> dict:
    """``OUT/TASK.jsonl`` and ``OUT/TASK.meta.json``, replaced together; returns the summary."""
    summary = summarize(result.records)
    summary.update(
        seconds=round(result.seconds, 2),
        requests_sent=result.sent,
        answers_from_store=result.cached,
        answers_waited_for=result.waited,
        paid=round(result.paid, 6),
        store_spent=round(result.spent, 6),
        stopped=result.stopped,
    )
    prompts = {
        f"{stage}.{lang}": load_prompt(stage, lang).sha256
        for stage in STAGES[cfg.task]
        for lang in sorted({r["lang"] for r in result.records})
    }
    with OutputPair(Path(cfg.out) / f"{cfg.task}.jsonl") as pair:
        for record in result.records:
            pair.file.write(jsonl_line(record))
        pair.commit({"schema_version": SCHEMA_VERSION, "command": f"distill {cfg.task}",
                     "config": config.to_dict(cfg), "prompt_sha256": prompts, "summary": summary})  # fmt: skip
    return summary


# `metachunk distill` exit statuses (also in its --help).
EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_BUDGET, EXIT_FAILURES = 0, 1, 2, 3, 4
EXIT_CODES_HELP = """exit status:
  0  every record was written and the failure rate is at most --max-failure-rate
  1  an unexpected error or an OS error (disk full, permission denied)
  2  a bad config or input file (the message names the file, line and field), or a refused key
  3  the budget: stopped before the store's spend would pass --max-cost; rerun with a higher cap
  4  failures: every record failed, more than --max-failure-rate of them did, or the endpoint
     could not be reached; the records are written and a rerun retries the transport failures"""


def exit_status(cfg, records: list[dict], stopped: str, paid: float, spent: float, unreachable: str = "",
                unit: str = "records", file=None) -> int:  # fmt: skip
    """Print why a run did not go through, if it did not, and return its exit status."""
    file = file or sys.stderr
    if stopped == "unreachable":
        print(f"metachunk: {unreachable}", file=file)
        return EXIT_FAILURES
    if stopped == "budget":
        print(
            f"metachunk: stopped at the budget: the store's spend is ${spent:.4f} against --max-cost "
            f"{cfg.max_cost} (this run paid ${paid:.4f}); every answer is stored. Rerun with a higher "
            "--max-cost to continue.",
            file=file,
        )
        return EXIT_BUDGET
    failed = sum(1 for r in records if r["status"] == "failed")
    if records and (failed == len(records) or failed / len(records) > cfg.max_failure_rate):
        reasons = Counter(r["reason"] or "unknown" for r in records if r["status"] == "failed")
        print(
            f"metachunk: {failed} of {len(records)} {unit} failed ("
            + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
            + f"), more than --max-failure-rate {cfg.max_failure_rate}; they are recorded, and a rerun "
            "retries the transport failures",
            file=file,
        )
        return EXIT_FAILURES
    return EXIT_OK


def summarize(records: list[dict]) -> dict:
    """Per-record outcome counts and, per stage, done / failed by reason / pending plus usage."""
    outcome = Counter(r["status"] for r in records)
    reasons = Counter(f"{r.get('stage', '')}:{r['reason']}" for r in records if r["status"] == "failed")
    stages: dict[str, dict] = defaultdict(
        lambda: {
            "done": 0,
            "failed": Counter(),
            "pending": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cost": 0.0,
        }
    )
    for r in records:
        for name, entry in r["stages"].items():
            row = stages[name]
            if entry["status"] == "ok":
                row["done"] += 1
            elif entry["status"] == "pending":
                row["pending"] += 1
            else:
                row["failed"][entry["reason"] or "unknown"] += 1
            spent = entry.get("spent") or {**entry["usage"], "cost": entry["cost"]}
            row["prompt_tokens"] += spent["prompt_tokens"]
            row["completion_tokens"] += spent["completion_tokens"]
            row["cost"] += spent["cost"]
    return {
        "chunks": len(records),
        "outcome": dict(outcome),
        "failed_by_stage_reason": dict(reasons),
        "stages": {
            k: {**v, "failed": dict(v["failed"]), "cost": round(v["cost"], 6)} for k, v in stages.items()
        },
        "cost": round(sum(v["cost"] for v in stages.values()), 6),
    }


# ------------------------------------------------------------------------------------- reports


def is_retryable(record: dict) -> bool:
    """Failed in transport (no answer was paid for): the next run sends the request again."""
    reason = record["reason"]
    return record["status"] == "failed" and (
        reason in ("timeout", "connection", "malformed_response") or reason.startswith("http_")
    )


def print_status(cfg: DistillConfig, result: RunResult, file=None) -> None:
    file = file or sys.stdout
    summary = summarize(result.records)
    print(
        f"{cfg.task}: {summary['chunks']} chunks  "
        + ", ".join(f"{k} {v}" for k, v in sorted(summary["outcome"].items())),
        file=file,
    )
    header = f"{'stage':<16} {'done':>6} {'failed':>7} {'pending':>8} {'prompt tok':>11} {'compl tok':>10} {'cost $':>10}  failed by reason"
    print(header + "\n" + "-" * len(header), file=file)
    for stage in STAGES[cfg.task]:
        row = summary["stages"].get(
            stage,
            {"done": 0, "failed": {}, "pending": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0},
        )
        failed = sum(row["failed"].values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["failed"].items()))
        print(f"{stage:<16} {row['done']:>6} {failed:>7} {row['pending']:>8} {row['prompt_tokens']:>11,} "
              f"{row['completion_tokens']:>10,} {row['cost']:>10.4f}  {reasons}", file=file)  # fmt: skip
    not_started = sum(1 for r in result.records if r["status"] == "pending" and not r["stages"])
    if not_started:
        print(f"{not_started} chunks not started", file=file)


def print_estimate(cfg: DistillConfig, result: RunResult, file=None) -> dict:
    """Dry run: calls still to send, with their estimated tokens and worst-case cost."""
    file = file or sys.stdout
    calls: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for record, job in zip(result.records, result.jobs):
        if record["status"] != "pending" and not is_retryable(record):
            continue
        for stage, prompt, completion in estimate_pending(record, job, cfg.teachers):
            row = calls[stage]
            row[0] += 1
            row[1] += prompt
            row[2] += completion
    total = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}
    header = f"{'stage':<16} {'model':<28} {'calls':>7} {'cached':>7} {'prompt tok':>11} {'max compl tok':>14} {'max cost $':>11}"
    print(f"dry run: {len(result.records)} chunks, nothing sent\n{header}\n{'-' * len(header)}", file=file)
    cached = Counter()
    for record in result.records:
        for stage, entry in record["stages"].items():
            cached[stage] += entry.get("cached", False)
    for stage in STAGES[cfg.task]:
        n, prompt, completion = calls[stage]
        teacher = cfg.teachers[stage]
        cost = cfg.prices.get(teacher.model, Price()).cost(prompt, completion)
        total["calls"] += n
        total["prompt_tokens"] += prompt
        total["completion_tokens"] += completion
        total["cost"] += cost
        print(
            f"{stage:<16} {teacher.model[-28:]:<28} {n:>7} {cached[stage]:>7} {prompt:>11,} {completion:>14,} {cost:>11.4f}",
            file=file,
        )
    print(f"{'total':<16} {'':<28} {total['calls']:>7} {sum(cached.values()):>7} {total['prompt_tokens']:>11,} "
          f"{total['completion_tokens']:>14,} {total['cost']:>11.4f}", file=file)  # fmt: skip
    print("(prompt tokens are estimated high; completions at max_tokens: an upper bound)", file=file)
    return total
