"""The two distillation pipelines, one chunk at a time (Meta-Chunking §3.2, Appendix C).

``rewrite``: reflection (what the chunk lacks) -> refinement (score and filter the items, JSON)
-> completion (fuse the kept items into the chunk). ``summary``: a global supplementary summary
and a local summary (concurrently) -> one fused, enhanced summary sentence.

Each function takes a `ChunkJob` and returns the chunk's output record. Parsing lives here
and reads what the teacher client returns, which on a rerun comes from the answer store: editing
a parser re-reads stored answers and sends nothing. A stage whose answer is empty or cannot be
parsed is asked again (``attempt`` + 1, a new cached request) up to ``parse_retries`` times,
then the record fails with that stage's raw text kept. A stage whose answer is JSON
(``refinement``) has an answer schema beside its prompts: its requests carry it as the teacher's
``structured_output`` says, and each answer is read against it (`metachunk.structured.read_answer`:
valid by the schema, repaired, or unparseable, counted per stage in the summary and the status table).

`ChunkTask` is both pipelines as the driver (`metachunk.distill.run`) runs them: the chunks
file read and checked against its documents (`read_jobs`, with each chunk's context), the
work per chunk, and the summary, status and dry-run rows of the records.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.students import CONTEXT_SEPARATOR, related_chunks, window_span
from metachunk.distill.config import STAGES, DistillConfig
from metachunk.distill.prompts import load_prompt, load_schema

from metachunk.artifacts import SCHEMA_VERSION, InputError
from metachunk.sources import Rejects, read_documents, read_records, refuse_or_skip
from metachunk.structured import OUTCOMES, json_in_text, read_answer
from metachunk.teacher import Answer, BudgetExceeded, Teacher, TeacherConfig, prompt_bytes, template_tokens

NOTHING_MISSING = {"none", "无", "无。", "none."}


@dataclass(frozen=True, slots=True)  # slots: a run holds one per chunk (20K at the paper's scale)
class ChunkJob:
    """One chunk to distil. Its text and its context window are read off its document when asked
    for: the document is one string its chunks share, where a copy of the window per chunk made a
    run's memory grow as chunks x ``max_context_chars`` (bench/distill_jobs_memory.py)."""

    doc_id: str
    index: int  # position of the chunk in its document
    start: int
    end: int
    lang: str
    document: str  # the whole document's text
    context_spans: tuple[tuple[int, int], ...] = ()  # where the context comes from in the document
    related: str | None = None  # the context, when it is the chunk's most related chunks (joined)

    @property
    def text(self) -> str:
        return self.document[self.start : self.end]

    @property
    def context(self) -> str:
        """The whole document (bounded: a window around the chunk) or its most related chunks."""
        if self.related is not None:
            return self.related
        left, right = self.context_spans[0]
        return self.document[left:right]


@dataclass(frozen=True)
class Item:
    missing: str
    supplement: str
    score: float

    def to_json(self) -> dict:
        return {"missing": self.missing, "supplement": self.supplement, "score": self.score}


class Pending(Exception):
    """A stage has no answer yet (dry run, status, or the budget stopped sending)."""

    def __init__(self, stage: str, answer: Answer | None, reason: str):
        self.stage, self.answer, self.reason = stage, answer, reason


class StageFailed(Exception):
    def __init__(self, stage: str, reason: str):
        self.stage, self.reason = stage, reason


def parse_items(text: str) -> list[Item] | None:
    """Refinement's ``{"items": [{missing, supplement, score}, ...]}``; None when it is not one.

    The stage's lenient reader (its schema, ``refinement.schema.json``, is checked first): tolerates
    a code fence and prose around the JSON, and a bare array of items (a model that skipped the
    object around it). Elements missing a field or with a score that is not a number are dropped;
    an array with elements but none usable is off-format.
    """
    data = json_in_text(text)
    if isinstance(data, dict):
        data = data.get("items")
    if not isinstance(data, list):
        return None
    items = []
    for element in data:
        if not isinstance(element, dict):
            continue
        missing, supplement, score = element.get("missing"), element.get("supplement"), element.get("score")
        try:
            score = float(score)
        except (TypeError, ValueError):
            continue
        if isinstance(missing, str) and isinstance(supplement, str) and supplement.strip():
            items.append(Item(missing.strip(), supplement.strip(), score))
    if data and not items:
        return None
    return items


def format_items(items: list[Item], lang: str) -> str:
    """Completion's ``{items}``, in the same shape the reflection prompt asks for."""
    if lang == "zh":
        return "\n".join(f"{i}. 缺失：{x.missing}／补充：{x.supplement}" for i, x in enumerate(items, 1))
    return "\n".join(
        f"{i}. missing: {x.missing} / supplement: {x.supplement}" for i, x in enumerate(items, 1)
    )


class StageRunner:
    """Asks one stage's teacher, retrying empty or unparseable answers, and records every
    attempt's answer in the stage's entry."""

    def __init__(self, teachers: dict[str, Teacher], parse_retries: int):
        self.teachers, self.parse_retries = teachers, parse_retries

    async def ask(self, record: dict, stage: str, lang: str, parse=None, **values: str):
        """The parsed value (the clean text when ``parse`` is None), recorded in the record's entry
        for the stage, ``record["stages"][stage]``. Raises Pending/StageFailed."""
        entry = record["stages"][stage] = {}
        return await self.ask_into(entry, stage, lang, parse, **values)

    async def ask_into(self, entry: dict, stage: str, lang: str, parse=None, **values: str):
        """`ask`, recording into ``entry`` (MoC keeps one entry per window of a record)."""
        prompt, schema, teacher = load_prompt(stage, lang), load_schema(stage), self.teachers[stage]
        messages = prompt.messages(**values)
        entry.update(prompt_sha256=prompt.sha256, attempts=0)
        if schema is not None:
            entry.update(schema_sha256=schema.sha256, json_outcomes=[])  # one outcome per answer read
        for attempt in range(self.parse_retries + 1):
            try:
                answer = await teacher.complete(messages, prompt.sha256, attempt, schema)
            except BudgetExceeded:  # the entry must still read as a stage entry (status, usage, cost)
                entry.setdefault("usage", {"prompt_tokens": 0, "completion_tokens": 0})
                entry.setdefault("cost", 0.0)
                entry.update(status="pending", reason="budget")
                raise Pending(stage, None, "budget") from None
            previous = entry.get("spent", {"prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0})
            entry.update(answer.to_record(), attempts=attempt + 1)
            entry["spent"] = {  # every request this stage made: parse retries and length retries
                "prompt_tokens": previous["prompt_tokens"] + answer.spent[0],
                "completion_tokens": previous["completion_tokens"] + answer.spent[1],
                "cost": round(previous["cost"] + answer.spent[2], 8),
            }
            if answer.status == "pending":
                raise Pending(stage, answer, "not sent")
            if not answer.ok:
                raise StageFailed(stage, answer.reason)
            if not answer.text.strip():
                entry["reason"] = "empty"
                if schema is not None:
                    entry["json_outcomes"].append("unparseable")
                continue
            if parse is None:
                return answer.text
            if schema is None:
                value = parse(answer.text)
            else:
                repair = teacher.cfg.structured_output == "none"  # nothing asked of the endpoint
                value, outcome = read_answer(answer.text, schema, parse, repair)
                entry["json_outcomes"].append(outcome)
            if value is not None:
                return value
            entry["reason"] = "unparseable"
        entry["status"] = "failed"
        raise StageFailed(stage, entry["reason"])


def new_record(task: str, job: ChunkJob) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "task": task,
        "doc_id": job.doc_id,
        "chunk_index": job.index,
        "start": job.start,
        "end": job.end,
        "text": job.text,
        "lang": job.lang,
        "context_spans": [list(span) for span in job.context_spans],  # rebuilds the context (SFT prompts)
        "status": "pending",
        "reason": "",
        "output": None,
        "stages": {},
    }


async def rewrite(job: ChunkJob, runner: StageRunner, threshold: float) -> dict:
    record = new_record("rewrite", job)
    values = {"context": job.context, "chunk": job.text}
    with _outcome(record):
        reflection = await runner.ask(record, "reflection", job.lang, **values)
        if reflection.strip().lower() in NOTHING_MISSING:
            record.update(status="complete_as_is", output=job.text)
            return record
        items = await runner.ask(
            record, "refinement", job.lang, parse=parse_items, reflection=reflection, **values
        )
        kept = [x for x in items if x.score >= threshold]
        record["stages"]["refinement"].update(
            items=[x.to_json() for x in items], kept=[x.to_json() for x in kept], threshold=threshold
        )
        if not kept:  # nothing worth adding: a valid sample whose target is the chunk itself
            record.update(status="complete_as_is", output=job.text)
            return record
        rewritten = await runner.ask(
            record, "completion", job.lang, items=format_items(kept, job.lang), **values
        )
        record.update(status="ok", output=rewritten)
    return record


async def summary(job: ChunkJob, runner: StageRunner) -> dict:
    record = new_record("summary", job)
    with _outcome(record):
        global_task = runner.ask(record, "summary_global", job.lang, context=job.context, chunk=job.text)
        local_task = runner.ask(record, "summary_local", job.lang, chunk=job.text)
        results = await asyncio.gather(global_task, local_task, return_exceptions=True)
        # Both answers are recorded; the record reports the first stage's problem, but an error that
        # is no stage outcome (an unreachable endpoint) stops the run whichever stage met it.
        problems = sorted(
            (r for r in results if isinstance(r, BaseException)),
            key=lambda e: isinstance(e, (Pending, StageFailed)),
        )
        if problems:
            raise problems[0]
        global_summary, local_summary = results
        fused = await runner.ask(
            record,
            "summary_fuse",
            job.lang,
            chunk=job.text,
            global_summary=global_summary,
            local_summary=local_summary,
        )
        record.update(status="ok", output=fused)
    return record


class _outcome:
    """Turn Pending/StageFailed into the record's status instead of an exception."""

    def __init__(self, record: dict):
        self.record = record

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, Pending):
            self.record.update(status="pending", reason=exc.reason, stage=exc.stage)
            return True
        if isinstance(exc, StageFailed):
            self.record.update(status="failed", reason=exc.reason, stage=exc.stage)
            return True
        return False


def estimate_pending(
    record: dict, job: ChunkJob, teachers: dict[str, TeacherConfig]
) -> list[tuple[str, int, int]]:
    """``(stage, prompt_tokens, completion_tokens)`` for every call a pending record still needs:
    the pending stage's own bound (what its claim reserved), then each later stage at the same
    bound, 1 token per UTF-8 byte of its prompt file, context and chunk (`prompt_bytes`), with the
    earlier answers at their ``max_tokens``. It had counted bytes / 3 and 400 tokens for the
    instructions: a completion prompt measured 2,026 bytes against 641 estimated tokens."""
    stages = STAGES[record["task"]]
    body = len(job.context.encode("utf-8")) + len(job.text.encode("utf-8"))
    calls = []
    for stage in stages:
        entry = record["stages"].get(stage, {})
        if entry.get("status") == "ok":
            continue
        if "estimate" in entry:
            prompt = entry["estimate"]["prompt_tokens"]
        else:
            template = load_prompt(stage, job.lang)
            messages = [
                {"role": "system", "content": template.system},
                {"role": "user", "content": template.user},
            ]
            earlier = sum(teachers[s].max_tokens for s in stages[: stages.index(stage)])
            prompt = prompt_bytes(messages) + template_tokens(messages) + body + earlier
        calls.append((stage, prompt, teachers[stage].max_tokens))
    return calls


# ---------------------------------------------------------------------------------------- inputs


def read_jobs(cfg: DistillConfig, rejects: Rejects | None = None) -> list[ChunkJob]:
    """Chunks to distil, checked against their documents; the context of each is built here. A
    bad record (or document row) is an error, or with ``rejects`` (``--on-bad-row skip``) left out
    whole: none of its chunks is distilled."""
    from metachunk.chunking.sentences import detect_lang

    docs = {d.id: d.text for d in read_documents(cfg.documents, rejects=rejects,
                                                 max_row_bytes=cfg.bad_rows.max_row_bytes)}  # fmt: skip
    jobs, related = [], []
    first_line: dict[str, int] = {}  # each document's record: a second would distil its chunks twice
    for number, raw, record in read_records(cfg.chunks, rejects, cfg.bad_rows.max_row_bytes):
        try:
            doc_id, text, chunks, selected = _chunks_record(cfg, docs, record, number)
            if first_line.setdefault(doc_id, number) != number:
                raise InputError(cfg.chunks, f"field 'id': document {doc_id!r} has a record already, at line "
                                 f"{first_line[doc_id]}", number)  # fmt: skip
        except InputError as e:
            refuse_or_skip(rejects, e, raw)
            continue
        lang = detect_lang(text) if cfg.lang == "auto" else cfg.lang
        for i in selected:
            c = chunks[i]
            left, right = window_span(len(text), c["start"], c["end"], cfg.max_context_chars)
            jobs.append(ChunkJob(doc_id, i, c["start"], c["end"], lang, text, ((left, right),)))
            if cfg.context == "related":  # the chunks are kept only to find each one's related ones
                related.append(chunks)
            if cfg.limit is not None and len(jobs) >= cfg.limit:
                break
        if cfg.limit is not None and len(jobs) >= cfg.limit:
            break
    if cfg.context == "related":
        jobs = with_related_context(jobs, related, cfg)
    return jobs


def _chunks_record(cfg: DistillConfig, docs: dict[str, str], record: dict, number: int):
    """``(doc_id, text, chunks, selected)`` of one chunks record, every chunk checked against its
    document (related context reads them all, not only the selected ones)."""
    path = Path(cfg.chunks)
    try:
        doc_id, chunks = str(record["id"]), record["chunks"]
    except (KeyError, TypeError) as e:
        raise InputError(path, f"expected a chunks record with 'id' and 'chunks' ({e})", number) from None
    if doc_id not in docs:
        raise InputError(path, f"document {doc_id!r} is not in {cfg.documents}", number)
    text = docs[doc_id]
    if not isinstance(chunks, list):
        raise InputError(path, "'chunks' must be a list of {text, start, end} objects", number)
    for i, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise InputError(path, f"chunks[{i}] must be an object with 'text', 'start', 'end'", number)
        for key in ("text", "start", "end"):
            if key not in c:
                raise InputError(path, f"chunks[{i}]: missing field {key!r}", number)
        if not isinstance(c["text"], str):
            raise InputError(path, f"chunks[{i}]: 'text' must be a string", number)
        for key in ("start", "end"):
            if isinstance(c[key], bool) or not isinstance(c[key], int):
                raise InputError(path, f"chunks[{i}]: {key!r} must be an integer, got {c[key]!r}", number)
        if not 0 <= c["start"] <= c["end"] <= len(text):
            raise InputError(
                path, f"chunks[{i}]: {c['start']}:{c['end']} is outside the document (0:{len(text)})", number
            )
        if text[c["start"] : c["end"]] != c["text"]:
            raise InputError(
                path, f"chunks[{i}]: text differs from the document at {c['start']}:{c['end']}", number
            )
    selected = record.get("selected", list(range(len(chunks))))
    if not isinstance(selected, list):
        raise InputError(path, "'selected' must be a list of chunk indices", number)
    for i in selected:
        # A negative index would silently pick a chunk from the end; a bool is not an index.
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(chunks):
            valid = f"0-{len(chunks) - 1}" if chunks else "the record has no chunks"
            raise InputError(path, f"'selected': {i!r} is not a chunk index ({valid})", number)
    if len(set(selected)) < len(
        selected
    ):  # one chunk twice: two records of it, its teacher cost counted twice
        twice = sorted({i for i in selected if selected.count(i) > 1})
        raise InputError(path, f"'selected' names chunk {twice[0]} more than once", number)
    return doc_id, text, chunks, selected


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
        out.append(
            ChunkJob(job.doc_id, job.index, job.start, job.end, job.lang, job.document, spans, context)
        )
    return out


def json_answers(entries) -> dict[str, dict[str, int]]:
    """``{stage: {"valid": n, "repaired": n, "unparseable": n}}`` over ``(stage, entry)`` pairs: the
    answers of each JSON stage by outcome (every answer read, parse retries included)."""
    counts: dict[str, dict[str, int]] = {}
    for stage, entry in entries:
        if "json_outcomes" in entry:
            row = counts.setdefault(stage, dict.fromkeys(OUTCOMES, 0))
            for outcome in entry["json_outcomes"]:
                row[outcome] += 1
    return counts


def json_line(counts: dict[str, dict[str, int]]) -> str:
    """``"refinement JSON: valid 3, repaired 1, unparseable 0"``, one clause per JSON stage."""
    return "; ".join(
        f"{stage} JSON: " + ", ".join(f"{k} {row[k]}" for k in OUTCOMES) for stage, row in counts.items()
    )


def summarize(records: list[dict]) -> dict:
    """Per-record outcome counts and, per stage, done / failed by reason / pending plus usage
    (and, for a JSON stage, its answers by outcome: ``json_answers``)."""
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
        "json_answers": json_answers((name, entry) for r in records for name, entry in r["stages"].items()),
    }


# ------------------------------------------------------------------------------------- the task


def tally(counts: dict, skip: tuple[str, ...] = ()) -> str:
    """``"failed 2, ok 7"``: a count per key, in key order, for the one-line reports."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in skip)


class ChunkTask:
    """``distill rewrite|summary`` as the driver (`metachunk.distill.run`) runs it: one record per chunk
    of a chunks file. A chunk's stages are a chain, one request at a time, so the driver keeps two
    chunks in flight per request slot."""

    unit = "chunk"
    workers_per_slot = 2

    def __init__(self, cfg: DistillConfig):
        self.cfg, self.name, self.stages = cfg, cfg.task, STAGES[cfg.task]

    def read(self, rejects: Rejects | None = None) -> list[ChunkJob]:
        return read_jobs(self.cfg, rejects)

    async def work(self, job: ChunkJob, runner: StageRunner) -> dict:
        if self.name == "rewrite":
            return await rewrite(job, runner, self.cfg.threshold)
        return await summary(job, runner)

    def summarize(self, records: list[dict]) -> dict:
        return summarize(records)

    def manifest(self) -> dict:
        return {}

    def summary_line(self, summary: dict) -> str:
        outcome = tally(summary["outcome"])
        waited = summary["answers_waited_for"]
        waited = f" ({waited} waited for: the same request was in flight)" if waited else ""
        answers = f"; {json_line(summary['json_answers'])}" if summary["json_answers"] else ""
        return (
            f"{self.cfg.out}/{self.name}.jsonl: {summary['chunks']} chunks ({outcome}); {summary['requests_sent']} "
            f"requests sent, {summary['answers_from_store']} answers from the store{waited}; ${summary['paid']:.4f} paid "
            f"by this run, ${summary['cost']:.4f} in the records{answers}; {summary['seconds']:.1f}s"
        )

    def status(self, records: list[dict]) -> list[str]:
        s = summarize(records)
        outcome = tally(s["outcome"])
        # valid / repaired / unparsed: a JSON stage's answers by outcome ("-" for a stage answering text)
        header = f"{'stage':<16} {'done':>6} {'failed':>7} {'pending':>8} {'prompt tok':>11} {'compl tok':>10} {'cost $':>10} {'valid':>6} {'repaired':>8} {'unparsed':>8}  failed by reason"
        lines = [f"{self.name}: {s['chunks']} chunks  {outcome}", header, "-" * len(header)]
        for stage in self.stages:
            row = s["stages"].get(
                stage,
                {
                    "done": 0,
                    "failed": {},
                    "pending": 0,
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "cost": 0.0,
                },
            )
            failed = sum(row["failed"].values())
            reasons = tally(row["failed"])
            if load_schema(stage) is None:
                valid = repaired = unparsed = "-"
            else:
                answers = s["json_answers"].get(stage, {})
                valid, repaired, unparsed = (str(answers.get(k, 0)) for k in OUTCOMES)
            lines.append(f"{stage:<16} {row['done']:>6} {failed:>7} {row['pending']:>8} {row['prompt_tokens']:>11,} "
                         f"{row['completion_tokens']:>10,} {row['cost']:>10.4f} {valid:>6} {repaired:>8} "
                         f"{unparsed:>8}  {reasons}")  # fmt: skip
        not_started = sum(1 for r in records if r["status"] == "pending" and not r["stages"])
        if not_started:
            lines.append(f"{not_started} chunks not started")
        return lines

    def entries(self, record: dict) -> list[tuple[str, dict]]:
        return list(record["stages"].items())

    def pending_calls(self, record: dict, job: ChunkJob) -> list[tuple[str, int, int, int]]:
        calls = estimate_pending(record, job, self.cfg.teachers)
        return [(stage, 1, prompt, completion) for stage, prompt, completion in calls]
