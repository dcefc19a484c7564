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


def test_the_default_plan_on_cpu_is_the_old_one(tiny):
    model, tok = tiny
    docs = ["Emma Woodhouse, handsome, clever, and rich. She had lived nearly twenty-one years. " * (k + 1)
            for k in range(12)]  # fmt: skip
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    for new, old in zip(token_nll(model, ids), token_nll(model, ids, batch_tokens=8192, max_batch_size=16)):
        assert new.tobytes() == old.tobytes()
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
