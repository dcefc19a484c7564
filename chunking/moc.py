"""Mixture-of-Chunkers inference (MoC §3.2): a router picks one of four chunking experts per
window of text; the expert writes a JSON list of ``head[MASK]tail`` rules; the rules are recovered
against the text as exact spans.

``metachunk chunk --method moc --router DIR --experts DIR0,DIR1,DIR2,DIR3``

Three modules: this one (the ``moc:`` options, the prompts, the router and `MocChunker`:
windows, routing, retries, fallback), `metachunk.chunking.moc_answers` (the experts' answer
format and its recovery against the text: pure functions) and `metachunk.chunking.moc_grammar`
(constrained decoding: the answer schema, xgrammar, the anchored grammar).

* **Options** (`MocOptions`): the ``moc:`` block of a chunk recipe (flat: ``--router``,
  ``--experts``, ``--moc-*``), checked in one place (`MocOptions.check`).
* **Prompts** (one home, shared with training): ``chunking/prompts/moc_router.{lang}.txt`` and
  ``moc_expert.{lang}.txt`` in the ``<<<system>>>/<<<user>>>`` format of `metachunk.prompts`
  (their sha256 is their version). `router_messages` and `expert_messages` build the
  chat messages; ``data build-sft moc-router`` / ``moc-expert`` build training rows with the same
  functions, so the prompt at inference is the training prompt byte for byte.
* **Router** (Eq. 5): a causal LM fine-tuned to answer one label token ``"0".."3"`` (granularity
  bins of the mean chunk length: ≤120, ≤150, ≤180, >180 characters, `granularity_label`).
  The label is the argmax of the logits of the four label tokens at the first generated position
  (`router_label`); nothing is generated.
* **Experts**: causal LMs fine-tuned to answer a JSON list of ``head{placeholder}tail`` strings
  (`metachunk.chunking.moc_answers`), decoded with sampling at temperature 0.1, top-p 0.1 (the
  paper's low-randomness setting), under their answer schema by default (``--moc-constrained``,
  `metachunk.chunking.moc_grammar`). ``--no-moc-constrained`` decodes freely and reads the
  outermost ``[...]`` of the answer (`parse_expert_answer`).
* **Failures and fallback**: an answer cut by the token budget before it parses (``truncated``),
  one that ends but is no JSON list of strings (``invalid_json``; none under the grammar), and one
  of which no element can be found in the text (``unrecovered``) are counted by cause and retried
  (each retry adds 0.4 to temperature and top-p, capped at 1); after the last retry the window is
  chunked by PPL chunking (`metachunk.chunking.ppl`) with the router's model or
  ``--moc-fallback-model``, counted in the run's line of ``runs.jsonl`` with the cause of its last failure.
* **Windows** (Appendix A.3's sliding window with chunk buffer): a document longer than
  ``window_chars`` is processed window by window, cut at sentence ends
  (`metachunk.chunking.sentences.split_sentences`); the last chunk of each window (when shorter than
  half a window) is carried over as the start of the next window and chunked again there.
  Documents advance in lockstep, so the router and each expert see batches of windows.

Weights load from safetensors only (`metachunk.chunking.students.student_dir`).
"""

from __future__ import annotations

import bisect
import copy
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.chunking.moc_answers import (
    ANCHOR_SCALES,
    DEFAULT_ANCHOR_CHARS,
    DEFAULT_MAX_RATIO,
    DEFAULT_PLACEHOLDER,
    PLACEHOLDERS,
    RecoveryStats,
    check_placeholder,
    parse_expert_answer,
    recover_spans,
    tile,
)
from metachunk.chunking.moc_grammar import (
    GRAMMAR_LIBRARY,
    ExpertGrammar,
    anchored_grammar,
    grammar_library,
    load_moc_schema,
    window_segments,
)
from metachunk.chunking.students import student_dir
from metachunk.chunking.types import Sentence

from metachunk.config import option
from metachunk.engine.generation import (
    Generation,
    chat_prompt_ids,
    generate_batched,
    padded_batches,
    prepare_tokenizer,
    stop_token_ids,
)
from metachunk.prompts import Prompt, load_prompt_file

ROUTER_LABELS = ("0", "1", "2", "3")
# Upper bounds (characters) of the mean chunk length of granularity labels 0, 1, 2 (§3.2.2).
GRANULARITY_BOUNDS = (120, 150, 180)
DEFAULT_WINDOW_CHARS = 1024
DEFAULT_TEMPERATURE = 0.1
DEFAULT_TOP_P = 0.1
DEFAULT_RETRIES = 2
DEFAULT_MAX_NEW_TOKENS = 512
RETRY_STEP = 0.4  # added to temperature and top-p on each retry
FAILURES = ("invalid_json", "truncated", "unrecovered")  # why an expert's answer gave no chunks

# ------------------------------------------------------------------------------------- options


@dataclass
class MocOptions:
    """``moc:`` (flat: ``--router``, ``--experts``, ``--moc-*``): Mixture-of-Chunkers inference
    (`metachunk.chunking.moc`)."""

    router: str | None = option(
        None,
        "moc: the router (local HF dir with safetensors, chat model answering one label 0-3)",
        flat="router",
    )
    experts: str | None = option(
        None,
        "moc: the four chunking experts, comma-separated, for granularity labels 0,1,2,3 (mean chunk "
        "length <=120, <=150, <=180, >180 chars); the same dir may repeat",
        flat="experts",
    )
    placeholder: str = option(
        DEFAULT_PLACEHOLDER,
        "moc: the placeholder between head and tail in the experts' answers (as they were trained)",
        choices=list(PLACEHOLDERS),
    )
    window_chars: int = option(
        DEFAULT_WINDOW_CHARS, "moc: characters per window sent to router and expert (cut at sentence ends)"
    )
    temperature: float = option(DEFAULT_TEMPERATURE, "moc: experts' sampling temperature")
    top_p: float = option(DEFAULT_TOP_P, "moc: experts' nucleus sampling top-p")
    retries: int = option(
        DEFAULT_RETRIES,
        "moc: retries of a window whose answer is cut by --moc-max-new-tokens, is no JSON list or "
        "matches nothing (each adds 0.4 to temperature and top-p); then the window falls back to PPL chunking",
    )
    max_new_tokens: int = option(
        DEFAULT_MAX_NEW_TOKENS,
        "moc: most new tokens of an expert's answer (an answer cut by it counts as truncated)",
    )
    constrained: bool = option(
        True,
        "moc: decode the experts under their answer schema (chunking/prompts/moc_expert.schema.json, "
        "a JSON list of strings, at most one per sentence of the window) with xgrammar, so every answer "
        "that ends parses; --no-moc-constrained: free decoding, the answer's outermost [...] parsed",
    )
    anchored: bool = option(
        False,
        "moc (needs --moc-constrained): decode each expert under a grammar built from its window's "
        "sentences, so every element is a sentence's start (head), the placeholder and a later "
        "sentence's end (tail) as in the text, the elements cover the window in order, and the "
        "expert only chooses where to cut; every answer that ends recovers exactly",
    )
    anchor_chars: int = option(
        DEFAULT_ANCHOR_CHARS,
        "moc --moc-anchored: characters of a chunk's start and end in the anchors (widened to whole "
        "words; doubled, then quadrupled, where a head is not unique), as distill's moc head_chars/tail_chars",
    )
    max_ratio: float = option(
        DEFAULT_MAX_RATIO,
        "moc: most edits, as a share of its length, for a head or tail found by edit distance",
    )
    fallback_model: str | None = option(
        None, "moc: model for the PPL fallback (threshold --threshold, default 0.5); default the router"
    )
    stand_in: str | None = option(
        None,
        "moc, at toy scale: where a router or expert dir holds no model (its training set had no rows), "
        "the trained expert of the nearest granularity stands in, else this model (e.g. smollm2); the "
        "run's line of runs.jsonl names every stand-in. Default: a missing model is an error",
    )

    def check(self) -> None:
        """The options a ``--method moc`` run can use, or a ValueError naming the flag: the one
        check, called by [`metachunk.chunking.pipeline.ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig] for ``--method moc`` and
        by `MocChunker`. (Not ``__post_init__``: a recipe of another method may carry a
        ``moc:`` block, and the config loader applies flags to a block one at a time.)"""
        check_placeholder(self.placeholder)
        if not (self.router and self.experts):
            raise ValueError("--method moc needs --router DIR and --experts DIR0,DIR1,DIR2,DIR3")
        parse_experts(self.experts)
        if self.window_chars < 64 or self.retries < 0 or self.max_new_tokens < 1:
            raise ValueError(
                "--moc-window-chars must be >= 64, --moc-retries >= 0, --moc-max-new-tokens >= 1"
            )
        if self.anchored and not self.constrained:
            raise ValueError(
                "--moc-anchored decodes under a grammar: it needs --moc-constrained "
                "(drop --no-moc-constrained, or drop --moc-anchored)"
            )
        if self.anchor_chars < 1:
            raise ValueError(f"--moc-anchor-chars must be >= 1, got {self.anchor_chars}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and 0 <= self.max_ratio < 1):
            raise ValueError(
                "--moc-temperature must be > 0, --moc-top-p in (0, 1], --moc-max-ratio in [0, 1)"
            )


def parse_experts(value: str | Sequence[str]) -> tuple[str, str, str, str]:
    """``"d0,d1,d2,d3"`` (or a list) -> the four expert dirs, label 0 first."""
    items = [x.strip() for x in (value.split(",") if isinstance(value, str) else value)]
    if len(items) != len(ROUTER_LABELS) or not all(items):
        raise ValueError("--experts takes 4 model dirs separated by commas (granularity 0,1,2,3)")
    return tuple(items)  # type: ignore[return-value]


def stand_in_models(router: str, experts: Sequence[str], stand_in: str | None) -> tuple[str, tuple, dict]:
    """``(router, experts, stand_ins)`` with every role whose dir holds no model (its training set
    had no rows, as at toy scale) given a stand-in: an expert the trained expert of the nearest
    granularity (the lower on a tie), the router, or every expert when none was trained,
    ``stand_in``. ``stand_ins`` maps each replaced role to its stand-in. Without ``stand_in`` nothing
    is replaced (a missing model is then the usual error)."""
    from metachunk.models import PRESETS, ModelNotFoundError, resolve

    if stand_in is None:
        return router, tuple(experts), {}

    def present(name: str) -> bool:  # found as loading finds it: `~/m/e0`, a Hub id, a preset
        if name in PRESETS:
            return True
        local = Path(name).expanduser()
        if local.exists():  # a folder a training left without weights is one to stand in for
            return any(local.glob("*.safetensors"))
        try:  # a Hub id
            return any(resolve(name).glob("*.safetensors"))
        except ModelNotFoundError:
            return False

    trained = [k for k, e in enumerate(experts) if present(e)]
    out, stand_ins = list(experts), {}
    for k in range(len(experts)):
        if k not in trained:
            out[k] = experts[min(trained, key=lambda t: (abs(t - k), t))] if trained else stand_in
            stand_ins[f"expert {k}"] = out[k]
    if not present(router):
        router, stand_ins["router"] = stand_in, stand_in
    return router, tuple(out), stand_ins


# ------------------------------------------------------------------------------------- prompts


def load_moc_prompt(role: str, lang: str) -> Prompt:
    """``moc_router`` / ``moc_expert`` prompt file of ``lang`` (zh, en)."""
    if role not in ("router", "expert"):
        raise ValueError(f"unknown MoC prompt {role!r}; have router, expert")
    return load_prompt_file("metachunk.chunking", f"moc_{role}", lang)


def router_messages(text: str, lang: str) -> list[dict]:
    """The router's prompt for ``text`` (about 1024 characters): [system, user] messages. The
    answer it is trained on is one of `ROUTER_LABELS`."""
    return load_moc_prompt("router", lang).messages(text=text)


def expert_messages(text: str, lang: str, placeholder: str = DEFAULT_PLACEHOLDER) -> list[dict]:
    """An expert's prompt for ``text``: [system, user] messages (the paper's Table 7 prompt). The
    answer it is trained on is a JSON list of ``head + placeholder + tail`` strings
    (`format_elements`)."""
    check_placeholder(placeholder)
    return load_moc_prompt("expert", lang).messages(text=text, placeholder=placeholder)


def granularity_label(mean_chunk_chars: float) -> int:
    """The router label (0..3) of a text whose chunks average ``mean_chunk_chars`` characters:
    (0, 120] -> 0, (120, 150] -> 1, (150, 180] -> 2, (180, inf) -> 3."""
    return bisect.bisect_left(GRANULARITY_BOUNDS, mean_chunk_chars)


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
    """Router + four experts, loaded once (each distinct model dir once; experts on first use).

    ``options`` is the run's ``moc:`` block (checked here, `MocOptions.check`); the rest are
    the run's settings it shares with other methods: the PPL fallback's threshold and context
    (``--threshold``, ``--max-context``), ``--batch-size``, ``--device``, ``--dtype``, and the seed
    of the experts' sampling. A role whose dir holds no model gets its stand-in here
    (``--moc-stand-in``, `stand_in_models`), named on stderr and in `manifest`."""

    def __init__(
        self,
        options: MocOptions,
        *,
        fallback_threshold: float = 0.5,
        max_context: int = 4096,
        batch_size: int = 8,
        device: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
    ):
        options.check()
        self.opts = options
        self.fallback_threshold, self.max_context, self.batch_size = (
            fallback_threshold,
            max_context,
            batch_size,
        )
        self.device, self.dtype, self.seed = device, dtype, seed
        self.router_model, self.expert_models, self.stand_ins = stand_in_models(
            options.router, parse_experts(options.experts), options.stand_in
        )
        if self.stand_ins:
            print("chunk: MoC stand-ins (no trained model there): "
                  + ", ".join(f"{role} <- {model}" for role, model in self.stand_ins.items()), file=sys.stderr)  # fmt: skip
        # Every dir is checked (safetensors present) before any model loads.
        self.router_path = student_dir(self.router_model).resolve()
        self.expert_paths = [student_dir(e).resolve() for e in self.expert_models]
        self.fallback_path = (
            student_dir(options.fallback_model).resolve() if options.fallback_model else self.router_path
        )
        self._models: dict[Path, _LM] = {}
        self._grammars: dict[Path, ExpertGrammar] = {}
        self.grammar_version = grammar_library()[1] if options.constrained else None  # before any load
        self.router = self.lm(self.router_path)
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

    def lm(self, path: Path) -> _LM:
        """The model at ``path`` (the router, an expert or the fallback), loaded once per chunker."""
        if path not in self._models:
            self._models[path] = _LM(path, self.device, self.dtype)
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
        for batch, input_ids, mask in padded_batches(lm.tokenizer, ids, self.batch_size, lm.model.device):
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
        """(temperature, top_p) of attempt 0 (the options) and of each retry (+0.4 each, at most 1)."""
        if attempt == 0:
            return self.opts.temperature, self.opts.top_p
        step = RETRY_STEP * attempt
        return min(1.0, self.opts.temperature + step), min(1.0, self.opts.top_p + step)

    def generate(
        self,
        lm: _LM,
        prompts: Sequence[list[dict]],
        attempt: int,
        max_items: Sequence[int] | None = None,
        grammars: Sequence[str] | None = None,
    ) -> list[Generation]:
        """One sampled answer per prompt (new text only); every batch is seeded with ``seed + attempt``.
        Constrained (``--moc-constrained``): each answer decodes under the expert schema, answer
        ``i`` with at most ``max_items[i]`` items (None: no bound), or under the EBNF grammar
        ``grammars[i]`` when given (``--moc-anchored``, `anchored_grammar`)."""
        temperature, top_p = self.sampling(attempt)
        config = copy.deepcopy(lm.model.generation_config)
        config.do_sample = True
        config.temperature, config.top_p = temperature, top_p
        for name in ("top_k", "min_p", "typical_p"):
            if hasattr(config, name):
                setattr(config, name, None)
        # Neutral penalties: an export keeps its base model's generation_config (a Qwen2.5-Instruct one has
        # repetition_penalty 1.1), which would penalise the placeholder and ", " that every rule repeats, and
        # the manifest records temperature and top_p only.
        for name, neutral in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                              ("encoder_repetition_penalty", 1.0), ("encoder_no_repeat_ngram_size", 0)):  # fmt: skip
            if getattr(config, name, None) is not None:
                setattr(config, name, neutral)
        config.max_new_tokens = self.opts.max_new_tokens
        config.num_beams = 1
        if config.pad_token_id is None:
            config.pad_token_id = lm.tokenizer.pad_token_id
        ids = [lm.encode(p) for p in prompts]
        processors = None
        if self.opts.constrained:
            grammar = self._grammar(lm)
            bounds = list(max_items) if max_items is not None else [None] * len(prompts)
            rows = list(grammars) if grammars is not None else [None] * len(prompts)

            def processors(batch: list[int]) -> list:
                return [grammar.processor([bounds[i] for i in batch], [rows[i] for i in batch])]

        out = generate_batched(lm.model, lm.tokenizer, ids, config, self.batch_size,
                               stop_ids=lm.stop_ids, seed=self.seed + attempt,
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
            lm = self.lm(self.expert_paths[label])
            placeholder = self.opts.placeholder
            if placeholder in lm.tokenizer.all_special_tokens:  # decoding skips special tokens: every rule
                from metachunk.artifacts import InputError  # would come back without it, none recoverable

                raise InputError(
                    self.expert_paths[label], f"--moc-placeholder {placeholder} is a special token of expert "
                    f"{label}'s tokenizer, which decoding drops; pick another placeholder"
                )  # fmt: skip
            pending = group
            for attempt in range(self.opts.retries + 1):
                if not pending:
                    break
                if attempt:
                    self.retried += len(pending)
                self.attempts += len(pending)
                for lang in {w.doc.lang for w in pending}:
                    self._note_prompt("expert", lang)
                started = time.perf_counter()
                prompts = [expert_messages(w.text, w.doc.lang, self.opts.placeholder) for w in pending]
                grammars = [self.window_grammar(w) for w in pending] if self.opts.anchored else None
                answers = self.generate(lm, prompts, attempt, [w.sentences for w in pending], grammars)
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
                    spans, stats = recover_spans(w.text, elements, self.opts.placeholder, self.opts.max_ratio)
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
        return anchored_grammar(w.text, w.segments(), self.opts.placeholder, self.opts.anchor_chars)

    def ppl_chunks(self, windows: Sequence[_Window]) -> None:
        """PPL chunking of each window (the fallback), with the fallback model."""
        from metachunk.chunking.ppl import ppl_boundaries, score_documents
        from metachunk.chunking.sentences import split_sentences
        from metachunk.chunking.types import chunks_from_boundaries

        if not windows:
            return
        started = time.perf_counter()
        lm = self.lm(self.fallback_path)
        texts = [w.text for w in windows]
        sentences = [split_sentences(t, w.doc.lang) for t, w in zip(texts, windows)]
        scores = score_documents(lm.model, lm.tokenizer, texts, sentences, self.max_context, self.batch_size)
        for w, t, sents, ppl in zip(windows, texts, sentences, scores):
            chunks = chunks_from_boundaries(t, sents, ppl_boundaries(ppl, self.fallback_threshold))
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
        half = self.opts.window_chars // 2
        while active := [d for d in docs if not d.done]:
            windows = []
            for d in active:
                end = char_window_end(d.sentences, d.ends, d.pos, d.prev_end, self.opts.window_chars)
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
        """What the run log records about the MoC run."""
        temperature, top_p = self.sampling(0)
        models = {str(p): lm for p, lm in self._models.items()}
        return {
            "router": {"model": self.router_model, "path": str(self.router_path)},
            "stand_ins": self.stand_ins,
            "experts": [
                {"label": k, "model": e, "path": str(p), "loaded": str(p) in models}
                for k, (e, p) in enumerate(zip(self.expert_models, self.expert_paths))
            ],
            "prompt_sha256": dict(sorted(self.prompt_sha256.items())),
            "schema_sha256": {"moc_expert": load_moc_schema().sha256},
            "constrained": self.constrained_manifest(),
            "placeholder": self.opts.placeholder,
            "window_chars": self.opts.window_chars,
            "generation": {
                "do_sample": True,
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": self.opts.max_new_tokens,
                "retries": self.opts.retries,
                "retry_sampling": [self.sampling(k) for k in range(1, self.opts.retries + 1)],
                "seed": self.seed,
            },
            "max_edit_ratio": self.opts.max_ratio,
            "fallback": {
                "method": "ppl",
                "model": self.opts.fallback_model or self.router_model,
                "threshold": self.fallback_threshold,
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
        """The moc block's ``constrained`` part: on or off, the library, what the grammar
        allows, and what it cost (compiling; masking the logits, over decoding steps and rows)."""
        if not self.opts.constrained:
            return {"enabled": False, "library": None, "version": None, "anchored": False}
        grammars = list(self._grammars.values())
        anchored = {}
        if self.opts.anchored:
            anchored = {
                "anchors": "each element: a sentence's head, the placeholder, a later sentence's tail "
                "(or a short chunk whole); elements cover the window's sentences in order",
                "anchor_chars": self.opts.anchor_chars,
                "anchor_scales": list(ANCHOR_SCALES),
                "grammars_compiled": sum(g.anchored_grammars for g in grammars),
                "anchored_compile_seconds": round(sum(g.anchored_compile_seconds for g in grammars), 3),
            }
        return {
            "enabled": True,
            "library": GRAMMAR_LIBRARY,
            "version": self.grammar_version,
            "anchored": self.opts.anchored,
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
