"""Text geometry shared by every stage: sentences and chunks as exact character spans.

Offsets always index the original document string (Python ``str`` indices, i.e. code points),
so ``doc[chunk.start:chunk.end] == chunk.text`` holds for every chunk of every method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sentence:
    """A sentence span ``[start, end)``.

    Sentences from `metachunk.chunking.sentences.split_sentences` tile the document: the first starts
    at 0, each ends where the next starts, and whitespace between sentences belongs to the
    sentence before it. ``score`` is the value a method decided on (PPL in nats, or MSP margin).
    """

    start: int
    end: int
    score: float | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a document: its ``text`` and its offsets, ``text == doc[start:end]``."""

    text: str
    start: int
    end: int

    @classmethod
    def span(cls, doc: str, start: int, end: int) -> Chunk:
        return cls(doc[start:end], start, end)

    def to_json(self) -> dict:
        return {"text": self.text, "start": self.start, "end": self.end}


def chunks_from_boundaries(doc: str, sentences: Sequence[Sentence], boundaries: Sequence[int]) -> list[Chunk]:
    """Group tiled sentences into chunks; sentence ``i`` in ``boundaries`` ends its chunk.

    The last sentence always ends a chunk, so the chunks tile the document exactly.
    """
    if not sentences:
        return []
    ends = sorted({i for i in boundaries if 0 <= i < len(sentences) - 1} | {len(sentences) - 1})
    chunks, first = [], 0
    for last in ends:
        chunks.append(Chunk.span(doc, sentences[first].start, sentences[last].end))
        first = last + 1
    return chunks
