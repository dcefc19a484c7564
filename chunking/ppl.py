"""Perplexity chunking (Meta-Chunking §3.1.1).

The score of sentence *i* is the mean token negative log-likelihood (nats) of its tokens given all
preceding text: the paper's PPL, which the threshold θ is compared against. Sentences are
tokenized one by one without special tokens and the ids concatenated (the reference convention),
so every token belongs to exactly one sentence. Boundaries are the PPL minima of the paper's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from metachunk.chunking.types import Sentence


def scoring_pieces(doc: str, sentences: Sequence[Sentence]) -> list[str]:
    """The text each sentence contributes to the token stream; the pieces tile ``doc``.

    Sentences own their *trailing* whitespace (so chunks end in "\\n\\n", not begin with it), but
    tokenizers expect whitespace to *lead* a word (" Next", "\\n\\nNext"). For scoring, the
    whitespace between two sentences is therefore moved to the front of the following piece. The
    concatenation of the pieces is still the document, byte for byte.
    """
    pieces, cursor = [], 0
    for i, s in enumerate(sentences):
        content_end = s.start + len(doc[s.start : s.end].rstrip())
        end = len(doc) if i == len(sentences) - 1 else content_end
        pieces.append(doc[cursor:end])
        cursor = end
    return pieces


def tokenize_sentences(
    tokenizer, doc: str, sentences: Sequence[Sentence], start: Sequence[int] | None = None
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the document, after the ids the tokenizer starts a text with (``start``, `start_ids`:
    Gemma's ``<bos>``, which then predicts the first token), and, per sentence, its ``[first, last)``
    token span."""
    pieces = scoring_pieces(doc, sentences)
    if not pieces:
        return [], []
    if start is None:
        from metachunk.engine.scoring import start_ids

        start = start_ids(tokenizer)
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    ids: list[int] = list(start)
    spans = []
    for piece_ids in encoded:
        spans.append((len(ids), len(ids) + len(piece_ids)))
        ids.extend(piece_ids)
    return ids, spans


def sentence_ppl(token_nll: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Mean NLL per sentence. The document's first token has no prediction (NaN) and is skipped;
    a sentence with no scored token gets NaN, which is never a boundary."""
    out = np.full(len(spans), np.nan, dtype=np.float64)
    for i, (a, b) in enumerate(spans):
        values = token_nll[a:b]
        values = values[~np.isnan(values)]
        if len(values):
            out[i] = float(values.mean())
    return out


def ppl_boundaries(ppl: Sequence[float], threshold: float) -> list[int]:
    """Indices of sentences that end a chunk: the paper's two kinds of minima.

    *i* is a boundary when ``ppl[i-1] > ppl[i] < ppl[i+1]`` and at least one of the two
    differences is ``>= threshold``; or when ``ppl[i-1] - ppl[i] >= threshold`` (with
    ``ppl[i-1] > ppl[i]``) and ``ppl[i+1] == ppl[i]``. NaN never satisfies a comparison.
    """
    boundaries = []
    for i in range(1, len(ppl) - 1):
        left, mid, right = ppl[i - 1], ppl[i], ppl[i + 1]
        if left > mid < right:
            if left - mid >= threshold or right - mid >= threshold:
                boundaries.append(i)
        elif left > mid == right and left - mid >= threshold:
            boundaries.append(i)
    return boundaries


# Rows per forward pass on CPU when not told: the plan every CPU figure was measured with.
CPU_ROWS = 8


def score_documents(
    model,
    tokenizer,
    docs: Sequence[str],
    sentences: Sequence[Sequence[Sentence]],
    max_context: int = 4096,
    batch_size: int | None = None,
    on_batch: Callable[[int], None] | None = None,
    head_dtype=None,
    long_context: str = "sliding-window",
    streams: int | None = None,
) -> list[np.ndarray]:
    """Sentence PPLs for several documents, scored together in batched windows: ``batch_size``
    rows per forward pass (default: 8 on CPU; on a GPU, the engine's budget from its free memory).
    `tokenize_documents`, then `score_tokenized`: a corpus run calls the two in different threads."""
    tokenized = tokenize_documents(tokenizer, docs, sentences)
    return score_tokenized(
        model, tokenized, max_context, batch_size, on_batch, head_dtype, long_context, streams
    )


def tokenize_documents(
    tokenizer, docs: Sequence[str], sentences: Sequence[Sequence[Sentence]]
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Each document's token ids and its sentences' token spans (`tokenize_sentences`)."""
    from metachunk.engine.scoring import start_ids

    start = start_ids(tokenizer)
    return [tokenize_sentences(tokenizer, d, s, start) for d, s in zip(docs, sentences)]


def score_tokenized(
    model,
    tokenized: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]],
    max_context: int = 4096,
    batch_size: int | None = None,
    on_batch: Callable[[int], None] | None = None,
    head_dtype=None,
    long_context: str = "sliding-window",
    streams: int | None = None,
) -> list[np.ndarray]:
    """Sentence PPLs of documents already tokenized by `tokenize_documents` (see `score_documents`)."""
    from metachunk.engine.scoring import CPU_BATCH_TOKENS, token_nll

    on_gpu = next(model.parameters()).device.type == "cuda"
    if batch_size is None and not on_gpu:
        batch_size = CPU_ROWS
    nlls = token_nll(
        model,
        [ids for ids, _ in tokenized],
        max_context=max_context,
        max_batch_size=batch_size,
        # a GPU's tokens per batch come from its free memory, whatever its rows
        batch_tokens=None if on_gpu else max(max_context, CPU_BATCH_TOKENS),
        on_batch=on_batch,
        head_dtype=head_dtype,
        long_context=long_context,
        streams=streams,
    )
    return [sentence_ppl(nll, spans) for nll, (_, spans) in zip(nlls, tokenized)]
