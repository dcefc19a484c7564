"""Margin sampling (MSP) chunking (Meta-Chunking §3.1.2, prompts of Tables 6 and 7).

For two consecutive pieces of text the model is asked whether to split them (answer "1") or keep
them together (answer "2"). ``margin = P(keep) - P(split)`` is read from the next-token
distribution right after the chat template's assistant header; no text is generated. Sentences are
merged when ``margin > θ``. θ is fixed, or dynamic: it starts at 0 and follows the mean of the past
margins of the document (optionally of the last ``k`` only).

Modes:
* ``pair``: sentence1 is the previous sentence. Every margin is independent, so all pairs of all
  documents are scored in batches.
* ``accumulated``: sentence1 is the current chunk so far. Each decision depends on the previous
  one, so documents advance in lock step and one step of every document shares a batch.

The instruction comes first in every prompt and is identical for every pair, so its KV cache is
computed once per scorer and reused by every batch; only the two sentences and the assistant
header are run per pair.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING

import numpy as np
from metachunk.chunking.types import Sentence

# torch is imported where used: `metachunk --help` must not pay for it.
if TYPE_CHECKING:
    import torch

# Tables 6 and 7 name "sentence1+sentence2" in the options and give the two sentences after the
# instruction, which every pair then shares; "released" is Table 6 as the authors' code sends it
# (meta_chunking/LongBench/prob_subtract_chunk.py in IAAR-Shanghai/Meta-Chunking): the sentences
# written into the options, so only its first line is shared.
PROMPT_VARIANTS = ("table6", "table7", "released")
_SENTINEL = "\x00MSP_PAIR\x00"
# Bound on sentence1 in accumulated mode: a chunk that keeps growing is cut to its last characters,
# so a prompt never grows with the document.
ACCUMULATED_MAX_CHARS = 1500
# A batch of pairs is closed early when adding the next (longer) pair would make its padded tokens
# exceed the real ones by more than this share. Padded positions cost as much as real ones, and
# pair lengths have a long tail: with fixed rows only, 16 rows of 64 Emma pairs were 32% padding
# and slower on CPU than 4 rows (bench/msp_speed.py).
MAX_PADDING = 0.1
# On a GPU a forward pass also has a fixed cost: every layer's kernel launches, the copy of the
# prefix's KV cache and the host sync that reads the margins take milliseconds, in which a
# data-centre GPU runs on the order of a thousand tokens of a 1.5B model (an estimate from launch
# and GEMM rates, not a measurement). There a batch may also pad by this many tokens before a new pass pays off: on
# bench/msp_speed.py's 64 Emma pairs the 10% rule alone cut B=64 into 11 passes of 1 to 16 rows,
# and this one into 4 (32, 21, 10 and 1 rows) with 23% more tokens.
GPU_PASS_TOKENS = 1024
# Pairs per batch on CPU, and the tokens a pair is counted as when a GPU's budget is divided into
# rows (Emma's pairs are 40-120 tokens after the prompt's prefix).
CPU_PAIR_ROWS = 8
GPU_PAIR_TOKENS = 128


def length_batches(
    lengths: Sequence[int], batch_size: int, max_padding: float = MAX_PADDING, pass_tokens: int = 0
) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, shortest first, for right-padded forward passes.

    A batch has at most ``batch_size`` rows, and a second or later row joins only while the batch's
    padding, ``rows * longest - sum(lengths)``, stays within ``max_padding * sum(lengths)`` or
    within ``pass_tokens``, whichever is larger (``GPU_PASS_TOKENS`` on a GPU, 0 on CPU).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        padded, total = (len(current) + 1) * n, real + n
        too_padded = padded > (1 + max_padding) * total and padded - total > pass_tokens
        if current and (len(current) >= batch_size or too_padded):
            batches.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class MspPrompt:
    variant: str
    lang: str
    instruction: str  # the fixed part, before the first placeholder line
    pair_template: str  # the part with {sentence1} and {sentence2}
    sha256: str  # of the prompt file; recorded in every run manifest

    @property
    def name(self) -> str:
        return f"msp_{self.variant}.{self.lang}"


def load_msp_prompt(variant: str = "table6", lang: str = "en") -> MspPrompt:
    """The Table 6, Table 7 or released prompt (`PROMPT_VARIANTS`): plain completion text (no chat
    parts), cut before the first line that names a sentence; its sha256 (of the text) is its version."""
    if variant not in PROMPT_VARIANTS:
        raise ValueError(f"unknown MSP prompt {variant!r}; choose one of {', '.join(PROMPT_VARIANTS)}")
    if lang not in ("zh", "en"):
        raise ValueError(f"MSP prompts exist for zh and en, not {lang!r}")
    text = (
        files("metachunk.chunking")
        .joinpath("prompts", f"msp_{variant}.{lang}.txt")
        .read_text(encoding="utf-8")
    )
    cut = text.rindex("\n", 0, text.index("{sentence1}")) + 1
    return MspPrompt(
        variant, lang, text[:cut], text[cut:].rstrip("\n"), hashlib.sha256(text.encode()).hexdigest()
    )


class MarginScorer:
    """Scores ``margin = P(keep) - P(split)`` for (sentence1, sentence2) pairs with one model."""

    def __init__(self, model, tokenizer, prompt: MspPrompt):
        self.model, self.tokenizer, self.prompt = model, tokenizer, prompt
        self.device = next(model.parameters()).device
        if tokenizer.chat_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.instruction + _SENTINEL}],
                tokenize=False,
                add_generation_prompt=True,
            )
            self.head, self.tail = rendered.split(_SENTINEL)
        else:  # a base model: plain completion prompt
            self.head, self.tail = prompt.instruction, "\nAnswer:"
        self.prefix_ids = self._encode(self.head)
        # A base model's plain prompt (Gemma-3-270m has no chat template) is read after the ids its
        # tokenizer starts a text with, as PPL chunking reads a document; a template may write them itself.
        from metachunk.engine.scoring import start_ids

        start = start_ids(tokenizer)
        if self.prefix_ids[: len(start)] != start:
            self.prefix_ids = start + self.prefix_ids
        self.split_id = self._answer_token("1")
        self.keep_id = self._answer_token("2")
        self._prefix_cache = None
        self._rows: int | None = None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answer_token(self, digit: str) -> int:
        """The single token the model would emit for the answer right after the template tail."""
        tail_ids = self._encode(self.tail)
        for candidate in (digit, " " + digit):
            ids = self._encode(self.tail + candidate)
            if len(ids) == len(tail_ids) + 1 and ids[: len(tail_ids)] == tail_ids:
                return ids[-1]
        ids = self._encode(digit)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer has no single token for the MSP answer {digit!r}")
        return ids[0]

    def pair_ids(self, sentence1: str, sentence2: str) -> list[int]:
        """Token ids that follow the shared prefix for one pair."""
        body = self.prompt.pair_template.format(sentence1=sentence1.strip(), sentence2=sentence2.strip())
        return self._encode(body + self.tail)

    def margins_from_logits(self, logits: torch.Tensor) -> np.ndarray:
        """``P(keep) - P(split)`` per row of next-token ``logits``, the softmax taken in float32."""
        import torch

        probs = torch.softmax(logits.float(), dim=-1)
        return (probs[:, self.keep_id] - probs[:, self.split_id]).cpu().numpy().astype(np.float64)

    def default_rows(self, free_bytes: int | None = None) -> int:
        """Pairs per forward pass when not told: 8 on CPU (the plan every CPU figure was measured
        with); on a GPU, what the engine's token budget for its free memory holds
        (`metachunk.engine.scoring.batch_budget`), counting each row as the shared prefix (whose
        KV cache every row copies) plus ``GPU_PAIR_TOKENS`` of pair. ``free_bytes``: as for
        ``batch_budget`` (default: the device's)."""
        from metachunk.engine.scoring import batch_budget

        if self.device.type != "cuda":
            return CPU_PAIR_ROWS
        row = len(self.prefix_ids) + GPU_PAIR_TOKENS
        tokens, _ = batch_budget(self.model, row, self.device, free_bytes)
        return max(CPU_PAIR_ROWS, tokens // row)

    @property
    def rows(self) -> int:
        """`default_rows`, read once per scorer: free memory shrinks by what the allocator keeps
        cached after the first batch, and a batch's shape moves bf16 margins, so a second reading
        would change a run's boundaries from its second call on (and a resumed run's from its first)."""
        if self._rows is None:
            self._rows = self.default_rows()
        return self._rows

    def plan(
        self, lengths: Sequence[int], batch_size: int | None = None, pass_tokens: int | None = None
    ) -> list[list[int]]:
        """The forward passes `margins` runs for pairs of these token lengths (after the prefix):
        `length_batches` with at most ``batch_size`` rows (default `rows`), and ``pass_tokens``
        of padding allowed per pass past ``MAX_PADDING`` (default ``GPU_PASS_TOKENS`` on a GPU, 0 on CPU)."""
        if pass_tokens is None:
            pass_tokens = GPU_PASS_TOKENS if self.device.type == "cuda" else 0
        return length_batches(lengths, batch_size or self.rows, pass_tokens=pass_tokens)

    def margins(
        self, pairs: Sequence[tuple[str, str]], batch_size: int | None = None, pass_tokens: int | None = None
    ) -> np.ndarray:
        """Margins for many pairs: the shared prefix's KV cache is reused, pairs run in the batches
        of `plan`."""
        import torch

        from metachunk.engine.scoring import lm_head_logits

        with torch.inference_mode():
            if not pairs:
                return np.zeros(0)
            decoder = self.model.get_decoder()
            if self._prefix_cache is None:
                ids = torch.as_tensor([self.prefix_ids], device=self.device)
                self._prefix_cache = decoder(input_ids=ids, use_cache=True).cache
            n_prefix = len(self.prefix_ids)
            suffixes = [self.pair_ids(a, b) for a, b in pairs]
            out = np.empty(len(pairs))
            # similar lengths share a batch
            for idx in self.plan([len(s) for s in suffixes], batch_size, pass_tokens):
                longest = max(len(suffixes[i]) for i in idx)
                ids = torch.zeros(len(idx), longest, dtype=torch.long)
                mask = torch.zeros(len(idx), n_prefix + longest, dtype=torch.long)
                mask[:, :n_prefix] = 1
                for r, i in enumerate(idx):  # right padding: real tokens keep their positions
                    ids[r, : len(suffixes[i])] = torch.as_tensor(suffixes[i])
                    mask[r, n_prefix : n_prefix + len(suffixes[i])] = 1
                cache = copy.deepcopy(self._prefix_cache)
                cache.batch_repeat_interleave(len(idx))
                hidden = decoder(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state
                last = torch.as_tensor([len(suffixes[i]) - 1 for i in idx], device=self.device)
                logits = lm_head_logits(self.model, hidden[torch.arange(len(idx), device=self.device), last])
                out[idx] = self.margins_from_logits(logits)
            return out

    def margin_single(self, sentence1: str, sentence2: str) -> float:
        """One full forward pass for one pair, no cache reuse: the reference for ``margins``."""
        import torch

        with torch.inference_mode():
            ids = torch.as_tensor([self.prefix_ids + self.pair_ids(sentence1, sentence2)], device=self.device)
            logits = self.model(input_ids=ids, logits_to_keep=1).logits[:, -1]
            return float(self.margins_from_logits(logits)[0])


class Threshold:
    """θ for MSP decisions: fixed, or dynamic (starts at 0, then the mean of past margins)."""

    def __init__(self, value: float = 0.0, dynamic: bool = False, window: int | None = None):
        self.fixed, self.dynamic, self.window = value, dynamic, window
        self.history: list[float] = []

    @property
    def value(self) -> float:
        if not self.dynamic:
            return self.fixed
        past = self.history[-self.window :] if self.window else self.history
        return float(np.mean(past)) if past else 0.0

    def decide(self, margin: float) -> bool:
        """True = keep together. The margin joins the history after the decision."""
        keep = margin > self.value
        self.history.append(margin)
        return keep


@dataclass
class MspResult:
    boundaries: list[int]  # sentence indices that end a chunk
    margins: list[float | None]  # per sentence: margin of (previous, this); None for the first
    thresholds: list[float | None]  # θ each decision was compared against


def _strip(doc: str, s: Sentence) -> str:
    return doc[s.start : s.end].strip()


def msp_decisions(
    scorer: MarginScorer,
    docs: Sequence[str],
    sentences: Sequence[Sequence[Sentence]],
    mode: str = "pair",
    threshold: float = 0.0,
    dynamic: bool = False,
    window: int | None = None,
    batch_size: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[MspResult]:
    if mode not in ("pair", "accumulated"):
        raise ValueError(f"msp mode must be 'pair' or 'accumulated', not {mode!r}")
    results = [MspResult([], [None] * len(s), [None] * len(s)) for s in sentences]
    thresholds = [Threshold(threshold, dynamic, window) for _ in docs]

    def record(d: int, i: int, margin: float) -> bool:
        results[d].thresholds[i] = thresholds[d].value
        results[d].margins[i] = margin
        keep = thresholds[d].decide(margin)
        if not keep:
            results[d].boundaries.append(i - 1)
        return keep

    if mode == "pair":
        keys = [(d, i) for d, sents in enumerate(sentences) for i in range(1, len(sents))]
        pairs = [(_strip(docs[d], sentences[d][i - 1]), _strip(docs[d], sentences[d][i])) for d, i in keys]
        margins = scorer.margins(pairs, batch_size=batch_size)
        for (d, i), m in zip(keys, margins):  # keys are in document order, as dynamic θ requires
            record(d, i, float(m))
        if on_step:
            on_step(len(keys))
        return results

    chunk_start = [0] * len(docs)  # index of the first sentence of each document's open chunk
    for i in range(1, max((len(s) for s in sentences), default=0)):
        active = [d for d in range(len(docs)) if i < len(sentences[d])]
        pairs = []
        for d in active:
            sents = sentences[d]
            current = docs[d][sents[chunk_start[d]].start : sents[i - 1].end].strip()
            pairs.append((current[-ACCUMULATED_MAX_CHARS:], _strip(docs[d], sents[i])))
        for d, m in zip(active, scorer.margins(pairs, batch_size=batch_size)):
            if not record(d, i, float(m)):
                chunk_start[d] = i
        if on_step:
            on_step(len(active))
    return results
