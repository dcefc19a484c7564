"""Questions, relevance and rank metrics for ``metachunk eval qa``.

Two QA sources (``--qa-format``, detected from the file when ``auto``):

* **GutenQA** (``questions.jsonl``: ``question, answer, chunk_must_contain``). The evidence is
  where ``chunk_must_contain`` sits in the documents, found in three steps: verbatim; then in the
  *normalised* text (NFKC, lower case, whitespace and quote marks removed: GutenQA writes ``'`` where
  the book has curly quotes, and joins paragraphs that the book separates); then, for a string that
  still is not found (GutenQA sometimes trims narration out of a quote), the best fuzzy alignment in
  the normalised text (``rapidfuzz`` partial ratio >= ``fuzzy_threshold``, default 90).
* **CRUD** (``qa_matches.jsonl`` from ``metachunk data prepare-crud``: ``qa_id, status, doc_ids,
  key_info, questions, answers``). Each entry has several questions; one row per question. Entries
  whose status is ``unmatched`` have no evidence article and are left out. The evidence of a
  question is the occurrences, *inside its matched articles only*, of its key strings, chosen in
  this order (the first level with an occurrence wins):

  1. the entry's ``key_info`` strings that hold the answer or are held by it (CRUD's key_info list
     is per entry, not per question: "500万元" is answered by the key "500万元体育类电子消费券");
  2. the answer itself (when it states a fact: not 无法推断, 是的, ...) plus the key strings that
     the question names;
  3. every ``key_info`` string of the entry.

**Relevance of a chunk** (both formats), by offsets in the original document, under one of two
rules (``--relevance``):

* ``whole``: the chunk holds an evidence span whole. This is GutenQA's rule (LumberChunker's
  evaluation counts a chunk that contains ``chunk_must_contain``) and Meta-Chunking's (the gold
  string inside the chunk): a chunk that cuts through the evidence is not relevant, and a question
  whose evidence every chunker cut has no relevant chunk and counts as a miss, which is what a
  chunking evaluation is there to see.
* ``share`` (the default, which the published tables use): the chunk covers at least ``min_share``
  (default 0.5) of an evidence span, **or** it is the chunk that covers the largest part of that
  span. So a string cut in two makes relevant the chunk(s) holding at least half of it, and a
  string spread over three or more small chunks still has one relevant chunk. Every question whose
  evidence is in the corpus has at least one relevant chunk, whatever the chunker.

A question with no evidence in the chunked documents (its chapter or article was not chunked)
counts as a miss under both (``--questions answerable`` leaves such questions out; which questions
those are depends on the evidence, never on the chunker).

**Metrics** over questions, at cutoff ``k`` (ranks are 1-based):

* Hits@k: 1 if any of the first ``k`` chunks is relevant;
* MRR@k: 1 / rank of the first relevant chunk within ``k``, else 0;
* MAP@k: mean of AP@k = (1 / min(R, k)) * sum over relevant ranks r <= k of precision@r, where R
  is the number of relevant chunks in the whole corpus (0 when R = 0);
* DCG@k: 1 / log2(r + 1) for the first relevant rank r <= k, else 0: GutenQA's DCG with binary
  relevance, where only the first match counts.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from metachunk.artifacts import InputError, check_unicode
from metachunk.crud import informative
from metachunk.sources import MAX_ROW_BYTES, Rejects, read_records, refuse_or_skip

FORMATS = ("gutenqa", "crud")
QUOTES = frozenset("'\"‘’“”„‟‚‛«»「」『』`´")  # dropped by the normaliser


# --------------------------------------------------------------------------------- normalising


def normalize_with_map(text: str) -> tuple[str, list[int]]:
    """``(normalised, where)``: NFKC, lower case, no whitespace, no quote marks; ``where[i]`` is
    the offset in ``text`` of the character that produced normalised character ``i``."""
    out: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        if ch.isspace() or ch in QUOTES:
            continue
        for c in unicodedata.normalize("NFKC", ch).lower():
            if c.isspace() or c in QUOTES:
                continue
            out.append(c)
            where.append(i)
    return "".join(out), where


def normalize(text: str) -> str:
    return normalize_with_map(text)[0]


class NormalizedDoc:
    """A document's normalised text and the map back to its original offsets."""

    __slots__ = ("id", "text", "norm", "where")

    def __init__(self, doc_id: str, text: str):
        self.id, self.text = doc_id, text
        self.norm, self.where = normalize_with_map(text)

    def span(self, a: int, b: int) -> tuple[int, int]:
        """Original offsets of normalised span ``[a, b)``."""
        return self.where[a], self.where[b - 1] + 1


# --------------------------------------------------------------------------------- questions


@dataclass
class Question:
    qid: str
    question: str
    answer: str
    # Evidence strings by priority level (the first level found in the corpus wins).
    needle_levels: list[list[str]]
    doc_ids: frozenset[str] | None = None  # evidence documents; None: any document
    source: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Evidence:
    doc_id: str
    start: int
    end: int
    needle: str
    how: str  # verbatim | normalized | fuzzy:SCORE


def detect_format(path: Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> str:
    """``gutenqa`` or ``crud`` from the first record of ``path``; with ``rejects``, from its first
    record that is either (the pass that reads the questions rejects the others)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "no such file")
    with path.open("rb") as f:
        if f.read(1) == b"{" and path.suffix == ".json":
            raise InputError(
                path,
                "this looks like CRUD's raw QA file; run `metachunk data prepare-crud` and pass its "
                "qa_matches.jsonl (questions matched to their evidence articles)",
            )
    for number, _, row in read_records(path, None if rejects is None else Rejects(None), max_row_bytes):
        if "chunk_must_contain" in row:
            return "gutenqa"
        if "qa_id" in row:
            return "crud"
        if rejects is None:
            raise InputError(
                path,
                "cannot tell the QA format: expected GutenQA rows (question, answer, chunk_must_contain) "
                "or qa_matches.jsonl rows from `metachunk data prepare-crud` (qa_id, ...)",
                number,
            )
    raise InputError(path, "no questions in the file")


def _rows(
    path: Path, rejects: Rejects | None = None, make=None, max_row_bytes: int = MAX_ROW_BYTES
) -> Iterable:
    """What ``make(number, row)`` gives for each row (``(number, row)`` without one); a bad line, or
    a row ``make`` refuses with an `InputError`, is an error or, with ``rejects``, left out."""
    for number, raw, row in read_records(path, rejects, max_row_bytes):
        try:
            made = make(number, row) if make else (number, row)
        except InputError as e:
            refuse_or_skip(rejects, e, raw)
            continue
        yield made


def _field(path, number, row, name, kind):
    value = row.get(name)
    if not isinstance(value, kind):
        raise InputError(path, f"field {name!r} must be a {kind.__name__}", number)
    strings = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for s in strings:
        if isinstance(s, str):
            check_unicode(path, number, name, s)
    return value


def load_gutenqa(
    path: Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES
) -> list[Question]:
    def question(number: int, row: dict) -> Question:
        q = _field(path, number, row, "question", str)
        a = _field(path, number, row, "answer", str)
        must = _field(path, number, row, "chunk_must_contain", str)
        if not must.strip():
            raise InputError(path, "field 'chunk_must_contain' is empty", number)
        return Question("", q, a, [[must]], None, {"line": number})

    # Numbered among the good rows, so a skipped row does not renumber the ones after it differently
    # from a file without it.
    return [
        replace(q, qid=f"gutenqa-{i}") for i, q in enumerate(_rows(path, rejects, question, max_row_bytes))
    ]


def crud_needle_levels(question: str, answer: str, key_info: Sequence[str]) -> list[list[str]]:
    """The evidence strings of one CRUD question, by priority (see the module docstring)."""
    keys = [k for k in dict.fromkeys(key_info) if normalize(k)]
    a, q = normalize(answer), normalize(question)
    levels = []
    if informative(answer) and a:
        levels.append([k for k in keys if a in normalize(k) or normalize(k) in a])
        levels.append([answer] + [k for k in keys if normalize(k) in q])
    else:
        levels.append([k for k in keys if normalize(k) in q])
    levels.append(keys)
    return [level for level in levels if level]


def load_crud(path: Path, statuses: Sequence[str], skipped: dict | None = None,
              rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> list[Question]:  # fmt: skip
    """One question per (question, answer) pair of each entry with one of ``statuses``. An entry
    whose question and answer lists differ in length (40 of CRUD's 800) cannot be paired safely
    (its answers skip questions): it is left out and counted in ``skipped``."""
    out = []
    skipped = {} if skipped is None else skipped
    first_line: dict[str, int] = {}  # each qa_id's line: a second entry would be asked and counted twice

    def entry(number: int, row: dict) -> tuple:
        fields = {name: _field(path, number, row, name, kind) for name, kind in
                  (("qa_id", str), ("status", str), ("doc_ids", list), ("key_info", list),
                   ("questions", list), ("answers", list))}  # fmt: skip
        for name in ("doc_ids", "key_info", "questions", "answers"):  # str() made null the evidence "None"
            bad = next((i for i, v in enumerate(fields[name]) if not isinstance(v, str)), None)
            if bad is not None:
                raise InputError(path, f"field {name!r}: item {bad} must be a string, got {fields[name][bad]!r:.40}",
                                 number)  # fmt: skip
        seen = first_line.setdefault(fields["qa_id"], number)
        if seen != number:
            raise InputError(
                path, f"field 'qa_id': {fields['qa_id']!r} is a duplicate of line {seen}", number
            )
        return number, fields

    for number, fields in _rows(path, rejects, entry, max_row_bytes):
        qa_id, status = fields["qa_id"], fields["status"]
        if status not in statuses:
            continue
        doc_ids, keys, questions, answers = (
            fields[k] for k in ("doc_ids", "key_info", "questions", "answers")
        )
        if len(questions) != len(answers):
            skipped["crud_entries_unpaired"] = skipped.get("crud_entries_unpaired", 0) + 1
            skipped["crud_questions_unpaired"] = skipped.get("crud_questions_unpaired", 0) + len(questions)
            continue
        for j, (q, a) in enumerate(zip(questions, answers)):
            out.append(
                Question(
                    f"{qa_id}#{j}",
                    str(q),
                    str(a),
                    crud_needle_levels(str(q), str(a), [str(k) for k in keys]),
                    frozenset(map(str, doc_ids)),
                    {"qa_id": qa_id, "status": status, "line": number},
                )
            )
    return out


def load_questions(
    path: Path, fmt: str = "auto", crud_statuses: Sequence[str] = ("matched", "ambiguous"),
    rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES,
) -> tuple[str, list[Question], dict]:  # fmt: skip
    """``(format, questions, skipped)``; ``skipped`` counts what could not be asked, by reason.
    Bad rows go to ``rejects`` when given (``--on-bad-row skip``)."""
    fmt = detect_format(path, rejects, max_row_bytes) if fmt == "auto" else fmt
    skipped: dict = {}
    if fmt == "gutenqa":
        return fmt, load_gutenqa(path, rejects, max_row_bytes), skipped
    if fmt == "crud":
        return fmt, load_crud(path, crud_statuses, skipped, rejects, max_row_bytes), skipped
    raise ValueError(f"unknown QA format {fmt!r}; have {', '.join(FORMATS)}")


# --------------------------------------------------------------------------------- evidence


def _occurrences(haystack: str, needle: str) -> list[int]:
    found, i = [], haystack.find(needle)
    while i >= 0:
        found.append(i)
        i = haystack.find(needle, i + 1)
    return found


def find_evidence(
    question: Question, docs: dict[str, NormalizedDoc], fuzzy: bool, fuzzy_threshold: float = 90.0
) -> list[Evidence]:
    """Evidence spans of ``question`` in ``docs`` (original offsets), per the module docstring."""
    pool = [d for doc_id, d in docs.items() if question.doc_ids is None or doc_id in question.doc_ids]
    for level in question.needle_levels:
        found: list[Evidence] = []
        for needle in level:
            for d in pool:
                hits = [(i, i + len(needle), "verbatim") for i in _occurrences(d.text, needle)]
                if not hits:
                    n = normalize(needle)
                    hits = (
                        [(*d.span(i, i + len(n)), "normalized") for i in _occurrences(d.norm, n)] if n else []
                    )
                found += [Evidence(d.id, a, b, needle, how) for a, b, how in hits]
        if not found and fuzzy:
            found = _fuzzy(level, pool, fuzzy_threshold)
        if found:
            return found
    return []


def _fuzzy(needles: list[str], pool: list[NormalizedDoc], threshold: float) -> list[Evidence]:
    """The single best fuzzy alignment of any needle over ``pool`` (normalised texts)."""
    from rapidfuzz import fuzz

    best = None
    for needle in needles:
        n = normalize(needle)
        if len(n) < 20:  # short strings align by chance somewhere
            continue
        for d in pool:
            if not d.norm:
                continue
            al = fuzz.partial_ratio_alignment(n, d.norm, score_cutoff=threshold)
            if al is not None and (best is None or al.score > best[0]):
                best = (al.score, d, needle, al.dest_start, al.dest_end)
    if best is None:
        return []
    score, d, needle, a, b = best
    return [Evidence(d.id, *d.span(a, b), needle, f"fuzzy:{score:.1f}")]


def relevant_chunks(
    evidence: Sequence[Evidence],
    chunks_by_doc: dict[str, list[tuple[int, int, int]]],
    min_share: float,
    rule: str = "share",
) -> set[int]:
    """Ids of the relevant chunks under ``rule`` (``share`` or ``whole``). ``chunks_by_doc[doc_id]``:
    ``(chunk id, start, end)``."""
    relevant: set[int] = set()
    for ev in evidence:
        length = max(1, ev.end - ev.start)
        shares = []
        for cid, start, end in chunks_by_doc.get(ev.doc_id, ()):
            overlap = min(end, ev.end) - max(start, ev.start)
            if overlap > 0:
                shares.append((overlap / length, cid))
        if not shares:
            continue
        if rule == "whole":
            relevant.update(cid for s, cid in shares if s >= 1.0)
            continue
        top = max(s for s, _ in shares)
        relevant.update(cid for s, cid in shares if s >= min_share or s == top)
    return relevant


# --------------------------------------------------------------------------------- metrics


def rank_metrics(flags: Sequence[bool], n_relevant: int, k: int) -> dict[str, float]:
    """Hits@k, MRR@k, AP@k and DCG@k of one ranked list (``flags[i]``: rank i+1 is relevant)."""
    top = list(flags[:k])
    first = next((i for i, f in enumerate(top) if f), None)
    hits, ap = 0, 0.0
    for i, f in enumerate(top):
        if f:
            hits += 1
            ap += hits / (i + 1)
    denominator = min(n_relevant, k)
    return {
        "hits": float(first is not None),
        "mrr": 0.0 if first is None else 1.0 / (first + 1),
        "map": ap / denominator if denominator else 0.0,
        "dcg": 0.0 if first is None else 1.0 / math.log2(first + 2),
    }


def cutoffs(depth: int, top_k: int) -> list[int]:
    """Hits cutoffs reported: the paper's 2, 4, 6, 8 (and 1, 10) up to ``depth``, ``top_k`` and ``depth``."""
    return sorted({k for k in (1, 2, 4, 6, 8, 10, top_k) if k <= depth} | {depth})


def aggregate(
    ranked: Sequence[Sequence[bool]],
    n_relevant: Sequence[int],
    hit_ks: Sequence[int],
    score_ks: Sequence[int],
    prefix: str = "",
) -> dict[str, float]:
    """Mean Hits@k for every ``k`` in ``hit_ks``; mean MRR@k, MAP@k and DCG@k for every ``k`` in ``score_ks``."""
    n = len(ranked)
    out: dict[str, float] = {}
    if not n:
        return out
    for k in hit_ks:
        out[f"{prefix}hits@{k}"] = sum(rank_metrics(f, r, k)["hits"] for f, r in zip(ranked, n_relevant)) / n
    for k in sorted(set(score_ks)):
        for name in ("mrr", "map", "dcg"):
            out[f"{prefix}{name}@{k}"] = (
                sum(rank_metrics(f, r, k)[name] for f, r in zip(ranked, n_relevant)) / n
            )
    return out
