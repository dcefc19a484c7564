"""The CPU attention in query blocks (metachunk.engine.attention) computes what torch's SDPA computes, for
every mask transformers hands it: none (causal, or one query over a cache), sliding windows,
padding, and queries that continue a cache."""

import pytest
import torch
import torch.nn.functional as F

from metachunk.engine import attention


def reference(query, key, value, mask, causal):
    """torch's SDPA with the key/value heads repeated for grouped queries; (batch, q, heads, dim)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal).transpose(1, 2)


def blocked(query, key, value, mask):
    out, _ = attention.blocked_attention(torch.nn.Module().eval(), query, key, value, mask)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("q_len", [1, 5, attention.QUERY_BLOCK, 2 * attention.QUERY_BLOCK + 37])
def test_causal_without_a_mask(heads, kv_heads, q_len):
    torch.manual_seed(q_len)
    q = torch.randn(2, heads, q_len, 16)
    k, v = torch.randn(2, kv_heads, q_len, 16), torch.randn(2, kv_heads, q_len, 16)
    torch.testing.assert_close(blocked(q, k, v, None), reference(q, k, v, None, causal=q_len > 1))


def test_one_query_over_a_cache_sees_every_key():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16)
    torch.testing.assert_close(blocked(q, k, v, None), reference(q, k, v, None, causal=False))


@pytest.mark.parametrize("window", [None, 7, 100])
def test_boolean_masks_sliding_padding_and_a_cache(window):
    """Queries 40..339 of 340 keys (a continued cache), left padding on row 1, an optional
    sliding window: rows with nothing to attend to are left out (SDPA gives them NaN)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, k_len, q_len = 2, 4, 2, 340, 300
    q = torch.randn(batch, heads, q_len, 16)
    k, v = torch.randn(batch, kv_heads, k_len, 16), torch.randn(batch, kv_heads, k_len, 16)
    key_pos = torch.arange(k_len)[None, :]
    query_pos = torch.arange(k_len - q_len, k_len)[:, None]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    mask = mask[None, None].repeat(batch, 1, 1, 1)
    mask[1, ..., :25] = False  # padding
    got, want = blocked(q, k, v, mask), reference(q, k, v, mask, causal=False)
    seen = mask.any(-1)[:, 0]  # (batch, q_len)
    torch.testing.assert_close(got[seen], want[seen])


def test_scaling_and_softcap_are_applied():
    """Gemma's attention passes both: q k^T times ``scaling``, then ``softcap * tanh(s / softcap)``,
    before the causal mask and the softmax."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    scaling, softcap = 0.3, 5.0
    got, _ = attention.blocked_attention(
        torch.nn.Module().eval(), q, k, v, None, scaling=scaling, softcap=softcap
    )
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = softcap * torch.tanh(q @ kk.transpose(-1, -2) * scaling / softcap)
    scores = scores.masked_fill(~torch.ones(70, 70, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(got, (scores.softmax(-1) @ vv).transpose(1, 2))


@pytest.mark.parametrize("route", ["as_chosen", "all_blocked"])
def test_load_causal_lm_uses_it_on_cpu_and_matches_sdpa(tiny_model_dir, monkeypatch, route):
    """The tiny model's 16-wide heads go to SDPA as chosen; ``all_blocked`` sends every layer to
    `blocked_attention`, so the blocks run inside a real model too, padded generation included."""
    from transformers import AutoModelForCausalLM

    from metachunk.models import attention_of, load_causal_lm

    calls = []
    if route == "all_blocked":
        monkeypatch.setattr(attention, "SDPA_MAX_HEAD_DIM", 0)
        blocks = attention.blocked_attention
        monkeypatch.setattr(
            attention, "blocked_attention", lambda *a, **k: calls.append(1) or blocks(*a, **k)
        )
    model, tok = load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")
    assert attention_of(model) == attention.NAME
    sdpa = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = torch.as_tensor([tok("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, sdpa.eval()(input_ids=ids).logits)
        tok.padding_side = "left"
        batch = tok(
            ["a short one", "a much longer text that pads the other row"], padding=True, return_tensors="pt"
        )
        greedy = dict(max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(model.generate(**batch, **greedy), sdpa.generate(**batch, **greedy))
    assert bool(calls) == (route == "all_blocked")


@pytest.mark.parametrize("dim,window", [(16, None), (16, 50), (256, None)])
def test_cpu_attention_sends_wide_heads_and_short_windows_to_the_blocks(monkeypatch, dim, window):
    calls = []
    monkeypatch.setattr(
        attention, "blocked_attention", lambda *a, **k: calls.append(1) or (a[1].transpose(1, 2), None)
    )
    module = torch.nn.Module()
    module.sliding_window = window
    q, k, v = torch.randn(1, 4, 80, dim), torch.randn(1, 2, 80, dim), torch.randn(1, 2, 80, dim)
    module.num_key_value_groups = 2
    attention.cpu_attention(module, q, k, v, None, scaling=dim**-0.5)
    assert calls == ([1] if dim > attention.SDPA_MAX_HEAD_DIM or window else [])
