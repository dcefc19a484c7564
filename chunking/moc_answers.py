"""What a MoC expert answers, and how its answer is found in the text (MoC §3.2.3-3.2.4). Pure
functions: no model, no torch.

* **The answer** is a JSON list of ``head + placeholder + tail`` strings, one per chunk
  (`format_elements`, as the experts are trained to write it; `expert_element` writes one
  chunk's rule, for the training targets of ``distill/moc.py`` and the anchored grammar of
  `metachunk.chunking.moc_grammar` alike). `parse_expert_answer` reads the outermost
  ``[...]`` of an answer; `split_element` cuts an element at its placeholder.
* **Recovery** (§3.2.4, `recover_spans`): each element is split at the placeholder and
  ``re.escape(head) + ".*?" + re.escape(tail)`` (DOTALL, shortest) is searched in the text after
  the previous match. When that fails, head and tail are found by edit distance
  (`metachunk.chunking.align.locate`, at most ``max_ratio`` = 10% edits, as in Appendix A.3, and
  at least one edit for anchors of 8 characters or more).
  Elements found nowhere are skipped and counted. Chunks start where the recovered elements start
  and tile the window (`tile`): text before the first match joins the first chunk, text
  between or after matches joins the chunk before it, so ``chunk.text == doc[start:end]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from metachunk.chunking.align import locate

from metachunk.structured import json_in_text

# The paper's eight placeholders for the omitted middle of a chunk (§3.2.3, Table 2); [MASK] is
# the one its experiments use.
PLACEHOLDERS = ("[MASK]", "<omitted>", "<ellipsis>", "[ELLIPSIS]", ".*?", "<...>", "<.*>", "<pad>")
DEFAULT_PLACEHOLDER = "[MASK]"
DEFAULT_MAX_RATIO = 0.1
MIN_TYPO_CHARS = 8  # anchors at least this long may always have one edit
# The anchors as distill/moc.py writes the experts' targets (head_chars = tail_chars = 10 in
# recipes/distill/moc.yaml, widened to whole ASCII words by at most WORD_SNAP characters; doubled,
# then quadrupled, where they do not recover). One definition for the training targets and the
# anchored grammar (--moc-anchored) that decodes them.
DEFAULT_ANCHOR_CHARS = 10
ANCHOR_SCALES = (1, 2, 4)
WORD_SNAP = 20

# ------------------------------------------------------------------------------------- format


def check_placeholder(placeholder: str) -> None:
    if placeholder not in PLACEHOLDERS:
        raise ValueError(f"unknown placeholder {placeholder!r}; have {', '.join(PLACEHOLDERS)}")


def format_elements(heads_tails: Sequence[tuple[str, str]], placeholder: str = DEFAULT_PLACEHOLDER) -> str:
    """The expert's answer for (head, tail) pairs: a JSON list of ``head + placeholder + tail``
    (non-ASCII kept as is)."""
    check_placeholder(placeholder)
    return json.dumps([h + placeholder + t for h, t in heads_tails], ensure_ascii=False)


def parse_expert_answer(answer: str) -> list[str] | None:
    """The expert's JSON list of strings, or None when the answer holds none.

    Tolerates text around the list (a code fence, a preamble): the outermost ``[ ... ]`` is parsed.
    A list with a non-string element, or an empty list, is invalid.
    """
    value = json_in_text(answer, openers="[")
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        return None
    return value


def split_element(element: str, placeholder: str = DEFAULT_PLACEHOLDER) -> tuple[str, str]:
    """(head, tail) of an element, whitespace around the placeholder dropped. An element without
    the placeholder is a whole chunk quoted in full (head = element, tail = "")."""
    head, sep, rest = element.partition(placeholder)
    if not sep:
        return element.strip(), ""
    tail = rest.rpartition(placeholder)[2]  # a repeated placeholder: the tail follows the last
    return head.strip(), tail.strip()


# ------------------------------------------------------------------------------------- anchors


def _word(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _snap_right(text: str, k: int) -> int:
    """Move a cut at ``k`` right to the end of the ASCII word it splits (at most WORD_SNAP)."""
    limit = min(len(text), k + WORD_SNAP)
    while 0 < k < limit and _word(text[k - 1]) and _word(text[k]):
        k += 1
    return k


def _snap_left(text: str, k: int) -> int:
    limit = max(0, k - WORD_SNAP)
    while limit < k < len(text) and _word(text[k - 1]) and _word(text[k]):
        k -= 1
    return k


def expert_element(
    chunk: str, head_chars: int, tail_chars: int, placeholder: str = DEFAULT_PLACEHOLDER
) -> str:
    """The expert's rule for one chunk: its first ``head_chars`` and last ``tail_chars`` characters
    (widened to whole ASCII words) around the placeholder; a short chunk is quoted whole. The one
    form both the experts' training targets (distill/moc.py) and anchored decoding write."""
    text = chunk.strip()
    if len(text) <= head_chars + tail_chars:
        return text
    head_end, tail_start = _snap_right(text, head_chars), _snap_left(text, len(text) - tail_chars)
    if head_end >= tail_start:
        return text
    return text[:head_end].rstrip() + placeholder + text[tail_start:].lstrip()


def anchor_head(text: str, chars: int) -> str:
    """The head of a chunk ``text`` as the experts' targets write it (`expert_element`): its first
    ``chars`` characters, widened to the end of a word, without surrounding whitespace."""
    text = text.strip()
    return text[: _snap_right(text, chars)].rstrip()


def anchor_tail(text: str, chars: int) -> str:
    """The tail of a chunk ``text``: its last ``chars`` characters, widened to a word's start."""
    text = text.strip()
    return text[_snap_left(text, len(text) - chars) :].lstrip()


# ------------------------------------------------------------------------------------- recovery


@dataclass
class RecoveryStats:
    """How the elements of expert answers were recovered."""

    elements: int = 0
    exact: int = 0  # found without edits (the head.*?tail pattern, or head and tail overlapping)
    fuzzy: int = 0  # head and/or tail found by edit distance
    skipped: int = 0  # found nowhere (or empty)

    def add(self, other: RecoveryStats) -> None:
        self.elements += other.elements
        self.exact += other.exact
        self.fuzzy += other.fuzzy
        self.skipped += other.skipped

    def to_json(self) -> dict:
        return {"elements": self.elements, "exact": self.exact, "fuzzy": self.fuzzy, "skipped": self.skipped}


def recover_spans(
    text: str,
    elements: Sequence[str],
    placeholder: str = DEFAULT_PLACEHOLDER,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> tuple[list[tuple[int, int]], RecoveryStats]:
    """Spans ``(start, end)`` of ``text`` matched by the elements, in order, and how.

    Each element is matched after the end of the previous match: first exactly
    (``head.*?tail``, DOTALL, shortest), else head and tail by edit distance (at most
    ``max_ratio`` of their length in edits), the tail searched from the head on (a short chunk's
    head and tail may overlap). An exact match that runs over the next element's head, where an
    edit-distance one (with edits) ends before it, is the typo'd tail found verbatim further on (MoC §3.2.4 asks
    for the closest match): the nearer one is taken. Spans are non-overlapping and increasing.
    """
    stats = RecoveryStats(elements=len(elements))
    spans: list[tuple[int, int]] = []
    cursor = 0
    heads = [split_element(element, placeholder)[0] for element in elements]
    for k, element in enumerate(elements):
        head, tail = split_element(element, placeholder)
        if not head and not tail:
            stats.skipped += 1
            continue
        pattern = re.compile(re.escape(head) + ".*?" + re.escape(tail), re.DOTALL)
        m = pattern.search(text, cursor)
        found = None
        if m is not None and m.end() > m.start():
            next_head = heads[k + 1] if k + 1 < len(elements) else ""
            # the exact match holds the next head and none follows it: it may have run over the next element
            swallows = (
                next_head and next_head in text[m.start() : m.end()] and text.find(next_head, m.end()) == -1
            )
            if swallows:
                found = _fuzzy_span(text, head, tail, cursor, max_ratio)
            nearer = (  # with edits: one without is the pattern's own match, or a head and tail overlapping
                found is not None
                and found[1] > 0
                and found[0][1] < m.end()
                and text.find(next_head, found[0][1], m.end()) != -1
            )
            if not nearer:
                spans.append((m.start(), m.end()))
                cursor = m.end()
                stats.exact += 1
                continue
        else:
            found = _fuzzy_span(text, head, tail, cursor, max_ratio)
        if found is None:
            stats.skipped += 1
            continue
        span, distance = found
        spans.append(span)
        cursor = span[1]
        if distance:
            stats.fuzzy += 1
        else:  # exact, but head and tail overlap (a chunk shorter than both)
            stats.exact += 1
    return spans, stats


def _edit_ratio(fragment: str, max_ratio: float) -> float:
    """``max_ratio``, but at least one edit for an anchor of `MIN_TYPO_CHARS` or more (10%
    of a 9-character anchor would allow no typo at all)."""
    if len(fragment) >= MIN_TYPO_CHARS:
        return max(max_ratio, 1.0 / len(fragment))
    return max_ratio


def _fuzzy_span(
    text: str, head: str, tail: str, cursor: int, max_ratio: float
) -> tuple[tuple[int, int], int] | None:
    """((start, end), edits) of an element the pattern missed, or None."""
    distance = 0
    if head:
        h = locate(head, text, cursor, max_ratio=_edit_ratio(head, max_ratio))
        if h is None or h.end <= h.start:
            return None
        start, head_end, distance = h.start, h.end, h.distance
    else:
        start = head_end = cursor
    if not tail:
        return ((start, head_end), distance) if head_end > start else None
    # The tail ends at or after the head's end; it may overlap the head (short chunks).
    t = locate(tail, text, max(start, head_end - len(tail)), max_ratio=_edit_ratio(tail, max_ratio))
    if t is None or t.end < head_end or t.end <= start:
        return None
    return (start, t.end), distance + t.distance


def tile(length: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    """Spans tiling ``[0, length)`` that begin at ``starts`` (0 always; out-of-range and repeated
    starts dropped): text before the first start joins the first chunk, every other gap the chunk
    before it."""
    if length <= 0:
        return []
    cuts = sorted({s for s in starts if 0 < s < length})
    edges = [0, *cuts, length]
    return list(zip(edges, edges[1:]))


def recover_chunks(
    text: str,
    elements: Sequence[str],
    placeholder: str = DEFAULT_PLACEHOLDER,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> tuple[list[tuple[int, int]], RecoveryStats]:
    """Chunks ``(start, end)`` tiling ``text``, one starting at each recovered element."""
    spans, stats = recover_spans(text, elements, placeholder, max_ratio)
    return tile(len(text), [s for s, _ in spans]), stats
