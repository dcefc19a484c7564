"""The row makers of ``metachunk data build-sft``: what each task turns a distilled record into.

The shared builder (`metachunk.distill.sft`) reads the records, checks contamination, drops duplicates
and over-long rows, splits, writes the shards and the card. A row maker knows only its task: how
to read one record, which rows it gives (with the reason the task drops one, if any), the row's
prompt and metadata columns, and what the task's card says. One class per kind of record:

``rewrite`` / ``summary`` (`TextRows`, records of ``distill rewrite|summary``): one row per
record. The student does not learn the teacher's three stages. It learns to go from chunk plus
context straight to the final answer (Meta-Chunking §3.2, trained with the loss of Eq. 3 on the
completion), with one versioned student instruction per task and language
(``chunking/prompts/student_{task}.{lang}.txt``). Its context is the one the teacher saw, rebuilt
from the record's ``context_spans``. The prompt is built by `metachunk.chunking.students.student_messages`,
the function ``metachunk chunk --rewrite/--summarize`` builds the inference prompt with. The
task's own filters, before the shared ones:

1. ``failed_or_empty``: the record did not end ok / complete_as_is, or its output is empty.
2. ``refusal_or_off_format``: a refusal, a preface ("Here is…"), leaked stage markup (``<think>``,
   "missing:", JSON items), or a "summary" that is not a short summary.
3. ``lost_content`` (rewrite): under ``min_overlap`` of the chunk's words (en) or character
   bigrams (zh) survive in the rewrite.

``moc-router`` / ``moc-expert`` (`MocRows`, records of ``distill moc``): one row per sample
of whole teacher chunks, with the prompts of `metachunk.chunking.moc` (the ones ``chunk --method moc``
sends at inference). ``moc-router``: one dataset at OUT; completion = the label token.
``moc-expert``: one dataset per granularity label in ``granularity`` (default all four) at
``OUT-k`` with the card ``NAME-k``; completion = the JSON list of the sample's
``head+placeholder+tail`` rules. Its own filters: ``failed_or_empty`` (a record that did not
finish or gave no sample: counted once per record) and ``unrecoverable`` (expert: a sample whose
rules do not recover its chunk starts).

Rows are TRL's conversational prompt–completion format: ``prompt`` = [system, user] messages,
``completion`` = [assistant] message, plus the metadata columns of `features` /
`moc_features`.
"""

from __future__ import annotations

import json
import re
from collections import Counter, namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from metachunk.chunking.moc import (
    ROUTER_LABELS,
    check_placeholder,
    expert_messages,
    granularity_label,
    load_moc_prompt,
    router_messages,
)
from metachunk.chunking.students import load_student_prompt, student_messages, window_span
from metachunk.distill.moc import STAGE as MOC_STAGE
from metachunk.distill.moc import TASK as MOC_TASK
from metachunk.distill.prompts import load_prompt

from metachunk.artifacts import InputError
from metachunk.markdown import shown_argument

# The shared builder's filters (metachunk.distill.sft), run after the task's own.
SHARED_FILTERS = ("contaminated", "exact_duplicate", "near_duplicate", "too_long")
# rewrite / summary: the task's own filters, then the shared ones (the card's table, in order).
FILTERS = ("failed_or_empty", "refusal_or_off_format", "lost_content", *SHARED_FILTERS)
# MoC's filters. Its cards list every filter of FILTERS (0 where it cannot fire), then unrecoverable.
MOC_FILTERS = ("failed_or_empty", "unrecoverable", *SHARED_FILTERS)


@dataclass
class Row:
    """One candidate row of a dataset, before the shared filters.

    ``reason`` is the task's own filter that drops it (None: it goes on to the contamination,
    duplicate and length checks). Duplicates are judged on ``text`` (exact: ``text`` and
    ``answer``; near: ``text``). ``columns`` gives the row's ``prompt`` and metadata columns; it is
    called only for a row that passed every other filter."""

    target: int | None  # the dataset it belongs to: None, or the expert set of this label
    doc_id: str
    lang: str
    reason: str | None
    text: str = ""
    answer: str = ""  # the completion's content
    label: int | None = None
    columns: Callable[[], dict] | None = None


class RowMaker:
    """What the builder asks of a task. A subclass sets the class attributes and has:

    ``features()`` (the dataset's columns); ``read(record)`` (the record's fields, with ``.lang``;
    KeyError / TypeError: not a record of this kind); ``entries(rec)`` (``(stage, entry)`` of every
    teacher answer, for usage and prompt versions); ``rows(rec, document)`` (its candidate
    `Row` s; ``document(doc_id)`` is the text, an input error when missing);
    ``students(langs)`` (``(name, Prompt)`` of the prompts the rows use) and ``limitations(...)``
    for the card. The methods below are the defaults: one dataset, no run settings, no labels."""

    kind = ""  # the error for an unreadable line: "not a {kind} record"
    meta_name = ""  # the distill run's meta file, named in the "no documents" error
    distill_command = ""  # the card's provenance when the meta file names no command
    provenance_note = ""  # appended to the card's provenance
    filters: tuple[str, ...] = ()  # the card's filter table, in order
    own_filters: tuple[str, ...] = ()  # the task's filters, applied before the shared ones
    record_task = ""  # the 'task' field the records must carry

    def targets(self) -> list[int | None]:
        """The datasets built: None is OUT; k is OUT-k (card NAME-k)."""
        return [None]

    def start(self, meta: dict) -> None:
        """Read what the distill run recorded (``TASK.meta.json``, ``{}`` if none)."""

    def wrong_task(self, record: dict) -> bool:
        return record.get("task") != self.record_task

    def command_args(self, target: int | None) -> str:
        return ""

    def card_labels(self, target: int | None, labels: Counter) -> dict:
        return {}


# -------------------------------------------------------------------------------- rewrite, summary

_REFUSAL = re.compile(
    r"(?i)\b(i'?m sorry|i am sorry|i cannot|i can'?t|as an ai|i am unable|i'?m unable)\b"
    r"|抱歉|对不起|作为(一个)?(AI|人工智能)|我无法|我不能"
)
_PREFACE = re.compile(
    r"(?i)^\s*(here is|here's|here are|sure[,!.]|certainly[,!.]|below is|the rewritten|rewritten (text|chunk)"
    r"|summary:|以下是|好的[，,]|改写后|摘要[:：])"
)
_STAGE_MARKUP = re.compile(r"(?i)<think>|</think>|\bmissing:|\bsupplement:|\"score\"\s*:|缺失：|补充：")
_SENTENCE_END = re.compile(r"[.!?。！？]+(?=\s|$)")


def off_format(task: str, output: str, chunk: str) -> bool:
    if _REFUSAL.search(output) or _PREFACE.search(output) or _STAGE_MARKUP.search(output):
        return True
    if task == "summary":  # one enhanced sentence: short, not a second copy of the chunk
        return len(_SENTENCE_END.findall(output.strip())) > 3 or len(output) > max(2 * len(chunk), 400)
    return False


def _grams(text: str, lang: str) -> set[str]:
    if lang == "zh":
        chars = [c for c in text if c.isalnum()]
        return {a + b for a, b in zip(chars, chars[1:])}
    return set(re.findall(r"\w+", text.lower()))


def content_kept(chunk: str, rewrite: str, lang: str) -> float:
    """Share of the chunk's words (en) or character bigrams (zh) present in the rewrite."""
    source = _grams(chunk, lang)
    return len(source & _grams(rewrite, lang)) / len(source) if source else 1.0


def features():
    """The columns of rewrite / summary rows."""
    return _features("chunk_index", {})


def _features(index: str, columns: dict):
    """prompt, completion, doc_id, the row's index and span, the task's columns, then the versions
    and the source record."""
    from datasets import Features, List, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            "prompt": List(message),
            "completion": List(message),
            "doc_id": Value("string"),
            index: Value("int64"),  # the chunk's / sample's position in its document
            "start": Value("int64"),  # the chunk's / sample's span in its document
            "end": Value("int64"),
            "lang": Value("string"),
            **columns,
            "teachers": Value("string"),  # JSON {stage: model}
            "prompt_sha256": Value("string"),  # the student prompt's version
            "teacher_prompt_sha256": Value("string"),  # JSON {stage: sha256}
            "source_record": Value("string"),  # FILE:LINE of the distilled record
        }
    )


def _check(record: dict, name: str, kind: type, what: str, within=None) -> None:
    """``record[name]`` is a ``kind`` (a bool is no int) and, with ``within``, a value it accepts."""
    if name not in record:
        raise ValueError(f"field {name!r} is missing")
    value = record[name]
    if (
        isinstance(value, bool) is not (kind is bool)
        or not isinstance(value, kind)
        or (within and not within(value))
    ):
        raise TypeError(f"field {name!r} must be {what}, got {value!r:.80}")


def _check_span(document: str, doc_id: str, start: int, end: int, field: str) -> None:
    """``start:end`` of a record lies in the document it names. A documents file other than the
    one distilled from would otherwise cut prompts from the wrong text, silently."""
    if not 0 <= start <= end <= len(document):
        raise ValueError(
            f"{field} {start}:{end} is outside document {doc_id!r} (0:{len(document)}); "
            "are the documents the ones the record was distilled from?"
        )


# The fields of a rewrite / summary record that the rows use (read, and checked, by TextRows.read).
TextRecord = namedtuple("TextRecord", "doc_id chunk output lang status stages record")


class TextRows(RowMaker):
    """``rewrite`` / ``summary``: one row per ``distill rewrite|summary`` record."""

    kind = "distill"
    meta_name = "TASK.meta.json"
    distill_command = "metachunk distill"
    filters = FILTERS
    own_filters = ("failed_or_empty", "refusal_or_off_format", "lost_content")

    def __init__(self, cfg):
        self.task = self.record_task = cfg.task
        self.min_overlap = cfg.min_overlap
        self.cli_context = cfg.max_context_chars
        self.max_context = None
        self.context_mode = "document"

    def features(self):
        return features()

    def start(self, meta: dict) -> None:
        self.max_context = self.cli_context or meta.get("config", {}).get("max_context_chars") or 8000
        self.context_mode = meta.get("config", {}).get("context") or "document"

    def context_spans(self, record: dict, text: str):
        """The record's context spans, as the chunker finds them at ``max_context`` characters: in
        document mode a window narrower than the distill run's is centred on the chunk again
        (`window_span`), as ``chunk --student-context-chars`` centres it, where cutting the distill
        run's window from its left edge gave prompts inference never sends, some without the chunk."""
        spans = record.get("context_spans")
        if (
            self.context_mode == "document"
            and spans
            and len(spans) == 1
            and spans[0][1] - spans[0][0] > self.max_context
        ):
            return [window_span(len(text), record["start"], record["end"], self.max_context)]
        return spans

    def read(self, record: dict) -> TextRecord:
        # Every field a row is made of, checked here, where the line is known: a wrong type surfaced as
        # an AttributeError deep in the filters, or as pyarrow refusing a shard after the build.
        for name in ("doc_id", "text", "lang", "status"):
            _check(record, name, str, "a string")
        _check(record, "stages", dict, "an object (stage: entry)")
        if record.get("output") is not None:
            _check(record, "output", str, "a string")
        for name in ("start", "end"):  # parquet's int64 columns
            _check(record, name, int, "a character offset (an int >= 0)", lambda v: 0 <= v < 2**63)
        if record["end"] < record["start"]:
            raise ValueError(f"field 'end' ({record['end']}) is before field 'start' ({record['start']})")
        if "chunk_index" in record:
            _check(record, "chunk_index", int, "an int (-1: not recorded)", lambda v: -1 <= v < 2**63)
        spans = record.get("context_spans")
        if spans is not None and not (
            isinstance(spans, list)
            and all(
                isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x)
                for x in spans
            )
        ):
            raise TypeError(
                f"field 'context_spans' must be a list of [start, end] offsets, got {spans!r:.80}"
            )
        output = record.get("output") or ""
        return TextRecord(record["doc_id"], record["text"], output, record["lang"], record["status"],
                          record["stages"], record)  # fmt: skip

    def wrong_task(self, record: dict) -> bool:
        return record.get("task", self.task) != self.task  # records written before 'task' existed pass

    def entries(self, rec: TextRecord):
        return rec.stages.items()

    def rows(self, rec: TextRecord, document: Callable[[str], str]) -> Iterator[Row]:
        reason = self._drop_reason(rec)
        columns = partial(self._columns, rec, document)
        yield Row(None, rec.doc_id, rec.lang, reason, rec.chunk, rec.output, columns=columns)

    def _drop_reason(self, rec: TextRecord) -> str | None:
        if rec.status not in ("ok", "complete_as_is") or not rec.output.strip():
            return "failed_or_empty"
        if rec.status == "ok" and off_format(self.task, rec.output, rec.chunk):
            return "refusal_or_off_format"
        if self.task == "rewrite" and content_kept(rec.chunk, rec.output, rec.lang) < self.min_overlap:
            return "lost_content"
        return None

    def _columns(self, rec: TextRecord, document: Callable[[str], str]) -> dict:
        record, stages = rec.record, rec.stages
        student = load_student_prompt(self.task, rec.lang)
        text = document(rec.doc_id)
        _check_span(text, rec.doc_id, record["start"], record["end"], "fields 'start':'end'")
        if text[record["start"] : record["end"]] != rec.chunk:
            raise ValueError(
                f"field 'text' differs from document {rec.doc_id!r} at {record['start']}:{record['end']}; "
                "are the documents the ones the record was distilled from?"
            )
        for span in record.get("context_spans") or ():
            _check_span(text, rec.doc_id, *span, "field 'context_spans'")
        return {
            # The one prompt builder: the chunker's --rewrite/--summarize sends exactly this.
            "prompt": student_messages(
                self.task,
                rec.lang,
                text,
                rec.chunk,
                self.context_spans(record, text),
                self.max_context,
            ),
            "chunk_index": record.get("chunk_index", -1),
            "start": record["start"],
            "end": record["end"],
            "lang": rec.lang,
            # a local teacher's model is its folder: shown as the card shows it, the dataset viewer shows every column
            "teachers": json.dumps(
                {s: shown_argument(e.get("teacher"), relative_to_cwd=False) for s, e in stages.items()},
                ensure_ascii=False,
            ),  # fmt: skip
            "prompt_sha256": student.sha256,
            "teacher_prompt_sha256": json.dumps({s: e.get("prompt_sha256") for s, e in stages.items()}),
        }

    # ---- card

    def students(self, langs: list[str]) -> list:
        return [(f"student_{self.task}.{lang}", load_prompt(f"student_{self.task}", lang)) for lang in langs]

    def limitations(self, target, labels, total_rows, n_records, n_test, teachers) -> list[str]:
        teacher_models = sorted({m for models in teachers.values() for m in models})
        notes = [
            "Targets are teacher outputs filtered by heuristics (refusals, prefaces, content overlap, length); "
            "they are not human-checked.",
        ]
        if total_rows < 20_000:
            notes.append(f"{total_rows} rows: the paper trains on 20,000 per component.")
        if n_test == 0:
            notes.append("No test documents were given, so no decontamination was done.")
        if any(m in ("smollm2", "gemma3-270m") or "models/" in m for m in teacher_models):
            notes.append(
                "Distilled from a small local teacher (SmolLM2-135M); only the pipeline is demonstrated."
            )
        return notes


# ------------------------------------------------------------------------------------------- MoC


def moc_features():
    """The columns of moc-router / moc-expert rows."""
    from datasets import Value

    return _features(
        "sample_index",
        {
            "label": Value("int64"),  # granularity 0..3 of the sample's mean chunk length
            "mean_chunk_chars": Value("float64"),  # of the sample's chunks
            "chunks": Value("int64"),
            "placeholder": Value("string"),
        },
    )


# The fields of a moc record that the rows use (read, and checked, by MocRows.read).
MocRecord = namedtuple("MocRecord", "doc_id lang status windows samples label record")


class MocRows(RowMaker):
    """``moc-router`` / ``moc-expert``: one row per sample of a ``distill moc`` record."""

    kind = "moc"
    meta_name = "moc.meta.json"
    distill_command = "metachunk distill moc"
    provenance_note = "; one row per sample of whole teacher chunks"
    # Every filter of the card's table (0 where it cannot fire here), then unrecoverable.
    filters = tuple(dict.fromkeys((*FILTERS, *MOC_FILTERS)))
    own_filters = ("failed_or_empty", "unrecoverable")

    def __init__(self, cfg):
        self.record_task = MOC_TASK
        self.role = cfg.task.removeprefix("moc-")
        self.labels = self._check_granularity(cfg) if self.role == "expert" else None
        self.no_samples = 0  # records that gave no sample, whatever their label (for the card)
        self.max_ratio = None  # the distill run's moc_max_ratio (its meta), for the card

    def start(self, meta: dict) -> None:
        self.max_ratio = meta.get("config", {}).get("moc_max_ratio")

    @staticmethod
    def _check_granularity(cfg) -> list[int]:
        labels = list(cfg.granularity) if cfg.granularity else list(range(len(ROUTER_LABELS)))
        bad = [k for k in labels if not 0 <= k < len(ROUTER_LABELS)]
        if bad or len(set(labels)) != len(labels):
            raise InputError("build-sft", f"--granularity takes distinct labels 0..3, got {labels}")
        return labels

    def targets(self) -> list[int | None]:
        return [None] if self.labels is None else self.labels

    def features(self):
        return moc_features()

    def read(self, record: dict) -> MocRecord:
        doc_id, lang, status = record["doc_id"], record["lang"], record["status"]
        windows, samples = record["windows"], record.get("samples") or []
        label = record.get("label")
        return MocRecord(doc_id, lang, status, windows, samples, label, record)

    def entries(self, rec: MocRecord):
        return [(MOC_STAGE, w.get("answer") or {}) for w in rec.windows]

    def rows(self, rec: MocRecord, document: Callable[[str], str]) -> Iterator[Row]:
        if rec.status != "ok" or not rec.samples:
            self.no_samples += 1
            target = None if self.labels is None else rec.label
            if self.labels is None or target in self.labels:  # an expert set only knows labelled records
                yield Row(target, rec.doc_id, rec.lang, "failed_or_empty")
            return
        # Each sample's label is its own chunks' granularity (MoC §3.2.2 labels the ~1,024-character text, as
        # the router sees it at inference), not its document's: it picks the router's answer and the expert set.
        labels = [granularity_label(sample["mean_chunk_chars"]) for sample in rec.samples]
        if self.labels is not None and not set(labels) & set(self.labels):
            return
        text = document(rec.doc_id)
        placeholder = rec.record.get("placeholder") or "[MASK]"
        check_placeholder(placeholder)
        answered = next((w["answer"] for w in rec.windows if w.get("answer")), {})
        teacher = json.dumps({MOC_STAGE: shown_argument(answered.get("teacher"), relative_to_cwd=False)})
        teacher_prompt = json.dumps({MOC_STAGE: answered.get("prompt_sha256")})
        lang = rec.lang
        for index, (sample, label) in enumerate(zip(rec.samples, labels)):
            target = None if self.labels is None else label
            if target is not None and target not in self.labels:
                continue
            for name in ("start", "end"):
                _check(sample, name, int, "a character offset (an int >= 0)")
            _check_span(text, rec.doc_id, sample["start"], sample["end"], f"samples[{index}] 'start':'end'")
            body = text[sample["start"] : sample["end"]]
            if self.role == "expert":
                answer = json.dumps(sample["elements"], ensure_ascii=False)
                prompt = expert_messages(body, lang, placeholder)
            else:
                answer = ROUTER_LABELS[label]
                prompt = router_messages(body, lang)
            reason = None
            if self.role == "expert" and not sample.get("recoverable", False):
                reason = "unrecoverable"
            columns = partial(
                dict,
                prompt=prompt,
                sample_index=index,
                start=sample["start"],
                end=sample["end"],
                lang=lang,
                label=label,
                mean_chunk_chars=float(sample["mean_chunk_chars"]),
                chunks=len(sample["chunks"]),
                placeholder=placeholder,
                teachers=teacher,
                prompt_sha256=load_moc_prompt(self.role, lang).sha256,
                teacher_prompt_sha256=teacher_prompt,
            )
            yield Row(target, rec.doc_id, lang, reason, body, answer, label, columns)

    # ---- card

    def students(self, langs: list[str]) -> list:
        return [(f"moc_{self.role}.{lang}", load_moc_prompt(self.role, lang)) for lang in langs]

    def command_args(self, target: int | None) -> str:
        return "" if target is None else f" --granularity {target}"

    def card_labels(self, target: int | None, labels: Counter) -> dict:
        return {"label": target, "labels": {k: labels.get(int(k), 0) for k in ROUTER_LABELS}}

    def limitations(self, target, labels, total_rows, n_records, n_test, teachers) -> list[str]:
        label_text = (
            "labels " + ", ".join(f"{k}: {labels.get(int(k), 0)}" for k in ROUTER_LABELS)
            if self.role == "router"
            else f"granularity label {target} only"
        )
        models = (
            ", ".join(sorted({shown_argument(m) for names in teachers.values() for m in names}))
            or "not recorded"
        )
        edits = (
            f"{self.max_ratio:.0%}"
            if isinstance(self.max_ratio, (int, float))
            else "the run's moc_max_ratio of"
        )
        notes = [
            f"Chunk boundaries are the teacher's ({models}), kept only where every chunk was found in the "
            f"source within {edits} edits; they are not human-checked.",
            f"Rows: {label_text}; {self.no_samples} of {n_records} distilled documents gave "
            "no sample (not finished, or no chunk accepted).",
        ]
        if total_rows < 20_000:
            notes.append(f"{total_rows} rows: the MoC paper trains each component on 20,000.")
        if n_test == 0:
            notes.append("No test documents were given, so no decontamination was done.")
        return notes


ROW_MAKERS: dict[str, type[RowMaker]] = {
    "rewrite": TextRows,
    "summary": TextRows,
    "moc-router": MocRows,
    "moc-expert": MocRows,
}
