"""The two distillation pipelines, one chunk at a time (Meta-Chunking §3.2, Appendix C).

``rewrite``: reflection (what the chunk lacks) -> refinement (score and filter the items, JSON)
-> completion (fuse the kept items into the chunk). ``summary``: a global supplementary summary
and a local summary (concurrently) -> one fused, enhanced summary sentence.

Each function takes a :class:`ChunkJob` and returns the chunk's output record. Parsing lives here
and reads what the teacher client returns, which on a rerun comes from the answer store: editing
a parser re-reads stored answers and sends nothing. A stage whose answer is empty or cannot be
parsed is asked again (``attempt`` + 1, a new cached request) up to ``parse_retries`` times,
then the record fails with that stage's raw text kept.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

from distill.prompts import load_prompt
from metachunk.artifacts import SCHEMA_VERSION
from metachunk.teacher import Answer, BudgetExceeded, Teacher, TeacherConfig, estimate_tokens

STAGES = {
    "rewrite": ("reflection", "refinement", "completion"),
    "summary": ("summary_global", "summary_local", "summary_fuse"),
}
NOTHING_MISSING = {"none", "无", "无。", "none."}


@dataclass(frozen=True)
class ChunkJob:
    doc_id: str
    index: int  # position of the chunk in its document
    start: int
    end: int
    text: str
    lang: str
    context: str  # the whole document (bounded) or the chunk's most related chunks
    context_spans: tuple[tuple[int, int], ...] = ()  # where the context comes from in the document


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


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def parse_items(text: str) -> list[Item] | None:
    """Refinement's JSON array of ``{missing, supplement, score}``; None when it is not one.

    Tolerates a code fence and prose around the array. Elements missing a field or with a score
    that is not a number are dropped; an array with elements but none usable is off-format.
    """
    text = _FENCE.sub("", text.strip())
    first, last = text.find("["), text.rfind("]")
    if first < 0 or last < first:
        return None
    try:
        data = json.loads(text[first : last + 1])
    except json.JSONDecodeError:
        return None
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
    attempt's answer under the stage's name."""

    def __init__(self, teachers: dict[str, Teacher], parse_retries: int):
        self.teachers, self.parse_retries = teachers, parse_retries

    async def ask(self, record: dict, stage: str, lang: str, parse=None, **values: str):
        """The parsed value (the clean text when ``parse`` is None). Raises Pending/StageFailed."""
        prompt = load_prompt(stage, lang)
        messages = prompt.messages(**values)
        entry = record["stages"][stage] = {"prompt_sha256": prompt.sha256, "attempts": 0}
        for attempt in range(self.parse_retries + 1):
            try:
                answer = await self.teachers[stage].complete(messages, prompt.sha256, attempt)
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
                continue
            if parse is None:
                return answer.text
            value = parse(answer.text)
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
        for result in results:  # report the first stage's problem; both answers are recorded
            if isinstance(result, BaseException):
                raise result
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
    the pending stage's own estimate, then each later stage with the earlier answers counted at
    their ``max_tokens`` (an upper bound)."""
    stages = STAGES[record["task"]]
    body = estimate_tokens(job.context) + estimate_tokens(job.text) + 400  # + the instructions
    calls = []
    for stage in stages:
        entry = record["stages"].get(stage, {})
        if entry.get("status") == "ok":
            continue
        if "estimate" in entry:
            prompt = entry["estimate"]["prompt_tokens"]
        else:
            prompt = body + sum(teachers[s].max_tokens for s in stages[: stages.index(stage)])
        calls.append((stage, prompt, teachers[stage].max_tokens))
    return calls
