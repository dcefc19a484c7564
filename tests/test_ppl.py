"""PPL chunking (Meta-Chunking §3.1.1): the minima rule, token geometry, the windowed NLL engine
against the per-sentence reference, and end-to-end properties on the real corpora (named datasets)."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.merge import text_length
from metachunk.chunking.ppl import ppl_boundaries, scoring_pieces, sentence_ppl, tokenize_sentences
from metachunk.chunking.sentences import split_sentences
from metachunk.chunking.types import Sentence, chunks_from_boundaries
from support.data import data_file

from metachunk.engine.scoring import Window, plan_windows, token_nll, token_nll_incremental

NAN = math.nan

# token_nll may batch windows of different lengths with a padding mask (``allow_padding``, the
# default on CUDA) or only windows of equal length (the CPU default). Check both paths when the
# engine has the switch; an engine without it always pads.
PADDING = (
    [{}, {"allow_padding": True}] if "allow_padding" in inspect.signature(token_nll).parameters else [{}]
)

DOCS = [
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world. "
    "She was the youngest of two daughters.  Her mother had died long ago!\n\nMr. Knightley came in. "
    "Was he sensible? He was.",
    "近日，抖音直播发布第二十期“不良直播PK内容”治理公示。公示显示，2023年7月1日以来，平台已对110991个账号进行处罚。"
    "其中，不乏超百万粉丝的主播账号！\n\n北京是中国的首都，上海是最大的城市。",
    "Mixed 中英文 text: RAG 系统 uses chunking 分块 to work well。The answer is 1.\nThe answer is 2.\n\nNew paragraph here.",
    "Just one sentence without a full stop",
    "Hi.",
]


# --------------------------------------------------------------------------------------------
# The minima rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ppl", "theta", "expected"),
    [
        # strict minimum, only the left difference reaches θ
        ([5.0, 3.0, 4.0], 1.5, [1]),
        # strict minimum, only the right difference reaches θ
        ([4.0, 3.0, 5.0], 1.5, [1]),
        # strict minimum, both differences below θ: no boundary
        ([4.0, 3.0, 4.0], 1.5, []),
        # differences exactly equal to θ (exact binary fractions): the rule is >=
        ([3.5, 3.0, 3.25], 0.5, [1]),
        ([3.25, 3.0, 3.5], 0.5, [1]),
        ([3.5, 3.0, 3.5], 0.5, [1]),
        # just below θ on both sides
        ([3.25, 3.0, 3.25], 0.5, []),
        # equal right neighbour: left - mid >= θ and right == mid
        ([4.0, 3.0, 3.0], 1.0, [1]),
        ([4.0, 3.0, 3.0, 5.0], 1.0, [1]),
        # equal right neighbour but left - mid < θ
        ([3.5, 3.0, 3.0], 1.0, []),
        # flat: never a boundary, even at θ = 0
        ([3.0, 3.0, 3.0], 0.0, []),
        ([3.0, 3.0, 3.0, 3.0, 3.0], 0.0, []),
        # equal *left* neighbour is not a minimum
        ([3.0, 3.0, 4.0], 0.0, []),
        # θ = 0: every strict minimum and every left drop onto a plateau
        ([3.0, 1.0, 3.0, 1.0, 3.0], 0.0, [1, 3]),
        ([3.0, 1.0, 1.0, 3.0], 0.0, [1]),
        ([3.0, 2.0, 1.0, 2.0, 3.0], 0.0, [2]),
        # first and last sentence are never boundaries, however low
        ([0.0, 9.0, 9.5, 0.0], 0.0, []),
        ([0.0, 9.0], 0.0, []),
        ([0.0], 0.0, []),
        ([], 0.0, []),
        # NaN never satisfies a comparison: not as mid, not as a neighbour
        ([5.0, NAN, 5.0], 0.0, []),
        ([NAN, 3.0, 5.0], 0.0, []),
        ([5.0, 3.0, NAN], 0.0, []),
        ([5.0, NAN, 3.0, 1.0, 4.0], 0.0, [3]),
        # a maximum is not a boundary
        ([1.0, 5.0, 1.0], 0.0, []),
    ],
)
def test_ppl_boundaries_rule(ppl, theta, expected):
    assert ppl_boundaries(ppl, theta) == expected
    assert ppl_boundaries(np.asarray(ppl, dtype=np.float64), theta) == expected


def test_ppl_boundaries_threshold_sweep():
    ppl = [6.0, 4.0, 5.0, 2.0, 2.0, 7.0, 6.75, 7.5]
    # i=1: diffs 2 / 1;  i=3: left 3, right == mid;  i=6: diffs 0.25 / 0.75
    assert ppl_boundaries(ppl, 0.0) == [1, 3, 6]
    assert ppl_boundaries(ppl, 0.75) == [1, 3, 6]
    assert ppl_boundaries(ppl, 0.76) == [1, 3]
    assert ppl_boundaries(ppl, 2.0) == [1, 3]
    assert ppl_boundaries(ppl, 2.5) == [3]
    assert ppl_boundaries(ppl, 3.0) == [3]
    assert ppl_boundaries(ppl, 3.01) == []


@settings(max_examples=200, deadline=None)
@given(
    ppl=st.lists(st.one_of(st.integers(0, 6).map(float), st.just(NAN)), max_size=25),
    t1=st.integers(0, 6).map(lambda x: x / 2),
    t2=st.integers(0, 6).map(lambda x: x / 2),
)
def test_ppl_boundaries_properties(ppl, t1, t2):
    lo, hi = sorted((t1, t2))
    b_lo, b_hi = ppl_boundaries(ppl, lo), ppl_boundaries(ppl, hi)
    assert set(b_hi) <= set(b_lo)  # raising θ never adds a boundary
    assert b_lo == sorted(set(b_lo))
    for i in b_lo:
        assert 1 <= i <= len(ppl) - 2
        left, mid, right = ppl[i - 1], ppl[i], ppl[i + 1]
        assert left > mid and right >= mid  # a minimum (NaN fails both comparisons)
        assert max(left - mid, right - mid) >= lo


# --------------------------------------------------------------------------------------------
# Text -> token geometry
# --------------------------------------------------------------------------------------------


def test_scoring_pieces_hand_made():
    doc = "A b.  C d.\n\nE f. "
    sents = [Sentence(0, 6), Sentence(6, 12), Sentence(12, 17)]
    assert [doc[s.start : s.end] for s in sents] == ["A b.  ", "C d.\n\n", "E f. "]
    assert scoring_pieces(doc, sents) == ["A b.", "  C d.", "\n\nE f. "]
    assert scoring_pieces(doc, []) == []
    assert scoring_pieces("  x ", [Sentence(0, 4)]) == ["  x "]  # leading ws stays with the first piece


@pytest.mark.parametrize("doc", [*DOCS, "  Leading space. Then\ttabs.\t\n\n\n  And   trailing.  \n"])
def test_scoring_pieces_tile_and_move_whitespace(doc):
    sents = split_sentences(doc, "auto")
    pieces = scoring_pieces(doc, sents)
    assert len(pieces) == len(sents)
    assert "".join(pieces) == doc
    for i, (piece, s) in enumerate(zip(pieces, sents)):
        assert piece.strip() == doc[s.start : s.end].strip()
        if i < len(sents) - 1:
            assert piece == piece.rstrip()  # trailing whitespace moved on ...
            trailing = doc[s.start : s.end][len(doc[s.start : s.end].rstrip()) :]
            assert pieces[i + 1].startswith(trailing)  # ... to the front of the next piece


def test_tokenize_sentences_spans_cover_ids(tiny_tokenizer):
    for doc in DOCS:
        sents = split_sentences(doc, "auto")
        ids, spans = tokenize_sentences(tiny_tokenizer, doc, sents)
        assert len(spans) == len(sents)
        assert spans[0][0] == 0 and spans[-1][1] == len(ids)
        for (_, b), (c, _) in zip(spans, spans[1:]):
            assert b == c
        for (a, b), piece in zip(spans, scoring_pieces(doc, sents)):
            assert ids[a:b] == tiny_tokenizer(piece, add_special_tokens=False)["input_ids"]
            assert b > a
        assert tiny_tokenizer.decode(ids) == doc  # lossless byte-level BPE
    assert tokenize_sentences(tiny_tokenizer, "", []) == ([], [])


class _WithBos:
    """The tiny tokenizer, putting a ``<bos>`` before every text as Gemma's does."""

    def __init__(self, tokenizer, bos: int):
        self.tokenizer, self.bos = tokenizer, bos

    def __call__(self, text, add_special_tokens=True):
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if add_special_tokens:
            ids = [[self.bos, *x] for x in ids] if isinstance(text, list) else [self.bos, *ids]
        return {"input_ids": ids}


def test_a_tokenizer_that_starts_texts_with_bos_scores_them_after_it(tiny_lm):
    """Chunking tokenized without special tokens: Gemma read every document without the <bos> it was
    trained with (its sentence scores 30-50% higher, a different boundary), while `eval chunk-quality`
    scored the same text after it. Now the <bos> leads each document, predicts the first token, and the
    sentences' spans start after it. A tokenizer with none (Qwen2's, SmolLM2's) tokenizes as before."""
    from metachunk.chunking.ppl import score_documents

    model, tok = tiny_lm
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    doc = DOCS[0]
    sents = split_sentences(doc, "auto")
    plain_ids, plain_spans = tokenize_sentences(tok, doc, sents)
    ids, spans = tokenize_sentences(_WithBos(tok, bos), doc, sents)
    assert ids == [bos, *plain_ids] and spans == [(a + 1, b + 1) for a, b in plain_spans]
    (ppl,) = score_documents(model, _WithBos(tok, bos), [doc], [sents])
    (nll,) = token_nll(model, [ids], max_context=4096)
    assert not np.isnan(nll[1:]).any()  # the document's first token is scored, after the <bos>
    np.testing.assert_allclose(ppl, sentence_ppl(nll, spans), atol=1e-5)
    a, b = spans[0]
    assert ppl[0] == pytest.approx(float(nll[a:b].mean()), abs=1e-5)


# --------------------------------------------------------------------------------------------
# Window planning
# --------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 3000), w=st.integers(2, 700), seq=st.integers(0, 5))
def test_plan_windows_cover_each_token_once(n, w, seq):
    windows = plan_windows(n, w, seq)
    if n < 2:
        assert windows == []
        return
    scored = []
    for win in windows:
        assert win.seq == seq
        assert 0 <= win.start < win.score_from < win.end <= n
        assert win.end - win.start <= w
        for p in range(win.score_from, win.end):
            assert p - win.start >= min(w // 2, p)  # context inside the window, or all of it
        scored.extend(range(win.score_from, win.end))
    assert scored == list(range(1, n))  # every token but the first, exactly once, in order
    if n <= w:
        assert len(windows) == 1 and windows[0].start == 0 and windows[0].end == n


def test_plan_windows_small_cases():
    assert plan_windows(10, 4) == [
        Window(0, 0, 4, 1),
        Window(0, 2, 6, 4),
        Window(0, 4, 8, 6),
        Window(0, 6, 10, 8),
    ]
    with pytest.raises(ValueError):
        plan_windows(10, 1)


# --------------------------------------------------------------------------------------------
# Engine vs the per-sentence reference (tiny random model, fp32)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir: Path):
    from metachunk.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_lm):
    return tiny_lm[1]


def _tokenized(tokenizer, doc):
    sents = split_sentences(doc, "auto")
    ids, spans = tokenize_sentences(tokenizer, doc, sents)
    return ids, spans


def _reference(model, ids, spans):
    return token_nll_incremental(model, [ids[a:b] for a, b in spans])


def test_engine_matches_reference_single_docs(tiny_lm):
    model, tok = tiny_lm
    for doc in DOCS:
        ids, spans = _tokenized(tok, doc)
        (nll,) = token_nll(model, [ids], max_context=max(16, len(ids)))
        ref = _reference(model, ids, spans)
        assert nll.shape == ref.shape == (len(ids),)
        assert nll.dtype == np.float32
        assert np.isnan(nll[0]) and np.isnan(ref[0])
        assert not np.isnan(nll[1:]).any()
        np.testing.assert_allclose(nll, ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(sentence_ppl(nll, spans), sentence_ppl(ref, spans), atol=1e-4, rtol=0)


@pytest.mark.parametrize("padding", PADDING)
@pytest.mark.parametrize("head_rows", [None, 3])
def test_engine_matches_reference_batched(tiny_lm, head_rows, padding):
    model, tok = tiny_lm
    tokenized = [_tokenized(tok, doc) for doc in DOCS]
    longest = max(len(ids) for ids, _ in tokenized)
    calls = []
    nlls = token_nll(
        model,
        [ids for ids, _ in tokenized],
        max_context=longest,
        max_batch_size=8,
        head_rows=head_rows,
        on_batch=calls.append,
        **padding,
    )
    assert sum(calls) == sum(max(0, len(ids) - 1) for ids, _ in tokenized)
    for nll, (ids, spans) in zip(nlls, tokenized):
        ref = _reference(model, ids, spans)
        np.testing.assert_allclose(nll, ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(sentence_ppl(nll, spans), sentence_ppl(ref, spans), atol=1e-4, rtol=0)


def test_engine_empty_and_one_token(tiny_lm):
    model, _ = tiny_lm
    out = token_nll(model, [[], [5], [5, 6, 7]], max_context=16)
    assert [len(x) for x in out] == [0, 1, 3]
    assert np.isnan(out[1][0]) and np.isnan(out[2][0]) and not np.isnan(out[2][1:]).any()
    assert token_nll(model, [], max_context=16) == []
    assert len(token_nll_incremental(model, [[], []])) == 0


def test_sentence_ppl_skips_unscored():
    nll = np.array([NAN, 1.0, 3.0, 2.0, 4.0], dtype=np.float32)
    out = sentence_ppl(nll, [(0, 1), (1, 3), (3, 5), (5, 5)])
    assert np.isnan(out[0]) and np.isnan(out[3])  # only the unscored first token; empty span
    assert out[1:3].tolist() == [2.0, 3.0]
    out = sentence_ppl(nll, [(0, 3)])
    assert out.tolist() == [2.0]  # the NaN of token 0 is skipped, not averaged


# --------------------------------------------------------------------------------------------
# Long documents: windows smaller than the document
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_ids(tiny_tokenizer) -> list[int]:
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        text = "\n\n".join(json.loads(line)["text"] for _, line in zip(range(8), f))
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 400
    return ids[:400]


def test_long_document_windows_match_direct_forward(tiny_lm, long_ids):
    import torch

    model, _ = tiny_lm
    w = 64
    (nll,) = token_nll(model, [long_ids], max_context=w, long_context="sliding-window")
    assert np.isnan(nll[0]) and not np.isnan(nll[1:]).any()
    windows = plan_windows(len(long_ids), w)
    assert len(windows) > 5
    for p in (1, 10, 63, 64, 65, 100, 200, 255, 399):
        win = next(x for x in windows if x.score_from <= p < x.end)
        ids = torch.as_tensor([long_ids[win.start : win.end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        expected = -logp[p - win.start - 1, long_ids[p]].item()
        assert nll[p] == pytest.approx(expected, abs=1e-4), p
    # Truncating the context changes the value for a late token (the window really is local) ...
    (full,) = token_nll(model, [long_ids], max_context=len(long_ids))
    assert np.abs(full[200:] - nll[200:]).max() > 1e-3
    # ... but not for tokens inside the first window.
    np.testing.assert_allclose(full[:w], nll[:w], atol=1e-4, rtol=0)


@pytest.mark.parametrize("long_context", ["kv-trim", "sliding-window"])
@pytest.mark.parametrize("padding", PADDING)
def test_long_document_independent_of_batch(tiny_lm, long_ids, padding, long_context):
    model, tok = tiny_lm
    others = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS[:3]]
    (alone,) = token_nll(model, [long_ids], max_context=64, max_batch_size=1, long_context=long_context)
    for kwargs in ({"max_batch_size": 16}, {"max_batch_size": 3, "batch_tokens": 100}, {"head_rows": 7}):
        batched = token_nll(
            model,
            [others[0], long_ids, others[1], long_ids[:150], others[2]],
            max_context=64,
            long_context=long_context,
            **kwargs,
            **padding,
        )
        np.testing.assert_allclose(batched[1], alone, atol=1e-5, rtol=0)
        np.testing.assert_allclose(batched[3], alone[:150], atol=1e-5, rtol=0)  # a prefix scores the same
        for got, ids in zip([batched[0], batched[2], batched[4]], others):
            (ref,) = token_nll(model, [ids], max_context=64, max_batch_size=1, long_context=long_context)
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# Streams: batches side by side, in threads that share the model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streams_give_the_same_bytes(tiny_lm, tiny_model_dir: Path, long_ids, dtype):
    import torch

    from metachunk.models import load_causal_lm

    model, tok = (
        tiny_lm if dtype == "float32" else load_causal_lm(str(tiny_model_dir), device="cpu", dtype=dtype)
    )
    sequences = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS] + [long_ids, long_ids[:150]]
    threads = torch.get_num_threads()
    runs = {}
    for streams in (1, 2, 3, 2):
        calls = []
        out = token_nll(model, sequences, max_context=64, max_batch_size=2, head_rows=16,
                        streams=streams, on_batch=calls.append)  # fmt: skip
        assert sum(calls) == sum(max(0, len(s) - 1) for s in sequences)
        assert torch.get_num_threads() == threads  # each stream's share is given back
        if streams in runs:  # a rerun: the same batches in the same streams
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(out, runs[streams]))
        runs[streams] = out
    for streams in (2, 3):
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(runs[streams], runs[1]))


def test_streams_stop_on_a_failure(tiny_lm):
    import torch

    model, tok = tiny_lm
    sequences = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    sequences[2] = [*sequences[2][:5], model.config.vocab_size + 7]  # no such token: its batch fails
    threads = torch.get_num_threads()
    with pytest.raises(IndexError):
        token_nll(model, sequences, max_context=64, max_batch_size=1, streams=2)
    assert torch.get_num_threads() == threads


def test_streams_stop_on_a_signal(tiny_lm, long_ids):
    """A signal handler that raises in the waiting thread (as SIGTERM's does under
    metachunk.stopping) ends the call within a batch per stream, not after the whole plan."""
    import signal
    import threading

    model, _ = tiny_lm
    calls = []

    def on_batch(n):  # from a stream's thread: the first scored batch signals the caller's
        calls.append(n)
        if len(calls) == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            token_nll(model, [long_ids] * 40, max_context=32, max_batch_size=1, head_rows=16, streams=2,
                      on_batch=on_batch)  # fmt: skip
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert 0 < sum(calls) < 40 * (len(long_ids) - 1) / 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(2, 50)), max_size=30), st.integers(1, 5))
def test_assign_batches_deals_each_batch_once(shapes, streams):
    from metachunk.engine.scoring import assign_batches

    batches = [[Window(k, 0, n, 1)] * rows for k, (rows, n) in enumerate(shapes)]
    lanes = assign_batches(batches, streams)
    assert len(lanes) == streams
    dealt = [b[0].seq for lane in lanes for b in lane]
    assert sorted(dealt) == list(range(len(batches)))
    assert all([b[0].seq for b in lane] == sorted(b[0].seq for b in lane) for lane in lanes)  # plan order
    work = [sum(len(b) * b[0].end for b in lane) for lane in lanes]
    assert max(work) - min(work) <= max((r * n for r, n in shapes), default=0)
    assert lanes == assign_batches(batches, streams)


# --------------------------------------------------------------------------------------------
# Real model (integration)
# --------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_engine_matches_reference_smollm2(smollm2):
    model, tok = smollm2
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        paragraphs = [json.loads(line)["text"] for line in f][21:33]  # 12 short paragraphs, dialogue
    doc = "\n\n".join(paragraphs)
    sents = split_sentences(doc, "en")
    ids, spans = tokenize_sentences(tok, doc, sents)
    assert len(sents) > 12
    (nll,) = token_nll(model, [ids], max_context=4096)
    ref = _reference(model, ids, spans)
    np.testing.assert_allclose(nll, ref, atol=1e-4, rtol=0)
    ppl, ppl_ref = sentence_ppl(nll, spans), sentence_ppl(ref, spans)
    np.testing.assert_allclose(ppl, ppl_ref, atol=1e-4, rtol=0)
    assert np.all((ppl > 0) & (ppl < 20))  # a real LM on English prose: a few nats per token


# --------------------------------------------------------------------------------------------
# End to end on the real corpora: Chunker(method="ppl")
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    news, emma = data_file("crud-news/news.jsonl"), data_file("gutenqa-emma/paragraphs.jsonl")
    with news.open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(10), f)]
    with emma.open(encoding="utf-8") as f:
        texts.append("\n\n".join(json.loads(line)["text"] for _, line in zip(range(60), f)))
    texts += ["", "  \n\n "]  # empty documents ride along
    return [f"doc{i}" for i in range(len(texts))], texts


@pytest.fixture(scope="module")
def chunk_ppl(tiny_model_dir: Path, corpus):
    from metachunk.chunking.pipeline import ChunkConfig, Chunker

    cache = {}

    def run(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cfg = ChunkConfig(method="ppl", model=str(tiny_model_dir), device="cpu", **kwargs)
            cache[key] = Chunker(cfg).chunk(*corpus)
        return cache[key]

    return run


def _assert_tiles(d):
    if not d.text:
        assert d.chunks == []  # only the empty document has no chunk
        return
    assert "".join(c.text for c in d.chunks) == d.text
    for c in d.chunks:
        assert c.text == d.text[c.start : c.end]
        assert c.end > c.start
    assert d.chunks[0].start == 0 and d.chunks[-1].end == len(d.text)


def test_chunker_ppl_tiles_corpus(chunk_ppl, corpus):
    ids, texts = corpus
    out = chunk_ppl(threshold=0.0)
    assert [d.id for d in out] == ids and [d.text for d in out] == texts
    n_boundaries = 0
    for d in out:
        _assert_tiles(d)
        if not d.text.strip():  # "" has nothing; whitespace is one sentence, one chunk: nothing dropped
            expected = [Sentence(0, len(d.text))] if d.text else []
            assert [(s.start, s.end) for s in d.sentences] == [(s.start, s.end) for s in expected]
            assert len(d.chunks) == len(expected) and d.boundaries == []
            continue
        assert len(d.sentences) > 1
        for s in d.sentences:
            assert s.score is None or (isinstance(s.score, float) and math.isfinite(s.score))
        assert sum(s.score is not None for s in d.sentences) >= len(d.sentences) - 1
        scores = [NAN if s.score is None else s.score for s in d.sentences]
        assert d.boundaries == ppl_boundaries(scores, 0.0)
        assert len(d.chunks) == len(d.boundaries) + 1
        n_boundaries += len(d.boundaries)
    assert n_boundaries > 20  # θ = 0 splits at every minimum


def test_chunker_ppl_target_len(chunk_ppl):
    out = chunk_ppl(target_len=178, len_unit="char")
    n_long = 0
    for d in out:
        _assert_tiles(d)
        if not d.chunks:
            continue
        meta = {(c.start, c.end) for c in chunks_from_boundaries(d.text, d.sentences, d.boundaries)}
        for c in d.chunks:
            if text_length(c.text, "char") > 178:
                assert (c.start, c.end) in meta  # an over-long meta-chunk stays alone, never cut
                n_long += 1
        # merged: fewer chunks than meta-chunks, and two neighbours never fit together in L
        assert len(d.chunks) <= len(meta)
        for a, b in zip(d.chunks, d.chunks[1:]):
            assert text_length(d.text[a.start : b.end], "char") > 178
    assert sum(len(d.chunks) for d in out) > 10
    assert n_long > 0  # the corpus does exercise over-long meta-chunks


def test_chunker_ppl_overlap(chunk_ppl):
    plain = chunk_ppl(threshold=0.0)
    out = chunk_ppl(threshold=0.0, overlap=True)
    for d, p in zip(out, plain):
        assert [c.end for c in d.chunks] == [c.end for c in p.chunks]  # same boundaries
        for c in d.chunks:
            assert c.text == d.text[c.start : c.end] and c.end > c.start
        if d.chunks:
            assert d.chunks[0].start == 0 and d.chunks[-1].end == len(d.text)
        for prev, nxt in zip(d.chunks, d.chunks[1:]):
            last = next(s for s in d.sentences if s.end == prev.end)
            assert prev.start <= last.start
            assert nxt.start == last.start  # chunk k+1 opens with chunk k's last sentence


def test_bf16_head_keeps_target_exact_and_normaliser_close(tiny_lm, long_ids):
    import torch

    from metachunk.engine.scoring import token_nll

    model, _ = tiny_lm
    ids = long_ids[:300]
    exact = token_nll(model, [ids])[0]
    same = token_nll(model, [ids], head_dtype=torch.float32)[0]
    fast = token_nll(model, [ids], head_dtype=torch.bfloat16, head_rows=7)[0]
    np.testing.assert_array_equal(np.isnan(exact), np.isnan(fast))
    assert np.nanmax(np.abs(exact - same)) == 0.0  # the weights' own dtype is the exact path
    assert 0.0 < np.nanmax(np.abs(exact - fast)) < 0.05  # bf16 normaliser: close, not identical


@pytest.mark.parametrize(("rows", "cols"), [(1, 50), (5, 7), (64, 16)])
def test_sliced_head_equals_a_full_log_softmax_with_bias_and_softcap(rows, cols):
    """The head tiles (positions x vocabulary blocks, each tile's log-sum-exp combined, reused buffers) give
    the plain ``-log_softmax(logits)[target]``, also with a head bias and Gemma-style soft-capping,
    and on last tiles narrower or shorter than the rest."""
    from types import SimpleNamespace

    import torch

    from metachunk.engine.scoring import sliced_nll

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden, targets = torch.randn(23, 16) * 4, torch.randint(0, 50, (23,))
    for cap in (None, 3.0):
        model = SimpleNamespace(
            get_output_embeddings=lambda: head, config=SimpleNamespace(final_logit_softcapping=cap)
        )
        with torch.inference_mode():
            logits = head(hidden)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            expected = -torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
            got = sliced_nll(model, hidden, targets, rows, vocab_block=cols)
            low = sliced_nll(model, hidden, targets, rows, head.weight.to(torch.bfloat16), vocab_block=cols)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert 0 < float((low - expected).abs().max()) < 0.5  # bf16 normaliser (logits of ~10)
        # Only the normaliser is bf16: each position scored against two targets is off by the same
        # amount for both, where a bf16 target logit would add its own error (~0.04 at logits of ~10).
        with torch.inference_mode():
            other = (targets + 1 + torch.arange(23) % 40) % 50
            pair = torch.cat([targets, other])
            logits = head(hidden)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            expected = -torch.log_softmax(logits, -1).repeat(2, 1).gather(1, pair[:, None]).squeeze(1)
            low = sliced_nll(
                model, hidden.repeat(2, 1), pair, rows, head.weight.to(torch.bfloat16), vocab_block=cols
            )
        error = low - expected
        torch.testing.assert_close(error[:23], error[23:], atol=2e-5, rtol=0)


def test_kv_trim_blocks_stitch_exactly_before_any_trimming(tiny_lm, long_ids):
    """Blocks of 32 against a cache that is not trimmed yet must equal one full pass: this checks
    positions, the causal mask across the cache and the prediction of each block's first token."""
    from metachunk.engine.scoring import supports_kv_trimming, token_nll_kv_trim

    model, _ = tiny_lm
    assert supports_kv_trimming(model)
    ids = long_ids[:64]  # two blocks of 32; after the first the cache (32) is within sinks + keep
    (full,) = token_nll(model, [ids], max_context=len(ids))
    stitched = token_nll_kv_trim(model, ids, max_context=64, head_rows=5)
    np.testing.assert_allclose(stitched, full, atol=1e-4, rtol=0)


def test_kv_trim_really_drops_old_context_and_scores_everything(tiny_lm, long_ids):
    from metachunk.engine.scoring import token_nll_kv_trim

    model, _ = tiny_lm
    (full,) = token_nll(model, [long_ids], max_context=len(long_ids))
    trimmed = token_nll_kv_trim(model, long_ids, max_context=64, head_rows=64)
    assert np.isnan(trimmed[0]) and not np.isnan(trimmed[1:]).any()
    np.testing.assert_allclose(trimmed[:64], full[:64], atol=1e-4, rtol=0)  # nothing dropped yet
    assert np.abs(trimmed[200:] - full[200:]).max() > 1e-3


def test_long_context_mode_is_validated(tiny_lm):
    model, _ = tiny_lm
    with pytest.raises(ValueError, match="long_context"):
        token_nll(model, [[1, 2, 3]], long_context="magic")
