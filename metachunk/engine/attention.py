"""Attention on CPU: torch's SDPA kernel where it is fast, causal attention in blocks of queries
where it is not. What ``load_causal_lm`` uses on a CPU.

In a CPU profile (Gemma-3-270m, bf16, CRUD articles; docs/performance.md), torch's SDPA CPU
kernel took a quarter of the decoder's time for 8% of its FLOPs: with Gemma's 256-wide heads it
is slow at every length, and it computes a sliding-window layer's whole causal triangle. With
SmolLM2's 64-wide heads and no windows it is the fastest there is (faster than eager and than
the blocks below at 300 to 4,096 tokens). So `cpu_attention` sends a layer to
`blocked_attention` when its heads are wider than `SDPA_MAX_HEAD_DIM` or its sliding
window is shorter than the keys, and to SDPA otherwise.

`blocked_attention` is eager's arithmetic (bf16 or fp32 matmuls, a float32 softmax) over
blocks of `QUERY_BLOCK` queries, each against only the keys its mask lets it see: the causal
triangle's upper half and everything outside a sliding window are never computed, grouped-query
heads read their shared key/value head without copies, and memory is one block's scores, never
the whole matrix.

Both get the boolean masks that ``sdpa`` gets: `NAME` is registered through transformers'
``AttentionInterface`` (https://huggingface.co/docs/transformers/attention_interface) with the
``sdpa`` mask builder, so padding, sliding windows and KV caches are transformers' own.
"""

from __future__ import annotations

import torch

NAME = "metachunk_cpu"

# The widest heads SDPA's CPU kernel gets (64: SmolLM2, 128: Llama and Qwen; Gemma's 256 go to
# the blocks).
SDPA_MAX_HEAD_DIM = 128

# Queries per block: small enough that a block's float32 scores stay in cache, large enough that
# each block's two matmuls run at the GEMM rate (128 and 256 were within noise on the bench).
QUERY_BLOCK = 128


def blocked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``softmax(q k^T * scaling) v`` per head, as transformers' attention functions are called:
    ``query`` (batch, heads, q_len, dim), ``key``/``value`` (batch, kv_heads, k_len, dim), and a
    boolean ``attention_mask`` (batch or 1, 1, q_len, k_len; True = may attend) or None. None means
    what it means to ``sdpa`` there: one query sees every key, several are causal from key 0 (torch's
    ``is_causal``). Returns (batch, q_len, heads, dim)."""
    if dropout and module.training:
        raise ValueError(f"{NAME} attention is for inference; train with sdpa or eager")
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    out = torch.empty(batch, q_len, heads, value.shape[-1], dtype=value.dtype, device=query.device)
    grouped = query.view(batch, kv_heads, group, q_len, dim)
    # Keys transposed once per call, not once per block: the blocks' matmuls then read a
    # contiguous right-hand side (15% of this function's time at 450 keys, 256-wide heads).
    keys_t = key.transpose(-1, -2).contiguous()
    # Without a mask, queries start..end-1 see keys 0..end-1: keys before start are before every
    # query of the block, so only the n x n diagonal square needs the triangle (masking whole
    # blocks cost a tenth of this function's time).
    causal = attention_mask is None and q_len > 1
    if causal:
        future = torch.ones(QUERY_BLOCK, QUERY_BLOCK, dtype=torch.bool, device=query.device).triu_(1)
    for start in range(0, q_len, QUERY_BLOCK):
        end = min(q_len, start + QUERY_BLOCK)
        n = end - start
        if attention_mask is None:
            lo, hi = 0, (min(end, k_len) if causal else k_len)
        else:
            block_mask = attention_mask[..., start:end, :]
            seen = block_mask.reshape(-1, k_len).any(0).nonzero()
            lo, hi = (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, 1)
        q = grouped[:, :, :, start:end].reshape(batch, kv_heads, group * n, dim)
        scores = torch.matmul(q, keys_t[..., lo:hi]).float().mul_(scaling)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        by_query = scores.view(batch, kv_heads, group, n, hi - lo)
        if causal and hi > start:  # keys start..hi-1 are the diagonal square (hi = end unless keys run out)
            by_query[..., start:hi].masked_fill_(future[:n, : hi - start], torch.finfo(scores.dtype).min)
        elif attention_mask is not None:
            allowed = block_mask[..., lo:hi].unsqueeze(2)  # (b, 1, 1, n, keys): shared by the group
            by_query.masked_fill_(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        block_out = torch.matmul(probs, value[:, :, lo:hi])  # (b, kv_heads, group * n, dim)
        out[:, start:end] = block_out.view(batch, kv_heads, group, n, -1).permute(0, 3, 1, 2, 4).flatten(2, 3)
    return out, None


def cpu_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`blocked_attention` for wide heads or a window shorter than the keys, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = getattr(module, "sliding_window", None)
    if query.shape[-1] > SDPA_MAX_HEAD_DIM or (window and key.shape[2] > window):
        return blocked_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Make `NAME` a valid ``attn_implementation`` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cpu_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
