"""Dynamic merging, PPL overlap and the baseline chunkers: offsets, tiling and length rules.

Properties are checked on generated text (hypothesis) and on the real corpora, the named datasets
crud-news (Chinese) and gutenqa-emma (English).
"""

from __future__ import annotations

import json
import random
import re
from functools import cache
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.baselines import fixed_chunks, minilm_embedder, semantic_chunks, sentence_chunks
from metachunk.chunking.merge import add_sentence_overlap, merge_chunks, text_length
from metachunk.chunking.sentences import split_sentences
from metachunk.chunking.types import Chunk, Sentence, chunks_from_boundaries
from support.data import data_file

# Whitespace of several kinds (incl. the ideographic space U+3000), sentence ends of both languages.
ALPHABET = "ab c\n\t.。！?中文\u3000"
docs = st.text(alphabet=ALPHABET, max_size=300)
lengths = st.integers(min_value=1, max_value=40)
units = st.sampled_from(["char", "word"])


def split(text: str) -> list[Sentence]:
    """A trivial sentence splitter with the contract of metachunk.chunking.sentences.split_sentences.

    Used for generated text and the hand-made examples, whose expected chunks depend on exactly
    where sentences end; the real corpora go through split_sentences. Sentences tile the text, the whitespace after a sentence belongs to it, and every sentence
    holds some non-whitespace: a cut falls after a run of terminators and the whitespace behind
    it, so each piece starts at 0 or with a non-space, and ends with a terminator or the text.
    A whitespace-only text is one (whitespace) sentence; only "" has none.
    """
    if not text.strip():
        return [Sentence(0, len(text))] if text else []
    cuts = sorted({m.end() for m in re.finditer(r"[.。！?]+\s*", text)} | {len(text)})
    starts = [0, *cuts[:-1]]
    sentences = [Sentence(a, b) for a, b in zip(starts, cuts) if b > a]
    assert all(text[s.start : s.end].strip() for s in sentences)
    return sentences


def read_texts(path: Path, n: int) -> list[str]:
    if not path.exists():
        pytest.skip(f"corpus not found: {path}")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in islice(f, n)]


# Real documents with their sentences from the project's splitter, built once per session
# (pysbd takes about a second for the English ones).
Corpus = list[tuple[str, list[Sentence]]]


@cache
def news_corpus() -> Corpus:
    return [
        (doc, split_sentences(doc, lang="zh")) for doc in read_texts(data_file("crud-news/news.jsonl"), 40)
    ]


@cache
def emma_corpus() -> Corpus:
    # Paragraphs are short; twenty of them joined make a document of a few thousand characters.
    paragraphs = read_texts(data_file("gutenqa-emma/paragraphs.jsonl"), 200)
    docs = ["\n\n".join(paragraphs[i : i + 20]) for i in range(0, len(paragraphs), 20)]
    return [(doc, split_sentences(doc, lang="en")) for doc in docs]


def random_meta_chunks(doc: str, sentences: list[Sentence], seed: int, p: float = 0.4) -> list[Chunk]:
    """Meta-chunks as PPL chunking would give them: sentence groups cut at random sentences."""
    rng = random.Random(seed)
    return chunks_from_boundaries(doc, sentences, [i for i in range(len(sentences)) if rng.random() < p])


# --- shared checks ---------------------------------------------------------------------------


def assert_tiles(doc: str, chunks: list[Chunk], start: int = 0, end: int | None = None) -> None:
    """Chunks are exact, non-empty, adjacent slices covering doc[start:end]."""
    end = len(doc) if end is None else end
    if start == end:
        assert chunks == []
        return
    assert chunks[0].start == start and chunks[-1].end == end
    for chunk in chunks:
        assert chunk.text == doc[chunk.start : chunk.end]
        assert chunk.end > chunk.start
    for left, right in zip(chunks, chunks[1:]):
        assert left.end == right.start
    assert "".join(c.text for c in chunks) == doc[start:end]


def assert_merged(doc: str, meta: list[Chunk], merged: list[Chunk], L: int, length) -> None:
    """The dynamic-merging contract, with ``length(text)`` the measure merging uses."""
    meta = [c for c in meta if c.end > c.start]
    if not meta:
        assert merged == []
        return
    assert_tiles(doc, merged, meta[0].start, meta[-1].end)
    spans = {(c.start, c.end) for c in meta}
    meta_starts = {c.start: c for c in meta}
    for chunk in merged:
        # Boundaries are meta-chunk boundaries; a chunk over L is a single oversized meta-chunk.
        assert chunk.start in meta_starts
        assert length(chunk.text) <= L or (chunk.start, chunk.end) in spans
    for left, right in zip(merged, merged[1:]):
        # Greedy: the next meta-chunk did not fit (len(c1..c4) > L).
        next_meta = meta_starts[right.start]
        assert length(doc[left.start : next_meta.end]) > L


# --- text_length -------------------------------------------------------------------------------


def test_text_length_units():
    assert text_length("  Hello, big world. \n", "char") == len("Hello, big world.")
    assert text_length("  Hello, big world. \n", "word") == 3
    assert text_length("中文句子。", "char") == 5
    fake = lambda text, add_special_tokens: {"input_ids": list(text)}  # noqa: E731
    assert text_length("abc", "token", fake) == 3
    with pytest.raises(ValueError, match="tokenizer"):
        text_length("abc", "token")
    with pytest.raises(ValueError, match=r"char\|word\|token"):
        text_length("abc", "line")


# --- merge_chunks --------------------------------------------------------------------------------


@settings(deadline=None)
@given(doc=docs, L=lengths, unit=units, data=st.data())
def test_merge_properties_generated(doc, L, unit, data):
    # Cut points may repeat, which makes empty meta-chunks; merging must drop them.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(doc)), max_size=30)))
    bounds = [0, *cuts, len(doc)]
    meta = [Chunk.span(doc, a, b) for a, b in zip(bounds, bounds[1:])]
    merged = merge_chunks(doc, meta, L, unit)
    assert_merged(doc, meta, merged, L, lambda t: text_length(t, unit))


@pytest.mark.parametrize("unit, L", [("char", 50), ("char", 178), ("char", 500), ("word", 1)])
def test_merge_news(unit, L):
    for n, (doc, sentences) in enumerate(news_corpus()):
        meta = random_meta_chunks(doc, sentences, seed=n)
        merged = merge_chunks(doc, meta, L, unit)
        assert_merged(doc, meta, merged, L, lambda t: text_length(t, unit))


@pytest.mark.parametrize("unit, L", [("char", 178), ("word", 30), ("word", 120)])
def test_merge_emma(unit, L):
    for n, (doc, sentences) in enumerate(emma_corpus()):
        meta = random_meta_chunks(doc, sentences, seed=n)
        merged = merge_chunks(doc, meta, L, unit)
        assert_merged(doc, meta, merged, L, lambda t: text_length(t, unit))


def test_merge_paper_example():
    # len(c1..c3) == L -> one chunk; then c4 + c5 < L but c4..c6 > L; c6 alone is over L.
    doc = "aaaa. bbb. cc. dddd. ee. " + "f" * 30 + ". gg."
    sentences = split(doc)
    meta = [Chunk.span(doc, s.start, s.end) for s in sentences]
    lens = [text_length(c.text, "char") for c in meta]
    assert lens == [5, 4, 3, 5, 3, 31, 3]
    merged = merge_chunks(doc, meta, 14, "char")
    assert [c.text for c in merged] == ["aaaa. bbb. cc. ", "dddd. ee. ", "f" * 30 + ". ", "gg."]


@pytest.mark.parametrize("L", [100, 160])
def test_merge_tokens_sum_per_chunk(L):
    """Merging counts tokens per meta-chunk and sums them (no re-tokenising of the seams). A tokenizer
    that adds 10 ids to every call tells the two apart: the sum counts them once per meta-chunk, a
    re-tokenised run once, so only the sum keeps each merged chunk within L, and the greedy check
    holds under the sum."""

    class Overhead:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [0] * (len(text.split()) + 10)}

    tokenizer = Overhead()
    doc, sentences = emma_corpus()[0]
    meta = [c for c in random_meta_chunks(doc, sentences, seed=1) if c.end > c.start]
    counts = [text_length(c.text, "token", tokenizer) for c in meta]
    merged = merge_chunks(doc, meta, L, "token", tokenizer)
    assert_tiles(doc, merged)
    starts = [c.start for c in meta]

    def summed(a: int, b: int) -> int:  # meta-chunks a..b-1
        return sum(counts[a:b])

    bounds = [starts.index(c.start) for c in merged] + [len(meta)]
    for i, j in zip(bounds, bounds[1:]):
        assert summed(i, j) <= L or j == i + 1  # within L, or one meta-chunk over it
        if j < len(meta):
            assert summed(i, j + 1) > L  # greedy: the next one did not fit
    # a re-tokenised run would have merged more: some chunk's text is within L though its sum is not
    assert any(summed(i, j + 1) > L >= text_length(doc[meta[i].start : meta[j].end], "token", tokenizer)
               for i, j in zip(bounds, bounds[1:]) if j < len(meta))  # fmt: skip


def test_merge_rejects_bad_input():
    doc = "one. two."
    with pytest.raises(ValueError, match="adjacent"):
        merge_chunks(doc, [Chunk.span(doc, 0, 4), Chunk.span(doc, 5, 9)], 10)
    with pytest.raises(ValueError, match="target_len"):
        merge_chunks(doc, [Chunk.span(doc, 0, 9)], 0)
    with pytest.raises(ValueError, match="tokenizer"):
        merge_chunks(doc, [Chunk.span(doc, 0, 9)], 5, "token")
    assert merge_chunks(doc, [], 5) == []


# --- add_sentence_overlap ----------------------------------------------------------------------


def assert_overlap(doc: str, chunks: list[Chunk], sentences: list[Sentence]) -> None:
    out = add_sentence_overlap(doc, chunks, sentences)
    assert len(out) == len(chunks)
    for chunk in out:
        assert chunk.text == doc[chunk.start : chunk.end]
    if chunks:
        assert out[0] == chunks[0]
    by_end = {s.end: s for s in sentences}
    for prev, orig, new in zip(chunks, chunks[1:], out[1:]):
        boundary_sentence = by_end[prev.end]
        assert new.start == boundary_sentence.start and new.end == orig.end
        assert prev.start <= boundary_sentence.start  # the sentence belongs to chunk k
        assert new.text == doc[boundary_sentence.start : boundary_sentence.end] + orig.text


@settings(deadline=None)
@given(doc=docs, data=st.data())
def test_overlap_generated(doc, data):
    sentences = split(doc)
    boundaries = data.draw(st.lists(st.integers(0, max(0, len(sentences) - 1)), max_size=10))
    assert_overlap(doc, chunks_from_boundaries(doc, sentences, boundaries), sentences)


def test_overlap_real_merged_chunks():
    for n, (doc, sentences) in enumerate(news_corpus()[:10] + emma_corpus()[:3]):
        merged = merge_chunks(doc, random_meta_chunks(doc, sentences, seed=n), 178)
        assert_overlap(doc, merged, sentences)


def test_overlap_single_sentence_chunk():
    # Chunk 1 is one sentence: the overlap is all of it, and chunk 2 contains chunk 1.
    doc = "First one. Second. Third one here."
    sentences = split(doc)
    chunks = chunks_from_boundaries(doc, sentences, [0, 1])
    out = add_sentence_overlap(doc, chunks, sentences)
    assert [c.text for c in out] == ["First one. ", "First one. Second. ", "Second. Third one here."]


def test_overlap_rejects_boundary_inside_sentence():
    doc = "First one. Second."
    with pytest.raises(ValueError, match="not the end of a sentence"):
        add_sentence_overlap(doc, [Chunk.span(doc, 0, 5), Chunk.span(doc, 5, 18)], split(doc))


# --- fixed_chunks ------------------------------------------------------------------------------


@settings(deadline=None)
@given(doc=docs, L=lengths)
def test_fixed_chars(doc, L):
    chunks = fixed_chunks(doc, L, "char")
    assert_tiles(doc, chunks)  # whitespace too: only "" has no chunk
    if not doc:
        return
    assert all(len(c.text) == L for c in chunks[:-1])
    assert 1 <= len(chunks[-1].text) <= L


@settings(deadline=None)
@given(doc=docs, L=lengths)
def test_fixed_words(doc, L):
    chunks = fixed_chunks(doc, L, "word")
    assert_tiles(doc, chunks)
    if not doc.strip():  # no word: one whitespace chunk, or none for ""
        assert len(chunks) == (1 if doc else 0)
        return
    assert all(len(c.text.split()) == L for c in chunks[:-1])
    assert 1 <= len(chunks[-1].text.split()) <= L
    for left, right in zip(chunks, chunks[1:]):
        # A chunk ends after the whitespace that follows its L-th word.
        assert left.text[-1].isspace() and not right.text[0].isspace()


def test_fixed_real_corpora():
    for doc, _ in news_corpus()[:10]:
        chunks = fixed_chunks(doc, 178, "char")
        assert_tiles(doc, chunks)
        assert all(len(c.text) == 178 for c in chunks[:-1])
    for doc, _ in emma_corpus()[:3]:
        chunks = fixed_chunks(doc, 100, "word")
        assert_tiles(doc, chunks)
        assert all(len(c.text.split()) == 100 for c in chunks[:-1])


def test_fixed_rejects_tokens():
    with pytest.raises(ValueError, match="token"):
        fixed_chunks("some text", 10, "token")
    assert fixed_chunks(" \n\u3000 ", 3) == [Chunk(" \n\u3000", 0, 3), Chunk(" ", 3, 4)]  # nothing dropped
    assert fixed_chunks("", 3) == []


# --- sentence_chunks ---------------------------------------------------------------------------


@settings(deadline=None)
@given(doc=docs, L=lengths, unit=units)
def test_sentence_chunks_generated(doc, L, unit):
    sentences = split(doc)
    chunks = sentence_chunks(doc, sentences, L, unit)
    meta = [Chunk.span(doc, s.start, s.end) for s in sentences]
    assert_merged(doc, meta, chunks, L, lambda t: text_length(t, unit))


def test_sentence_chunks_real_corpora():
    for doc, sentences in news_corpus()[:10] + emma_corpus()[:3]:
        meta = [Chunk.span(doc, s.start, s.end) for s in sentences]
        assert_merged(doc, meta, sentence_chunks(doc, sentences, 178, "char"), 178, lambda t: len(t.strip()))


def test_sentence_chunks_need_tiling_sentences():
    doc = "One. Two."
    with pytest.raises(ValueError, match="whole document"):
        sentence_chunks(doc, [Sentence(0, 5)], 10, "char")
    with pytest.raises(ValueError, match="no sentences"):
        sentence_chunks("  ", [], 10, "char")
    assert sentence_chunks("  ", [Sentence(0, 2)], 10, "char") == [Chunk("  ", 0, 2)]
    assert sentence_chunks("", [], 10, "char") == []


# --- semantic_chunks ---------------------------------------------------------------------------


def topic_embedder(calls: list[list[str]]):
    """Embeds a text as (number of 'cat', number of 'dog'); records what it was asked."""

    def embed(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        return np.array([[t.count("cat"), t.count("dog")] for t in texts], dtype=float)

    return embed


def test_semantic_breakpoints_stub():
    doc = "A cat. The cat sat. Cats purr, cat. A dog. Dog barks, dog. The dog. A cat again. The cat."
    sentences = split(doc)
    assert len(sentences) == 8
    calls: list[list[str]] = []
    chunks, distances = semantic_chunks(doc, sentences, topic_embedder(calls), percentile=70, buffer_size=0)
    # Topic changes after sentences 2 and 5: distance 1 there, 0 elsewhere.
    assert distances == pytest.approx([0, 0, 1, 0, 0, 1, 0])
    assert [c.text for c in chunks] == [
        "A cat. The cat sat. Cats purr, cat. ",
        "A dog. Dog barks, dog. The dog. ",
        "A cat again. The cat.",
    ]
    assert calls == [[doc[s.start : s.end] for s in sentences]]


def test_semantic_windows_and_scores():
    doc = "cat. cat. dog. dog. dog. cat."
    sentences = split(doc)
    calls: list[list[str]] = []
    chunks, distances = semantic_chunks(doc, sentences, topic_embedder(calls), percentile=95, buffer_size=1)
    n = len(sentences)
    expected = [doc[sentences[max(0, i - 1)].start : sentences[min(n - 1, i + 1)].end] for i in range(n)]
    assert calls == [expected]
    assert len(distances) == n - 1
    # Windows (cat, dog) counts: (2,0) (2,1) (1,2) (0,3) (1,2) (1,1); the widest turn is 1 -> 2.
    assert distances == pytest.approx([1 - 2 / 5**0.5, 0.2, 1 - 2 / 5**0.5, 1 - 2 / 5**0.5, 1 - 3 / 10**0.5])
    assert [c.text for c in chunks] == ["cat. cat. ", "dog. dog. dog. cat."]


def test_semantic_edge_cases():
    calls: list[list[str]] = []
    assert semantic_chunks("", [], topic_embedder(calls)) == ([], [])
    doc = "Only one cat."
    assert semantic_chunks(doc, split(doc), topic_embedder(calls)) == ([Chunk.span(doc, 0, len(doc))], [])
    assert calls == []  # nothing to compare, so nothing embedded


@pytest.mark.integration
def test_semantic_minilm_emma():
    pytest.importorskip("sentence_transformers")
    from metachunk.models import ModelNotFoundError

    try:
        embed = minilm_embedder(device="cpu")
    except ModelNotFoundError as err:
        pytest.skip(str(err))
    doc, sentences = emma_corpus()[0]
    sentences = sentences[:30]
    doc = doc[: sentences[-1].end]
    chunks, distances = semantic_chunks(doc, sentences, embed)
    assert_tiles(doc, chunks)
    assert len(distances) == len(sentences) - 1
    assert all(0.0 <= d <= 2.0 for d in distances)
    # 95th percentile of 29 gaps: the cut lands at the largest distance, and there are few cuts.
    assert 2 <= len(chunks) <= 3
    assert sentences[int(np.argmax(distances))].end in {c.end for c in chunks}
