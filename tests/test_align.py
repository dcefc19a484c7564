"""Tests for metachunk.chunking.align.locate: edit-distance recovery of garbled quotes as exact offsets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.align import Match, best_substring, locate
from rapidfuzz.distance import Levenshtein

TEXT = (
    "The committee met on Tuesday (in the old hall) to discuss the budget. "
    "Members asked: what costs *more* than last year? The answer was clear. "
    "After a long debate, the committee approved the plan with minor changes."
)


def brute_best(fragment: str, text: str) -> int:
    """The least edit distance of ``fragment`` to any substring of ``text`` (quadratic, small inputs)."""
    return min(
        Levenshtein.distance(fragment, text[s:e])
        for s in range(len(text) + 1)
        for e in range(s, len(text) + 1)
    )


def test_exact_match_offsets():
    frag = "to discuss the budget."
    m = locate(frag, TEXT)
    assert m == Match(TEXT.index(frag), TEXT.index(frag) + len(frag), 0)


def test_light_typo_accepted_with_correct_offsets():
    want = "Members asked: what costs *more* than last year?"
    typo = "Members askd: what costs *more* then last year?"  # one deletion, one substitution
    m = locate(typo, TEXT)
    assert m is not None
    assert (m.start, m.end) == (TEXT.index(want), TEXT.index(want) + len(want))
    assert m.distance == 2
    assert TEXT[m.start : m.end] == want


def test_typo_at_the_edges_keeps_the_span():
    want = "approved the plan"
    m = locate("Approved the plaN", TEXT, max_ratio=0.2)
    assert m is not None and TEXT[m.start : m.end] == want and m.distance == 2


def test_hallucinated_fragment_rejected():
    assert locate("The weather in Paris was sunny and warm all week.", TEXT) is None
    # close but over the budget: 10% of 20 characters is 2 edits, this needs more
    assert locate("the comitee aproved tha", TEXT, max_ratio=0.1) is None


def test_regex_metacharacters_are_literal():
    for frag in ["(in the old hall)", "*more*", "last year?", "budget. Members"]:
        m = locate(frag, TEXT)
        assert m is not None and TEXT[m.start : m.end] == frag and m.distance == 0
    m = locate("(in the old hxll)", TEXT)
    assert m is not None and TEXT[m.start : m.end] == "(in the old hall)"
    m = locate("what costs *mor* than", TEXT)
    assert m is not None and TEXT[m.start : m.end] == "what costs *more* than"


def test_repeated_text_first_occurrence_after_start():
    unit = "Breaking news: the river rose again. "
    doc = "Intro. " + unit * 5
    firsts = [i for i in range(len(doc)) if doc.startswith("Breaking news", i)]
    # exact
    assert locate("Breaking news", doc).start == firsts[0]
    after = [f + len("Breaking news: the") for f in firsts]  # a start past each occurrence
    assert locate("Breaking news", doc, start=after[0]).start == firsts[1]
    # with a typo: still the first occurrence at or after start
    for k, pos in enumerate(firsts):
        m = locate("Braking news: the river", doc, start=0 if k == 0 else after[k - 1])
        assert m is not None and m.start == pos and m.distance == 1
        assert doc[m.start : m.end] == "Breaking news: the river"


def test_far_match_found_by_expanding_window():
    doc = "x" * 5000 + "the needle in the haystack" + "y" * 3000
    m = locate("the needel in the haystack", doc)  # fuzzy, far beyond the first window
    assert m is not None and doc[m.start : m.end] == "the needle in the haystack"
    assert locate("something else entirely, not here", doc) is None


def test_start_bounds_and_empty():
    assert locate("", TEXT, start=5) == Match(5, 5, 0)
    # the window near start decides: "he committee" (one edit) beats the exact hit further on
    assert locate("The committee", TEXT, start=1) == Match(1, 13, 1)
    assert locate("The committee", TEXT, start=20).start == TEXT.index("the committee approved")
    with pytest.raises(ValueError):
        locate("a", "abc", start=4)
    assert locate("abc", "abc", start=3) is None


def test_chinese():
    doc = "今天上午，市政府召开新闻发布会。会议介绍了今年的城市建设计划，包括三条新地铁线。"
    m = locate("会议介绍了今年城市建设的计划", doc, max_ratio=0.2)
    assert m is not None and doc[m.start : m.end].startswith("会议介绍了今年")


alphabet = st.sampled_from("ab c.(*")


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    frag=st.text(alphabet, min_size=1, max_size=10),
    start=st.integers(0, 40),
)
def test_matches_brute_force(text, frag, start):
    start = min(start, len(text))
    m = locate(frag, text, start=start, max_ratio=0.3)
    best = brute_best(frag, text[start:])
    if best <= math.floor(0.3 * len(frag) + 1e-9):
        assert m is not None
        assert start <= m.start <= m.end <= len(text)
        assert Levenshtein.distance(frag, text[m.start : m.end]) == m.distance
        # the first window with a match decides, so a later, closer match may lose; never over budget
        assert m.distance <= math.floor(0.3 * len(frag) + 1e-9)
        if len(text) - start <= len(frag) * 1.5 + 16:  # one window: the global optimum
            assert m.distance == best
    else:
        assert m is None
    b = best_substring(frag, text)
    assert b is not None and b.distance == brute_best(frag, text)
