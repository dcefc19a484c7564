"""Edit-distance alignment of a (possibly garbled) fragment to the text it was copied from.

Generative chunkers (MoC experts, teacher answers) quote the document, and a small model quotes
it with typos: a dropped character, a changed quote mark, a re-spaced line. `locate` finds
where such a fragment sits in the source, as exact offsets of the source, by minimum edit
(Levenshtein) distance over substrings:

```
locate("quick brwn fox", "The quick brown fox") == Match(start=4, end=19, distance=1)
```

How (never a quadratic scan of the document):

1. exact ``str.find`` in the window first (distance 0, the common case);
2. ``rapidfuzz.fuzz.partial_ratio_alignment`` (C++) over the window as a cheap reject: its score
   bounds the best edit distance from below (see `_partial_cutoff`), so a window that
   cannot hold a match within ``max_ratio`` is skipped without any Python-level work;
3. otherwise the exact best ends are found by Myers' bit-parallel approximate string matching
   (semi-global edit distance, one pass over the window with the pattern as a Python int), and
   the start by ``rapidfuzz.distance.Levenshtein`` over the few possible starts.

The window starts at ``start`` and is ``len(fragment) * (1 + window_slack)`` characters long
(plus the edit budget); when it holds no match it doubles, up to the end of the source, so the
total work is linear in how far the match lies from ``start``. The first window with a match
decides: a fuzzy match near ``start`` wins over an exact one further on (quotes come in order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rapidfuzz.distance import Levenshtein
from rapidfuzz.fuzz import partial_ratio_alignment

__all__ = ["Match", "locate", "best_substring"]


@dataclass(frozen=True, slots=True)
class Match:
    """``source[start:end]`` is the substring closest to the fragment; ``distance`` is the
    Levenshtein distance between them (0: exact)."""

    start: int
    end: int
    distance: int


def locate(
    fragment: str,
    source: str,
    start: int = 0,
    max_ratio: float = 0.1,
    window_slack: float = 0.5,
) -> Match | None:
    """The substring of ``source[start:]`` nearest to ``fragment`` by edit distance.

    Searches a window beginning at ``start`` (``len(fragment) * (1 + window_slack)`` characters
    plus the edit budget), doubling it until a match is found or the source ends. Returns ``None``
    when the best distance exceeds ``max_ratio * len(fragment)`` (a hallucinated fragment). Among
    equally close substrings the first occurrence after ``start`` wins, and within it the span
    that begins and ends on the fragment's own first and last characters, then the one whose
    length is closest to the fragment's (``"plaN"`` recovers ``"plan"``, not ``"pla"``). Offsets index ``source``.
    """
    if not 0 <= start <= len(source):
        raise ValueError(f"start {start} outside the source (length {len(source)})")
    if max_ratio < 0 or window_slack < 0:
        raise ValueError("max_ratio and window_slack must be >= 0")
    m = len(fragment)
    if m == 0:
        return Match(start, start, 0)
    budget = math.floor(max_ratio * m + 1e-9)
    width = max(int(m * (1 + window_slack)) + budget, m + budget, 16)
    lo = start
    while True:
        hi = min(len(source), start + width)
        # Exact fast path. Searching [lo, hi) for an exact hit; overlap with the previous
        # window by m so a hit straddling the old edge is seen.
        i = source.find(fragment, max(start, lo - m), hi)
        if i >= 0:
            return Match(i, i + m, 0)
        if budget > 0:
            # Fuzzy: the region [lo - overlap, hi) so that matches straddling windows are seen.
            r0 = max(start, lo - (m + budget))
            hit = _fuzzy(fragment, source, r0, hi, budget)
            if hit is not None:
                return hit
        if hi >= len(source):
            return None
        lo = hi
        width *= 2


def best_substring(fragment: str, text: str) -> Match | None:
    """The substring of ``text`` with the least edit distance to ``fragment`` (whole-text scan,
    no threshold; ``None`` only for an empty fragment)."""
    if not fragment:
        return None
    hit = _fuzzy(fragment, text, 0, len(text), len(fragment))
    return hit if hit is not None else Match(0, 0, len(fragment))


# ------------------------------------------------------------------------------------ internals


def _partial_cutoff(m: int, budget: int) -> float:
    """A lower bound on ``partial_ratio`` when a substring within ``budget`` edits exists.

    If ``lev(F, T) = d``, then ``|T|`` is within ``d`` of ``m`` and a length-``m`` window that
    contains (or is contained in) ``T`` has Indel distance at most ``2d + d`` to ``F``; rapidfuzz
    scores a window ``100 * (1 - indel / (2m))``.
    """
    return max(0.0, 100.0 * (1.0 - 3.0 * budget / (2.0 * m)) - 1e-6)


def _fuzzy(fragment: str, source: str, lo: int, hi: int, budget: int) -> Match | None:
    m = len(fragment)
    text = source[lo:hi]
    if not text:
        return None
    if len(text) >= m:
        pre = partial_ratio_alignment(fragment, text, score_cutoff=_partial_cutoff(m, budget))
        if pre is None:
            return None
    ends, dist = _myers_scores(fragment, text)
    if dist > budget:
        return None
    s, end = _best_span(fragment, text, ends, dist)
    return Match(lo + s, lo + end, dist)


def _myers_scores(pattern: str, text: str) -> tuple[list[int], int]:
    """(ends, d): ``d`` is the least edit distance of ``pattern`` to a substring of ``text``,
    ``ends`` the ends reaching it within ``d`` characters after the first (same occurrence)."""
    m = len(pattern)
    peq: dict[str, int] = {}
    for i, c in enumerate(pattern):
        peq[c] = peq.get(c, 0) | (1 << i)
    mask = (1 << m) - 1
    top = 1 << (m - 1)
    pv, mv, score = mask, 0, m
    best, ends = m, [0]
    for j, c in enumerate(text):
        eq = peq.get(c, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | (~(xh | pv) & mask)
        mh = pv & xh
        if ph & top:
            score += 1
        elif mh & top:
            score -= 1
        ph = (ph << 1) & mask  # row 0 is all zeros: a match may start anywhere
        mh = (mh << 1) & mask
        pv = mh | (~(xv | ph) & mask)
        mv = ph & xv
        if score < best:
            best, ends = score, [j + 1]
        elif score == best and j + 1 - ends[0] <= best:
            ends.append(j + 1)
        elif j + 1 - ends[0] > best and best == 0:
            break
    return ends, best


def _best_span(fragment: str, text: str, ends: list[int], dist: int) -> tuple[int, int]:
    """Among the substrings ending at ``ends`` with distance ``dist``: the one whose first and
    last characters equal the fragment's (a typo next to the edge does not move the edge), then
    the one closest in length to the fragment, then the earliest end, then the longest."""
    m = len(fragment)
    best, best_key = (ends[0], ends[0]), None
    for end in ends:
        lo = max(0, end - m - dist)
        hi = max(lo, end - max(0, m - dist))
        for s in range(lo, hi + 1):
            d = Levenshtein.distance(fragment, text[s:end], score_cutoff=dist)
            if d <= dist:
                edges = (s < end and text[s] == fragment[0]) + (s < end and text[end - 1] == fragment[-1])
                key = (d, -edges, abs((end - s) - m), end, s)
                if best_key is None or key < best_key:
                    best, best_key = (s, end), key
    return best
