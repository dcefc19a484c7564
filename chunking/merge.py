"""Dynamic merging of meta-chunks and PPL sentence overlap.

Meta-Chunking first cuts a document into small logical units (meta-chunks) with PPL or MSP
chunking, then merges adjacent meta-chunks up to a user length ``L`` (paper §3.1.3):
``c1..c3`` become one chunk when ``len(c1..c3) == L``, or ``len(c1..c3) < L`` and
``len(c1..c4) > L``. A meta-chunk that is longer than ``L`` on its own stays alone; it is
never cut.

The overlapping variant of PPL chunking (paper §5.3, Appendix D) gives the sentence at each PPL
minimum, i.e. the last sentence of a chunk, to the following chunk as well; see
`add_sentence_overlap`.

Lengths are measured in one of three units (`text_length`): ``"char"`` (code points of the
stripped text; the paper's unit for Chinese), ``"word"`` (whitespace-separated words) or
``"token"`` (tokens of a Hugging Face tokenizer).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from itertools import accumulate

from metachunk.chunking.types import Chunk, Sentence

UNITS = ("char", "word", "token")
_WORD = re.compile(r"\S+")


def _check_unit(unit: str, tokenizer) -> None:
    if unit not in UNITS:
        raise ValueError(f"unknown length unit {unit!r}; use one of: char|word|token")
    if unit == "token" and tokenizer is None:
        raise ValueError('unit "token" needs a tokenizer')


def text_length(text: str, unit: str, tokenizer=None) -> int:
    """Length of ``text`` in ``unit``: "char", "word" or "token".

    "char" ignores leading and trailing whitespace, so the whitespace that a sentence carries
    after its full stop does not count. "token" counts ``tokenizer(text)`` ids without special
    tokens.
    """
    _check_unit(unit, tokenizer)
    if unit == "char":
        return len(text.strip())
    if unit == "word":
        return len(text.split())
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _run_length(doc: str, chunks: Sequence[Chunk], unit: str, tokenizer) -> Callable[[int, int], int]:
    """Return ``length(i, j)``: the length of ``doc[chunks[i].start:chunks[j].end]`` in ``unit``.

    For "char" and "word" the answer equals ``text_length`` of that slice exactly, found by
    bisecting the document's whitespace-free runs, so merging never re-reads the growing text.
    For "token" it is the sum of the chunks' own token counts: re-tokenising the growing run at
    every step would make merging quadratic, and a seam shifts the count by a token or two at most.
    """
    if unit == "token":
        counts = [text_length(doc[c.start : c.end], "token", tokenizer) for c in chunks]
        total = list(accumulate(counts, initial=0))
        return lambda i, j: total[j + 1] - total[i]

    # Words are maximal runs of non-whitespace (what str.split and str.strip see). A slice [a, b)
    # holds the words that intersect it, possibly cut at a or b.
    # Two lists of ints, not a list of span tuples besides them (~20 bytes a character).
    lo, hi = chunks[0].start, chunks[-1].end
    starts, ends = [], []
    for m in _WORD.finditer(doc, lo, hi):
        starts.append(m.start())
        ends.append(m.end())

    def length(i: int, j: int) -> int:
        a, b = chunks[i].start, chunks[j].end
        first = bisect.bisect_right(ends, a)  # first word ending after a
        last = bisect.bisect_left(starts, b) - 1  # last word starting before b
        if last < first:
            return 0
        if unit == "word":
            return last - first + 1
        return min(ends[last], b) - max(starts[first], a)

    return length


def merge_chunks(
    doc: str, chunks: Sequence[Chunk], target_len: int, unit: str = "char", tokenizer=None
) -> list[Chunk]:
    """Greedily merge adjacent meta-chunks into chunks of at most ``target_len`` units.

    Walking left to right, the next meta-chunk joins the current chunk while the merged length
    stays ``<= target_len``; otherwise it starts a new chunk. A meta-chunk longer than
    ``target_len`` therefore stands alone. The merged length is ``text_length`` of
    ``doc[first.start:last.end]``, exactly for "char" and "word"; for "token" it is the sum of
    the meta-chunks' token counts (an approximation, see ``_run_length``).

    ``chunks`` must be adjacent (each ends where the next starts). The output tiles the same
    span, holds no empty chunk, and every text is the exact ``doc`` slice.
    """
    if target_len < 1:
        raise ValueError(f"target_len must be >= 1, got {target_len}")
    _check_unit(unit, tokenizer)
    for left, right in zip(chunks, chunks[1:]):
        if left.end != right.start:
            raise ValueError(
                f"chunks are not adjacent: one ends at {left.end}, the next starts at {right.start}"
            )
    # An empty meta-chunk adds nothing to any length, so dropping it keeps the tiling intact.
    chunks = [c for c in chunks if c.end > c.start]
    if not chunks:
        return []

    length = _run_length(doc, chunks, unit, tokenizer)
    merged: list[Chunk] = []
    first = 0  # index of the first meta-chunk of the chunk being built
    for j in range(1, len(chunks)):
        if length(first, j) > target_len:
            merged.append(Chunk.span(doc, chunks[first].start, chunks[j - 1].end))
            first = j
    merged.append(Chunk.span(doc, chunks[first].start, chunks[-1].end))
    return merged


def add_sentence_overlap(doc: str, chunks: Sequence[Chunk], sentences: Sequence[Sentence]) -> list[Chunk]:
    """PPL overlap: the last sentence of chunk ``k`` also opens chunk ``k+1``.

    In PPL chunking a chunk ends at a PPL minimum, so its last sentence is the boundary sentence
    that the paper assigns to both neighbouring chunks. Chunk ``k`` keeps its span; chunk
    ``k+1`` is extended backwards to the start of that sentence. The first chunk is unchanged.
    If chunk ``k`` is a single sentence, the overlap is the whole of chunk ``k``, which is then
    contained in chunk ``k+1``; that is what the rule says, so it is kept.

    Every chunk boundary must fall on a sentence end (true for chunks built from these
    sentences, merged or not); otherwise ``ValueError``.
    """
    ends = [s.end for s in sentences]
    out: list[Chunk] = []
    for k, chunk in enumerate(chunks):
        if k == 0:
            out.append(Chunk.span(doc, chunk.start, chunk.end))
            continue
        prev = chunks[k - 1]
        i = bisect.bisect_left(ends, prev.end)
        if i == len(ends) or ends[i] != prev.end or sentences[i].start < prev.start:
            raise ValueError(f"chunk boundary at {prev.end} is not the end of a sentence inside that chunk")
        out.append(Chunk.span(doc, sentences[i].start, chunk.end))
    return out
