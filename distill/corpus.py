"""``metachunk data prepare-crud``: split the CRUD news corpus into test documents and a clean training pool.

Meta-Chunking (Appendix H) evaluates on the CRUD news articles that its QA pairs were written from,
and trains the rewriting and summary models only on the remaining articles. Our corpus is a
1,200-article sample of CRUD's 80K, so most QA entries have no source article here at all; the job
is to find the ones that do, say how sure we are, and keep those articles (and anything that is
nearly the same text) out of the training pool.

Matching ("sentence- and key-string matching"). Every QA entry has key strings (``key_info``) and
answers. Texts are compared after NFKC normalisation, lower-casing and whitespace removal. For a
candidate article, each key string gets a credit:

* 1 when it occurs verbatim in the article;
* otherwise ``max(0, (f - 0.5) / 0.5)``, where ``f`` is the best character-bigram containment of
  the key (punctuation dropped) in one of the article's sentences (split on 。！？；!?; and newlines),
  i.e. the share of the key's bigrams that one sentence holds. Against unrelated articles about
  95% of keys score ``f < 0.5``, hence the offset; the paraphrased keys of true sources mostly
  score 0.8-0.93. A sentence counts only if it holds every number of the key, compared whole
  ("500人" is not in "35,000人"), and a key of one bigram gets no fuzzy credit.

The key coverage ``K`` is the mean credit weighted by key length, capped at 10 characters (a
2-character key such as 中国 is weak evidence; a 10-character string is already as good as unique).
The answer coverage ``A`` is the unweighted mean credit of the informative answers (not 无法推断 and
the like, at least 2 characters), scored the same way: answers are often paraphrased whole
sentences (28% of the answers of clear matches are not verbatim), so verbatim-only would punish the
true source. Then:

```
confidence = 0.8 * K + 0.2 * A     (confidence = K when no answer is informative)
```

An entry is ``matched`` when its best article reaches ``match_threshold`` and the runner-up is at
least ``margin`` lower; ``ambiguous`` when it reaches the threshold but other articles are within the
margin (near-identical reports of one event; all of them become test documents); ``unmatched``
otherwise. Candidates come from an inverted index of character trigrams (IDF-weighted hits, top
``shortlist`` articles), so only a few thousand article/entry pairs are scored in full; on the
shared data a shortlist of 10 already decides every entry as scoring all 1,200 articles does.

The default threshold, 0.7, comes from reading the entries around it on the shared data (800
entries; best-candidate confidences 0.5-0.6: 16, 0.6-0.7: 9, 0.7-0.8: 7, 0.8-0.9: 8, 0.9-1: 43, no
clean valley). From 0.7 up, what the best article misses are paraphrases or generic words; below,
it misses specific facts (another match report of the same team, another article on the same
typhoon). Erring low is the safe side: a wrong match only moves an article from the pool to the
test set, a missed one would leak its source into training.

Leakage. Exact copies (same normalised text under another id) are folded into their first copy
before matching. Every remaining article that is an exact copy of a test document, or a near
duplicate (character 5-gram Jaccard >= ``near_dup_threshold``, found with MinHash LSH and checked
exactly), is removed from the training pool, and each removal is reported with its test document.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from metachunk import config
from metachunk.artifacts import (
    SCHEMA_VERSION,
    Document,
    InputError,
    OutputSet,
    check_unicode,
    jsonl_line,
    read_json,
)
from metachunk.command import Reads, Result
from metachunk.config import block, option
from metachunk.crud import informative, normalize  # shared with eval: how CRUD's QA pairs are read
from metachunk.sources import (
    BadRows,
    Rejects,
    finish_rejects,
    read_documents,
    read_records,
    refuse_or_skip,
)

# datasketch (which imports scipy) is imported where used: `metachunk --help` must not pay for it.
if TYPE_CHECKING:
    from datasketch import MinHash

STATUSES = ("matched", "ambiguous", "unmatched")
DEFAULT_MATCH_THRESHOLD = 0.7
DEFAULT_MARGIN = 0.1

KEY_WEIGHT_CAP = 10  # characters: a key string longer than this counts no more than this
FUZZY_FLOOR = 0.5  # bigram containment at or below this earns no credit
KEY_SHARE = 0.8  # of the confidence; the answers give the rest

_SENTENCE_END = re.compile(r"[。！？；!?;\n]+")
_WHITESPACE = re.compile(r"\s+")
_PUNCTUATION = re.compile(r"[\W_]+")


def char_ngrams(text: str, n: int) -> set[str]:
    """The set of ``n``-character substrings; a non-empty text shorter than ``n`` is one gram."""
    if len(text) < n:
        return {text} if text else set()
    return {text[i : i + n] for i in range(len(text) - n + 1)}


# -------------------------------------------------------------------------------- near duplicates


class NearDuplicateIndex:
    """Texts indexed by key; ``query`` finds those whose shingle Jaccard with a text is >= threshold.

    Shingles are character ``shingle``-grams of the text with all whitespace removed, which works
    the same for Chinese and English (a text shorter than ``shingle`` is one shingle; an empty text
    has none and never matches). Candidates come from datasketch's MinHash LSH with ``num_perm``
    permutations, built for ``threshold - 0.2``: at the default 0.8 a pair right at the threshold is
    a candidate with probability ~0.99 (an LSH built at the threshold itself finds it ~40% of the
    time, and MinHash false negatives are leaks). Each candidate is then checked with the exact Jaccard of the shingle sets, so
    there are no false positives. Deterministic for a given ``seed``.

    Memory: per text, its LSH entry (~6 KB at 128 permutations) and the text itself without whitespace;
    a candidate's shingle set is rebuilt from that text when it is checked. (Keeping the shingle sets
    instead cost ~50 KB per 350-character text, ~1 GB for build-sft's 20K chunks.)

    Used by prepare-crud (pool articles vs. test articles) and by build-sft (decontamination and
    near-duplicate rows):

    ```
    index = NearDuplicateIndex(threshold=0.8)
    index.add("doc-1", text)
    index.query(other_text)  # -> ["doc-1"] when they are near duplicates
    ```
    """

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, shingle: int = 5, seed: int = 1):
        from datasketch import MinHashLSH

        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if num_perm < 2:
            raise ValueError(f"num_perm must be at least 2, got {num_perm}")
        if shingle < 1:
            raise ValueError(f"shingle must be at least 1, got {shingle}")
        self.threshold = threshold
        self.num_perm = num_perm
        self.shingle = shingle
        self.seed = seed
        self._lsh = MinHashLSH(threshold=max(0.05, threshold - 0.2), num_perm=num_perm)
        self._texts: dict[str, str] = {}  # key -> text without whitespace; shingles rebuilt on demand
        self._order: dict[str, int] = {}  # insertion order breaks ties in query results

    def shingles(self, text: str) -> frozenset[str]:
        return frozenset(char_ngrams(_WHITESPACE.sub("", text), self.shingle))

    def _minhash(self, shingles: Iterable[str]) -> MinHash:
        from datasketch import MinHash

        m = MinHash(num_perm=self.num_perm, seed=self.seed)
        m.update_batch([s.encode("utf-8") for s in shingles])
        return m

    def add(self, key: str, text: str) -> None:
        """Index ``text`` under ``key``; a key can be added once."""
        if key in self._texts:
            raise ValueError(f"key {key!r} is already in the index")
        squeezed = _WHITESPACE.sub("", text)
        shingles = self.shingles(squeezed)
        self._order[key] = len(self._order)
        self._texts[key] = squeezed
        if shingles:
            self._lsh.insert(key, self._minhash(shingles))

    def query_scored(self, text: str) -> list[tuple[str, float]]:
        """``(key, exact Jaccard)`` of the indexed texts at or above the threshold, most similar first."""
        shingles = self.shingles(text)
        if not shingles or not self._texts:
            return []
        found = []
        for key in self._lsh.query(self._minhash(shingles)):
            other = self.shingles(self._texts[key])
            similarity = len(shingles & other) / len(shingles | other)
            if similarity >= self.threshold:
                found.append((key, similarity))
        return sorted(found, key=lambda kv: (-kv[1], self._order[kv[0]]))

    def query(self, text: str) -> list[str]:
        """Keys of the indexed texts whose Jaccard with ``text`` is >= threshold, most similar first."""
        return [key for key, _ in self.query_scored(text)]

    def __contains__(self, key: object) -> bool:
        return key in self._texts

    def __len__(self) -> int:
        return len(self._texts)


# ---------------------------------------------------------------------------------------- QA input


@dataclass(frozen=True, slots=True)
class QAEntry:
    qa_id: str
    key_info: tuple[str, ...]
    questions: tuple[str, ...]
    answers: tuple[str, ...]


def read_qa(path: str | Path, rejects: Rejects | None = None) -> dict[str, QAEntry]:
    """CRUD's QA file: ``{qa_id: {"key_info": [...], "question": [...], "answers": [...]}}``. A
    malformed entry is an error, or with ``rejects`` (``--on-bad-row skip``) left out; the file
    itself must be one JSON object."""
    path = Path(path)
    data = read_json(path)
    entries = {}
    for qa_id, entry in data.items():
        try:
            entries[qa_id] = _qa_entry(path, qa_id, entry)
        except InputError as e:
            refuse_or_skip(rejects, e, json.dumps({qa_id: entry}, ensure_ascii=False))
    return entries


def _qa_entry(path: Path, qa_id: str, entry) -> QAEntry:
    if not isinstance(entry, dict):
        raise InputError(path, f"entry {qa_id!r} must be an object")
    fields = {}
    for name in ("key_info", "question", "answers"):
        value = entry.get(name)
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InputError(path, f"entry {qa_id!r}: field {name!r} must be a list of strings")
        for s in value:
            check_unicode(path, None, f"{qa_id}.{name}", s)
        fields[name] = tuple(value)
    return QAEntry(qa_id, fields["key_info"], fields["question"], fields["answers"])


# ---------------------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class QAMatch:
    """Where one QA entry comes from.

    ``doc_ids`` are the articles the entry makes test documents: the best one when matched, every
    article within the margin of the best when ambiguous, none when unmatched. ``candidates`` are
    the best-scoring articles whatever the status (``[doc_id, confidence]``, up to three), and
    ``evidence`` says which key strings, answers and sentences the best candidate hit.
    """

    qa_id: str
    status: str
    confidence: float
    doc_ids: tuple[str, ...]
    candidates: tuple[tuple[str, float], ...] = ()
    evidence: dict = field(default_factory=dict)


_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3})")


def _numbers(normalized: str) -> frozenset[str]:
    """The numbers in a normalised text, whole: "35,000人" holds 35000, not 500."""
    return frozenset(_NUMBER.findall(_THOUSANDS.sub("", normalized)))


@dataclass
class _Article:
    text: str  # normalised
    sentences: list[str]  # as written, for evidence
    bigrams: list[set[str]]  # per sentence, normalised, punctuation dropped
    numbers: list[frozenset[str]]  # per sentence
    all_bigrams: set[str]  # of all sentences: a bound that spares most sentence-by-sentence searches


def _article(text: str) -> _Article:
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if normalize(s)]
    normalized = [normalize(s) for s in sentences]
    bigrams = [char_ngrams(_PUNCTUATION.sub("", s), 2) for s in normalized]
    return _Article(
        normalize(text), sentences, bigrams, [_numbers(s) for s in normalized], set().union(*bigrams)
    )


@dataclass(frozen=True)
class _Needle:
    """A key string or answer to look for: as written, normalised, its bigrams and its numbers."""

    original: str
    text: str
    bigrams: frozenset[str]
    numbers: frozenset[str]


def _needles(strings: Iterable[str]) -> list[_Needle]:
    """First spelling of each distinct normalised string; empty strings dropped."""
    seen: dict[str, str] = {}
    for s in strings:
        n = normalize(s)
        if n and n not in seen:
            seen[n] = s
    return [
        _Needle(s, n, frozenset(char_ngrams(_PUNCTUATION.sub("", n), 2)), _numbers(n))
        for n, s in seen.items()
    ]


def _credit(needle: _Needle, article: _Article) -> tuple[float, float, int]:
    """(credit, bigram containment, best sentence index; -1 when verbatim or nothing) of one needle.

    Only sentences holding all of the needle's numbers count: a paraphrase keeps its figures, and
    bigrams alone would find "500人" in "35,000人".
    """
    if needle.text in article.text:
        return 1.0, 1.0, -1
    grams = needle.bigrams
    if len(grams) < 2:  # one bigram is not enough to tell a paraphrase from chance
        return 0.0, 0.0, -1
    if len(grams & article.all_bigrams) <= FUZZY_FLOOR * len(grams):  # no sentence can earn credit
        return 0.0, 0.0, -1
    best, where = 0, -1
    for i, sentence in enumerate(article.bigrams):
        shared = len(grams & sentence)
        if shared > best and needle.numbers <= article.numbers[i]:
            best, where = shared, i
    share = best / len(grams)
    return max(0.0, (share - FUZZY_FLOOR) / (1 - FUZZY_FLOOR)), share, where


def _score(
    keys: list[_Needle], answers: list[_Needle], article: _Article
) -> tuple[float, float | None, float | None]:
    """(confidence, key coverage K, answer coverage A) of ``article`` as the source of an entry.

    See the module docstring; each value is rounded to 4 decimals, and K or A is None when the
    entry has no key strings or no informative answers.
    """
    k = a = None
    if keys:
        weights = [min(len(n.text), KEY_WEIGHT_CAP) for n in keys]
        k = round(sum(w * _credit(n, article)[0] for w, n in zip(weights, keys)) / sum(weights), 4)
    if answers:
        a = round(sum(_credit(n, article)[0] for n in answers) / len(answers), 4)
    if k is None or a is None:
        confidence = k if a is None else a
        return (0.0 if confidence is None else confidence), k, a
    return round(KEY_SHARE * k + (1 - KEY_SHARE) * a, 4), k, a


def _evidence(keys: list[_Needle], answers: list[_Needle], article: _Article) -> dict:
    """Which key strings and answers ``article`` holds verbatim, which only in a similar sentence."""
    evidence: dict = {}
    for kind, needles in (("keys", keys), ("answers", answers)):
        verbatim, fuzzy, missing = [], [], []
        for n in needles:
            value, share, where = _credit(n, article)
            if value == 1.0 and where == -1:
                verbatim.append(n.original)
            elif value > 0:
                sentence = article.sentences[where]
                sentence = sentence if len(sentence) <= 200 else sentence[:200] + "…"
                fuzzy.append({"text": n.original, "overlap": round(share, 4), "sentence": sentence})
            else:
                missing.append(n.original)
        evidence |= {f"{kind}_verbatim": verbatim, f"{kind}_fuzzy": fuzzy, f"{kind}_missing": missing}
    _, evidence["key_coverage"], evidence["answer_coverage"] = _score(keys, answers, article)
    return evidence


class _GramIndex:
    """Character n-gram -> articles holding it, for shortlisting candidates by IDF-weighted hits.

    Only the grams in ``vocabulary`` (trigrams of the strings that will be looked up, or the
    strings themselves when shorter) are indexed.
    """

    def __init__(self, texts: Sequence[str], vocabulary: set[str]):
        by_length: dict[int, set[str]] = {}
        for gram in vocabulary:
            by_length.setdefault(len(gram), set()).add(gram)
        postings: dict[str, list[int]] = {}
        for i, text in enumerate(texts):
            for n, grams in sorted(by_length.items()):
                for gram in char_ngrams(text, n) & grams:
                    postings.setdefault(gram, []).append(i)
        self.size = len(texts)
        self.postings = {g: np.array(ids, dtype=np.int64) for g, ids in postings.items()}
        # Smoothed, so that a gram found in every article (a corpus of one) still counts a little.
        self.idf = {g: math.log(1 + self.size / len(ids)) for g, ids in postings.items()}

    def shortlist(self, grams: set[str], limit: int) -> list[int]:
        scores = np.zeros(self.size)
        for gram in sorted(grams):  # a fixed order: the float sums, and so the ranking, never change
            if gram in self.postings:
                scores[self.postings[gram]] += self.idf[gram]
        order = np.lexsort((np.arange(self.size), -scores))  # best first, ties in corpus order
        return [int(i) for i in order[:limit] if scores[i] > 0]


def _lookup_grams(needles: Iterable[_Needle]) -> set[str]:
    """What the shortlist looks up: a needle's character trigrams, or the needle itself when shorter."""
    grams = set()
    for n in needles:
        grams |= char_ngrams(n.text, 3)  # a 1- or 2-character needle is its own gram
    return grams


def match_qa(
    docs: Sequence[Document],
    qa: Mapping[str, QAEntry],
    match_threshold: float = DEFAULT_MATCH_THRESHOLD,
    margin: float = DEFAULT_MARGIN,
    shortlist: int = 20,
) -> list[QAMatch]:
    """Find the source article of each QA entry among ``docs``; one QAMatch per entry, in ``qa`` order.

    Deterministic: ties are broken by corpus order. Confidences are rounded to 4 decimals before
    any comparison, so the written numbers are the ones that were decided on.
    """
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids must be unique")
    entries = []
    for qa_id, entry in qa.items():
        answers = [n for n in _needles(entry.answers) if informative(n.original)]
        ignored = [a for a in entry.answers if not informative(a)]
        entries.append((qa_id, _needles(entry.key_info), answers, ignored))
    articles = [_article(d.text) for d in docs]
    index = _GramIndex(
        [a.text for a in articles], set().union(*(_lookup_grams(k + a) for _, k, a, _ in entries))
    )
    matches = []
    for qa_id, keys, answers, ignored in entries:
        candidates = index.shortlist(_lookup_grams(keys + answers), shortlist)
        scored = sorted(
            ((_score(keys, answers, articles[i])[0], i) for i in candidates), key=lambda ci: (-ci[0], ci[1])
        )
        if not scored:
            matches.append(QAMatch(qa_id, "unmatched", 0.0, (), (), {"answers_ignored": ignored}))
            continue
        best, best_i = scored[0]
        evidence = {
            "doc_id": ids[best_i],
            **_evidence(keys, answers, articles[best_i]),
            "answers_ignored": ignored,
        }
        close = [i for c, i in scored if round(best - c, 4) < margin]
        if best < match_threshold:
            status, doc_ids = "unmatched", ()
        elif len(close) == 1:
            status, doc_ids = "matched", (ids[best_i],)
        else:
            status, doc_ids = "ambiguous", tuple(ids[i] for i in close)
        top = tuple((ids[i], c) for c, i in scored[:3])
        matches.append(QAMatch(qa_id, status, best, doc_ids, top, evidence))
    return matches


# ------------------------------------------------------------------------------------ prepare-crud


@dataclass
class PrepareCrudConfig:
    news: Path = option(None, "news articles: JSONL with id, text and source (crud-news/news.jsonl)")
    qa: Path = option(None, "CRUD QA entries: JSON {qa_id: {key_info, question, answers}}")
    out: Path = option(
        None, "output dir: test_documents.jsonl, train_pool.jsonl, qa_matches.jsonl, report.json"
    )
    match_threshold: float = option(
        DEFAULT_MATCH_THRESHOLD, "an entry is matched when its best article's confidence reaches this"
    )
    margin: float = option(
        DEFAULT_MARGIN,
        "matched also needs the runner-up this much lower; else all articles this close are test (ambiguous)",
    )
    near_dup_threshold: float = option(
        0.8, "drop pool articles whose character 5-gram Jaccard with a test article reaches this"
    )
    num_perm: int = option(128, "MinHash permutations for the near-duplicate search")
    bad_rows: BadRows = block(BadRows, "what a bad article row or QA entry does", prefix="")

    def __post_init__(self):
        config.check_choices(self)
        for name in ("news", "qa", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        if not 0 < self.match_threshold <= 1:
            raise ValueError(f"field 'match_threshold' must be in (0, 1], got {self.match_threshold}")
        if not 0 < self.margin < 1:
            raise ValueError(f"field 'margin' must be in (0, 1), got {self.margin}")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError(f"field 'near_dup_threshold' must be in (0, 1], got {self.near_dup_threshold}")
        if self.num_perm < 2:
            raise ValueError(f"field 'num_perm' must be at least 2, got {self.num_perm}")


def _sources(
    path: Path, keep: set[str], rejects: Rejects | None, max_row_bytes: int
) -> dict[str, str | None]:
    """The ``source`` field of the articles ``keep`` names (read_documents keeps only id and text).
    The rows read_documents left out (``rejects``) are passed over here, silently: a rejected
    duplicate of a kept id must not lend it its source."""
    if path.suffix != ".jsonl":
        return {}
    left_out = {line for file, line in (rejects.rows if rejects else {}) if file == str(path)}
    sources = {}
    for number, _, record in read_records(path, Rejects(None), max_row_bytes):
        doc_id = str(record.get("id", number))
        if number not in left_out and doc_id in keep and doc_id not in sources:
            sources[doc_id] = record.get("source")
    return sources


def _histogram(values: Iterable[float]) -> dict[str, int]:
    buckets = {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": 0 for b in range(10)}
    for v in values:
        b = min(int(v * 10), 9)
        buckets[f"{b / 10:.1f}-{(b + 1) / 10:.1f}"] += 1
    return buckets


def prepare_crud(
    news_path: str | Path,
    qa_path: str | Path,
    out_dir: str | Path,
    match_threshold: float = DEFAULT_MATCH_THRESHOLD,
    margin: float = DEFAULT_MARGIN,
    near_dup_threshold: float = 0.8,
    num_perm: int = 128,
    bad_rows: BadRows | None = None,
) -> dict:
    """Match the QA entries to the articles and write the test set, the training pool and a report.

    Writes (each atomically) ``test_documents.jsonl`` and ``train_pool.jsonl`` (``{id, text,
    source}``, corpus order), ``qa_matches.jsonl`` (one line per QA entry) and ``report.json``;
    returns the report. ``bad_rows``: what a bad article row or QA entry does (default: an error;
    a duplicate article id is one, `metachunk.sources.DocumentSource`).
    """
    news_path, qa_path, out = Path(news_path), Path(qa_path), Path(out_dir)
    bad_rows = bad_rows or BadRows()
    rejects = bad_rows.rejects(out)
    docs = list(read_documents(news_path, rejects=rejects, max_row_bytes=bad_rows.max_row_bytes))
    sources = _sources(news_path, {d.id for d in docs}, rejects, bad_rows.max_row_bytes)
    qa = read_qa(qa_path, rejects)

    # Exact copies: match against the first copy only; the others follow it below.
    first_copy: dict[str, str] = {}
    copy_of: dict[str, str] = {}  # doc id -> id of the first doc with the same normalised text
    for d in docs:
        copy_of[d.id] = first_copy.setdefault(normalize(d.text), d.id)
    groups: dict[str, list[str]] = {}
    for doc_id, first in copy_of.items():
        groups.setdefault(first, []).append(doc_id)
    exact_groups = [g for g in groups.values() if len(g) > 1]

    unique_docs = [d for d in docs if copy_of[d.id] == d.id]
    matches = match_qa(unique_docs, qa, match_threshold=match_threshold, margin=margin)
    test_ids = {doc_id for m in matches for doc_id in m.doc_ids}

    index = NearDuplicateIndex(threshold=near_dup_threshold, num_perm=num_perm)
    for d in docs:
        if d.id in test_ids:
            index.add(d.id, d.text)
    removed = []
    test_docs, pool_docs = [], []
    for d in docs:
        if d.id in test_ids:
            test_docs.append(d)
        elif copy_of[d.id] in test_ids:
            removed.append({"pool_id": d.id, "test_id": copy_of[d.id], "jaccard": 1.0, "kind": "exact"})
        elif found := index.query_scored(d.text):
            test_id, similarity = found[0]
            removed.append(
                {"pool_id": d.id, "test_id": test_id, "jaccard": round(similarity, 4), "kind": "near"}
            )
        else:
            pool_docs.append(d)

    def record(d: Document) -> str:
        return jsonl_line({"id": d.id, "text": d.text, "source": sources.get(d.id)})

    # The test set, the pool, the matches and the report are replaced together or not at all: a new test
    # set beside an old pool (a full disk, or a kill, while the pool was written) would leak test documents.
    with OutputSet() as outputs:
        out.mkdir(parents=True, exist_ok=True)
        outputs.open(out / "test_documents.jsonl").writelines(record(d) for d in test_docs)
        outputs.open(out / "train_pool.jsonl").writelines(record(d) for d in pool_docs)
        matches_file = outputs.open(out / "qa_matches.jsonl")
        for m in matches:
            entry = qa[m.qa_id]
            matches_file.write(
                jsonl_line(
                    {
                        "qa_id": m.qa_id,
                        "status": m.status,
                        "confidence": m.confidence,
                        "doc_ids": list(m.doc_ids),
                        "candidates": [list(c) for c in m.candidates],
                        "key_info": list(entry.key_info),
                        "questions": list(entry.questions),
                        "answers": list(entry.answers),
                        "evidence": m.evidence,
                    }
                )
            )

        statuses = {s: sum(m.status == s for m in matches) for s in STATUSES}
        report = {
            "schema_version": SCHEMA_VERSION,
            "inputs": {"news": str(news_path), "qa": str(qa_path)},
            "documents": len(docs),
            "qa_entries": len(matches),
            **statuses,
            "test_documents": len(test_docs),
            "train_pool": len(pool_docs),
            "near_duplicates_removed": len(removed),
            "near_duplicate_pairs": removed,
            "exact_duplicate_groups": exact_groups,
            "thresholds": {
                "match_threshold": match_threshold,
                "margin": margin,
                "near_dup_threshold": near_dup_threshold,
                "num_perm": num_perm,
                "shingle": index.shingle,
            },
            "method": {
                "matching": "sentence- and key-string matching over an IDF-weighted character-trigram "
                "shortlist; texts NFKC-normalised, lower-cased, whitespace removed",
                "confidence": f"{KEY_SHARE} * K + {1 - KEY_SHARE:.1f} * A (K alone without informative "
                f"answers). K: key strings' credit weighted by min(length, {KEY_WEIGHT_CAP}); A: mean "
                "credit of informative answers. Credit: 1 if verbatim, else max(0, (f - 0.5) / 0.5) with "
                "f the best share of the string's character bigrams held by one sentence",
                "status": "matched: confidence >= match_threshold and runner-up < confidence - margin; "
                "ambiguous: >= match_threshold with other articles within the margin (all become test "
                "documents); unmatched: otherwise",
                "leakage": "exact copies (normalised text) and near duplicates (character 5-gram "
                "Jaccard >= near_dup_threshold; MinHash LSH candidates, exact Jaccard check) of test "
                "documents are removed from the training pool",
            },
            "confidence_histogram": _histogram(m.confidence for m in matches),
        }
        rejected = finish_rejects(rejects, "data prepare-crud")
        if rejected is not None:
            report["rejects"] = rejected
        outputs.commit(out / "report.json", report)
        return report


def print_report(report: dict, file=None) -> None:
    """A short table of what prepare-crud decided."""
    exact = sum(p["kind"] == "exact" for p in report["near_duplicate_pairs"])
    t = report["thresholds"]
    rows = [
        ("QA entries", report["qa_entries"]),
        (f"  matched (>= {t['match_threshold']}, margin {t['margin']})", report["matched"]),
        ("  ambiguous", report["ambiguous"]),
        ("  unmatched", report["unmatched"]),
        ("test documents", report["test_documents"]),
        ("training pool", report["train_pool"]),
        (f"near-dups removed (Jaccard >= {t['near_dup_threshold']})", report["near_duplicates_removed"]),
        ("  of which exact copies", exact),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>6}", file=file)
    histogram = "  ".join(f"{k}:{v}" for k, v in report["confidence_histogram"].items())
    print(f"best-candidate confidence: {histogram}", file=file)


# ---- `metachunk data prepare-crud` ---------------------------------------------------------------

CONFIG = PrepareCrudConfig
SUMMARY_KEYS = (
    "matched",
    "ambiguous",
    "unmatched",
    "test_documents",
    "train_pool",
    "near_duplicates_removed",
)


def run(cfg: PrepareCrudConfig) -> Result:
    import sys

    report = prepare_crud(cfg.news, cfg.qa, cfg.out, match_threshold=cfg.match_threshold, margin=cfg.margin,
                          near_dup_threshold=cfg.near_dup_threshold, num_perm=cfg.num_perm,
                          bad_rows=cfg.bad_rows)  # fmt: skip
    print_report(report)
    print(
        f"{cfg.out}: test_documents.jsonl, train_pool.jsonl, qa_matches.jsonl, report.json", file=sys.stderr
    )
    return Result.with_rejects({k: report[k] for k in SUMMARY_KEYS if k in report}, report.get("rejects"))


def inputs(cfg: PrepareCrudConfig) -> Reads:
    return Reads.of(paths=[cfg.news, cfg.qa])


def outputs(cfg: PrepareCrudConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
