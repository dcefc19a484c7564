"""Re-ranking the dense top-N (Meta-Chunking Appendix E): PPL re-rank and any local cross-encoder.

**PPL** (``--rerank ppl``), the coarse-grained ranking of LongLLMLingua (Jiang et al. 2023) that
the paper's PPLRerank uses: a small causal LM reads the candidate passage, then the question
followed by a restrictive statement ("We can get the answer to this question in the given
documents."); the passage's score is the negative mean NLL (nats) of the question + statement
tokens. A passage that makes the question likely comes first. NLLs come from
`metachunk.engine.scoring.token_nll` (the one scoring function), all (passage, question) pairs of
all questions in one call, which batches them. A passage longer than ``max_passage_tokens`` keeps
its first tokens.

**Cross-encoder** (``--rerank cross-encoder --reranker DIR``): ``sentence_transformers.CrossEncoder``
scores each (question, passage) pair; higher is better.

Both return, per question, the candidates' scores; the caller sorts (stable, so ties keep the
dense order).
"""

from __future__ import annotations

from collections.abc import Sequence

RESTRICT = {
    "en": " We can get the answer to this question in the given documents.",
    "zh": "我们可以在给定的文档中找到这个问题的答案。",
}
SEPARATOR = "\n\n"


def ppl_pair_ids(
    tokenizer, passage: str, question: str, lang: str, max_passage_tokens: int
) -> tuple[list[int], int]:
    """``(ids, first scored position)`` of one pair: [BOS] passage, blank line, question + statement."""
    from metachunk.engine.scoring import start_ids

    specials = start_ids(tokenizer)
    head = (
        specials + tokenizer(passage + SEPARATOR, add_special_tokens=False)["input_ids"][:max_passage_tokens]
    )
    tail = tokenizer(question.strip() + RESTRICT[lang], add_special_tokens=False)["input_ids"]
    return head + tail, len(head)


def ppl_scores(
    model,
    tokenizer,
    queries: Sequence[tuple[str, Sequence[str]]],
    lang: str,
    max_passage_tokens: int = 512,
    batch_tokens: int = 8192,
    progress: bool = False,
) -> list[list[float]]:
    """Per ``(question, passages)``, each passage's score: - mean NLL of the question given it."""
    import numpy as np

    from metachunk.engine.scoring import token_nll
    from metachunk.progress import bar as progress_bar

    pairs, owners = [], []
    for q, (question, passages) in enumerate(queries):
        for passage in passages:
            pairs.append(ppl_pair_ids(tokenizer, passage, question, lang, max_passage_tokens))
            owners.append(q)
    if not pairs:
        return [[] for _ in queries]
    longest = max(len(ids) for ids, _ in pairs)
    total = sum(len(ids) - 1 for ids, _ in pairs)
    with progress_bar(total=total, unit="tok", desc="rerank ppl", enabled=progress) as bar:
        nll = token_nll(
            model,
            [ids for ids, _ in pairs],
            max_context=max(longest, 2),  # one window per pair: the question always sees its passage
            batch_tokens=max(batch_tokens, longest),
            on_batch=bar.update,
        )
    out: list[list[float]] = [[] for _ in queries]
    for q, (_, first), values in zip(owners, pairs, nll):
        out[q].append(-float(np.nanmean(values[max(first, 1) :])))
    return out


def load_cross_encoder(name_or_dir: str, device: str | None = None):
    from sentence_transformers import CrossEncoder

    from metachunk.models import check_device, default_device, resolve

    device = check_device(device or default_device())
    return CrossEncoder(str(resolve(name_or_dir)), device=device)


def cross_encoder_scores(
    model, queries: Sequence[tuple[str, Sequence[str]]], batch_size: int = 32, progress: bool = False
) -> list[list[float]]:
    pairs = [(question, passage) for question, passages in queries for passage in passages]
    if not pairs:
        return [[] for _ in queries]
    from metachunk.progress import bar as progress_bar

    # In slices under our own bar (sentence-transformers' own would redraw into a log). predict sorts
    # its input by length so that a batch pads little; the slices are cut from the pairs sorted
    # longest first, so that they batch alike.
    order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
    scores = [0.0] * len(pairs)
    step = batch_size * 16
    with progress_bar(total=len(pairs), unit="pair", desc="rerank cross-encoder", enabled=progress) as bar:
        for a in range(0, len(order), step):
            rows = order[a : a + step]
            part = model.predict([pairs[i] for i in rows], batch_size=batch_size, show_progress_bar=False,
                                 convert_to_numpy=True)  # fmt: skip
            for i, s in zip(rows, part.reshape(len(rows), -1)[:, 0]):
                scores[i] = float(s)
            bar.update(len(rows))
    out, i = [], 0
    for _, passages in queries:
        out.append(scores[i : i + len(passages)])
        i += len(passages)
    return out


def order(scores: Sequence[float]) -> list[int]:
    """Indices by descending score; ties keep their input (dense) order."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])
