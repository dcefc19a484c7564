"""Mixture-of-Chunkers inference (MoC §3.2): a router picks one of four chunking experts per
window of text; the expert writes a JSON list of ``head[MASK]tail`` rules; the rules are recovered
against the text as exact spans.

``metachunk chunk --method moc --router DIR --experts DIR0,DIR1,DIR2,DIR3``

* **Prompts** (one home, shared with training): ``chunking/prompts/moc_router.{lang}.txt`` and
  ``moc_expert.{lang}.txt`` in the ``<<<system>>>/<<<user>>>`` format of :mod:`metachunk.prompts`
  (their sha256 is their version). :func:`router_messages` and :func:`expert_messages` build the
  chat messages; ``data build-sft moc-router`` / ``moc-expert`` build training rows with the same
  functions, so the prompt at inference is the training prompt byte for byte.
* **Router** (Eq. 5): a causal LM fine-tuned to answer one label token ``"0".."3"`` (granularity
  bins of the mean chunk length: ≤120, ≤150, ≤180, >180 characters, :func:`granularity_label`).
  The label is the argmax of the logits of the four label tokens at the first generated position
  (:func:`router_label`); nothing is generated.
* **Experts**: causal LMs fine-tuned to answer a JSON list of ``head{placeholder}tail`` strings,
  decoded with sampling at temperature 0.1, top-p 0.1 (the paper's low-randomness setting).
* **Constrained decoding** (``--moc-constrained``, the default; :class:`ExpertGrammar`): the experts
  decode under their answer schema, ``chunking/prompts/moc_expert.schema.json`` (a JSON array of
  strings, at least one; sha256-versioned like the prompts), with at most one item per sentence of
  the window, compiled for each expert's tokenizer by xgrammar and applied as a logits processor
  before temperature and top-p. The array is written as the experts are trained to write it
  (``json.dumps``: ``", "`` between items, no other whitespace); no stop token may come before the
  closing ``]`` and only a stop token after it, so an answer that stops always parses. An answer
  that ``--moc-max-new-tokens`` cuts before its ``]`` is *truncated*. ``--no-moc-constrained``
  decodes freely and reads the outermost ``[...]`` of the answer (:func:`parse_expert_answer`).
* **Failures and fallback**: an answer cut by the token budget before it parses (``truncated``),
  one that ends but is no JSON list of strings (``invalid_json``; none under the grammar), and one
  of which no element can be found in the text (``unrecovered``) are counted by cause and retried
  (each retry adds 0.4 to temperature and top-p, capped at 1); after the last retry the window is
  chunked by PPL chunking (:mod:`metachunk.chunking.ppl`) with the router's model or
  ``--moc-fallback-model``, counted in the run's ``.meta.json`` with the cause of its last failure.
* **Recovery** (§3.2.4, :func:`recover_spans`): each element is split at the placeholder and
  ``re.escape(head) + ".*?" + re.escape(tail)`` (DOTALL, shortest) is searched in the text after
  the previous match. When that fails, head and tail are found by edit distance
  (:func:`metachunk.chunking.align.locate`, at most ``max_ratio`` = 10% edits, as in Appendix A.3, and
  at least one edit for anchors of 8 characters or more).
  Elements found nowhere are skipped and counted. Chunks start where the recovered elements start
  and tile the window (:func:`tile`): text before the first match joins the first chunk, text
  between or after matches joins the chunk before it, so ``chunk.text == doc[start:end]``.
* **Windows** (Appendix A.3's sliding window with chunk buffer): a document longer than
  ``window_chars`` is processed window by window, cut at sentence ends
  (:func:`metachunk.chunking.sentences.split_sentences`); the last chunk of each window (when shorter than
  half a window) is carried over as the start of the next window and chunked again there.
  Documents advance in lockstep, so the router and each expert see batches of windows.

Weights load from safetensors only (:func:`metachunk.chunking.students.student_dir`).
"""

from __future__ import annotations

import bisect
import copy
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from metachunk.chunking.align import locate
from metachunk.chunking.students import student_dir
from metachunk.chunking.types import Sentence

from metachunk.generation import (
    Generation,
    chat_prompt_ids,
    generate_batched,
    padded_batches,
    prepare_tokenizer,
    stop_token_ids,
)
from metachunk.prompts import Prompt, Schema, load_prompt_file, load_schema_file

# The paper's eight placeholders for the omitted middle of a chunk (§3.2.3, Table 2); [MASK] is
# the one its experiments use.
PLACEHOLDERS = ("[MASK]", "<omitted>", "<ellipsis>", "[ELLIPSIS]", ".*?", "<...>", "<.*>", "<pad>")
DEFAULT_PLACEHOLDER = "[MASK]"
ROUTER_LABELS = ("0", "1", "2", "3")
# Upper bounds (characters) of the mean chunk length of granularity labels 0, 1, 2 (§3.2.2).
GRANULARITY_BOUNDS = (120, 150, 180)
DEFAULT_WINDOW_CHARS = 1024
DEFAULT_TEMPERATURE = 0.1
DEFAULT_TOP_P = 0.1
DEFAULT_RETRIES = 2
DEFAULT_MAX_NEW_TOKENS = 512
DEFAULT_MAX_RATIO = 0.1
RETRY_STEP = 0.4  # added to temperature and top-p on each retry
MIN_TYPO_CHARS = 8  # anchors at least this long may always have one edit
GRAMMAR_LIBRARY = "xgrammar"  # the constrained decoding of the experts' answers (ExpertGrammar)
FAILURES = ("invalid_json", "truncated", "unrecovered")  # why an expert's answer gave no chunks
# --moc-anchored (anchored_grammar): the anchors as distill/moc.py writes the experts' targets
# (head_chars = tail_chars = 10 in recipes/distill/moc.yaml, widened to whole ASCII words by at most
# WORD_SNAP characters; doubled, then quadrupled, where they do not recover).
DEFAULT_ANCHOR_CHARS = 10
ANCHOR_SCALES = (1, 2, 4)
WORD_SNAP = 20

# ------------------------------------------------------------------------------------- prompts


def load_moc_prompt(role: str, lang: str) -> Prompt:
    """``moc_router`` / ``moc_expert`` prompt file of ``lang`` (zh, en)."""
    if role not in ("router", "expert"):
        raise ValueError(f"unknown MoC prompt {role!r}; have router, expert")
    return load_prompt_file("metachunk.chunking", f"moc_{role}", lang)


def router_messages(text: str, lang: str) -> list[dict]:
    """The router's prompt for ``text`` (about 1024 characters): [system, user] messages. The
    answer it is trained on is one of :data:`ROUTER_LABELS`."""
    return load_moc_prompt("router", lang).messages(text=text)


def expert_messages(text: str, lang: str, placeholder: str = DEFAULT_PLACEHOLDER) -> list[dict]:
    """An expert's prompt for ``text``: [system, user] messages (the paper's Table 7 prompt). The
    answer it is trained on is a JSON list of ``head + placeholder + tail`` strings
    (:func:`format_elements`)."""
    check_placeholder(placeholder)
    return load_moc_prompt("expert", lang).messages(text=text, placeholder=placeholder)


def load_moc_schema() -> Schema:
    """``chunking/prompts/moc_expert.schema.json``: the JSON Schema of an expert's answer (a JSON
    array of strings, at least one); its sha256 is its version, as a prompt's."""
    return load_schema_file("metachunk.chunking", "moc_expert", object_root=False)


def expert_schema(max_items: int | None = None) -> dict:
    """The schema an expert decodes under: the file's, with ``maxItems`` when given (at least its
    ``minItems``)."""
    schema = dict(load_moc_schema().data)
    if max_items is not None:
        schema["maxItems"] = max(max_items, schema.get("minItems", 0))
    return schema


def check_placeholder(placeholder: str) -> None:
    if placeholder not in PLACEHOLDERS:
        raise ValueError(f"unknown placeholder {placeholder!r}; have {', '.join(PLACEHOLDERS)}")


def granularity_label(mean_chunk_chars: float) -> int:
    """The router label (0..3) of a text whose chunks average ``mean_chunk_chars`` characters:
    (0, 120] -> 0, (120, 150] -> 1, (150, 180] -> 2, (180, inf) -> 3."""
    return bisect.bisect_left(GRANULARITY_BOUNDS, mean_chunk_chars)


def format_elements(heads_tails: Sequence[tuple[str, str]], placeholder: str = DEFAULT_PLACEHOLDER) -> str:
    """The expert's answer for (head, tail) pairs: a JSON list of ``head + placeholder + tail``
    (non-ASCII kept as is)."""
    check_placeholder(placeholder)
    return json.dumps([h + placeholder + t for h, t in heads_tails], ensure_ascii=False)


# ------------------------------------------------------------------------------------- router


def label_token_ids(tokenizer) -> list[int]:
    """Token id of each router label; each label must be one token of its own."""
    ids = []
    for label in ROUTER_LABELS:
        pieces = tokenizer.encode(label, add_special_tokens=False)
        if len(pieces) != 1:
            raise ValueError(f"router label {label!r} is {len(pieces)} tokens for this tokenizer; need 1")
        ids.append(pieces[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"router labels share token ids: {ids}")
    return ids


def router_label(logits, label_ids: Sequence[int]) -> int:
    """Eq. 5: argmax over the logits of the label tokens at the first generated position.
    ``logits``: one row (vocabulary) or a batch of rows; returns the label index (0..3), or a list."""
    import torch

    logits = torch.as_tensor(logits)
    picked = logits[..., list(label_ids)]
    best = picked.argmax(dim=-1)
    return best.tolist() if best.ndim else int(best)


# ------------------------------------------------------------------------------------- answers


def parse_expert_answer(answer: str) -> list[str] | None:
    """The expert's JSON list of strings, or None when the answer holds none.

    Tolerates text around the list (a code fence, a preamble): the outermost ``[ ... ]`` is parsed.
    A list with a non-string element, or an empty list, is invalid.
    """
    first, last = answer.find("["), answer.rfind("]")
    if first < 0 or last <= first:
        return None
    try:
        value = json.loads(answer[first : last + 1])
    except json.JSONDecodeError:
        return None
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


# ------------------------------------------------------------------------------------- grammar


def grammar_library():
    """(the xgrammar module, its installed version); a clear error when it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    from metachunk.models import ModelNotFoundError

    try:
        import xgrammar

        return xgrammar, version(GRAMMAR_LIBRARY)
    except (ImportError, PackageNotFoundError):
        raise ModelNotFoundError(
            "--moc-constrained (the default) decodes the experts under their answer schema with "
            "xgrammar, which is not installed: pip install xgrammar==0.2.9 (in metachunk's "
            "dependencies), or run with --no-moc-constrained"
        ) from None


@cache
def _timed_processor_class():
    """xgrammar's transformers logits processor, timing its calls into its :class:`ExpertGrammar`."""
    from xgrammar.contrib.hf import LogitsProcessor

    class TimedLogitsProcessor(LogitsProcessor):
        def __init__(self, compiled, grammar: ExpertGrammar):
            super().__init__(compiled)
            self.grammar = grammar

        def __call__(self, input_ids, scores):
            started = time.perf_counter()
            scores = super().__call__(input_ids, scores)
            g = self.grammar
            g.mask_seconds += time.perf_counter() - started
            g.mask_steps += 1
            g.mask_rows += input_ids.shape[0]
            return scores

    return TimedLogitsProcessor


class ExpertGrammar:
    """The expert answer schema compiled for one model's tokenizer (xgrammar), and the logits
    processor that holds a batch of answers to it.

    Every row of a batch has its own grammar: the schema with ``maxItems`` = the sentences of its
    window (compiled once per count). The array is written as :func:`format_elements` writes it,
    the form the experts are trained on (``", "`` between items, no other whitespace, so no token is
    spent on layout). The model's stop tokens are the grammar's: none is allowed before the closing
    ``]``, and only they after it, so generation ends cleanly once the array closes.
    """

    def __init__(self, model, tokenizer, stop_ids: set[int]):
        xgr, self.version = grammar_library()
        started = time.perf_counter()
        vocab_size = model.get_output_embeddings().weight.shape[0]  # the logits' width (may pad the vocab)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[int, object] = {}
        self._anchored: dict[str, object] = {}  # --moc-anchored: by grammar text
        self.compile_seconds = time.perf_counter() - started
        self.anchored_compile_seconds = 0.0
        self.mask_seconds = 0.0
        self.mask_steps = self.mask_rows = 0  # processor calls (decoding steps), rows masked over them

    def compiled(self, max_items: int):
        if max_items not in self._compiled:
            started = time.perf_counter()
            schema = json.dumps(expert_schema(max_items))
            self._compiled[max_items] = self._compiler.compile_json_schema(schema, any_whitespace=False)
            self.compile_seconds += time.perf_counter() - started
        return self._compiled[max_items]

    def compiled_ebnf(self, grammar: str):
        """An EBNF grammar (:func:`anchored_grammar`) compiled, once per grammar text."""
        if grammar not in self._anchored:
            started = time.perf_counter()
            self._anchored[grammar] = self._compiler.compile_grammar(grammar)
            seconds = time.perf_counter() - started
            self.compile_seconds += seconds
            self.anchored_compile_seconds += seconds
        return self._anchored[grammar]

    @property
    def anchored_grammars(self) -> int:
        return len(self._anchored)

    def processor(self, max_items: Sequence[int], grammars: Sequence[str | None] | None = None):
        """A logits processor for one ``generate`` call whose row ``i`` may answer at most
        ``max_items[i]`` items, or, where ``grammars[i]`` is given, what that EBNF grammar allows
        (xgrammar's processor serves one call: make one per call)."""
        grammars = grammars or [None] * len(max_items)
        compiled = [
            self.compiled(n) if g is None else self.compiled_ebnf(g) for n, g in zip(max_items, grammars)
        ]
        return _timed_processor_class()(compiled, self)


# ------------------------------------------------------------------------------------- anchored


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
    """The head of a chunk ``text`` as the experts' targets write it (:func:`expert_element`): its first
    ``chars`` characters, widened to the end of a word, without surrounding whitespace."""
    text = text.strip()
    return text[: _snap_right(text, chars)].rstrip()


def anchor_tail(text: str, chars: int) -> str:
    """The tail of a chunk ``text``: its last ``chars`` characters, widened to a word's start."""
    text = text.strip()
    return text[_snap_left(text, len(text) - chars) :].lstrip()


def ebnf_literal(s: str) -> str:
    """``s`` as it is written inside a JSON string (json.dumps, non-ASCII kept), as an EBNF string
    literal (backslashes and double quotes escaped again)."""
    body = json.dumps(s, ensure_ascii=False)[1:-1]
    return '"' + body.replace("\\", "\\\\").replace('"', '\\"') + '"'


def window_segments(text: str, ends: Sequence[int]) -> list[tuple[int, int]]:
    """The sentences of a window ``text`` as spans tiling it: cut at ``ends`` (sentence ends in
    window coordinates); a whitespace-only piece joins the sentence before it (or after it, first)."""
    edges = [0, *sorted({e for e in ends if 0 < e < len(text)}), len(text)]
    segments: list[list[int]] = []
    for a, b in zip(edges, edges[1:]):
        if segments and not text[a:b].strip():
            segments[-1][1] = b
        elif segments and not text[segments[-1][0] : segments[-1][1]].strip():
            segments[-1][1] = b  # a whitespace-only first piece
        else:
            segments.append([a, b])
    return [(a, b) for a, b in segments]


def anchored_grammar(
    text: str,
    segments: Sequence[tuple[int, int]],
    placeholder: str = DEFAULT_PLACEHOLDER,
    chars: int = DEFAULT_ANCHOR_CHARS,
) -> str:
    """The EBNF grammar (xgrammar) of the answers an expert may give for a window ``text`` whose
    sentences are ``segments`` (spans tiling it, :func:`window_segments`), for ``--moc-anchored``.

    An answer is a JSON array written as :func:`format_elements` writes it (``", "`` between items)
    of one element per chunk, the chunks being runs of whole sentences that cover the window in
    order: sentences ``i..j`` are written as the experts' targets write a chunk (:func:`expert_element`):
    ``head(i) + placeholder + tail(j)``, or the chunk quoted whole when it is at most
    ``2 * chars`` characters. The head of sentence ``i`` is its first ``chars`` characters (widened
    to a word's end), doubled then quadrupled until its first occurrence after the window's first
    character is sentence ``i``'s start, so :func:`recover_spans` finds every element exactly where
    its chunk starts; the tail is the last ``chars`` characters of sentence ``j`` (to a word's
    start). The expert chooses only the tails: where its chunks end. At most one element per
    sentence, as ``maxItems`` in the schema mode.
    """
    n = len(segments)
    if n == 0:
        raise ValueError("a window needs at least one sentence")
    starts = [a + len(text[a:b]) - len(text[a:b].lstrip()) for a, b in segments]
    ends = [b - (len(text[a:b]) - len(text[a:b].rstrip())) for a, b in segments]
    heads = []
    for i in range(n):
        rest = text[starts[i] :]
        for scale in ANCHOR_SCALES:
            head = anchor_head(rest, chars * scale)
            if i == 0 or text.find(head, 1) == starts[i]:
                break
        heads.append(head)
    tails = [anchor_tail(text[: ends[j]], chars) for j in range(n)]
    mask = ebnf_literal(placeholder)
    rules = ['root ::= "[" e0']
    for j in range(n):
        rules.append(f'r{j} ::= "\\", " e{j + 1}' if j < n - 1 else f'r{j} ::= "\\"]"')
        tail = f"{ebnf_literal(tails[j])} r{j}"
        rules.append(f"t{j} ::= {tail} | t{j + 1}" if j < n - 1 else f"t{j} ::= {tail}")
    for i in range(n):
        options = []
        masked_from = None  # the first sentence j where the chunk i..j is longer than head + tail
        for j in range(i, n):
            whole = text[starts[i] : ends[j]]
            if len(whole) > 2 * chars:
                masked_from = j
                break
            if i == 0 or text.find(whole, 1) == starts[i]:  # quoted whole: recovered at its start
                options.append(f"{ebnf_literal(whole)} r{j}")
        if masked_from is not None:
            options.append(f"{ebnf_literal(heads[i])} {mask} t{masked_from}")
        if not options:  # a short duplicate sentence: anchored anyway (recovered at its first copy)
            options.append(f"{ebnf_literal(heads[i])} {mask} t{i}")
        rules.append(f'e{i} ::= "\\"" ({" | ".join(options)})')
    return "\n".join(rules) + "\n"


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
    head and tail may overlap). Spans are non-overlapping and increasing.
    """
    stats = RecoveryStats(elements=len(elements))
    spans: list[tuple[int, int]] = []
    cursor = 0
    for element in elements:
        head, tail = split_element(element, placeholder)
        if not head and not tail:
            stats.skipped += 1
            continue
        pattern = re.compile(re.escape(head) + ".*?" + re.escape(tail), re.DOTALL)
        m = pattern.search(text, cursor)
        if m is not None and m.end() > m.start():
            spans.append((m.start(), m.end()))
            cursor = m.end()
            stats.exact += 1
            continue
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
    """``max_ratio``, but at least one edit for an anchor of :data:`MIN_TYPO_CHARS` or more (10%
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


# ------------------------------------------------------------------------------------- windows


def char_window_end(
    sentences: Sequence[Sentence], ends: Sequence[int], start: int, after: int, limit: int
) -> int:
    """End (a character offset) of the window beginning at ``start``: the last sentence end within
    ``limit`` characters of ``start``, but past ``after`` (the previous window's end, so every window brings new text);
    the first sentence end past ``after`` when none fits. ``ends``: the sentences' ends, sorted."""
    first = bisect.bisect_right(ends, max(start, after))
    if first >= len(ends):
        return sentences[-1].end if sentences else start
    last = bisect.bisect_right(ends, start + limit) - 1
    return ends[max(first, last)]


@dataclass
class _Doc:
    text: str
    lang: str
    ends: list[int]
    sentences: Sequence[Sentence]
    pos: int = 0  # where the next window starts (a carried-over chunk's start)
    prev_end: int = 0  # the previous window's end
    chunks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pos >= len(self.text)


@dataclass
class _Window:
    doc: _Doc
    start: int
    end: int
    label: int = -1
    elements: list[str] | None = None
    spans: list[tuple[int, int]] | None = None  # chunks, window coordinates
    failure: str | None = None  # why the last answer gave no chunks (one of FAILURES)

    @property
    def text(self) -> str:
        return self.doc.text[self.start : self.end]

    def segments(self) -> list[tuple[int, int]]:
        """The window's sentences as spans tiling its text (window coordinates)."""
        return window_segments(
            self.text, [e - self.start for e in self.doc.ends if self.start < e < self.end]
        )

    @property
    def sentences(self) -> int:
        """How many of the document's sentences end inside the window (at least 1)."""
        ends = self.doc.ends
        return max(1, bisect.bisect_right(ends, self.end) - bisect.bisect_right(ends, self.start))


# ------------------------------------------------------------------------------------- chunker


@dataclass
class MocSettings:
    router: str
    experts: tuple[str, str, str, str]
    placeholder: str = DEFAULT_PLACEHOLDER
    window_chars: int = DEFAULT_WINDOW_CHARS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    retries: int = DEFAULT_RETRIES
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_ratio: float = DEFAULT_MAX_RATIO
    fallback_model: str | None = None  # PPL fallback; None: the router's model
    fallback_threshold: float = 0.5
    max_context: int = 4096
    batch_size: int = 8
    device: str | None = None
    dtype: str = "auto"
    seed: int = 0
    constrained: bool = True  # decode the experts under their answer schema (ExpertGrammar)
    anchored: bool = False  # constrained to the window's own sentences (anchored_grammar)
    anchor_chars: int = DEFAULT_ANCHOR_CHARS
    stand_ins: dict[str, str] = field(
        default_factory=dict
    )  # role -> the model that stands in (stand_in_models)

    def __post_init__(self):
        check_placeholder(self.placeholder)
        if len(self.experts) != len(ROUTER_LABELS):
            raise ValueError(
                f"MoC needs {len(ROUTER_LABELS)} experts (one per granularity), got {len(self.experts)}"
            )
        if self.retries < 0 or self.window_chars < 64 or self.max_new_tokens < 1:
            raise ValueError("retries must be >= 0, window_chars >= 64, max_new_tokens >= 1")
        if not (0 < self.temperature and 0 < self.top_p <= 1):
            raise ValueError("temperature must be > 0 and top_p in (0, 1]")
        if self.anchored and not self.constrained:
            raise ValueError(
                "anchored decoding (--moc-anchored) is a grammar: it needs constrained decoding "
                "(--moc-constrained); drop --no-moc-constrained or --moc-anchored"
            )
        if self.anchor_chars < 1:
            raise ValueError("anchor_chars must be >= 1")


def stand_in_models(router: str, experts: Sequence[str], stand_in: str | None) -> tuple[str, tuple, dict]:
    """``(router, experts, stand_ins)`` with every role whose dir holds no model (its training set
    had no rows, as at toy scale) given a stand-in: an expert the trained expert of the nearest
    granularity (the lower on a tie), the router, or every expert when none was trained,
    ``stand_in``. ``stand_ins`` maps each replaced role to its stand-in. Without ``stand_in`` nothing
    is replaced (a missing model is then the usual error)."""
    from metachunk.models import PRESETS

    if stand_in is None:
        return router, tuple(experts), {}

    def present(name: str) -> bool:
        return name in PRESETS or any(Path(name).glob("*.safetensors"))

    trained = [k for k, e in enumerate(experts) if present(e)]
    out, stand_ins = list(experts), {}
    for k in range(len(experts)):
        if k not in trained:
            out[k] = experts[min(trained, key=lambda t: (abs(t - k), t))] if trained else stand_in
            stand_ins[f"expert {k}"] = out[k]
    if not present(router):
        router, stand_ins["router"] = stand_in, stand_in
    return router, tuple(out), stand_ins


def parse_experts(value: str | Sequence[str]) -> tuple[str, str, str, str]:
    """``"d0,d1,d2,d3"`` (or a list) -> the four expert dirs, label 0 first."""
    items = [x.strip() for x in (value.split(",") if isinstance(value, str) else value)]
    if len(items) != len(ROUTER_LABELS) or not all(items):
        raise ValueError(
            f"--experts takes {len(ROUTER_LABELS)} model dirs separated by commas (granularity 0..3), "
            f"got {value!r}"
        )
    return tuple(items)  # type: ignore[return-value]


class _LM:
    """A loaded chat model (router / expert / fallback), shared by every role that names its path."""

    def __init__(self, path: Path, device: str | None, dtype: str):
        from metachunk.models import ModelNotFoundError, load_causal_lm

        started = time.perf_counter()
        self.path = path
        self.model, self.tokenizer = load_causal_lm(
            str(path), device=device, dtype=dtype, use_safetensors=True
        )
        self.load_seconds = time.perf_counter() - started
        tok = self.tokenizer
        if not tok.chat_template:
            raise ModelNotFoundError(f"{path} has no chat template; MoC models are trained on chat messages")
        prepare_tokenizer(tok)
        self.stop_ids = stop_token_ids(self.model.generation_config, tok)

    def encode(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)


class MocChunker:
    """Router + four experts, loaded once (each distinct model dir once; experts on first use)."""

    def __init__(self, settings: MocSettings):
        self.s = settings
        # Every dir is checked (safetensors present) before any model loads.
        self.router_path = student_dir(settings.router).resolve()
        self.expert_paths = [student_dir(e).resolve() for e in settings.experts]
        self.fallback_path = (
            student_dir(settings.fallback_model).resolve() if settings.fallback_model else self.router_path
        )
        self._models: dict[Path, _LM] = {}
        self._grammars: dict[Path, ExpertGrammar] = {}
        self.grammar_version = grammar_library()[1] if settings.constrained else None  # before any load
        self.router = self._lm(self.router_path)
        self.label_ids = label_token_ids(self.router.tokenizer)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the run's counters (models stay loaded)."""
        self.routes = Counter()
        self.recovery = RecoveryStats()
        self.windows = self.attempts = self.retried = self.invalid_json = self.unrecovered = 0
        self.truncated = self.fallback_windows = self.carried = 0
        self.fallback_causes = Counter()
        for g in self._grammars.values():
            g.mask_seconds, g.mask_steps, g.mask_rows = 0.0, 0, 0
        self.new_tokens = 0
        self.seconds = {"router": 0.0, "experts": 0.0, "fallback": 0.0, "recovery": 0.0}
        self.prompt_sha256: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg) -> MocChunker:
        """The MoC chunker a :class:`~metachunk.chunking.pipeline.ChunkConfig` asks for (its ``moc:`` block)."""
        moc = cfg.moc
        if not moc.router or not moc.experts:
            raise ValueError("--method moc needs --router DIR and --experts DIR0,DIR1,DIR2,DIR3")
        router, experts, stand_ins = stand_in_models(moc.router, parse_experts(moc.experts), moc.stand_in)
        if stand_ins:
            print("chunk: MoC stand-ins (no trained model there): "
                  + ", ".join(f"{role} <- {model}" for role, model in stand_ins.items()), file=sys.stderr)  # fmt: skip
        return cls(
            MocSettings(
                router=router,
                experts=experts,
                stand_ins=stand_ins,
                placeholder=moc.placeholder,
                window_chars=moc.window_chars,
                temperature=moc.temperature,
                top_p=moc.top_p,
                retries=moc.retries,
                max_new_tokens=moc.max_new_tokens,
                max_ratio=moc.max_ratio,
                fallback_model=moc.fallback_model,
                fallback_threshold=cfg.effective_threshold,
                max_context=cfg.max_context,
                batch_size=cfg.batch_size,
                device=cfg.device,
                dtype=cfg.dtype,
                constrained=moc.constrained,
                anchored=moc.anchored,
                anchor_chars=moc.anchor_chars,
            )
        )

    def _lm(self, path: Path) -> _LM:
        if path not in self._models:
            self._models[path] = _LM(path, self.s.device, self.s.dtype)
        return self._models[path]

    def _grammar(self, lm: _LM) -> ExpertGrammar:
        if lm.path not in self._grammars:
            self._grammars[lm.path] = ExpertGrammar(lm.model, lm.tokenizer, lm.stop_ids)
        return self._grammars[lm.path]

    def _note_prompt(self, role: str, lang: str) -> None:
        p = load_moc_prompt(role, lang)
        self.prompt_sha256[f"{p.name}.{p.lang}"] = p.sha256

    # ---------------------------------------------------------------------------------- steps

    def route(self, texts: Sequence[str], langs: Sequence[str]) -> list[int]:
        """Router label (0..3) of each text: one forward pass, no generation."""
        import torch

        started = time.perf_counter()
        lm = self.router
        labels = [0] * len(texts)
        for lang in set(langs):
            self._note_prompt("router", lang)
        ids = [lm.encode(router_messages(t, lang)) for t, lang in zip(texts, langs)]
        for batch, input_ids, mask in padded_batches(lm.tokenizer, ids, self.s.batch_size, lm.model.device):
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real positions
            with torch.inference_mode():
                logits = lm.model(
                    input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1
                ).logits[:, -1, :]
            for i, label in zip(batch, router_label(logits.float(), self.label_ids)):
                labels[i] = label
        self.seconds["router"] += time.perf_counter() - started
        return labels

    def sampling(self, attempt: int) -> tuple[float, float]:
        """(temperature, top_p) of attempt 0 (the settings) and of each retry (+0.4 each, at most 1)."""
        if attempt == 0:
            return self.s.temperature, self.s.top_p
        step = RETRY_STEP * attempt
        return min(1.0, self.s.temperature + step), min(1.0, self.s.top_p + step)

    def generate(
        self,
        lm: _LM,
        prompts: Sequence[list[dict]],
        attempt: int,
        max_items: Sequence[int] | None = None,
        grammars: Sequence[str] | None = None,
    ) -> list[Generation]:
        """One sampled answer per prompt (new text only); every batch is seeded with ``seed + attempt``.
        Constrained (``settings.constrained``): each answer decodes under the expert schema, answer
        ``i`` with at most ``max_items[i]`` items (None: no bound), or under the EBNF grammar
        ``grammars[i]`` when given (``--moc-anchored``, :func:`anchored_grammar`)."""
        temperature, top_p = self.sampling(attempt)
        config = copy.deepcopy(lm.model.generation_config)
        config.do_sample = True
        config.temperature, config.top_p = temperature, top_p
        for name in ("top_k", "min_p", "typical_p"):
            if hasattr(config, name):
                setattr(config, name, None)
        config.max_new_tokens = self.s.max_new_tokens
        config.num_beams = 1
        if config.pad_token_id is None:
            config.pad_token_id = lm.tokenizer.pad_token_id
        ids = [lm.encode(p) for p in prompts]
        processors = None
        if self.s.constrained:
            grammar = self._grammar(lm)
            bounds = list(max_items) if max_items is not None else [None] * len(prompts)
            rows = list(grammars) if grammars is not None else [None] * len(prompts)

            def processors(batch: list[int]) -> list:
                return [grammar.processor([bounds[i] for i in batch], [rows[i] for i in batch])]

        out = generate_batched(lm.model, lm.tokenizer, ids, config, self.s.batch_size,
                               stop_ids=lm.stop_ids, seed=self.s.seed + attempt,
                               logits_processor=processors)  # fmt: skip
        self.new_tokens += sum(g.new_tokens for g in out)
        return out

    def expert_chunks(self, windows: Sequence[_Window]) -> None:
        """Fill ``spans`` of each window (with its ``label`` set) from its expert; windows whose
        expert never gives a usable answer keep ``spans = None``."""
        by_label: dict[int, list[_Window]] = {}
        for w in windows:
            by_label.setdefault(w.label, []).append(w)
        for label, group in sorted(by_label.items()):
            lm = self._lm(self.expert_paths[label])
            pending = group
            for attempt in range(self.s.retries + 1):
                if not pending:
                    break
                if attempt:
                    self.retried += len(pending)
                self.attempts += len(pending)
                for lang in {w.doc.lang for w in pending}:
                    self._note_prompt("expert", lang)
                started = time.perf_counter()
                prompts = [expert_messages(w.text, w.doc.lang, self.s.placeholder) for w in pending]
                # --moc-anchored: each window's own grammar (passed only then: fakes in tests take 4 args)
                anchored = {"grammars": [self.window_grammar(w) for w in pending]} if self.s.anchored else {}
                answers = self.generate(lm, prompts, attempt, [w.sentences for w in pending], **anchored)
                self.seconds["experts"] += time.perf_counter() - started
                started = time.perf_counter()
                still = []
                for w, answer in zip(pending, answers):
                    elements = parse_expert_answer(answer.text)
                    if elements is None:
                        # the budget cut it before it parsed, or it ended as no JSON list of strings
                        w.failure = "invalid_json" if answer.stopped else "truncated"
                        if answer.stopped:
                            self.invalid_json += 1
                        else:
                            self.truncated += 1
                        still.append(w)
                        continue
                    spans, stats = recover_spans(w.text, elements, self.s.placeholder, self.s.max_ratio)
                    self.recovery.add(stats)
                    if not spans:
                        w.failure = "unrecovered"
                        self.unrecovered += 1
                        still.append(w)
                        continue
                    w.elements, w.failure = elements, None
                    w.spans = tile(len(w.text), [a for a, _ in spans])
                self.seconds["recovery"] += time.perf_counter() - started
                pending = still

    def window_grammar(self, w: _Window) -> str:
        """``--moc-anchored``: the grammar of the window's answers (its own sentences' anchors)."""
        return anchored_grammar(w.text, w.segments(), self.s.placeholder, self.s.anchor_chars)

    def ppl_chunks(self, windows: Sequence[_Window]) -> None:
        """PPL chunking of each window (the fallback), with the fallback model."""
        from metachunk.chunking.ppl import ppl_boundaries, score_documents
        from metachunk.chunking.sentences import split_sentences
        from metachunk.chunking.types import chunks_from_boundaries

        if not windows:
            return
        started = time.perf_counter()
        lm = self._lm(self.fallback_path)
        texts = [w.text for w in windows]
        sentences = [split_sentences(t, w.doc.lang) for t, w in zip(texts, windows)]
        scores = score_documents(
            lm.model, lm.tokenizer, texts, sentences, self.s.max_context, self.s.batch_size
        )
        for w, t, sents, ppl in zip(windows, texts, sentences, scores):
            chunks = chunks_from_boundaries(t, sents, ppl_boundaries(ppl, self.s.fallback_threshold))
            w.spans = [(c.start, c.end) for c in chunks] or tile(len(t), [0])
        self.fallback_windows += len(windows)
        self.fallback_causes.update(w.failure for w in windows)
        self.seconds["fallback"] += time.perf_counter() - started

    # ---------------------------------------------------------------------------------- documents

    def chunk_documents(
        self, texts: Sequence[str], langs: Sequence[str], sentences: Sequence[Sequence[Sentence]]
    ) -> list[list[tuple[int, int]]]:
        """Chunks ``(start, end)`` tiling each document, the documents processed in lockstep."""
        # A whitespace-only document has nothing to route or recover: it is one chunk, asked of no model.
        docs = [
            _Doc(t, lang, [s.end for s in sents], sents, pos=0 if sents and t.strip() else len(t))
            for t, lang, sents in zip(texts, langs, sentences)
        ]
        half = self.s.window_chars // 2
        while active := [d for d in docs if not d.done]:
            windows = []
            for d in active:
                end = char_window_end(d.sentences, d.ends, d.pos, d.prev_end, self.s.window_chars)
                windows.append(_Window(d, d.pos, end))
            self.windows += len(windows)
            for w, label in zip(
                windows, self.route([w.text for w in windows], [w.doc.lang for w in windows])
            ):
                w.label = label
                self.routes[label] += 1
            self.expert_chunks(windows)
            self.ppl_chunks([w for w in windows if w.spans is None])
            for w in windows:
                d = w.doc
                spans = [(w.start + a, w.start + b) for a, b in w.spans]
                d.prev_end = w.end
                last_start = spans[-1][0]
                if w.end < len(d.text) and last_start > w.start and w.end - last_start <= half:
                    d.chunks.extend(spans[:-1])  # the chunk buffer: the last chunk starts the next window
                    d.pos = last_start
                    self.carried += 1
                else:
                    d.chunks.extend(spans)
                    d.pos = w.end
        return [d.chunks or tile(len(d.text), [0]) for d in docs]  # only "" has no chunk

    def manifest(self) -> dict:
        """What the run's ``.meta.json`` records about the MoC run."""
        temperature, top_p = self.sampling(0)
        models = {str(p): lm for p, lm in self._models.items()}
        return {
            "router": {"model": self.s.router, "path": str(self.router_path)},
            "stand_ins": self.s.stand_ins,
            "experts": [
                {"label": k, "model": e, "path": str(p), "loaded": str(p) in models}
                for k, (e, p) in enumerate(zip(self.s.experts, self.expert_paths))
            ],
            "prompt_sha256": dict(sorted(self.prompt_sha256.items())),
            "schema_sha256": {"moc_expert": load_moc_schema().sha256},
            "constrained": self.constrained_manifest(),
            "placeholder": self.s.placeholder,
            "window_chars": self.s.window_chars,
            "generation": {
                "do_sample": True,
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": self.s.max_new_tokens,
                "retries": self.s.retries,
                "retry_sampling": [self.sampling(k) for k in range(1, self.s.retries + 1)],
                "seed": self.s.seed,
            },
            "max_edit_ratio": self.s.max_ratio,
            "fallback": {
                "method": "ppl",
                "model": self.s.fallback_model or self.s.router,
                "threshold": self.s.fallback_threshold,
                "windows": self.fallback_windows,
                "causes": {k: self.fallback_causes.get(k, 0) for k in FAILURES},  # each one's last failure
            },
            "windows": self.windows,
            "carried_over": self.carried,
            "routes": {str(k): self.routes.get(k, 0) for k in range(len(ROUTER_LABELS))},
            "expert_attempts": self.attempts,
            "retried": self.retried,
            "invalid_json": self.invalid_json,
            "truncated_answers": self.truncated,
            "unrecovered_answers": self.unrecovered,
            "recovery": self.recovery.to_json(),
            "new_tokens": self.new_tokens,
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
            "load_seconds": {str(p): round(lm.load_seconds, 2) for p, lm in self._models.items()},
        }

    def constrained_manifest(self) -> dict:
        """The ``constrained`` block of the manifest: on or off, the library, what the grammar
        allows, and what it cost (compiling; masking the logits, over decoding steps and rows)."""
        if not self.s.constrained:
            return {"enabled": False, "library": None, "version": None, "anchored": False}
        grammars = list(self._grammars.values())
        anchored = {}
        if self.s.anchored:
            anchored = {
                "anchors": "each element: a sentence's head, the placeholder, a later sentence's tail "
                "(or a short chunk whole); elements cover the window's sentences in order",
                "anchor_chars": self.s.anchor_chars,
                "anchor_scales": list(ANCHOR_SCALES),
                "grammars_compiled": sum(g.anchored_grammars for g in grammars),
                "anchored_compile_seconds": round(sum(g.anchored_compile_seconds for g in grammars), 3),
            }
        return {
            "enabled": True,
            "library": GRAMMAR_LIBRARY,
            "version": self.grammar_version,
            "anchored": self.s.anchored,
            **anchored,
            "schema": "chunking/prompts/moc_expert.schema.json",
            "max_items": "sentences in the window",
            "whitespace": "as json.dumps: ', ' between items, none elsewhere",
            "compile_seconds": round(sum(g.compile_seconds for g in grammars), 3),
            "mask_seconds": round(sum(g.mask_seconds for g in grammars), 3),
            "mask_steps": sum(g.mask_steps for g in grammars),
            "mask_rows": sum(g.mask_rows for g in grammars),
        }

    def summary_line(self) -> str:
        m = self.manifest()
        c = m["constrained"]
        decoding = f"constrained by {c['library']} {c['version']}" if c["enabled"] else "unconstrained"
        if c["anchored"]:
            decoding += " (anchored to the windows' sentences)"
        return (
            f"  moc: {m['windows']} windows, routes {m['routes']}, {decoding}, {m['retried']} retries, "
            f"{m['fallback']['windows']} PPL fallbacks; failed answers: {m['invalid_json']} invalid JSON, "
            f"{m['truncated_answers']} truncated, {m['unrecovered_answers']} unrecovered; "
            f"{m['recovery']['skipped']} elements skipped"
        )
