"""The kernels of metachunk/engine/kernels: built on first use (the C one for CPUs; the compiled one
for GPUs, run here on torch.compile's CPU backend), equal to torch's ops, and torch's ops wherever
they cannot be built."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from metachunk.engine import kernels
from metachunk.models import cpu_flags

needs_avx512 = pytest.mark.skipif(
    "avx512f" not in cpu_flags() or shutil.which(os.environ.get("CC") or "cc") is None,
    reason="the kernel is AVX-512F code, built by a C compiler",
)


@pytest.fixture
def fresh(monkeypatch, tmp_path: Path):
    """A cache of its own and no kernel loaded yet in this process."""
    monkeypatch.setenv("METACHUNK_CACHE", str(tmp_path))
    kernels.lse_rows_bf16.cache_clear()
    yield tmp_path
    kernels.lse_rows_bf16.cache_clear()


@needs_avx512
def test_lse_rows_bf16_equals_torch(fresh):
    lse = kernels.lse_rows_bf16()
    assert lse is not None, kernels.status()
    assert kernels.status()["lse_rows_bf16"].startswith("compiled")
    assert len(list((fresh / "kernels").glob("lse_rows_bf16-*.so"))) == 1
    g = torch.Generator().manual_seed(0)
    for rows, cols, scale in [
        (5, 8192, 1.0),
        (3, 8192 + 13, 8.0),
        (7, 31, 30.0),
        (1, 1, 1.0),
        (4, 4480, 0.01),
    ]:
        x = (torch.randn(rows, cols, generator=g) * scale).bfloat16()
        out = torch.full((rows,), float("nan"))
        lse(x, out)
        np.testing.assert_allclose(out, torch.logsumexp(x.float(), -1), rtol=1e-6, atol=1e-5)
    # a tile's view (rows longer than its columns) into a column of a wider matrix, as the head uses them
    big = (torch.randn(6, 100, generator=g) * 5).bfloat16()
    table = torch.zeros(6, 3)
    lse(big[:, :40], table[:, 1])
    np.testing.assert_allclose(table[:, 1], torch.logsumexp(big[:, :40].float(), -1), rtol=1e-6, atol=1e-5)
    assert not table[:, [0, 2]].any()
    # rows of -inf (a masked vocabulary) and one far-off entry
    x = torch.full((2, 64), float("-inf")).bfloat16()
    x[1, 5] = -300.0
    out = torch.empty(2)
    lse(x, out)
    assert out[0] == float("-inf") and out[1] == pytest.approx(-300.0)
    # a NaN anywhere makes the row's log-sum-exp NaN, as in torch (in the vector body and the tail)
    x = torch.zeros(3, 40).bfloat16()
    x[0, 3], x[1, 37] = float("nan"), float("nan")
    out = torch.empty(3)
    lse(x, out)
    assert out[:2].isnan().all() and out[2] == pytest.approx(float(np.log(40)))
    for bad_x, bad_out in [(big.T, torch.empty(100)), (big.float(), torch.empty(6)),
                           (big, torch.empty(6, dtype=torch.bfloat16)), (big, torch.empty(5))]:  # fmt: skip
        with pytest.raises(ValueError, match="row-contiguous 2-D bfloat16 CPU tile"):
            lse(bad_x, bad_out)


@needs_avx512
def test_a_second_load_reuses_the_built_library(fresh):
    assert kernels.lse_rows_bf16() is not None
    (built,) = (fresh / "kernels").glob("*.so")
    stamp = built.stat().st_mtime_ns
    kernels.lse_rows_bf16.cache_clear()
    assert kernels.lse_rows_bf16() is not None
    assert built.stat().st_mtime_ns == stamp and len(list((fresh / "kernels").iterdir())) == 1


@pytest.mark.parametrize(
    "setup, why",
    [
        ({"env": {"METACHUNK_KERNELS": "0"}}, "off (METACHUNK_KERNELS=0)"),
        ({"env": {"CC": "no-such-compiler-here"}}, "no C compiler"),
        ({"flags": {"fpu", "avx2"}}, "no AVX-512F"),
        ({"env": {"CC": "false"}}, "false failed"),
        ({"cache_is_a_file": True}, "building or loading the kernel failed"),
    ],
)
def test_without_a_kernel_the_reason_is_kept(fresh, monkeypatch, setup, why):
    for k, v in setup.get("env", {}).items():
        monkeypatch.setenv(k, v)
    if setup.get("cache_is_a_file"):  # a cache that cannot be written: scoring goes on without the kernel
        (fresh / "file").write_text("")
        monkeypatch.setenv("METACHUNK_CACHE", str(fresh / "file"))
        if shutil.which("cc") is None:
            pytest.skip("needs a C compiler to get as far as the cache")
    flags = setup.get("flags", cpu_flags() | {"avx512f"})
    monkeypatch.setattr("metachunk.models.cpu_flags", lambda cpuinfo=None: flags)
    assert kernels.lse_rows_bf16() is None
    assert why in kernels.status()["lse_rows_bf16"]
    assert not list((fresh / "kernels").glob("*.so")) if (fresh / "kernels").exists() else True


@needs_avx512
def test_bf16_scoring_with_and_without_the_kernel(fresh, tiny_model_dir: Path, monkeypatch):
    from metachunk.engine.scoring import token_nll
    from metachunk.models import load_causal_lm

    model, tok = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    texts = ["Emma Woodhouse, handsome, clever, and rich.", "She was the youngest of the two daughters."]
    sequences = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    lse, calls = kernels.lse_rows_bf16(), []
    assert lse is not None, kernels.status()
    monkeypatch.setattr(
        "metachunk.engine.scoring.lse_rows_bf16", lambda: lambda x, out: (calls.append(len(x)), lse(x, out))
    )
    with_kernel = token_nll(model, sequences, max_context=64, head_rows=4)
    assert sum(calls) == sum(len(s) - 1 for s in sequences) * -(-model.config.vocab_size // 8192)
    monkeypatch.setattr("metachunk.engine.scoring.lse_rows_bf16", lambda: None)
    with_torch = token_nll(model, sequences, max_context=64, head_rows=4)
    for a, b in zip(with_kernel, with_torch):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The GPU's compiled head reduction, on this CPU: torch.compile's CPU backend instead of its
    Triton one (the graph, its guards and the engine's calls are the same)."""
    from metachunk.engine import scoring

    monkeypatch.setattr(kernels, "COMPILED_LSE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(scoring, "COMPILED_LSE_DEVICES", ("cuda", "cpu"))
    kernels.lse_rows_compiled.cache_clear()
    yield
    kernels.lse_rows_compiled.cache_clear()


def test_the_compiled_head_reduction_is_compiled_while_loading_and_scores_as_torch(
    compiled_on_cpu, tiny_model_dir: Path, monkeypatch
):
    """`warm_up_head` compiles the reduction (both graphs) before any batch; bf16 scoring through it
    equals torch's ops within fp32 rounding, across whole and partial tiles of rows and vocabulary."""
    from metachunk.engine import scoring
    from metachunk.models import load_causal_lm

    model, tok = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    built = []
    real = kernels.lse_rows_compiled.__wrapped__
    monkeypatch.setattr(scoring, "lse_rows_compiled", functools.cache(lambda d: built.append(d) or real(d)))
    scoring.warm_up_head(model)
    assert built == ["cpu"] and kernels.status()["lse_rows_compiled (cpu)"] == "compiled (torch.compile)"
    fused = scoring.lse_rows_compiled("cpu")
    shapes = []
    monkeypatch.setattr(
        scoring, "lse_rows_compiled", lambda d: lambda x: shapes.append(tuple(x.shape)) or fused(x)
    )
    texts = ["Emma Woodhouse, handsome, clever, and rich.", "She was the youngest of the two daughters."]
    sequences = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # vocab_block 1000 of the tiny model's 1,536: a whole block and a partial one; head_rows 4: partial rows too
    monkeypatch.setattr(scoring, "head_tile", lambda device: (4, 1000))
    with_compiled = scoring.token_nll(model, sequences, max_context=64, head_rows=4)
    assert {c for _, c in shapes} == {1000, 536} and any(r < 4 for r, _ in shapes)
    monkeypatch.setattr(scoring, "COMPILED_LSE_DEVICES", ("cuda",))
    with_torch = scoring.token_nll(model, sequences, max_context=64, head_rows=4)
    for a, b in zip(with_compiled, with_torch):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_compiler_that_fails_leaves_torchs_ops_and_says_why(
    compiled_on_cpu, tiny_model_dir: Path, monkeypatch
):
    from metachunk.engine.scoring import token_nll
    from metachunk.models import load_causal_lm

    def no_triton(*args, **kwargs):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(torch, "compile", no_triton)
    assert kernels.lse_rows_compiled("cpu") is None
    assert kernels.status()["lse_rows_compiled (cpu)"].startswith(
        "torch.compile failed: RuntimeError: Cannot find"
    )
    model, tok = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    sequences = [tok("Emma was clever. She was rich.", add_special_tokens=False)["input_ids"]]
    assert np.isfinite(token_nll(model, sequences, max_context=64)[0][1:]).all()
    kernels.lse_rows_compiled.cache_clear()
    monkeypatch.setenv("METACHUNK_KERNELS", "0")
    assert kernels.lse_rows_compiled("cpu") is None
    assert kernels.status()["lse_rows_compiled (cpu)"] == "off (METACHUNK_KERNELS=0)"
