"""``metachunk distill rewrite|summary|moc|status``: one driver for every teacher pipeline.

A task (`Task`) supplies how to read its items, the work per item, and the summary,
status and dry-run rows of its records: rewrite and summary (`metachunk.distill.pipelines.ChunkTask`,
one record per chunk) and moc (`metachunk.distill.moc.MocTask`, one record per document). The driver
does the rest the same way for each: check the prompt files, run the work over the items with the
teacher pool's workers (`metachunk.teacher.TeacherPool.map`), replay against the store the
items a stop (budget, unreachable endpoint) left unstarted, write the records and the manifest,
and choose the exit status.

The answer store is the source of truth; ``OUT/TASK.jsonl`` is a view of it, rebuilt in full by
every run (answered requests come from the store, so a rerun after a crash or a parser change
costs nothing but the requests that never got an answer). ``--dry-run`` and ``status`` replay the
pipeline against the store without a network client: whatever is answered is read, and the first
unanswered request of each item is counted, with the calls after it estimated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from metachunk.distill.config import TASK_STAGES, DistillConfig
from metachunk.distill.moc import MocTask
from metachunk.distill.pipelines import ChunkTask, StageRunner
from metachunk.distill.prompts import load_prompt, load_schema

from metachunk import config, stopping
from metachunk.artifacts import SCHEMA_VERSION, OutputPair, append_run_log, jsonl_line
from metachunk.command import Reads, Result
from metachunk.redaction import redact
from metachunk.sources import Rejects, finish_rejects
from metachunk.store import AnswerStore
from metachunk.teacher import Price, TeacherPool, is_transport_failure, wire_body

# ---------------------------------------------------------------------------------------- tasks


class Task(Protocol):
    """One teacher pipeline, as the driver runs it: `metachunk.distill.pipelines.ChunkTask` (rewrite,
    summary) and `metachunk.distill.moc.MocTask`."""

    name: str  # the task: `distill NAME` writes OUT/NAME.jsonl and OUT/NAME.meta.json
    stages: tuple[str, ...]  # its teacher stages, each with a prompt file per language
    unit: str  # what one item, and its record, is: "chunk", "document"
    workers_per_slot: int  # items in flight per request slot of the endpoints

    def read(self, rejects: Rejects | None = None) -> list:
        """The items, checked (each has a ``lang``); a bad input row raises InputError, or with
        ``rejects`` (``--on-bad-row skip``) is handed to it and left out."""

    async def work(self, item, runner: StageRunner) -> dict:
        """The item's record. A stage the budget refused, or (offline) not answered yet, leaves it pending."""

    def summarize(self, records: list[dict]) -> dict:
        """The records' counts: the manifest's ``summary``, before the run's own numbers."""

    def manifest(self) -> dict:
        """What the manifest holds besides the config, the prompt hashes and the summary."""

    def summary_line(self, summary: dict) -> str:
        """The line printed after a run, from its summary (`write_records`)."""

    def status(self, records: list[dict]) -> list[str]:
        """``distill status``: the lines printed."""

    def entries(self, record: dict) -> list[tuple[str, dict]]:
        """``(stage, stage entry)`` for every request the record holds an answer (or error) for."""

    def pending_calls(self, record: dict, item) -> list[tuple[str, int, int, int]]:
        """Dry run: ``(stage, calls, prompt tokens, completion tokens)`` the record still needs, at worst."""


def make_task(cfg: DistillConfig) -> Task:
    if cfg.task == "moc":  # windows + chunk buffer + edit-distance cleaning (distill/moc.py)
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
    # answers another sender (a process on the store, or this run's own request) was paying for
    waited: int = 0
    stopped: str = ""  # why the run stopped early: "budget", "unreachable", "refused", or ""
    stop_message: str = ""  # stopped by an endpoint: the one line saying why (with the provider's words)
    paid: float = 0.0  # billed to this run's requests
    spent: float = 0.0  # the whole answer store's spend when the run ended (every process)
    batch: dict | None = None  # mode: batch: rounds, batches, requests, answered, failed, expired
    bodies: dict | None = None  # dry run: each stage's first request body, as it would be sent
    rejects: dict | None = None  # --on-bad-row skip: the input rows left out (sources.Rejects.write)


def run_task(cfg: DistillConfig, offline: bool = False) -> RunResult:
    """Run (or, offline, replay) the task's pipeline over every item; returns the records. Rows
    ``--on-bad-row skip`` leaves out go to ``OUT/TASK.rejects.jsonl`` (not on a replay), written
    before any request is sent."""
    task = make_task(cfg)
    rejects = cfg.bad_rows.rejects(records_path(cfg))
    if offline and rejects is not None:
        rejects = Rejects(None, cfg.bad_rows.max_bad_rows)
    items = task.read(rejects)
    rejected = None if offline else finish_rejects(rejects, f"distill {cfg.task}")
    for stage in task.stages:  # fail on a broken prompt or schema file before anything is sent
        load_schema(stage)
        for lang in {item.lang for item in items}:
            load_prompt(stage, lang)
    store = AnswerStore(cfg.cache, create=not offline)  # a replay writes nothing
    try:
        if offline or all(t.mode == "online" for t in cfg.teachers.values()):
            pool = TeacherPool(cfg.teachers, cfg.prices, store, cfg.max_cost, offline=offline)
            spool = None if offline else Path(cfg.out)  # a replay makes no output folder
            result = stopping.run(drive(cfg, task, items, pool, cfg.progress and not offline, spool))
        else:
            result = run_batch_rounds(cfg, task, items, store)
    finally:
        store.close()
    result.rejects = rejected
    return result


def records_path(cfg: DistillConfig) -> Path:
    """``OUT/TASK.jsonl``: the task's records (its ``.meta.json`` and ``.rejects.jsonl`` beside it)."""
    return Path(cfg.out) / f"{cfg.task}.jsonl"


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
            for failure in got["failures"]:  # sent again by this run or the next
                print(f"  {path}: {failure}", file=sys.stderr)
        if cfg.max_cost is not None and store.spent() > cfg.max_cost:  # paid already, wherever they ran
            print(f"distill: the imported answers bring the store's spend to ${store.spent():.4f}, past --max-cost "
                  f"{cfg.max_cost}: nothing more is sent", file=sys.stderr)  # fmt: skip
    while True:
        pool = TeacherPool(cfg.teachers, cfg.prices, store, cfg.max_cost)
        if not cfg.export_batch:
            batch.wait(store, pool.stages, counts, progress=cfg.progress)
        result = stopping.run(drive(cfg, task, items, pool, cfg.progress, Path(cfg.out)))
        counts.rounds += 1
        counts.online_sent += result.sent
        counts.online_paid += result.paid
        # The run's figures over every round: online requests and what the batches were billed.
        result.sent, result.paid = counts.online_sent, counts.online_paid + counts.cost
        result.batch = counts.to_json()
        if cfg.export_batch:
            capped = cfg.max_cost is not None and math.isfinite(cfg.max_cost)
            room = max(0.0, cfg.max_cost - store.spent()) if capped else None
            n, left = batch.export(pool.stages, cfg.export_batch, room)
            result.batch["exported"] = n
            print(f"{cfg.export_batch}: {n} requests for `vllm run-batch -i {cfg.export_batch} -o RESULTS.jsonl`; "
                  "then rerun with --import-batch RESULTS.jsonl", file=sys.stderr)  # fmt: skip
            if left:
                result.batch["left_out_by_max_cost"] = left
                print(f"{cfg.export_batch}: {left} more requests left out: their worst cases pass --max-cost "
                      f"{cfg.max_cost} (${room:.4f} left); export them once these are imported", file=sys.stderr)  # fmt: skip
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

    def __init__(self, folder: Path | None, n: int):
        """``folder``: None puts the spool in the system's temp folder (a replay, which writes no output)."""
        import array
        import tempfile

        if folder is not None:
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


async def drive(
    cfg: DistillConfig, task: Task, items: list, pool: TeacherPool, progress: bool, spool: Path | None
) -> RunResult:
    """The items through the task's stages against ``pool``; the records are spooled in ``spool``
    (`RecordSpool`)."""
    started = time.perf_counter()
    runner = StageRunner(pool.stages, cfg.parse_retries)
    done = await pool.map(
        items,
        lambda item: task.work(item, runner),
        workers=task.workers_per_slot * pool.slots,
        desc=f"distill {task.name}",
        unit=task.unit,
        progress=progress,
        results=RecordSpool(spool, len(items)),
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
    """``OUT/TASK.jsonl`` and ``OUT/TASK.meta.json``, replaced together, then one line for this
    attempt in ``OUT/runs.jsonl``; returns the summary (both parts).

    The meta file's summary says what the records are (outcomes, usage and cost in them, rejects),
    so a rerun answered from the store writes the same bytes. How this attempt went (seconds,
    requests sent, answers from the store, paid, why it stopped, batch rounds) is the run log's."""
    task = result.task
    made = task.summarize(result.records)
    if result.rejects is not None:
        made["rejects"] = result.rejects
    attempt = {
        "seconds": round(result.seconds, 2),
        "requests_sent": result.sent,
        "answers_from_store": result.cached,
        "answers_waited_for": result.waited,
        "paid": round(result.paid, 6),
        "store_spent": round(result.spent, 6),
        "stopped": result.stopped,
    }
    if result.batch is not None:
        attempt["batch"] = result.batch
    prompts = {
        f"{stage}.{lang}": load_prompt(stage, lang).sha256
        for stage in task.stages
        for lang in sorted({r["lang"] for r in result.records})
    }
    # The answer schemas of the JSON stages (one per stage, for every language).
    schemas = {stage: schema.sha256 for stage in task.stages if (schema := load_schema(stage)) is not None}
    manifest = {"schema_version": SCHEMA_VERSION, "command": f"distill {task.name}", "config": config.to_dict(cfg),
                **task.manifest(), "prompt_sha256": prompts, "schema_sha256": schemas, "summary": made}  # fmt: skip
    with OutputPair(records_path(cfg)) as pair:
        for record in result.records:
            pair.file.write(jsonl_line(record))
        # A stop waits for the run-log line too: a paid attempt's records had been left with no line
        # saying what it paid.
        with stopping.deferred():
            pair.commit(manifest)
            append_run_log(cfg.out, {"command": f"distill {task.name}", **config.runtime(cfg), **attempt})
    return {**made, **attempt}


# ---- the command: `metachunk distill TASK` / `distill status` / `--dry-run` ------------------------

CONFIG = DistillConfig
# What a run reports to `metachunk run` (its stage summary, the regen manifest, a dataset card's "what it
# made"): the records' counts and the cost in them. What this attempt sent and paid is its summary line's
# and the run log's: on a card, "paid 0" would describe the rerun, not the rows.
SUMMARY_KEYS = ("chunks", "documents", "outcome", "cost", "json_answers")


def run(cfg: DistillConfig) -> Result:
    """Run the task and write its records (``--dry-run``: `estimate`)."""
    if cfg.dry_run:
        return estimate(cfg)
    result = run_task(cfg)
    summary = write_records(cfg, result)
    print(result.task.summary_line(summary), file=sys.stderr)
    counts = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
    done = Result.with_rejects(counts, result.rejects, exit_status(cfg, result))
    return dataclasses.replace(done, retry=unfinished(result))


def unfinished(result: RunResult) -> bool:
    """Whether a rerun would send something: a record pending (a stop, the budget) or failed in transport."""
    return bool(result.stopped) or any(
        r["status"] == "pending" or (r["status"] == "failed" and is_transport_failure(r["reason"]))
        for r in result.records
    )


def estimate(cfg: DistillConfig) -> Result:
    """The dry run: replayed against the store, nothing sent; prints the table, returns its totals."""
    result = run_task(cfg, offline=True)
    return Result(EXIT_OK, estimate=print_estimate(cfg, result))


def status(cfg: DistillConfig) -> Result:
    """``distill status``: done / failed / pending per stage, from the store."""
    print_status(run_task(cfg, offline=True))
    return Result(EXIT_OK)


def inputs(cfg: DistillConfig) -> Reads:
    from metachunk.prompts import prompt_files

    stages = TASK_STAGES[cfg.task]
    models = [cfg.moc.tokenizer] if cfg.task == "moc" else []
    if cfg.context == "related" and cfg.task != "moc":
        models.append(cfg.embedder)
    return Reads.of(paths=[cfg.chunks if cfg.task != "moc" else None, cfg.documents, *(cfg.import_batch or [])],
                    models=models, prompts=prompt_files("metachunk.distill", *(f"{s}." for s in stages)))  # fmt: skip


def teachers(cfg: DistillConfig) -> dict[str, str]:
    """Each stage's teacher model name (never its URL or key)."""
    return {stage: str(t.model) for stage, t in cfg.teachers.items()}


def served(config: dict, teacher) -> dict:
    """The recipe with every stage's teacher block pointed at ``teacher`` (a served local teacher)."""
    from metachunk.teacher import point_at

    return {
        **config,
        "teachers": {k: point_at(b, teacher) for k, b in (config.get("teachers") or {}).items()},
    }


def outputs(cfg: DistillConfig) -> list:
    """The task's records and rejects (the run folder is shared with the other tasks and the answer
    store)."""
    return [records_path(cfg), *cfg.bad_rows.outputs(records_path(cfg))]


# `metachunk distill` exit statuses, as its --help lists them (EPILOG); 1 and 2 are the CLI's.
EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_BUDGET, EXIT_FAILURES = 0, 1, 2, 3, 4
EPILOG = """exit status:
  0  every record was written and the failure rate is at most --max-failure-rate
  1  an unexpected error or an OS error (disk full, permission denied)
  2  a bad config or input file (the message names the file, line and field), or a refused key
  3  the budget: stopped before the store's spend would pass --max-cost; rerun with a higher cap
  4  failures: every record failed, more than --max-failure-rate of them did, the endpoint
     could not be reached, or it refused the requests for a reason that repeats (its message is
     printed); the records are written and a rerun retries the transport failures
  6  done, leaving out the input rows --on-bad-row skip rejected (in OUT/TASK.rejects.jsonl)"""


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
            # Nothing is sent: an answer here was stored, and counts unless the next run sends it again.
            cached[stage] += entry["status"] != "pending" and not (
                entry["status"] == "failed" and is_transport_failure(entry["reason"])
            )
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
    print("(prompts at 1 token per byte, or the teacher's tokenizer, and completions at max_tokens, the bound "
          "a live run reserves; a later stage's prompt counts the earlier answers at their max_tokens)",
          file=file)  # fmt: skip
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
        print(redact(json.dumps(shown, ensure_ascii=False, indent=2)), file=file)  # extra_body may hold a key
