"""The engine's batch plan for the device: on CPU the plan every CPU figure was measured with, on a
GPU what its free memory holds (a fake free-memory figure here: no GPU needed), and a corpus run's
documents per call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from metachunk.chunking.pipeline import GPU_DOCUMENTS_PER_CALL, ChunkConfig
from metachunk.chunking.ppl import score_documents
from metachunk.chunking.sentences import split_sentences

from metachunk.engine import scoring
from metachunk.engine.scoring import Window, batch_budget, plan_batches, token_nll

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from metachunk.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")


def test_cpu_keeps_its_plan(tiny):
    model, _ = tiny
    assert batch_budget(model, 4096, torch.device("cpu")) == (8192, 16)
    assert batch_budget(model, 16384, torch.device("cpu")) == (16384, 16)  # one window always fits


def test_a_gpu_budget_follows_its_free_memory(tiny):
    model, _ = tiny
    per_token = scoring.activation_bytes_per_token(model)
    assert per_token == 4 * (8 * 64 + 3 * 128)  # fp32, hidden 64, MLP 128
    tokens, rows = batch_budget(model, 4096, CUDA, free_bytes=100 * 2**20)
    assert tokens == int(100 * 2**20 * scoring.GPU_MEMORY_SHARE) // per_token and rows == tokens // 128
    assert batch_budget(model, 4096, CUDA, free_bytes=80 * 2**30) == (131_072, 1024)  # capped
    assert batch_budget(model, 4096, CUDA, free_bytes=2**20)[0] == 4096  # at least one window
    # a plan under the budget: 500-token windows, as many rows as the tokens allow
    windows = [Window(i, 0, 500, 1) for i in range(400)]
    batches = plan_batches(
        windows, *batch_budget(model, 4096, CUDA, free_bytes=100 * 2**20), allow_padding=True
    )
    assert {len(b) for b in batches[:-1]} == {tokens // 500}


def test_a_gpu_budget_counts_what_its_allocator_holds_unused_as_free(tiny, monkeypatch):
    """After a first batch the driver's free figure drops by what torch keeps cached; the budget
    must not (a fake device: no GPU needed)."""
    model, _ = tiny
    first = batch_budget(model, 4096, CUDA, free_bytes=10 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * 2**30 + 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**20)  # the weights
    assert scoring.free_gpu_bytes(CUDA) == 10 * 2**30
    assert batch_budget(model, 4096, CUDA) == first


def test_an_explicit_batch_size_on_a_gpu_keeps_the_gpu_token_budget(monkeypatch):
    """--batch-size caps rows; on a GPU the tokens per batch still come from free memory, not the
    CPU's 8,192 (a fake device: no GPU needed)."""
    from types import SimpleNamespace

    from metachunk.chunking import ppl

    seen = []
    monkeypatch.setattr(scoring, "token_nll", lambda model, seqs, **kw: seen.append(kw) or [None] * len(seqs))
    monkeypatch.setattr(ppl, "sentence_ppl", lambda nll, spans: None)
    for device, batch_tokens in ((CUDA, None), (torch.device("cpu"), 8192)):
        model = SimpleNamespace(parameters=lambda device=device: iter([SimpleNamespace(device=device)]))
        for rows in (None, 64):
            ppl.score_tokenized(model, [([1, 2, 3], [(0, 3)])], 4096, batch_size=rows)
            assert seen[-1]["batch_tokens"] == batch_tokens
            assert seen[-1]["max_batch_size"] == (rows or (None if device == CUDA else ppl.CPU_ROWS))


def test_the_default_plan_on_cpu_is_the_old_one(tiny, monkeypatch):
    model, tok = tiny
    # three documents of each length: on CPU only windows of one length share a batch, so these
    # batches hold several rows and a different budget would batch them differently
    docs = ["Emma Woodhouse, handsome, clever, and rich. She had lived nearly twenty-one years. " * (k + 1)
            for k in range(12) for _ in range(3)]  # fmt: skip
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    plans = []
    planned = scoring.plan_batches
    monkeypatch.setattr(scoring, "plan_batches", lambda *a, **k: plans.append(planned(*a, **k)) or plans[-1])

    def scored(**budget):
        return token_nll(model, ids, streams=1, **budget), plans[-1]

    (new, new_plan), (old, old_plan) = scored(), scored(batch_tokens=8192, max_batch_size=16)
    assert new_plan == old_plan and max(map(len, old_plan)) == 3  # batches of several rows
    assert scored(batch_tokens=8192, max_batch_size=1)[1] != old_plan  # a different budget shows
    for a, b in zip(new, old):
        assert a.tobytes() == b.tobytes()
    sentences = [split_sentences(d, "en") for d in docs]
    new = score_documents(model, tok, docs, sentences)
    old = score_documents(model, tok, docs, sentences, batch_size=8)
    assert all(np.array_equal(a, b) for a, b in zip(new, old))


def test_documents_per_call(tiny_model_dir):
    def cfg(**kw):
        return ChunkConfig(method="ppl", model=str(tiny_model_dir), **kw)

    assert cfg(device="cpu").documents_per_call() == 32  # 4 x the 8 rows of a CPU batch
    assert cfg(device="cpu", batch_size=2).documents_per_call() == 16
    assert cfg(device="cuda").documents_per_call() == GPU_DOCUMENTS_PER_CALL


# ---- packed windows (padding-free rows, for flash-attention's varlen and flex attention) ---------


def test_a_packed_plan_puts_windows_end_to_end_in_order_under_the_budget():
    windows = [Window(i, 0, n, 1) for i, n in enumerate([900, 700, 700, 400, 300, 300, 120, 5])]
    batches = scoring.plan_packed(windows, 1024)
    assert [w for b in batches for w in b] == windows  # every window once, in the plan's order
    assert all(sum(w.end - w.start for w in b) <= 1024 for b in batches)
    assert [len(b) for b in batches] == [1, 1, 1, 3, 2]  # 900 | 700 | 700 | 400+300+300 | 120+5
    assert scoring.plan_packed([Window(0, 0, 4096, 1)], 1024) == [[Window(0, 0, 4096, 1)]]  # a long one alone


def test_packed_rows_score_as_padded_batches_do(tiny):
    """fp32: the windows of documents of every length, end to end in rows with positions restarting
    (attention kept inside each window by transformers' packed-sequence mask), give the NLL of the
    padded plan, every token scored once."""
    model, tok = tiny
    docs = ["Emma Woodhouse, handsome, clever, and rich. She had lived nearly twenty-one years. " * (k % 5 + 1)
            for k in range(14)]  # fmt: skip
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    kw = dict(max_context=64, batch_tokens=256, max_batch_size=8, streams=1)
    padded = token_nll(model, ids, pack=False, allow_padding=True, **kw)
    packed = token_nll(model, ids, pack=True, **kw)
    for a, b, seq in zip(padded, packed, ids):
        assert np.isnan(a[0]) and np.isnan(b[0]) and not np.isnan(b[1:]).any() and len(b) == len(seq)
        np.testing.assert_allclose(b[1:], a[1:], rtol=1e-5, atol=1e-5)


def test_packing_is_the_default_only_where_attention_reads_packed_rows(tiny, monkeypatch):
    import metachunk.models

    model, _ = tiny
    assert not scoring.packs_windows(model)  # the CPU attention: padded batches, as measured
    for name in (*scoring.PACKED_ATTENTION, "sdpa"):
        monkeypatch.setattr(metachunk.models, "attention_of", lambda m, name=name: name)
        assert scoring.packs_windows(model) == (name in scoring.PACKED_ATTENTION)


def test_flex_attention_reads_the_packed_rows_as_the_padded_plan(tiny_model_dir):
    """The GPU's packed path through a real packed-row attention: flex attention, whose block mask
    transformers builds from the position ids (compiled by torch on CPU here too)."""
    from metachunk.models import load_causal_lm

    padded_model, tok = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")
    flex_model, _ = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32",
                                   attn_implementation="flex_attention")  # fmt: skip
    assert scoring.packs_windows(flex_model) and not scoring.packs_windows(padded_model)
    docs = ["Emma Woodhouse, handsome, clever, and rich. She had lived nearly twenty-one years. " * k
            for k in (1, 2, 3, 4)]  # fmt: skip
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    kw = dict(max_context=64, batch_tokens=1024, max_batch_size=8, streams=1)
    padded = token_nll(padded_model, ids, allow_padding=True, **kw)
    packed = token_nll(flex_model, ids, **kw)
    for a, b in zip(padded, packed):
        np.testing.assert_allclose(b[1:], a[1:], rtol=1e-5, atol=1e-5)


def test_attention_is_picked_for_the_device(monkeypatch):
    import importlib.util

    from metachunk.engine import attention
    from metachunk.models import pick_attention

    assert pick_attention("auto", "cpu") == attention.NAME
    assert (
        pick_attention("sdpa", "cpu") == "sdpa"
        and pick_attention("flex_attention", "cuda") == "flex_attention"
    )
    real = importlib.util.find_spec
    for installed, expected in ((True, "flash_attention_2"), (False, None)):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, on=installed: object() if name == "flash_attn" and on else real(name))  # fmt: skip
        assert pick_attention("auto", "cuda") == expected


def test_a_gpu_reads_the_head_in_bigger_tiles_and_the_tile_changes_no_score(tiny):
    assert scoring.head_tile(torch.device("cpu")) == (scoring.DEFAULT_HEAD_ROWS, scoring.DEFAULT_VOCAB_BLOCK)
    assert scoring.head_tile(CUDA) == (scoring.GPU_HEAD_ROWS, scoring.GPU_VOCAB_BLOCK)
    model, _ = tiny
    torch.manual_seed(0)
    hidden = torch.randn(300, model.config.hidden_size)
    targets = torch.randint(0, model.config.vocab_size, (300,))
    with torch.inference_mode():  # as token_nll calls it
        small = scoring.sliced_nll(model, hidden, targets, head_rows=64, vocab_block=100)
        whole = scoring.sliced_nll(model, hidden, targets, head_rows=8192, vocab_block=32768)  # one tile
    torch.testing.assert_close(small, whole, rtol=1e-5, atol=1e-5)
