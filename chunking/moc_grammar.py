"""Constrained decoding of the MoC experts (``--moc-constrained``, the default; ``--moc-anchored``).

* **The schema**: the experts decode under their answer schema,
  ``chunking/prompts/moc_expert.schema.json`` (a JSON array of strings, at least one;
  sha256-versioned like the prompts, `load_moc_schema`), with at most one item per sentence of
  the window (`expert_schema`), compiled for each expert's tokenizer by xgrammar
  (`ExpertGrammar`) and applied as a logits processor before temperature and top-p. The
  array is written as the experts are trained to write it (``json.dumps``: ``", "`` between items,
  no other whitespace); no stop token may come before the closing ``]`` and only a stop token after
  it, so an answer that stops always parses. An answer that ``--moc-max-new-tokens`` cuts before its
  ``]`` is *truncated*.
* **Anchored** (``--moc-anchored``, `anchored_grammar`): an EBNF grammar built from the
  window's own sentences (`window_segments`), whose every answer is a partition of the window
  into runs of sentences, each written as the experts' targets write a chunk
  (`metachunk.chunking.moc_answers.expert_element`), so it recovers exactly.

The teacher side never constrains locally: it asks the endpoint (``structured_output``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import cache

from metachunk.chunking.moc_answers import (
    ANCHOR_SCALES,
    DEFAULT_ANCHOR_CHARS,
    DEFAULT_PLACEHOLDER,
    anchor_head,
    anchor_tail,
)

from metachunk.prompts import Schema, load_schema_file

GRAMMAR_LIBRARY = "xgrammar"  # the constrained decoding of the experts' answers (ExpertGrammar)

# ------------------------------------------------------------------------------------- schema


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


# ------------------------------------------------------------------------------------- xgrammar


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
    """xgrammar's transformers logits processor, timing its calls into its `ExpertGrammar`."""
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
    window (compiled once per count). The array is written as `format_elements` writes it,
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
        """An EBNF grammar (`anchored_grammar`) compiled, once per grammar text."""
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
    sentences are ``segments`` (spans tiling it, `window_segments`), for ``--moc-anchored``.

    An answer is a JSON array written as `format_elements` writes it (``", "`` between items)
    of one element per chunk, the chunks being runs of whole sentences that cover the window in
    order: sentences ``i..j`` are written as the experts' targets write a chunk (`expert_element`):
    ``head(i) + placeholder + tail(j)``, or the chunk quoted whole when it is at most
    ``2 * chars`` characters. The head of sentence ``i`` is its first ``chars`` characters (widened
    to a word's end), doubled then quadrupled until its first occurrence after the window's first
    character is sentence ``i``'s start, so `recover_spans` finds every element exactly where
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
