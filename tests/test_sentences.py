"""Tests for metachunk.chunking.sentences: the tiling contract, language rules, the hard cap and speed."""

from __future__ import annotations

import json
import re
from itertools import islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.sentences import detect_lang, split_sentences
from metachunk.chunking.types import Sentence
from support.data import data_file

NEWS = "crud-news/news.jsonl"
EMMA = "gutenqa-emma/paragraphs.jsonl"

LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
ZH_TERMINATORS = "。！？；…"
CLOSERS = "\"'”’」』）)]}】》〉〕〗〙〛］｝»›"


def pieces(text: str, **kwargs) -> list[str]:
    return [text[s.start : s.end] for s in split_sentences(text, **kwargs)]


def assert_contract(text: str, sentences: list[Sentence], max_chars: int = 1500) -> None:
    """Every promise of split_sentences that holds for any input."""
    if not text.strip():  # nothing dropped: a whitespace-only text is one sentence, only "" has none
        assert sentences == ([Sentence(0, len(text))] if text else [])
        return
    assert sentences[0].start == 0
    assert sentences[-1].end == len(text)
    for prev, nxt in zip(sentences, sentences[1:]):
        assert prev.end == nxt.start
    parts = [text[s.start : s.end] for s in sentences]
    assert "".join(parts) == text
    starts = {s.start for s in sentences}
    for i, part in enumerate(parts):
        assert part.strip(), f"whitespace-only sentence {i}: {part!r}"
        # Whitespace between sentences trails the one before; only the doc's leading
        # whitespace may start a sentence.
        if i > 0:
            assert not part[0].isspace()
            assert len(part.rstrip()) <= max_chars
        assert len(part.strip()) <= max_chars
    # A line break always ends a sentence: the next non-whitespace character starts one.
    seen_text = False
    for j, ch in enumerate(text):
        if ch in LINE_BREAKS and seen_text:
            nxt = re.compile(r"\S").search(text, j)
            if nxt:
                assert nxt.start() in starts, f"no sentence starts after the line break at {j}"
        seen_text = seen_text or not ch.isspace()


# ---------------------------------------------------------------------------------------------
# Property tests on generated text

TOKENS = [
    "a", "Z", "word", "The", "Mr.", "Mrs.", "e.g.", "U.S.", "3.14", "...", ".", "!", "?", ";",
    " ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\u3000", "\xa0", "\u2029", "\x0c",
    "你", "好", "中文", "。", "！", "？", "；", "…", "……", "“", "”", "「", "」", "（", "）", '"', "'",
]  # fmt: skip
token_text = st.lists(st.sampled_from(TOKENS), max_size=60).map("".join)
any_text = st.one_of(token_text, st.text(max_size=200))
langs = st.sampled_from(["auto", "zh", "en"])


@settings(max_examples=300, deadline=None)
@given(text=any_text, lang=langs)
def test_tiles_any_text(text: str, lang: str):
    assert_contract(text, split_sentences(text, lang=lang))


@settings(max_examples=200, deadline=None)
@given(text=any_text, lang=langs, max_chars=st.integers(1, 40))
def test_max_chars_any_text(text: str, lang: str, max_chars: int):
    assert_contract(text, split_sentences(text, lang=lang, max_chars=max_chars), max_chars)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="ab \n\t\u3000中", max_size=300), max_chars=st.integers(1, 20))
def test_max_chars_is_exact_without_long_whitespace(text: str, max_chars: int):
    """With single spaces only, a sentence exceeds max_chars by at most its one trailing space."""
    text = re.sub(r"\s+", " ", text).strip()
    for part in pieces(text, max_chars=max_chars):
        assert len(part.rstrip()) <= max_chars
        assert len(part) <= max_chars + 1


# ---------------------------------------------------------------------------------------------
# Real corpora


def read_jsonl(name: str, limit: int | None = None) -> list[dict]:
    with data_file(name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in islice(f, limit)]


@pytest.fixture(scope="module")
def news_docs() -> list[str]:
    return [row["text"] for row in read_jsonl(NEWS, 100)]


@pytest.fixture(scope="module")
def emma_doc() -> tuple[str, list[str]]:
    """The first two chapters of Emma, paragraphs joined by blank lines."""
    chapters: list[str] = []
    paragraphs: list[str] = []
    for row in read_jsonl(EMMA):
        if row["chapter"] not in chapters:
            if len(chapters) == 2:
                break
            chapters.append(row["chapter"])
        paragraphs.append(row["text"])
    return "\n\n".join(paragraphs), paragraphs


def test_news_corpus(news_docs: list[str]):
    inner_terminator = re.compile(
        f"[{ZH_TERMINATORS}][{ZH_TERMINATORS}{CLOSERS}]*[^{ZH_TERMINATORS}{CLOSERS}]"
    )
    total = 0
    for doc in news_docs:
        assert detect_lang(doc) == "zh"
        sentences = split_sentences(doc)
        assert_contract(doc, sentences)
        for s in sentences:
            # A Chinese terminator run (plus closers) only ever ends a sentence.
            part = doc[s.start : s.end].rstrip()
            assert not inner_terminator.search(part), part
        total += len(sentences)
    assert total > 5 * len(news_docs)  # news articles have many sentences each


def test_news_corpus_small_cap(news_docs: list[str]):
    for doc in news_docs[:20]:
        assert_contract(doc, split_sentences(doc, max_chars=30), max_chars=30)


def test_emma_corpus(emma_doc: tuple[str, list[str]]):
    doc, paragraphs = emma_doc
    sentences = split_sentences(doc)
    assert_contract(doc, sentences)
    assert split_sentences(doc, lang="en") == sentences  # every paragraph is detected as English
    parts = [doc[s.start : s.end] for s in sentences]
    assert len(parts) > 2 * len(paragraphs)
    # No split after an honorific: "Mr. Knightley", "Mrs. Weston".
    for part in parts:
        assert not re.search(r"\b(Mr|Mrs|Miss|Dr)\.$", part.rstrip()), part
    # Paragraph boundaries are sentence boundaries.
    starts = {s.start for s in sentences}
    pos = 0
    for paragraph in paragraphs:
        assert pos in starts
        pos += len(paragraph) + 2


def test_emma_corpus_small_cap(emma_doc: tuple[str, list[str]]):
    doc, _ = emma_doc
    assert_contract(doc, split_sentences(doc, max_chars=50), max_chars=50)


# ---------------------------------------------------------------------------------------------
# Hand cases


def test_chinese_closing_quote():
    assert pieces("他说：“你好。”然后走了。") == ["他说：“你好。”", "然后走了。"]


def test_chinese_terminator_runs():
    assert pieces("等等……然后呢？！好吧；走。") == ["等等……", "然后呢？！", "好吧；", "走。"]
    assert pieces("「好！」『是。』（完）") == ["「好！」", "『是。』", "（完）"]


def test_chinese_with_lang_zh_and_indent():
    text = "\u3000\u3000第一句。\u3000第二句！\n\u3000\u3000第三句"
    assert pieces(text, lang="zh") == ["\u3000\u3000第一句。\u3000", "第二句！\n\u3000\u3000", "第三句"]


def test_english_abbreviations():
    assert pieces("Mr. Knightley came. He sat down.") == ["Mr. Knightley came. ", "He sat down."]
    # pysbd alone splits after "Mr." when a dash comes before it.
    assert pieces("He was cheerful—Mr. Weston was. Yes.") == ["He was cheerful—Mr. Weston was. ", "Yes."]
    text = "Mrs. Weston met Dr. Perry, e.g. at noon. The U.S. Army paid 3.14 dollars. Then it left."
    assert pieces(text) == [
        "Mrs. Weston met Dr. Perry, e.g. at noon. ",
        "The U.S. Army paid 3.14 dollars. ",
        "Then it left.",
    ]


def test_english_quotes_and_questions():
    assert pieces('He said "Hi." Then he left! Why? No.') == [
        'He said "Hi." ',
        "Then he left! ",
        "Why? ",
        "No.",
    ]


def test_chinese_terminators_split_english_paragraph():
    assert pieces("The word is 你好。Then more text.") == ["The word is 你好。", "Then more text."]


def test_english_punctuation_in_chinese_paragraph():
    assert pieces("我喜欢Python. It is great. 然后呢? 好的!再见") == [
        "我喜欢Python. ",
        "It is great. ",
        "然后呢? ",
        "好的!",
        "再见",
    ]
    # Not safe: an abbreviation, a decimal, a dot without a following space.
    assert pieces("我看了Mr. Smith的书，花了3.5元，见www.example.com网站。") == [
        "我看了Mr. Smith的书，花了3.5元，见www.example.com网站。"
    ]


def test_mixed_paragraphs():
    text = "第一段。第二句！\nEnglish here. Mr. Smith agreed.\n\n中文段落里有 Python. It works."
    assert [detect_lang(line) for line in text.split("\n") if line] == ["zh", "en", "zh"]
    assert pieces(text) == [
        "第一段。",
        "第二句！\n",
        "English here. ",
        "Mr. Smith agreed.\n\n",
        "中文段落里有 Python. ",
        "It works.",
    ]


def test_newlines_end_sentences():
    text = "  \n  Title line\nno punctuation here\r\nlast\n\n"
    assert pieces(text) == ["  \n  Title line\n", "no punctuation here\r\n", "last\n\n"]


def test_hard_cap_without_spaces():
    text = "字" * 10_000
    sentences = split_sentences(text, max_chars=1500)
    assert [s.end - s.start for s in sentences] == [1500] * 6 + [1000]
    assert_contract(text, sentences)


def test_hard_cap_with_spaces():
    text = "word " * 2000  # 10,000 chars, no punctuation
    parts = pieces(text, max_chars=1500)
    assert "".join(parts) == text
    assert all(len(p) <= 1500 for p in parts)
    assert all(p.endswith(" ") for p in parts)  # cut after whitespace, never inside a word
    assert pieces("ab cd ef gh", max_chars=5) == ["ab ", "cd ", "ef gh"]
    assert pieces("abcdefgh ij", max_chars=5) == ["abcde", "fgh ", "ij"]


def test_hard_cap_never_splits_off_whitespace():
    # The limit falls inside a whitespace run: the run stays trailing whitespace.
    assert pieces("aaaaa     b", max_chars=5) == ["aaaaa     ", "b"]
    assert pieces("        abc", max_chars=2) == ["        ab", "c"]


def test_empty_and_whitespace_only():
    assert split_sentences("") == []
    assert split_sentences(" \n\t\u3000\r\n ") == [Sentence(0, 7)]  # whitespace is kept, as one sentence
    assert pieces("  x  ") == ["  x  "]


def test_bad_arguments():
    with pytest.raises(ValueError, match="zh, en, auto"):
        split_sentences("Hello.", lang="fr")
    with pytest.raises(ValueError, match="max_chars"):
        split_sentences("Hello.", max_chars=0)


def test_detect_lang():
    assert detect_lang("今天天气很好。") == "zh"
    assert detect_lang("The capital of China is 北京.") == "en"
    assert detect_lang("Python是一种编程语言") == "zh"  # 8 of 14 non-space chars
    assert detect_lang("") == "en"
    assert detect_lang("   ") == "en"


# ---------------------------------------------------------------------------------------------
# 200K-char documents: they complete and keep the contract (their speed is bench/'s to measure)


@pytest.mark.parametrize(
    "text",
    [
        "a" * 200_000,
        "ab " * 70_000,
        "a\n" * 100_000,
        ("x" * 5000 + ". ") * 40,
        "中. A" * 50_000,
        "！" * 200_000,
    ],
    ids=["no-punct", "words", "many-lines", "long-words", "zh-dots", "bangs"],
)
def test_pathological_inputs_tile(text: str):
    # Speed on these inputs is measured by bench/, not asserted here; this checks they complete and tile.
    assert_contract(text, split_sentences(text))


def test_200k_mixed_document_tiles(news_docs: list[str], emma_doc: tuple[str, list[str]]):
    zh = "\n".join(news_docs)
    en, _ = emma_doc
    doc = (zh[:100_000] + "\n\n" + en * (100_000 // len(en) + 1))[:200_000]
    sentences = split_sentences(doc)
    assert_contract(doc, sentences)


def test_threads_splitting_at_once_get_the_boundaries_one_thread_gets():
    """pysbd's Segmenter keeps the text it was given on the instance and reads it back: one segmenter
    shared by threads (a chunker under a thread pool, chonkie's achunk) lost boundaries in 21 of 40
    documents. Each thread has its own."""
    from concurrent.futures import ThreadPoolExecutor

    from metachunk.chunking.sentences import split_sentences

    docs = [" ".join(f"Document {d} says thing {k} plainly. Mr. Knightley agreed with it!" for k in range(15))
            for d in range(40)]  # fmt: skip
    alone = [split_sentences(doc, "en") for doc in docs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda doc: split_sentences(doc, "en"), docs))
    assert together == alone


@pytest.mark.parametrize("text", ["👨\u200d👩\u200d👧\u200d👦" * 800, "x" + "e\u0301" * 2000, "🇫🇷" * 1000])
def test_a_long_run_without_spaces_is_cut_between_graphemes(text):
    import regex
    from metachunk.chunking.sentences import split_sentences

    pieces = split_sentences(text, "en", max_chars=1500)
    assert len(pieces) > 1 and "".join(text[p.start : p.end] for p in pieces) == text
    boundaries = {m.end() for m in regex.finditer(r"\X", text)}
    assert all(p.end in boundaries for p in pieces), [p.end for p in pieces]
    assert all(p.end - p.start <= 1500 for p in pieces)


@pytest.mark.parametrize(
    "text", ["👨\u200d👩\u200d👧\u200d👦" * 3, "a" + "\u0301" * 10 + "   ", "x" * 3 + "e\u0301" * 4 + " "]
)
def test_a_grapheme_longer_than_the_limit_is_kept_whole_and_no_piece_is_blank(text):
    from metachunk.chunking.sentences import split_sentences

    pieces = split_sentences(text, "en", max_chars=5)
    assert "".join(text[p.start : p.end] for p in pieces) == text
    assert all(text[p.start : p.end].strip() for p in pieces), [(p.start, p.end) for p in pieces]
