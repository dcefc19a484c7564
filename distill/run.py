"""``metachunk distill rewrite|summary|moc|status``: one driver for every teacher pipeline.

A task (:class:`Task`) supplies how to read its items, the work per item, and the summary,
status and dry-run rows of its records: rewrite and summary (:class:`metachunk.distill.pipelines.ChunkTask`,
one record per chunk) and moc (:class:`metachunk.distill.moc.MocTask`, one record per document). The driver
does the rest the same way for each: check the prompt files, run the work over the items with the
teacher pool's workers (:meth:`metachunk.teacher.TeacherPool.map`), replay against the store the
items a stop (budget, unreachable endpoint) left unstarted, write the records and the manifest,
and choose the exit status.

The answer store is the source of truth; ``OUT/TASK.jsonl`` is a view of it, rebuilt in full by
every run (answered requests come from the store, so a rerun after a crash or a parser change
costs nothing but the requests that never got an answer). ``--dry-run`` and ``status`` replay the
pipeline against the store without a network client: whatever is answered is read, and the first
unanswered request of each item is counted, with the calls after it estimated.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from metachunk.chunking.moc import DEFAULT_PLACEHOLDER, PLACEHOLDERS
from metachunk.distill.pipelines import STAGES, ChunkTask, StageRunner
from metachunk.distill.prompts import load_prompt, load_schema

from metachunk import config
from metachunk.artifacts import SCHEMA_VERSION, OutputPair, jsonl_line
from metachunk.config import option
from metachunk.store import AnswerStore
from metachunk.teacher import Price, TeacherConfig, TeacherPool, is_transport_failure, wire_body

# Each task's teacher stages; `moc` (distill/moc.py) asks one teacher to chunk raw text (MoC Table 6).
TASK_STAGES = {**STAGES, "moc": ("moc_chunk",)}


@dataclass
class MocOptions:
    """``distill moc``'s own options (distill/moc.py, MoC §3.2.1 and Appendix A.3). A block of
    :class:`DistillConfig` whose keys and flags stay flat: ``window_tokens: 512`` or
    ``moc: {window_tokens: 512}`` in a recipe, ``--window-tokens 512`` on the command line."""

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
    export_batch: Path | None = option(
        None,
        "teachers in mode: batch: write this round's requests as Batch API JSONL here (for `vllm run-batch`) "
        "instead of submitting them, and stop; rerun with --import-batch RESULTS for the next round",
    )
    import_batch: list[Path] | None = option(
        None, "store the answers of Batch API result files (vllm run-batch's output) before the run"
    )
    progress: bool = option(True, "show a progress bar")
    moc: MocOptions = config.block(
        MocOptions, "moc: windows, cleaning and samples (flat keys and flags: window_tokens, ...)", prefix=""
    )

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
            raise ValueError("window_tokens must be >= 16; sample_chars, head_chars, tail_chars >= 1")
        if not 0 <= moc.max_edit_ratio < 1:
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


# ---------------------------------------------------------------------------------------- tasks


class Task(Protocol):
    """One teacher pipeline, as the driver runs it: :class:`metachunk.distill.pipelines.ChunkTask` (rewrite,
    summary) and :class:`metachunk.distill.moc.MocTask`."""

    name: str  # the task: `distill NAME` writes OUT/NAME.jsonl and OUT/NAME.meta.json
    stages: tuple[str, ...]  # its teacher stages, each with a prompt file per language
    unit: str  # what one item, and its record, is: "chunk", "document"
    workers_per_slot: int  # items in flight per request slot of the endpoints

    def read(self) -> list:
        """The items, checked (each has a ``lang``); a bad input raises InputError."""

    async def work(self, item, runner: StageRunner) -> dict:
        """The item's record. A stage the budget refused, or (offline) not answered yet, leaves it pending."""

    def summarize(self, records: list[dict]) -> dict:
        """The records' counts: the manifest's ``summary``, before the run's own numbers."""

    def manifest(self) -> dict:
        """What the manifest holds besides the config, the prompt hashes and the summary."""

    def summary_line(self, result: RunResult, summary: dict) -> str:
        """The line printed after a run."""

    def status(self, records: list[dict]) -> list[str]:
        """``distill status``: the lines printed."""

    def entries(self, record: dict) -> list[tuple[str, dict]]:
        """``(stage, stage entry)`` for every request the record holds an answer (or error) for."""

    def pending_calls(self, record: dict, item) -> list[tuple[str, int, int, int]]:
        """Dry run: ``(stage, calls, prompt tokens, completion tokens)`` the record still needs, at worst."""


def make_task(cfg: DistillConfig) -> Task:
    if cfg.task == "moc":  # windows + chunk buffer + edit-distance cleaning (distill/moc.py)
        from metachunk.distill.moc import MocTask

        return MocTask(cfg)
    return ChunkTask(cfg)


# ------------------------------------------------------------------------------------------ run


@dataclass
class RunResult:
    task: Task
    records: Sequence[dict]  # a RecordSpool: on disk, read back in input order
    items: list  # what the records were made from (chunk jobs, documents), in the same order
    seconds: float
    sent: int
    cached: int
    waited: int = 0  # answers another process on the store was paying for when this run wanted them
    stopped: str = ""  # why the run stopped early: "budget", "unreachable", "refused", or ""
    stop_message: str = ""  # stopped by an endpoint: the one line saying why (with the provider's words)
    paid: float = 0.0  # billed to this run's requests
    spent: float = 0.0  # the whole answer store's spend when the run ended (every process)
    batch: dict | None = None  # mode: batch: rounds, batches, requests, answered, failed, expired
    bodies: dict | None = None  # dry run: each stage's first request body, as it would be sent


def run(cfg: DistillConfig, offline: bool = False) -> RunResult:
    """Run (or, offline, replay) the task's pipeline over every item; returns the records."""
    task = make_task(cfg)
    items = task.read()
    for stage in task.stages:  # fail on a broken prompt or schema file before anything is sent
        load_schema(stage)
        for lang in {item.lang for item in items}:
            load_prompt(stage, lang)
    store = AnswerStore(cfg.cache)
    try:
        if offline or all(t.mode == "online" for t in cfg.teachers.values()):
            pool = TeacherPool(cfg.teachers, cfg.prices, store, cfg.max_cost, offline=offline)
            return asyncio.run(drive(cfg, task, items, pool, cfg.progress and not offline))
        return run_batch_rounds(cfg, task, items, store)
    finally:
        store.close()


def run_batch_rounds(cfg: DistillConfig, task: Task, items: list, store: AnswerStore) -> RunResult:
    """Teachers in ``mode: batch``: drive the items against the store, submit what no stored answer
    covers as batches, wait for them, and drive again, until a round has nothing left to ask (each
    chained stage takes one round). Live batches of a killed run are waited for first."""
    from metachunk import batch

    counts = batch.BatchCounts()
    if cfg.import_batch:
        offline = TeacherPool(cfg.teachers, cfg.prices, store, offline=True)
        for path in cfg.import_batch:
            got = batch.import_results(store, offline.stages, path)
            print(f"{path}: {got['answered']} answers stored, {got['failed']} failed, {got['skipped']} already "
                  "stored", file=sys.stderr)  # fmt: skip
    while True:
        pool = TeacherPool(cfg.teachers, cfg.prices, store, cfg.max_cost)
        if not cfg.export_batch:
            batch.wait(store, pool.stages, counts, progress=cfg.progress)
        result = asyncio.run(drive(cfg, task, items, pool, cfg.progress))
        counts.rounds += 1
        counts.online_sent += result.sent
        counts.online_paid += result.paid
        # The run's figures over every round: online requests and what the batches were billed.
        result.sent, result.paid = counts.online_sent, counts.online_paid + counts.cost
        result.batch = counts.to_json()
        if cfg.export_batch:
            n = batch.export(pool.stages, cfg.export_batch)
            result.batch["exported"] = n
            print(f"{cfg.export_batch}: {n} requests for `vllm run-batch -i {cfg.export_batch} -o RESULTS.jsonl`; "
                  "then rerun with --import-batch RESULTS.jsonl", file=sys.stderr)  # fmt: skip
            return result
        if result.stopped:
            return result
        if not batch.spooled(pool.stages):
            if not batch.awaited(pool.stages):
                return result
            # Nothing to send, but another run on the store submitted some of these requests after
            # this round's wait: wait for its batch, then drive again.
            time.sleep(min(t.batch_poll_seconds for t in cfg.teachers.values()))
            continue
        submitted, refused = batch.submit(store, pool.stages, cfg.max_cost, counts)
        if submitted == 0 and refused:
            result.stopped = "budget"  # every spooled request the store could not answer was refused
            result.batch = counts.to_json()
            result.paid = counts.online_paid + counts.cost
            return result
        if submitted == 0:  # all of them are being sent by another run on the store: wait for its answers
            time.sleep(min(5.0, min(t.batch_poll_seconds for t in cfg.teachers.values())))
        batch.wait(store, pool.stages, counts, progress=cfg.progress)


class RecordSpool(MutableSequence):
    """The run's records on disk, in input order, so a run's memory does not grow with its
    records (each holds its stages' raw answers): ``spool[i] = record`` appends it to an unlinked
    temp file beside the output and remembers where; ``spool[i]`` reads it back (None until set)."""

    def __init__(self, folder: Path, n: int):
        import array
        import tempfile

        folder.mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=folder, prefix=".records-")  # gone when closed or killed
        self._offsets = array.array("q", [-1]) * n

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> dict | None:
        offset = self._offsets[i]
        if offset < 0:
            return None
        self._file.seek(offset)
        return json.loads(self._file.readline())

    def __setitem__(self, i: int, record: dict) -> None:
        self._file.seek(0, os.SEEK_END)
        self._offsets[i] = self._file.tell()
        self._file.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")

    def __delitem__(self, i):
        raise TypeError("a record spool keeps every position")

    def insert(self, i, record):
        raise TypeError("a record spool keeps every position")

    def done(self, i: int) -> bool:
        return self._offsets[i] >= 0


async def drive(cfg: DistillConfig, task: Task, items: list, pool: TeacherPool, progress: bool) -> RunResult:
    started = time.perf_counter()
    runner = StageRunner(pool.stages, cfg.parse_retries)
    done = await pool.map(
        items,
        lambda item: task.work(item, runner),
        workers=task.workers_per_slot * pool.slots,
        desc=f"distill {task.name}",
        unit=task.unit,
        progress=progress,
        results=RecordSpool(Path(cfg.out), len(items)),
    )
    # Items never started (or cut short) because the run stopped: replay them against the store,
    # sending nothing, so that the records still show every answer the store holds for them.
    records = done.results
    replay = TeacherPool(cfg.teachers, cfg.prices, pool.store, offline=True)
    replay_runner = StageRunner(replay.stages, cfg.parse_retries)
    for i in range(len(records)):
        if not records.done(i):
            record = await task.work(items[i], replay_runner)
            if record["status"] == "pending":
                record["reason"] = done.stopped
            records[i] = record
    cached = sum(t.cached for t in (*pool.stages.values(), *replay.stages.values()))
    bodies = {stage: t.first_request for stage, t in pool.stages.items() if t.first_request is not None}
    for stage in task.stages:  # waits on an earlier stage's answer: the body around a placeholder prompt
        teacher = pool.stages[stage]
        if stage not in bodies and teacher.offline:
            placeholder = [
                {"role": "user", "content": f"(the {stage} prompt, once the earlier stages have answered)"}
            ]
            body, _ = teacher.request(placeholder, "", 0, teacher.cfg.max_tokens, load_schema(stage))
            bodies[stage] = wire_body(teacher.cfg, body)
    return RunResult(task, records, items, time.perf_counter() - started, pool.sent, cached, pool.waited,
                     done.stopped, done.message, pool.budget.paid, pool.store.spent(), bodies=bodies)  # fmt: skip


def write_records(cfg: DistillConfig, result: RunResult) -> dict:
    """``OUT/TASK.jsonl`` and ``OUT/TASK.meta.json``, replaced together; returns the summary."""
    task = result.task
    summary = task.summarize(result.records)
    summary.update(
        seconds=round(result.seconds, 2),
        requests_sent=result.sent,
        answers_from_store=result.cached,
        answers_waited_for=result.waited,
        paid=round(result.paid, 6),
        store_spent=round(result.spent, 6),
        stopped=result.stopped,
    )
    if result.batch is not None:
        summary["batch"] = result.batch
    prompts = {
        f"{stage}.{lang}": load_prompt(stage, lang).sha256
        for stage in task.stages
        for lang in sorted({r["lang"] for r in result.records})
    }
    # The answer schemas of the JSON stages (one per stage, for every language).
    schemas = {stage: schema.sha256 for stage in task.stages if (schema := load_schema(stage)) is not None}
    with OutputPair(Path(cfg.out) / f"{task.name}.jsonl") as pair:
        for record in result.records:
            pair.file.write(jsonl_line(record))
        pair.commit({"schema_version": SCHEMA_VERSION, "command": f"distill {task.name}", "config": config.to_dict(cfg),
                     **task.manifest(), "prompt_sha256": prompts, "schema_sha256": schemas,
                     "summary": summary})  # fmt: skip
    return summary


def main(cfg: DistillConfig, action: str) -> int:
    """``metachunk distill TASK`` / ``distill status`` / ``--dry-run``, for every task."""
    if action == "status" or cfg.dry_run:
        result = run(cfg, offline=True)
        print_status(result) if action == "status" else print_estimate(cfg, result)
        return EXIT_OK
    result = run(cfg)
    summary = write_records(cfg, result)
    print(result.task.summary_line(result, summary), file=sys.stderr)
    return exit_status(cfg, result)


# `metachunk distill` exit statuses (also in its --help).
EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_BUDGET, EXIT_FAILURES = 0, 1, 2, 3, 4
EXIT_CODES_HELP = """exit status:
  0  every record was written and the failure rate is at most --max-failure-rate
  1  an unexpected error or an OS error (disk full, permission denied)
  2  a bad config or input file (the message names the file, line and field), or a refused key
  3  the budget: stopped before the store's spend would pass --max-cost; rerun with a higher cap
  4  failures: every record failed, more than --max-failure-rate of them did, the endpoint
     could not be reached, or it refused the requests for a reason that repeats (its message is
     printed); the records are written and a rerun retries the transport failures"""


def exit_status(cfg: DistillConfig, result: RunResult, file=None) -> int:
    """Print why a run did not go through, if it did not, and return its exit status."""
    file = file or sys.stderr
    records = result.records
    if result.stopped in ("unreachable", "refused"):
        print(f"metachunk: {result.stop_message}", file=file)
        return EXIT_FAILURES
    if result.stopped == "budget":
        print(
            f"metachunk: stopped at the budget: the store's spend is ${result.spent:.4f} against --max-cost "
            f"{cfg.max_cost} (this run paid ${result.paid:.4f}); every answer is stored. Rerun with a higher "
            "--max-cost to continue.",
            file=file,
        )
        return EXIT_BUDGET
    failed = sum(1 for r in records if r["status"] == "failed")
    if records and (failed == len(records) or failed / len(records) > cfg.max_failure_rate):
        reasons = Counter(r["reason"] or "unknown" for r in records if r["status"] == "failed")
        print(
            f"metachunk: {failed} of {len(records)} {result.task.unit}s failed ("
            + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
            + f"), more than --max-failure-rate {cfg.max_failure_rate}; they are recorded, and a rerun "
            "retries the transport failures",
            file=file,
        )
        return EXIT_FAILURES
    return EXIT_OK


# ------------------------------------------------------------------------------------- reports


def print_status(result: RunResult, file=None) -> None:
    print("\n".join(result.task.status(result.records)), file=file or sys.stdout)


def print_estimate(cfg: DistillConfig, result: RunResult, file=None) -> dict:
    """Dry run: calls still to send, with their estimated tokens and worst-case cost."""
    file = file or sys.stdout
    task = result.task
    calls: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    cached = Counter()
    unfinished = 0
    for record, item in zip(result.records, result.items):
        for stage, entry in task.entries(record):
            cached[stage] += entry.get("cached", False)
        # Pending, or failed in transport (the next run sends it again): still to send.
        if record["status"] != "pending" and not (
            record["status"] == "failed" and is_transport_failure(record["reason"])
        ):
            continue
        unfinished += 1
        for stage, n, prompt, completion in task.pending_calls(record, item):
            row = calls[stage]
            row[0] += n
            row[1] += prompt
            row[2] += completion
    total = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}
    header = f"{'stage':<16} {'model':<28} {'calls':>7} {'cached':>7} {'prompt tok':>11} {'max compl tok':>14} {'max cost $':>11}"
    print(f"dry run: {len(result.records)} {task.unit}s, {unfinished} unfinished, nothing sent", file=file)
    print(f"{header}\n{'-' * len(header)}", file=file)
    for stage in task.stages:
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
    print_request_bodies(cfg, result, file)
    return total


def print_request_bodies(cfg: DistillConfig, result: RunResult, file, cut: int = 160) -> None:
    """Per teacher, its provider and the body its first request sends (message contents cut at
    ``cut`` characters, marked), so a recipe can be checked against the provider before it pays.
    A stage whose prompt needs an earlier stage's answer shows its body around a placeholder."""
    for stage, body in (result.bodies or {}).items():
        teacher = cfg.teachers[stage]
        shown = dict(body)
        shown["messages"] = [
            {**m, "content": m["content"][:cut] + f"…[+{len(m['content']) - cut} chars]"}
            if len(m["content"]) > cut
            else m
            for m in body["messages"]
        ]
        print(
            f"\n{stage}: provider {teacher.provider or 'generic'}, model {teacher.model}, "
            f"{'streamed' if teacher.stream else 'not streamed'}, structured_output {teacher.structured_output}, "
            f"mode {teacher.mode}; request body:",
            file=file,
        )
        print(json.dumps(shown, ensure_ascii=False, indent=2), file=file)
