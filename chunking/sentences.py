"""Sentence splitting for Chinese, English and mixed text, as exact character spans.

`split_sentences` returns `Sentence` spans that tile the document:
the first starts at 0, each ends where the next starts, the last ends at ``len(text)``, and no
sentence is whitespace-only. Whitespace between two sentences is trailing whitespace of the one
before it; only the document's leading whitespace belongs to the sentence after it (the first).
The one exception: a document of nothing but whitespace is a single (whitespace) sentence, so that
every chunker built on these sentences keeps it; only the empty string has no sentence.

How boundaries are found:

* Line breaks (any character `str.splitlines` splits on, e.g. ``\\n``, ``\\r``,
  ``\\u2029``) always end a sentence. The text between line breaks is a *paragraph*.
* Each paragraph gets a language: the ``lang`` argument, or with ``lang="auto"``
  `detect_lang` of that paragraph, so mixed documents get the right rule per paragraph.
* Chinese paragraphs end a sentence after a run of ``。！？；…`` plus any closing quotes or
  brackets. ASCII ``!``/``?`` also end one when Chinese text or a capitalised word follows, and
  ``.`` when whitespace and then Chinese text or a capitalised word follows, unless the word before
  the dot looks like an abbreviation or an initial ("Mr.", "U.S.", "J."). Deliberately simple:
  English inside a Chinese paragraph is usually a name or a short phrase.
* English paragraphs go through pysbd (abbreviation-aware), in blocks of about
  ``_PYSBD_BLOCK`` characters because pysbd gets slower than linear on long inputs. Its segments
  are mapped back to offsets by searching forward; a segment that cannot be found (pysbd altered
  the text) only costs a boundary, never text. A pysbd cut right after a title ("—Mr. Weston")
  is dropped. Chinese ``。！？；`` also end a sentence here.
* Finally a sentence longer than ``max_chars`` is cut into pieces: at the last word start within
  the limit, else hard at ``max_chars`` characters.

Everything is linear in the length of the text apart from sorting the boundary offsets. A
200K-character document takes about a second if English (nearly all of it in pysbd) and a few
hundredths of a second if Chinese.
"""

from __future__ import annotations

import bisect
import re
import threading

import pysbd
import regex
from metachunk.chunking.types import Sentence

LANGS = ("zh", "en", "auto")

# Share of CJK ideographs among non-whitespace characters at or above which text counts as
# Chinese. Chinese prose is ~80-95% ideographs (the rest is punctuation and digits); English with
# a few Chinese names stays far below 20%.
ZH_THRESHOLD = 0.2

# CJK Unified Ideographs, Extension A, compatibility ideographs, Extensions B-H, and 〇.
_CJK_CHARS = "\u3007\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
CJK_RE = re.compile(f"[{_CJK_CHARS}]")  # one CJK character (also lumber.py's word count)

# Closing quotes and brackets that stay with the sentence they close. Straight quotes are
# included as the spec asks, even though one can occasionally open the next sentence instead.
_CLOSERS = "\"'”’」』）)\\]}】》〉〕〗〙〛］｝»›"
_ZH_TERMINATORS = "。！？；…"
# Opening marks that may start a Chinese sentence right after an ASCII "!" or "?".
_ZH_OPENERS = "“‘「『（《【"

# A run of Chinese terminators with its closing marks; a closer followed by another terminator
# (“好！”。) stays in the same match so no sentence is just "。".
_ZH_END_RE = re.compile(f"[{_ZH_TERMINATORS}][{_ZH_TERMINATORS}{_CLOSERS}]*")
# In English paragraphs only the unambiguous full-width terminators split (an ellipsis "…" is
# often mid-sentence in English).
_ZH_END_IN_EN_RE = re.compile(f"[。！？；][{_ZH_TERMINATORS}{_CLOSERS}]*")
# ASCII terminators inside a Chinese paragraph (see module docstring for when they are "safe").
_ASCII_BANG_RE = re.compile(f"[!?]+[{_CLOSERS}]*(?=\\s*[{_CJK_CHARS}{_ZH_OPENERS}]|\\s+[A-Z])")
_ASCII_DOT_RE = re.compile(f"\\.+[{_CLOSERS}]*(?=\\s+[A-Z{_CJK_CHARS}{_ZH_OPENERS}])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr mt vs etc cf fig no vol pp ed eds inc ltd co corp dept gen col capt sgt"
    " rev hon jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
# Titles before a name, matched at the end of a pysbd segment (see _en_cuts).
_TITLE_END_RE = re.compile(
    r"(?<![A-Za-z])(?:mr|mrs|ms|messrs|mme|mlle|dr|prof|rev|hon|capt|col|gen|lt|sgt)\.\s*\Z", re.IGNORECASE
)
# Any character str.splitlines() treats as a line boundary.
_PARAGRAPH_RE = re.compile("[^\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]+")
_NON_WS_RE = re.compile(r"\S")
_WS_RE = re.compile(r"\s")
_WORD_START_RE = re.compile(r"(?<=\s)\S")
_ASCII_TERMINATOR_RE = re.compile(r"[.!?]")

# pysbd is fed at most about this many characters at a time: its time per character grows with the
# text it is given, so a long paragraph in one call takes seconds.
_PYSBD_BLOCK = 1000
# One pysbd Segmenter per thread: segment() keeps the text it was given on the instance and reads it back,
# so a segmenter shared by threads (one chunker under a thread pool, chonkie's achunk) lost boundaries.
_SEGMENTERS = threading.local()


_GRAPHEME = regex.compile(r"\X")  # an extended grapheme cluster (Unicode UAX #29), as regex matches it


def _grapheme_cut(text: str, first: int, limit: int) -> int:
    """The last grapheme boundary after ``first`` and at or before ``limit``, counted from ``first``
    (a boundary); the end of the first grapheme when that one alone runs past ``limit``."""
    cut = None
    for m in _GRAPHEME.finditer(text, first):
        if m.end() > limit:
            return m.end() if cut is None else cut
        cut = m.end()
    return len(text) if cut is None else cut


def _segmenter() -> pysbd.Segmenter:
    segmenter = getattr(_SEGMENTERS, "segmenter", None)
    if segmenter is None:
        segmenter = _SEGMENTERS.segmenter = pysbd.Segmenter(language="en", clean=False)
    return segmenter


def detect_lang(text: str) -> str:
    """Return ``"zh"`` if CJK ideographs are >= 20% of the non-whitespace characters, else ``"en"``.

    Only ideographs count (not CJK punctuation or kana). Text without any non-whitespace character
    counts as English.
    """
    non_space = sum(map(len, text.split()))
    if non_space == 0:
        return "en"
    cjk = len(CJK_RE.findall(text))
    return "zh" if cjk >= ZH_THRESHOLD * non_space else "en"


def split_sentences(text: str, lang: str = "auto", max_chars: int = 1500) -> list[Sentence]:
    """Split ``text`` into sentences that tile it exactly (see the module docstring).

    ``lang`` is ``"zh"``, ``"en"`` or ``"auto"`` (decide per paragraph with `detect_lang`).
    No sentence is longer than ``max_chars`` characters, with one exception forced by the ban on
    whitespace-only sentences: a whitespace run is never cut, so a sentence may run past the
    limit with its trailing whitespace (and the first one with the document's leading
    whitespace), and a grapheme cluster is never cut, so one longer than the limit is a sentence of
    its own. Otherwise ``len(sentence_text.strip()) <= max_chars`` holds.
    """
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}; got {lang!r}")
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1; got {max_chars}")
    first = _NON_WS_RE.search(text)
    if first is None:  # "" or whitespace only: nothing to split, but nothing may be dropped either
        return [Sentence(0, len(text))] if text else []

    cuts: list[int] = []
    for para in _PARAGRAPH_RE.finditer(text):
        a, b = para.span()
        para_lang = detect_lang(para.group()) if lang == "auto" else lang
        if para_lang == "zh":
            cuts.extend(a + c for c in _zh_cuts(para.group()))
        else:
            cuts.extend(a + c for c in _en_cuts(para.group()))
        cuts.append(b)  # a line break always ends a sentence

    ends = _normalise_cuts(text, cuts, first.start())
    sentences: list[Sentence] = []
    start = 0
    for end in ends:
        sentences.extend(_cap(text, start, end, max_chars))
        start = end
    return sentences


def _normalise_cuts(text: str, cuts: list[int], first_non_ws: int) -> list[int]:
    """Turn raw cut offsets into sorted sentence ends, the last being ``len(text)``.

    Each cut moves forward past whitespace, so whitespace trails the sentence before it. Cuts that
    would leave a whitespace-only sentence (at or before the first non-whitespace character, or
    landing on an earlier end) are dropped.
    """
    ends: list[int] = []
    last = first_non_ws
    for cut in sorted(cuts):
        # A cut inside the whitespace run that the previous end skipped lands on that same end;
        # skipping it here also keeps this loop linear when there are many such cuts.
        if cut <= last:
            continue
        nxt = _NON_WS_RE.search(text, cut)
        cut = nxt.start() if nxt else len(text)
        ends.append(cut)
        last = cut
    if not ends or ends[-1] != len(text):
        ends.append(len(text))
    return ends


def _zh_cuts(para: str) -> list[int]:
    """Sentence-end offsets inside a Chinese paragraph."""
    cuts = [m.end() for m in _ZH_END_RE.finditer(para)]
    cuts.extend(m.end() for m in _ASCII_BANG_RE.finditer(para))
    for m in _ASCII_DOT_RE.finditer(para):
        # "..." is an ellipsis, never an abbreviation; a single dot needs a look at the word.
        if m.group().startswith("..") or not _is_abbreviation(para, m.start()):
            cuts.append(m.end())
    return cuts


def _is_abbreviation(para: str, dot: int) -> bool:
    """Whether the dot at ``para[dot]`` ends an abbreviation or an initial ("Mr", "U.S", "J")."""
    start = dot
    # Look back at most a few characters: abbreviations are short, and an unbounded scan would
    # make long letter runs quadratic.
    while start > 0 and dot - start < 12:
        ch = para[start - 1]
        if not (ch == "." or (ch.isascii() and ch.isalpha())):
            break
        start -= 1
    word = para[start:dot]
    if not word:
        return False
    return len(word) == 1 or "." in word or word.lower() in _ABBREVIATIONS


def _en_cuts(para: str) -> list[int]:
    """Sentence-end offsets inside an English paragraph: pysbd plus full-width terminators."""
    cuts = [m.end() for m in _ZH_END_IN_EN_RE.finditer(para)]
    if _needs_pysbd(para):
        # pysbd only knows "Mr." after whitespace, so it splits "cheerful—Mr. Weston"; a title
        # essentially never ends a sentence, so such cuts are dropped.
        cuts.extend(c for c in _pysbd_cuts(para) if not _TITLE_END_RE.search(para, max(0, c - 12), c))
    return cuts


def _needs_pysbd(para: str) -> bool:
    """Whether pysbd could find a boundary: an ASCII terminator before the paragraph's tail.

    Saves the pysbd call, whose fixed cost a short line pays too, on titles and one-sentence lines.
    """
    end = len(para)
    while end and (para[end - 1].isspace() or para[end - 1] in _CLOSERS or para[end - 1] in ".!?"):
        end -= 1
    return _ASCII_TERMINATOR_RE.search(para, 0, end) is not None


def _pysbd_cuts(para: str) -> list[int]:
    """Segment ``para`` with pysbd block by block and return the segment end offsets.

    A block's last segment may be a sentence cut short by the block edge, so it is not trusted:
    the next block starts where it starts. Blocks end at whitespace so no word is cut in two.
    """
    cuts: list[int] = []
    pos, n = 0, len(para)
    while pos < n:
        end = n
        if n - pos > _PYSBD_BLOCK:
            ws = _WS_RE.search(para, pos + _PYSBD_BLOCK, pos + _PYSBD_BLOCK + 200)
            end = ws.start() if ws else pos + _PYSBD_BLOCK
        spans = _segment_spans(para, pos, end)
        if end == n:
            cuts.extend(e for _, e in spans)
            break
        if len(spans) >= 2 and spans[-1][0] > pos:
            cuts.extend(e for _, e in spans[:-1])
            pos = spans[-1][0]
        else:
            # No boundary inside this block: one long sentence, move on.
            pos = end
    return cuts


def _segment_spans(para: str, pos: int, end: int) -> list[tuple[int, int]]:
    """Run pysbd on ``para[pos:end]`` and map its segments to ``(start, end)`` offsets in ``para``.

    pysbd's own ``char_span`` is unreliable (it re-finds segments by regex and can be slow), so
    each stripped segment is looked for right after the previous one, then in a bounded window.
    Segments that are not found are skipped; the spans found are strictly increasing.
    """
    try:
        segments = _segmenter().segment(para[pos:end])
    except Exception:  # pysbd bug on odd input: fall back to the simple ASCII rule
        return _fallback_spans(para, pos, end)
    spans: list[tuple[int, int]] = []
    cur, missed = pos, 0
    for segment in segments:
        core = segment.strip()
        if not core:
            continue
        nxt = _NON_WS_RE.search(para, cur, end)
        found = nxt.start() if nxt and para.startswith(core, nxt.start()) else -1
        if found < 0:
            # Bounded search keeps a run of unmatched segments from scanning the block repeatedly.
            found = para.find(core, cur, min(end, cur + missed + 2 * len(segment) + 64))
        if found < 0:
            missed += len(segment)
            continue
        spans.append((found, found + len(core)))
        cur, missed = found + len(core), 0
    return spans


def _fallback_spans(para: str, pos: int, end: int) -> list[tuple[int, int]]:
    """Boundaries of the Chinese-paragraph ASCII rule, as spans, for when pysbd fails."""
    block = para[pos:end]
    ends = sorted(set(_zh_cuts(block)) | {len(block)})
    starts = [0, *ends[:-1]]
    return [(pos + s, pos + e) for s, e in zip(starts, ends) if s < e]


def _cap(text: str, start: int, end: int, max_chars: int) -> list[Sentence]:
    """Cut the sentence ``text[start:end]`` into pieces of at most ``max_chars`` characters.

    Cuts go at the last word start within the limit, else at the last grapheme boundary within it (a
    grapheme longer than the limit is kept whole). Whitespace is never
    split off on its own (see `split_sentences`), so the limit counts from the first
    non-whitespace character and a piece may end with extra whitespace.
    """
    last_non_ws = len(text[start:end].rstrip()) + start
    first = _NON_WS_RE.search(text, start).start()
    if last_non_ws - first <= max_chars:
        return [Sentence(start, end)]
    word_starts = [m.start() for m in _WORD_START_RE.finditer(text, start, end)]
    pieces: list[Sentence] = []
    while True:
        limit = first + max_chars
        if last_non_ws <= limit:
            pieces.append(Sentence(start, end))
            return pieces
        i = bisect.bisect_right(word_starts, limit) - 1
        if i >= 0 and word_starts[i] > first:
            cut = word_starts[i]
        elif text[limit].isspace():
            # The limit falls in a whitespace run: keep the run as trailing whitespace.
            cut = word_starts[bisect.bisect_right(word_starts, limit)]
        else:  # no space to cut at: the last grapheme boundary at or before the limit (never inside an
            # emoji sequence or before a combining mark), or the first one after it for a longer grapheme
            cut = _grapheme_cut(text, first, limit)
            if cut >= last_non_ws:  # one grapheme runs to the end: no piece may be empty or blank
                pieces.append(Sentence(start, end))
                return pieces
        pieces.append(Sentence(start, cut))
        start = first = cut
