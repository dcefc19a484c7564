"""MoC dataset distillation (MoC §3.2.1, Appendix A.3): a teacher chunks raw text, we keep offsets.

``metachunk distill moc --config recipes/distill/moc.yaml`` asks a GPT-4o-class teacher to chunk
documents without changing them (the paper's Table 6 prompt, ``distill/prompts/moc_chunk.{lang}.txt``,
chunks separated by ``\\n—\\n``; an endpoint that takes a schema decodes under
``moc_chunk.schema.json``, ``{"chunks": [...]}``, and `answer_chunks` reads both), through
the same driver (`metachunk.distill.run`, `MocTask`), teacher client, answer store, limits, budget and resume as
``distill rewrite|summary``: the store is the source of truth, ``OUT/moc.jsonl`` is rebuilt from it
by every run, and a rerun (or a run after a crash) sends only the requests that never got an answer.
``metachunk data build-sft moc-router|moc-expert`` turns the records into the router's and the
experts' SFT sets (`metachunk.distill.sft_rows`), with the prompts of `metachunk.chunking.moc` (the ones
``chunk --method moc`` sends at inference).

**Windows.** A document is sent in windows of at most ``window_tokens`` (1024) tokens of the
``tokenizer`` (a preset or local HF dir; the teacher's own tokenizer is not needed, only a
comparable count; sentences are counted one by one, which comes out a few tokens over a count of
the whole window, never under). A window ends at a sentence end (`metachunk.chunking.sentences.split_sentences`),
preferably at a paragraph end (a sentence followed by a line break) when one lies in the second
half of the budget. Every window reaches past the previous window's end, so every request brings
new text; a single sentence over the budget is sent alone and counted (``over_budget``).

**Chunk buffer.** The last chunk the teacher returns for a window may have been cut by the window
edge, so it is not kept: the next window starts where it starts, and it is chunked again there
with the text after it. When the teacher answers a window that was cut short at a paragraph end
with a single chunk, the window is asked again with the whole budget (``widened``). So no
boundary is forced by a window edge, except when a single chunk fills a whole-budget window
(kept, counted as ``forced_edges``). The document's last window keeps all its chunks.

**Cleaning.** Each returned chunk is located in the window by edit distance
(`metachunk.chunking.align.locate`, searched forward from the previous chunk's end). A chunk whose
best match needs more than ``moc_max_ratio`` (10%) of its length in edits is *flagged*: kept in
the record with the teacher's text (for review) and excluded from training. Accepted chunks are
stored as exact offsets of the document (with their edit distance), never as teacher text: the
training data quotes the source. An answer of which no chunk can be located is asked again
(``parse_retries``); when no answer is usable the window is skipped (a *fallback*: its text is
left uncovered, a ``gap``) and the next window starts at its end. A transport failure (timeout,
HTTP error) stops the document there; the next run resumes it. An answer cut at ``max_tokens``
(after the teacher client's ``max_tokens_limit`` retries) is still used: its last chunk is the
buffer, whatever the window.

**Labels and samples.** A completed document's label is the granularity of the mean length (in
characters) of its accepted chunks (`metachunk.chunking.moc.granularity_label`: (0,120] → 0,
(120,150] → 1, (150,180] → 2, (180,∞) → 3). Samples are texts of about ``sample_chars`` (1024)
characters made of whole consecutive chunks (§3.2.2: long texts truncated, short ones
concatenated, always at chunk boundaries), never spanning a gap. A sample's own label (the router's
target and its expert set: §3.2.2 labels the ~1,024-character text, as the router reads it) is the
granularity of its chunks' mean length, ``mean_chunk_chars``; each sample also carries its expert target: one ``head + placeholder + tail`` string per
chunk (``head_chars`` / ``tail_chars`` characters, widened to whole ASCII words; a chunk shorter
than both is quoted whole). A target is checked by recovering it with the inference algorithm
(`metachunk.chunking.moc_answers.recover_spans`): when its chunk starts do not come back, the anchors are
doubled (twice), else the sample is marked ``recoverable: false`` and kept out of the expert set.

Record (one per document, ``OUT/moc.jsonl``):

```
{"schema_version": 1, "task": "moc", "doc_id", "lang", "chars",
 "status": "ok" | "pending" | "failed", "reason",     # failed: transport reason or "no_chunks"
 "windows": [{"start", "end", "tokens", "over_budget", "status": "ok"|"failed"|"pending", "reason",
              "answer": {stage entry: teacher, params, prompt_sha256, schema_sha256, request_key,
                         usage, cost, spent, attempts, raw, text, finish_reason,
                         json_outcomes: ["valid" | "repaired" | "unparseable", one per answer]},
              "returned", "accepted": [[start, end, distance]], "carried": [start, end] | null,
              "flagged": [{"index", "text", "near": [start, end, score]}], "forced_edge", "widened",
              "fallback", "truncated"}],
 "chunks": [{"start", "end", "distance"}],             # accepted, document offsets, in order
 "gaps": [[start, end]],                               # text no accepted chunk covers
 "counts": {"windows", "returned", "accepted", "flagged", "fuzzy", "fallbacks", "forced_edges",
            "widened", "over_budget"},
 "mean_chunk_chars", "label",                          # null unless status is ok
 "placeholder", "head_chars", "tail_chars",
 "samples": [{"start", "end", "chunks": [[start, end]], "mean_chunk_chars", "elements": [str],
              "recoverable"}]}
```

``OUT/moc.meta.json`` holds the config, the prompt and schema hashes, the tokenizer and the records'
counts (tokens, cost, chunks returned / accepted / flagged, fallbacks, labels, samples, answers valid
by the schema / repaired / unparseable); requests sent and answers from the store are each
attempt's, in ``OUT/runs.jsonl``.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from metachunk.chunking.align import locate
from metachunk.chunking.moc import ROUTER_LABELS, granularity_label

# ANCHOR_SCALES: the head/tail lengths tried, in multiples of head_chars/tail_chars. One definition
# for the training targets written here and the anchored grammar that decodes them.
from metachunk.chunking.moc_answers import ANCHOR_SCALES, expert_element, recover_spans
from metachunk.chunking.sentences import detect_lang, split_sentences
from metachunk.chunking.types import Sentence
from metachunk.distill.config import DistillConfig, MocDistillOptions
from metachunk.distill.pipelines import Pending, StageFailed, StageRunner, json_answers, json_line, tally
from metachunk.distill.prompts import load_prompt

from metachunk.artifacts import SCHEMA_VERSION
from metachunk.sources import Rejects, read_documents
from metachunk.structured import json_in_text
from metachunk.teacher import estimate_tokens, is_transport_failure, prompt_bytes, template_tokens

TASK = "moc"
STAGE = "moc_chunk"  # the teacher stage and its prompt file, distill/prompts/moc_chunk.{lang}.txt
SEPARATOR = "\n—\n"  # what the paper's Table 6 prompt puts between chunks (read as a fallback)

# ------------------------------------------------------------------------------------- answers

# A separator line: dashes only (em dash as asked, or en dash / hyphens / a horizontal bar).
_SEPARATOR_LINE = re.compile(r"[ \t]*[—–―-]{1,6}[ \t]*")
# The separator written out literally (`\n—\n` with backslashes), as some models echo it.
_LITERAL_SEPARATOR = re.compile(r"\\n[ \t]*([—–―-]{1,6})[ \t]*\\n")
# A code fence around the whole answer, with or without a language tag (```text, ```markdown).
_CODE_FENCE = re.compile(r"\A```[\w+-]*[ \t]*\n?|\n?```\Z")
_ECHO = re.compile(r"^\s*(the segmented text chunks are|分割后的文本块为)\s*[:：]?\s*", re.IGNORECASE)


def answer_chunks(answer: str) -> list[str]:
    """The chunks of a teacher answer: the ``"chunks"`` strings of its JSON object (or a bare JSON
    list of strings), else the pieces between separator lines (`split_answer`)."""
    # the whole answer only: a chunk of the separator format may itself hold a JSON list
    data = json_in_text(answer, whole=True)
    if isinstance(data, dict):
        data = data.get("chunks")
    if isinstance(data, list) and all(isinstance(piece, str) for piece in data):
        return [piece.strip() for piece in data if piece.strip()]
    return split_answer(answer)


def split_answer(answer: str) -> list[str]:
    """The chunks of a teacher answer: pieces between separator lines, stripped, empty ones dropped.

    Tolerates the separator written literally (``\\n—\\n``), other dashes on their own line, a
    code fence and an echo of the prompt's last line."""
    text = _LITERAL_SEPARATOR.sub(lambda m: "\n" + m.group(1) + "\n", answer)
    text = _ECHO.sub("", _CODE_FENCE.sub("", text.strip()))
    pieces, current = [], []
    for line in text.splitlines(keepends=True):
        if _SEPARATOR_LINE.fullmatch(line.rstrip("\r\n")):
            pieces.append("".join(current))
            current = []
        else:
            current.append(line)
    pieces.append("".join(current))
    return [p.strip() for p in pieces if p.strip()]


# ------------------------------------------------------------------------------------- geometry


class TokenCounter:
    """Counts tokens with a preset's (or a local HF dir's) tokenizer, no special tokens."""

    def __init__(self, name_or_dir: str):
        from transformers import AutoTokenizer

        from metachunk.models import resolve

        self.name = name_or_dir
        self.path = resolve(name_or_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def count_many(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


@dataclass
class DocPlan:
    """A document's sentences with their token counts, for cutting windows."""

    doc_id: str
    text: str
    lang: str
    sentences: list[Sentence]
    ends: list[int]
    prefix: list[int]  # prefix[i]: tokens of sentences[:i]
    paragraph: list[bool]  # sentence i ends a paragraph (line break after it) or the document
    counter: TokenCounter

    @classmethod
    def build(cls, doc_id: str, text: str, lang: str, counter: TokenCounter) -> DocPlan:
        sentences = split_sentences(text, lang)
        pieces = [text[s.start : s.end] for s in sentences]
        prefix = [0]
        for n in counter.count_many(pieces):
            prefix.append(prefix[-1] + n)
        paragraph = [
            i == len(pieces) - 1 or any(c in "\n\r\u2029" for c in p[len(p.rstrip()) :])
            for i, p in enumerate(pieces)
        ]
        return cls(doc_id, text, lang, sentences, [s.end for s in sentences], prefix, paragraph, counter)


def window_end(
    plan: DocPlan, pos: int, after: int, budget: int, paragraphs: bool = True
) -> tuple[int, int, bool]:
    """``(end, tokens, over_budget)`` of the window starting at ``pos``: the last sentence end
    within ``budget`` tokens, or (``paragraphs``) the last paragraph end when it has at least half
    the budget, always past ``after`` (the previous window's end). When even the first new
    sentence end is over the budget, that end (``over_budget``)."""
    ends, prefix, n = plan.ends, plan.prefix, len(plan.ends)
    first = bisect.bisect_right(ends, max(pos, after))
    if first >= n:
        return len(plan.text), plan.counter.count(plan.text[pos:]), False
    i = bisect.bisect_right(ends, pos)  # the sentence holding pos
    s = plan.sentences[i]
    head = prefix[i + 1] - prefix[i] if s.start == pos else plan.counter.count(plan.text[pos : s.end])

    def tokens(j: int) -> int:  # text[pos:ends[j]], j >= i
        return head + prefix[j + 1] - prefix[i + 1]

    lo, hi = first, n  # the first j over the budget
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens(mid) <= budget:
            lo = mid + 1
        else:
            hi = mid
    last = lo - 1
    if last < first:
        return ends[first], tokens(first), True
    k = last
    while paragraphs and k >= first and not plan.paragraph[k]:
        k -= 1
    if paragraphs and k >= first and k != last and tokens(k) * 2 >= budget:
        last = k
    return ends[last], tokens(last), False


# ------------------------------------------------------------------------------------- cleaning


@dataclass
class Cleaned:
    """Where each returned chunk lies in the window: ``(start, end, distance)``, or None (flagged)."""

    pieces: list[str]
    spans: list[tuple[int, int, int] | None]

    @property
    def located(self) -> list[tuple[int, tuple[int, int, int]]]:
        return [(k, s) for k, s in enumerate(self.spans) if s is not None]


def clean_window(window: str, pieces: Sequence[str], max_ratio: float) -> Cleaned:
    """Locate each piece in ``window`` by edit distance, in order, each after the previous match."""
    spans: list[tuple[int, int, int] | None] = []
    cursor = 0
    for piece in pieces:
        match = locate(piece, window, cursor, max_ratio=max_ratio)
        if match is None or match.end <= match.start:
            spans.append(None)
            continue
        spans.append((match.start, match.end, match.distance))
        cursor = match.end
    return Cleaned(list(pieces), spans)


def _near(piece: str, window: str, offset: int) -> list:
    """Where a flagged piece comes closest (rapidfuzz partial ratio), for a reviewer."""
    from rapidfuzz.fuzz import partial_ratio_alignment

    found = partial_ratio_alignment(piece, window)
    if found is None:
        return [offset, offset, 0.0]
    return [offset + found.dest_start, offset + found.dest_end, round(found.score, 1)]


# ------------------------------------------------------------------------------------- samples


def expert_target(
    text: str, chunks: Sequence[tuple[int, int]], head_chars: int, tail_chars: int, placeholder: str
) -> tuple[list[str], bool]:
    """``(elements, recoverable)`` for a sample ``text`` whose chunks are ``chunks`` (offsets in
    ``text``). Recoverable: the inference recovery (`metachunk.chunking.moc_answers.recover_spans`) finds every
    element exactly, at its chunk's start. Anchors are doubled until it does (ANCHOR_SCALES)."""
    first = None
    for scale in ANCHOR_SCALES:
        elements = [
            expert_element(text[s:e], head_chars * scale, tail_chars * scale, placeholder) for s, e in chunks
        ]
        first = first or elements
        spans, stats = recover_spans(text, elements, placeholder, max_ratio=0.0)
        if stats.skipped == 0 and [a for a, _ in spans] == [s for s, _ in chunks]:
            return elements, True
    return first, False


def runs(text: str, chunks: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive chunks with nothing but whitespace between them."""
    out: list[list[tuple[int, int]]] = []
    for c in chunks:
        if out and not text[out[-1][-1][1] : c[0]].strip():
            out[-1].append(c)
        else:
            out.append([c])
    return out


def pack_samples(text: str, chunks: Sequence[tuple[int, int]], target: int) -> list[list[tuple[int, int]]]:
    """Groups of whole consecutive chunks of about ``target`` characters (never across a gap): a
    group grows while it stays within ``target`` (a longer chunk stands alone); a run's remainder
    shorter than ``target / 2`` joins the group before it when the two fit in ``1.5 * target``."""
    groups: list[list[tuple[int, int]]] = []
    for run in runs(text, chunks):
        made = []
        for c in run:
            if made and c[1] - made[-1][0][0] <= target:
                made[-1].append(c)
            else:
                made.append([c])
        if len(made) > 1 and made[-1][-1][1] - made[-1][0][0] < target / 2:
            if made[-1][-1][1] - made[-2][0][0] <= 1.5 * target:
                made[-2].extend(made.pop())
        groups.extend(made)
    return groups


def gaps_of(text: str, chunks: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Spans of ``text`` that hold non-whitespace text and no chunk."""
    out, cursor = [], 0
    for s, e in [*chunks, (len(text), len(text))]:
        if s > cursor and text[cursor:s].strip():
            out.append([cursor, s])
        cursor = max(cursor, e)
    return out


def _mean(chunks: Sequence[tuple[int, int]]) -> float:
    return round(sum(e - s for s, e in chunks) / len(chunks), 2) if chunks else 0.0


def finish_record(record: dict, text: str, opts: MocDistillOptions) -> dict:
    """Gaps, counts, label and samples of a document whose windows are done."""
    chunks = [(c["start"], c["end"]) for c in record["chunks"]]
    record["gaps"] = gaps_of(text, chunks)
    windows = record["windows"]
    record["counts"] = {
        "windows": len(windows),
        "returned": sum(w.get("returned", 0) for w in windows),
        "accepted": len(chunks),
        "flagged": sum(len(w.get("flagged", [])) for w in windows),
        "fuzzy": sum(1 for c in record["chunks"] if c["distance"] > 0),
        "fallbacks": sum(1 for w in windows if w.get("fallback")),
        "forced_edges": sum(1 for w in windows if w.get("forced_edge")),
        "widened": sum(1 for w in windows if w.get("widened")),
        "over_budget": sum(1 for w in windows if w.get("over_budget")),
    }
    if record["status"] == "ok" and not chunks:
        record.update(status="failed", reason="no_chunks")
    if record["status"] != "ok":
        return record
    record["mean_chunk_chars"] = _mean(chunks)
    record["label"] = granularity_label(record["mean_chunk_chars"])
    for group in pack_samples(text, chunks, opts.sample_chars):
        start, end = group[0][0], group[-1][1]
        relative = [(s - start, e - start) for s, e in group]
        elements, recoverable = expert_target(
            text[start:end], relative, opts.head_chars, opts.tail_chars, opts.placeholder
        )
        record["samples"].append(
            {
                "start": start,
                "end": end,
                "chunks": [list(c) for c in group],
                "mean_chunk_chars": _mean(group),
                "elements": elements,
                "recoverable": recoverable,
            }
        )
    return record


# ------------------------------------------------------------------------------------- one document


def new_record(plan: DocPlan, opts: MocDistillOptions) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "task": TASK,
        "doc_id": plan.doc_id,
        "lang": plan.lang,
        "chars": len(plan.text),
        "status": "ok",
        "reason": "",
        "windows": [],
        "chunks": [],
        "gaps": [],
        "counts": {},
        "mean_chunk_chars": None,
        "label": None,
        "placeholder": opts.placeholder,
        "head_chars": opts.head_chars,
        "tail_chars": opts.tail_chars,
        "samples": [],
    }


async def chunk_document(plan: DocPlan, runner: StageRunner, opts: MocDistillOptions) -> dict:
    """Window by window through the document; returns its record."""
    text = plan.text
    record = new_record(plan, opts)
    pos = after = 0
    widen = False  # ask the same window again without the paragraph preference
    while pos < len(text) and text[pos:].strip():
        end, tokens, over = window_end(plan, pos, after, opts.window_tokens, paragraphs=not widen)
        can_widen = not widen and window_end(plan, pos, after, opts.window_tokens, paragraphs=False)[0] > end
        widen = False
        window = {
            "start": pos,
            "end": end,
            "tokens": tokens,
            "over_budget": over,
            "status": "ok",
            "reason": "",
        }
        record["windows"].append(window)
        body = text[pos:end]
        entry: dict = {}  # the window's teacher answer (a stage entry)
        truncated = False

        def parse(answer: str, body=body) -> Cleaned | None:
            cleaned = clean_window(body, answer_chunks(answer), opts.max_ratio)
            return cleaned if cleaned.located else None

        try:
            cleaned = await runner.ask_into(entry, STAGE, plan.lang, parse=parse, text=body)
        except Pending as e:
            window.update(status="pending", reason=e.reason, answer=entry)
            record.update(status="pending", reason=e.reason)
            break
        except StageFailed as e:
            window.update(status="failed", reason=e.reason, answer=entry)
            if is_transport_failure(e.reason):
                record.update(status="failed", reason=e.reason)
                break
            cleaned = None
            if e.reason == "length" and entry.get("text"):  # cut at max_tokens: its last chunk is the buffer
                cleaned = parse(entry["text"])
                truncated = cleaned is not None
            if cleaned is None:  # fallback: skip the window, its text stays uncovered
                pieces = answer_chunks(entry.get("text") or "")
                flagged = [{"index": k, "text": p, "near": _near(p, body, pos)} for k, p in enumerate(pieces)]
                window.update(fallback=True, returned=len(pieces), flagged=flagged)
                pos = after = end
                continue
        window["answer"] = entry
        pos, after, widen = settle(window, cleaned, body, pos, end, len(text), truncated, can_widen, record)
    return finish_record(record, text, opts)


def settle(
    window: dict,
    cleaned: Cleaned,
    body: str,
    start: int,
    end: int,
    length: int,
    truncated: bool,
    can_widen: bool,
    record: dict,
) -> tuple[int, int, bool]:
    """Accept the window's located chunks but the last (the buffer, re-chunked by the next window);
    returns where the next window starts, the end it must pass, and whether it is this window
    again with the whole budget (``can_widen``: it was cut short at a paragraph end)."""
    located = cleaned.located
    window.update(
        returned=len(cleaned.pieces),
        truncated=truncated,
        flagged=[
            {"index": k, "text": piece, "near": _near(piece, body, start)}
            for k, (piece, span) in enumerate(zip(cleaned.pieces, cleaned.spans))
            if span is None
        ],
        carried=None,
        forced_edge=False,
        widened=False,
    )
    spans = [span for _, span in located]
    if end >= length and not truncated:  # the last window keeps every chunk
        keep, nxt = spans, length
    elif spans[-1][0] > 0:  # the buffer: the next window starts with the last chunk
        keep, nxt = spans[:-1], start + spans[-1][0]
        window["carried"] = [start + spans[-1][0], start + spans[-1][1]]
    elif truncated:  # a cut answer whose only chunk starts the window: nothing to keep
        window.update(status="failed", reason="length", fallback=True, accepted=[])
        return end, end, False
    elif can_widen:  # one chunk in a window cut short at a paragraph end: the same, with the whole budget
        window.update(widened=True, accepted=[])
        return start, end, True
    else:  # one chunk from the window's start: keep it; the edge is forced if it reaches it
        keep, nxt = spans, spans[-1][1]
        window["forced_edge"] = nxt >= len(body.rstrip())
        while nxt < len(body) and body[nxt].isspace():
            nxt += 1
        nxt += start
    window["accepted"] = [[start + s, start + e, d] for s, e, d in keep]
    record["chunks"].extend({"start": start + s, "end": start + e, "distance": d} for s, e, d in keep)
    return nxt, end, False


# ------------------------------------------------------------------------------------- the task


class MocDocument(NamedTuple):
    id: str
    text: str
    lang: str


def read_moc_documents(cfg: DistillConfig, rejects: Rejects | None = None) -> list[MocDocument]:
    """The documents to chunk (the first ``limit``); ids must be unique (a duplicate is a bad
    row, `metachunk.sources.DocumentSource`); bad rows to ``rejects`` when given."""
    docs = []
    for doc in read_documents(cfg.documents, rejects=rejects, max_row_bytes=cfg.bad_rows.max_row_bytes):
        lang = detect_lang(doc.text) if cfg.lang == "auto" else cfg.lang
        docs.append(MocDocument(doc.id, doc.text, lang))
        if cfg.limit is not None and len(docs) >= cfg.limit:
            break
    return docs


class MocTask:
    """``distill moc`` as the driver (`metachunk.distill.run`) runs it: one record per document. A
    document's windows are sequential, so the driver keeps one document in flight per request slot."""

    name = TASK
    stages = (STAGE,)
    unit = "document"
    workers_per_slot = 1

    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self.counter: TokenCounter | None = None  # loaded with the documents

    def read(self, rejects: Rejects | None = None) -> list[MocDocument]:
        docs = read_moc_documents(self.cfg, rejects)
        self.counter = TokenCounter(self.cfg.moc.tokenizer)
        return docs

    async def work(self, doc: MocDocument, runner: StageRunner) -> dict:
        plan = DocPlan.build(doc.id, doc.text, doc.lang, self.counter)
        return await chunk_document(plan, runner, self.cfg.moc)

    def summarize(self, records: list[dict]) -> dict:
        return summarize(records)

    def manifest(self) -> dict:
        return {"tokenizer": str(self.counter.path), "separator": SEPARATOR}

    def summary_line(self, summary: dict) -> str:
        outcome = tally(summary["outcome"])
        chunks, labels = summary["chunks"], summary["labels"]
        return (
            f"{self.cfg.out}/{TASK}.jsonl: {summary['documents']} documents ({outcome}); {summary['windows']['total']} "
            f"windows, {summary['fallbacks']} fallbacks; chunks {chunks['accepted']} accepted "
            f"({chunks['accepted_with_edits']} with edits), {chunks['flagged']} flagged; labels "
            f"{' '.join(f'{k}:{v}' for k, v in labels.items())}; {summary['samples']['total']} samples; "
            f"{summary['requests_sent']} requests sent, {summary['answers_from_store']} answers from the store; "
            f"{summary['prompt_tokens'] + summary['completion_tokens']:,} tokens, ${summary['cost']:.4f}; "
            + (f"{json_line(summary['json_answers'])}; " if summary["json_answers"] else "")
            + f"{summary['seconds']:.1f}s"
        )

    def status(self, records: list[dict]) -> list[str]:
        s = summarize(records)
        outcome, reasons = tally(s["outcome"]), tally(s["failed_by_reason"])
        windows = tally(s["windows"], skip=("total",))
        chunks = s["chunks"]
        return [
            f"moc: {s['documents']} documents  {outcome}" + (f"  (failed: {reasons})" if reasons else ""),
            f"  windows {s['windows']['total']}: {windows}; fallbacks {s['fallbacks']}, widened "
            f"{s['widened_windows']}, forced edges {s['forced_edges']}, over budget {s['over_budget_windows']}",
            f"  chunks: returned {chunks['returned']}, accepted {chunks['accepted']} ({chunks['accepted_with_edits']} "
            f"with edits), flagged {chunks['flagged']}; gaps {s['gaps']['count']} ({s['gaps']['chars']} chars)",
            f"  labels {' '.join(f'{k}:{v}' for k, v in s['labels'].items())}; samples {s['samples']['total']} "
            f"({s['samples']['unrecoverable']} unrecoverable)",
            f"  tokens {s['prompt_tokens']:,} prompt + {s['completion_tokens']:,} completion; ${s['cost']:.4f}",
            f"  answers: {json_line(s['json_answers']) or 'none read'}",
        ]

    def entries(self, record: dict) -> list[tuple[str, dict]]:
        return [(STAGE, w["answer"]) for w in record["windows"] if w.get("answer")]

    def pending_calls(self, record: dict, doc: MocDocument) -> list[tuple[str, int, int, int]]:
        """The document's text after its last window's start, in windows of ``window_tokens`` (a
        quarter re-sent as chunk buffer), each answered at worst with ``max_tokens``. The number of
        windows is estimated (`estimate_tokens`); their prompts are counted at the bound a live run
        reserves, 1 token per UTF-8 byte of the text and the prompt file (`prompt_bytes`)."""
        template = load_prompt(STAGE, record["lang"])
        messages = [
            {"role": "system", "content": template.system},
            {"role": "user", "content": template.user},
        ]
        instructions = prompt_bytes(messages) + template_tokens(messages)
        pos = record["windows"][-1]["start"] if record["windows"] else 0
        rest = doc.text[pos:]
        n = max(1, math.ceil(estimate_tokens(rest) / (0.75 * self.cfg.moc.window_tokens)))
        prompt = math.ceil(len(rest.encode("utf-8")) / 0.75) + n * instructions
        return [(STAGE, n, prompt, n * self.cfg.teachers[STAGE].max_tokens)]


def summarize(records: Sequence[dict]) -> dict:
    """The run's counts over every record (documents, windows, chunks, labels, samples, spend)."""
    outcome = Counter(r["status"] for r in records)
    failed = Counter(r["reason"] for r in records if r["status"] == "failed")
    windows = Counter(w["status"] for r in records for w in r["windows"])
    counts = Counter()
    for r in records:
        counts.update(r.get("counts") or {})
    spend = {"prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}
    for r in records:
        for w in r["windows"]:
            entry = w.get("answer") or {}
            spent = entry.get("spent") or {**entry.get("usage", {}), "cost": entry.get("cost", 0.0)}
            for k in spend:
                spend[k] += spent.get(k, 0)
    ok = [r for r in records if r["status"] == "ok"]
    samples = [s for r in ok for s in r["samples"]]
    lengths = [c["end"] - c["start"] for r in ok for c in r["chunks"]]
    return {
        "documents": len(records),
        "outcome": dict(outcome),
        "failed_by_reason": dict(failed),
        "windows": {**dict(windows), "total": sum(windows.values())},
        "fallbacks": counts["fallbacks"],
        "forced_edges": counts["forced_edges"],
        "widened_windows": counts["widened"],
        "over_budget_windows": counts["over_budget"],
        "chunks": {
            "returned": counts["returned"],
            "accepted": counts["accepted"],
            "accepted_with_edits": counts["fuzzy"],
            "flagged": counts["flagged"],
            "mean_chars": round(sum(lengths) / len(lengths), 1) if lengths else 0.0,
        },
        "gaps": {
            "count": sum(len(r["gaps"]) for r in records),
            "chars": sum(e - s for r in records for s, e in r["gaps"]),
        },
        "labels": {label: sum(1 for r in ok if r["label"] == int(label)) for label in ROUTER_LABELS},
        "samples": {
            "total": len(samples),
            "unrecoverable": sum(1 for s in samples if not s["recoverable"]),
            "by_label": {  # each sample by its own label, as build-sft sorts them
                label: sum(1 for s in samples if granularity_label(s["mean_chunk_chars"]) == int(label))
                for label in ROUTER_LABELS
            },
        },
        "prompt_tokens": spend["prompt_tokens"],
        "completion_tokens": spend["completion_tokens"],
        "cost": round(spend["cost"], 6),
        "json_answers": json_answers(
            (STAGE, w["answer"]) for r in records for w in r["windows"] if w.get("answer")
        ),
    }
