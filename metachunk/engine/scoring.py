"""Per-token negative log-likelihood: the one scoring function every PPL-based method calls.

PPL chunking, Boundary Clarity / Chunk Stickiness, PPL re-ranking and the perplexity diagnostics
all need ``-log p(token_t | tokens_<t)`` for every token of long texts. Doing that fast and in
bounded memory comes down to three choices:

* **Windows, not one call per sentence.** A sequence that fits in ``max_context`` tokens is
  scored in one pass. A longer one is scored by recomputed windows (or, on request, in blocks
  against a trimmed KV cache, see `token_nll_kv_trim`): a sequence of ``n`` tokens is
  scored by forward passes
  over windows of at most ``max_context`` tokens. The first window scores its own tokens; every
  later window re-reads the previous ``max_context // 2`` tokens as context and scores the next
  ``max_context // 2``. So every token sees at least ``max_context / 2`` tokens of context (or all
  of them, near the start), positions restart at 0 in each window (valid for any position
  encoding), and peak memory depends on the window, never on the document length. Both are
  readings of the paper's "drop old KV pairs" rule: trimming never runs a token twice;
  recomputing keeps windows independent and batchable, and works for any cache layout.
* **Windows of many documents share a batch.** All windows of all sequences are sorted by length
  and packed into batches under a token budget, so short documents do not run one by one.
* **The LM head is applied in tiles.** Only the hidden states of positions that are scored are
  gathered, then the head and the log-sum-exp run on tiles of ``head_rows`` positions x 8,192
  vocabulary entries, each tile's log-sum-exp combined across the vocabulary at the end, and only
  the target's logit is taken. Full fp32 logits for thousands of positions (262K vocab x 8K positions = 8 GB) never exist.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from metachunk.engine.kernels import COMPILED_LSE_DEVICES, lse_rows_bf16, lse_rows_compiled


@dataclass(frozen=True, slots=True)
class Window:
    seq: int  # index of the sequence this window reads
    start: int  # first token of the window (context included)
    end: int  # one past the last token
    score_from: int  # first token whose NLL this window produces


def start_ids(tokenizer) -> list[int]:
    """The ids a tokenizer puts before any text: Gemma's ``<bos>``, nothing for Qwen2's or SmolLM2's. A model
    trained with them reads a text after them, and scores it far worse without (every one of Gemma's
    sentence scores is off), so each scored sequence starts with them."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def plan_windows(n_tokens: int, max_context: int, seq: int = 0) -> list[Window]:
    """Windows that together score tokens ``1..n_tokens-1`` exactly once."""
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if n_tokens < 2:
        return []
    windows = [Window(seq, 0, min(n_tokens, max_context), 1)]
    context = max_context // 2
    stride = max_context - context
    scored_to = windows[0].end
    while scored_to < n_tokens:
        end = min(n_tokens, scored_to + stride)
        windows.append(Window(seq, scored_to - context, end, scored_to))
        scored_to = end
    return windows


def _softcap(model, logits: torch.Tensor) -> torch.Tensor:
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma-style soft-capping is part of the model's distribution.
        logits = torch.tanh(logits / cap) * cap
    return logits


def lm_head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the model's LM head for some hidden states, soft-capped as the model does."""
    return _softcap(model, model.get_output_embeddings()(hidden).float())


def sliced_nll(
    model,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head_rows: int,
    low: torch.Tensor | None = None,
    vocab_block: int | None = None,
) -> torch.Tensor:
    """``logsumexp(logits) - logit[target]`` per row, over tiles of ``head_rows`` positions x
    ``vocab_block`` vocabulary entries: each tile's log-sum-exp, then theirs across the vocabulary.

    Why tiles: a slice of all positions times the whole vocabulary is either small in positions
    (then the matmul re-reads the whole head for every few rows: memory-bound) or big in memory
    (1,024 positions x 262K vocab = 1 GB of fp32). A tile of 1,024 x 8,192 is 32 MB, reads each
    head row once per 1,024 positions, and its exp and sum run while it is still in cache. The
    two tile buffers (the matmul's output and its fp32 copy, one tensor when the head is fp32) are
    allocated once and reused: on CPU a fresh tensor per operation costs its page faults every
    time. A tile's log-sum-exp is read off ``log_softmax`` run in place (``lse = x0 - log_softmax(x)_0``,
    exact to fp32 rounding): torch's CPU kernel takes the max, the sum of exps and the write in
    one fused pass each, where max, subtract, exp and sum as separate ops each read the tile again.

    With bf16 logits on CPU, each tile's log-sum-exp comes from a C kernel instead
    (`metachunk.engine.kernels.lse_rows_bf16`: the rows read once in bf16, reduced in fp32, several
    times faster than the copy and ``log_softmax`` on one thread), where it can be compiled; torch's ops otherwise. On a GPU, from ``logsumexp(x.float())`` compiled into
    one kernel (`metachunk.engine.kernels.lse_rows_compiled`), where ``torch.compile`` works there.

    The target logit is one fp32 dot product of the position's hidden state with its target's
    row of the head (the head's own weights, even when ``low`` is given). ``low`` is an optional
    low-precision copy of the head's weight (bf16 on a CPU with AMX, where the head matmul is ~4x
    faster): then only the normaliser comes from low-precision logits.
    """
    head = model.get_output_embeddings()
    weight = head.weight if low is None else low
    n, vocab = len(targets), weight.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    if n == 0:
        return out
    rows = min(head_rows, n)
    cols = min(vocab_block or head_tile(hidden.device)[1], vocab)
    cap = getattr(model.config, "final_logit_softcapping", None)
    # The kernel runs a tile on one thread, where torch's ops split it over all of them: the kernel
    # wins up to two threads (a stream's share by default), torch's split beyond (docs/performance.md).
    native = weight.dtype == torch.bfloat16 and hidden.device.type == "cpu" and not cap
    lse_rows = lse_rows_bf16() if native and torch.get_num_threads() <= 2 else None
    # On a GPU, bf16 tiles reduced by one compiled kernel; each tile is then a fresh tensor, the
    # one layout its graph is compiled for (the caching allocator makes that free).
    lse_compiled = lse_rows_compiled(str(hidden.device)) if head_compiles(model, weight.dtype) else None
    if not lse_compiled:
        logits_buf = torch.empty(rows, cols, dtype=weight.dtype, device=hidden.device)
        work_buf = (
            logits_buf
            if weight.dtype == torch.float32 or lse_rows
            else torch.empty_like(logits_buf, dtype=torch.float32)
        )
    starts = range(0, vocab, cols)
    for i in range(0, n, rows):
        h, t = hidden[i : i + rows], targets[i : i + rows]
        h_low = h.to(weight.dtype)
        tile_lse = torch.empty(len(h), len(starts), dtype=torch.float32, device=hidden.device)
        for k, j in enumerate(starts):
            block = weight[j : j + cols]
            if lse_compiled:
                logits = torch.matmul(h_low, block.T)
                if head.bias is not None:
                    logits.add_(head.bias[j : j + cols].to(weight.dtype))
                tile_lse[:, k] = lse_compiled(logits)
                continue
            logits, work = logits_buf[: len(h), : len(block)], work_buf[: len(h), : len(block)]
            torch.matmul(h_low, block.T, out=logits)
            if head.bias is not None:
                logits.add_(head.bias[j : j + cols].to(weight.dtype))
            if lse_rows:
                lse_rows(logits, tile_lse[:, k])
                continue
            if work is not logits:
                work.copy_(logits)
            if cap:  # Gemma-style soft-capping is part of the model's distribution (as in _softcap)
                work.div_(cap).tanh_().mul_(cap)
            first = work[:, 0].clone()
            # In place: the kernel reduces each row (max, sum of exps) before it writes that row.
            torch.log_softmax(work, dim=-1, out=work)
            tile_lse[:, k] = first - work[:, 0]
        total = torch.logsumexp(tile_lse, dim=-1)
        target_logit = (h.float() * head.weight[t].float()).sum(-1)
        if head.bias is not None:
            target_logit = target_logit + head.bias[t].float()
        out[i : i + len(h)] = total - _softcap(model, target_logit)
    return out


def head_compiles(model, head_dtype: torch.dtype) -> bool:
    """Whether `sliced_nll` reduces ``model``'s head tiles, computed in ``head_dtype``, with the
    compiled kernel (`metachunk.engine.kernels.lse_rows_compiled`): bf16 logits on a device in
    ``COMPILED_LSE_DEVICES``, and no soft-capping (which the kernel leaves out)."""
    device = model.get_output_embeddings().weight.device
    cap = getattr(model.config, "final_logit_softcapping", None)
    return head_dtype == torch.bfloat16 and device.type in COMPILED_LSE_DEVICES and not cap


def warm_up_head(model, head_dtype: torch.dtype | None = None) -> None:
    """Run the LM head (`sliced_nll`, in ``head_dtype`` as `token_nll` would) once on a whole tile
    of positions and once on a single row, so that what it compiles on first use (on a GPU,
    `metachunk.engine.kernels.lse_rows_compiled` and its one-row graph) is compiled while the model
    loads, not in its first batch. Nothing to do where no tile is compiled."""
    weight = model.get_output_embeddings().weight
    device, dtype = weight.device, head_dtype or weight.dtype
    if not head_compiles(model, dtype):
        return  # before any copy of the head: a CPU load must not pay for one
    low = weight.to(dtype) if dtype != weight.dtype else None
    rows = head_tile(device)[0]
    hidden = torch.zeros(rows + 1, weight.shape[1], dtype=weight.dtype, device=device)
    with torch.inference_mode():
        sliced_nll(model, hidden, torch.zeros(rows + 1, dtype=torch.long, device=device), rows, low)


# Head tiles (see sliced_nll): positions x vocabulary entries, 32 MB of fp32 logits per tile on
# CPU, where a tile should stay in cache. On a GPU a tile that small is a few microseconds of
# tensor-core work against the launches of its matmul, copy and reductions, so tiles there are
# 32x bigger (0.5 GB of bf16 logits, 1 GB in fp32): 1.5M scored tokens of a 152K vocabulary are
# ~1,800 tiles instead of ~27,000.
DEFAULT_HEAD_ROWS = 1024
DEFAULT_VOCAB_BLOCK = 8192
GPU_HEAD_ROWS = 8192
GPU_VOCAB_BLOCK = 32768


def head_tile(device: torch.device) -> tuple[int, int]:
    """``(head_rows, vocab_block)`` of the LM head's tiles on ``device`` when not told."""
    if device.type == "cuda":
        return GPU_HEAD_ROWS, GPU_VOCAB_BLOCK
    return DEFAULT_HEAD_ROWS, DEFAULT_VOCAB_BLOCK


# Tokens of the very start of a sequence that stay in a trimmed KV cache. LLMs park attention on
# the first tokens ("attention sinks", StreamingLLM); dropping them from the cache wrecks every
# later prediction (docs/chunking.md: three times the NLL error without them on SmolLM2).
ATTENTION_SINKS = 4


def supports_kv_trimming(model) -> bool:
    """KV trimming edits a plain DynamicCache; models with sliding-window or other cache layers
    (Gemma 3, Mistral, ...) are scored with recomputed windows instead."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=model.config)
    except Exception:
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@torch.inference_mode()
def token_nll_kv_trim(
    model, ids: Sequence[int], max_context: int, head_rows: int, low: torch.Tensor | None = None
) -> np.ndarray:
    """NLL of one long sequence, each token computed once, in bounded memory.

    Blocks of ``max_context // 2`` new tokens run against a KV cache that is trimmed after every
    block to the last ``max_context // 2`` tokens plus the first `ATTENTION_SINKS`. Keys
    keep the rotary positions they were computed at and new tokens get their true positions, so
    relative distances stay correct. Unlike recomputed windows, no token is run twice.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    decoder = model.get_decoder()
    keep = max_context // 2
    block = max_context - keep
    x = torch.as_tensor(list(ids), device=device)
    out = np.full(len(ids), np.nan, dtype=np.float32)
    cache, prev_last = DynamicCache(config=model.config), None
    for a in range(0, len(ids), block):
        b = min(len(ids), a + block)
        past = cache.get_seq_length()
        causal = (
            torch.arange(past + b - a, device=device)[None, :]
            <= (past + torch.arange(b - a, device=device))[:, None]
        )
        hidden = decoder(
            input_ids=x[None, a:b],
            attention_mask=causal[None, None],
            position_ids=torch.arange(a, b, device=device)[None],
            cache=cache,
            use_cache=True,
        ).last_hidden_state[0]
        if prev_last is None:  # token 0 has nothing to be predicted from
            states, first = hidden[:-1], a + 1
        else:  # the previous block's last state predicts this block's first token
            states, first = torch.cat([prev_last[None], hidden[:-1]]), a
        out[first:b] = sliced_nll(model, states, x[first:b], head_rows, low).cpu().numpy()
        prev_last = hidden[-1]
        for layer in cache.layers:
            if layer.keys.shape[-2] > ATTENTION_SINKS + keep:
                layer.keys = torch.cat(
                    [layer.keys[..., :ATTENTION_SINKS, :], layer.keys[..., -keep:, :]], dim=-2
                )
                layer.values = torch.cat(
                    [layer.values[..., :ATTENTION_SINKS, :], layer.values[..., -keep:, :]], dim=-2
                )
    return out


# What a forward batch may hold on CPU (the default plan), and a GPU's cap: past ~128K tokens a
# bigger batch keeps a large GPU no busier, and a plan of fewer, bigger batches leaves the last one
# ragged.
CPU_BATCH_TOKENS = 8192
CPU_BATCH_ROWS = 16
GPU_BATCH_TOKENS_MAX = 131_072
# The share of a GPU's free memory a batch's activations may take: the rest covers the allocator's
# fragmentation, the LM head's fp32 tiles, and what another process on the device allocates.
GPU_MEMORY_SHARE = 0.5


def activation_bytes_per_token(model) -> int:
    """Peak bytes one token's activations take in an inference forward pass, generously: a layer's
    residual stream, norms, projections and attention output (8 x hidden) and its MLP's gate, up and
    activation (3 x intermediate), in the weights' dtype; one layer at a time is alive (no cache,
    no autograd). SDPA's fused kernels keep no attention matrix."""
    c = model.config
    c = getattr(c, "text_config", None) or c
    width = next(model.parameters()).element_size()
    return width * (8 * c.hidden_size + 3 * c.intermediate_size)


def free_gpu_bytes(device: torch.device) -> int:
    """What this process may still allocate on ``device``: the driver's free memory plus the blocks
    torch's caching allocator holds but no tensor uses. The driver counts those as taken, so its
    figure alone drops after a first batch and a later plan would shrink with it (and change what
    bf16 scores)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def batch_budget(
    model, max_context: int, device: torch.device, free_bytes: int | None = None
) -> tuple[int, int]:
    """``(batch_tokens, max_batch_size)`` for `token_nll` on ``device``: on CPU, one window
    at least and 8,192 tokens in at most 16 rows, for a caller that names no row count (PPL chunking
    names 8: `metachunk.chunking.ppl.CPU_ROWS`); on
    a GPU, what ``GPU_MEMORY_SHARE`` of its free memory holds (``free_bytes``, default
    `free_gpu_bytes`), between one window and ``GPU_BATCH_TOKENS_MAX`` tokens, in rows of at
    least 128 tokens each."""
    if device.type != "cuda":
        return max(max_context, CPU_BATCH_TOKENS), CPU_BATCH_ROWS
    if free_bytes is None:
        free_bytes = free_gpu_bytes(device)
    fits = int(free_bytes * GPU_MEMORY_SHARE) // activation_bytes_per_token(model)
    tokens = max(max_context, min(GPU_BATCH_TOKENS_MAX, fits))
    return tokens, max(CPU_BATCH_ROWS, tokens // 128)


@torch.inference_mode()
def token_nll(
    model,
    sequences: Sequence[Sequence[int]],
    max_context: int = 4096,
    batch_tokens: int | None = None,
    max_batch_size: int | None = None,
    head_rows: int | None = None,
    head_dtype: torch.dtype | None = None,
    on_batch: Callable[[int], None] | None = None,
    allow_padding: bool | None = None,
    long_context: str = "sliding-window",
    streams: int | None = None,
    pack: bool | None = None,
) -> list[np.ndarray]:
    """NLL in nats of every token given all preceding tokens of its sequence (within the window).

    Returns one float32 array per sequence, of the sequence's length; entry 0 is NaN because the
    first token has nothing to be predicted from. ``batch_tokens`` caps padded tokens per forward
    pass, ``max_batch_size`` caps rows; either left out is `batch_budget`'s for the model's
    device (on a GPU, sized by its free memory). ``on_batch(n_scored_tokens)`` is called after each
    batch.

    ``allow_padding`` (default: only on CUDA) lets windows of different lengths share a batch. On
    CPU a padding mask pushes SDPA off its causal kernel onto the math path, which materialises
    every attention matrix and is slower than running the windows one by one, so there only
    windows of equal length are batched and no mask is passed.

    ``long_context`` picks how sequences longer than ``max_context`` are scored:
    ``sliding-window`` (default: recomputed windows, `plan_windows`, batched with the rest,
    any model) or ``kv-trim`` (`token_nll_kv_trim`: every token computed once, for models
    with a plain KV cache). Both give every token at least ``max_context // 2`` tokens of context.
    On CPU they ran at the same speed (docs/performance.md; the trimmed cache needs an explicit
    attention mask, which costs what the saved recomputation gains), so the default is the mode
    that works for every model.

    ``pack`` (default `packs_windows`: where the model's attention reads packed rows natively)
    puts a batch's windows end to end in one row, with positions restarting at 0 in each window and
    no padding (`plan_packed`); transformers then confines attention to each window (flash-attention's
    varlen kernel, or flex attention's block mask, from the position ids). Otherwise windows of
    similar length share a padded batch (`plan_batches`).

    ``head_dtype`` (default: the weights' dtype) runs the LM head's matmul in another dtype, e.g.
    ``torch.bfloat16`` for speed on CPUs with AMX; see `sliced_nll` for what stays exact.

    ``streams`` (default `default_streams`: on CPU up to 8 that split the torch threads evenly, one on a GPU)
    scores that many batches at a time, in threads that share the model and each take
    ``threads // streams`` torch threads. A document's result does not depend on the timing, and
    in the tests (fp32 and bf16, one thread a stream) not on the number of streams either; the
    BLAS does not promise the same bits at every thread count. ``on_batch`` is then called from
    those threads, one call at a time.
    """
    device = next(model.parameters()).device
    if batch_tokens is None or max_batch_size is None:
        budget_tokens, budget_rows = batch_budget(model, max_context, device)
        batch_tokens = batch_tokens or budget_tokens
        max_batch_size = max_batch_size or budget_rows
    if allow_padding is None:
        allow_padding = device.type == "cuda"
    head_rows = head_rows or head_tile(device)[0]
    weight = model.get_output_embeddings().weight
    low = weight.to(head_dtype) if head_dtype not in (None, weight.dtype) else None  # converted once per call
    results = [np.full(len(s), np.nan, dtype=np.float32) for s in sequences]
    if long_context not in ("kv-trim", "sliding-window"):
        raise ValueError(f"long_context must be kv-trim or sliding-window, not {long_context!r}")
    trim = long_context == "kv-trim"
    if trim and not supports_kv_trimming(model):
        raise ValueError(
            f"{type(model).__name__} has non-standard cache layers; use long_context='sliding-window'"
        )
    long_ones = {i for i, s in enumerate(sequences) if trim and len(s) > max_context}
    for i in sorted(long_ones):
        results[i] = token_nll_kv_trim(model, sequences[i], max_context, head_rows, low)
        if on_batch:
            on_batch(len(sequences[i]) - 1)
    windows = [
        w for i, s in enumerate(sequences) if i not in long_ones for w in plan_windows(len(s), max_context, i)
    ]
    windows.sort(key=lambda w: w.end - w.start, reverse=True)
    if pack is None:
        pack = packs_windows(model)
    if pack:
        batches = plan_packed(windows, batch_tokens)
    else:
        batches = plan_batches(windows, batch_tokens, max_batch_size, allow_padding)
    streams = min(streams or default_streams(device), max(1, len(batches)))
    if streams == 1:
        _score_batches(
            model, sequences, batches, _HeadQueue(model, head_rows, low, results), on_batch, pack=pack
        )
        return results

    # Streams: each scores its own batches, with its own head queue and an equal share of the
    # threads (torch keeps one process-wide count, which a new thread re-applies on its first
    # parallel op: unequal shares would race). Which stream takes which batch is fixed by the plan,
    # never by timing, so the same count reruns byte-identically. The weights are shared; torch ops
    # release the GIL.
    lanes = assign_batches(batches, streams)
    threads = torch.get_num_threads()
    share = max(1, threads // streams)
    lock, stop = threading.Lock(), threading.Event()

    def progress(n: int) -> None:
        with lock:
            on_batch(n)

    def stream(k: int) -> None:
        if device.type == "cpu":  # on a GPU the host's threads do little, and Dynamo guards on their count
            torch.set_num_threads(share)
        with torch.inference_mode():
            head = _HeadQueue(model, head_rows, low, results)
            _score_batches(model, sequences, lanes[k], head, progress if on_batch else None, stop, pack)

    pool = ThreadPoolExecutor(streams, thread_name_prefix="token_nll")
    futures = []
    try:
        futures = [pool.submit(stream, k) for k in range(streams)]
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:  # after a failure, or a signal in this thread (SIGTERM, Ctrl-C), the other streams
        stop.set()  # end after their current batch
        pool.shutdown(wait=True)
        torch.set_num_threads(threads)
    for future in futures:
        future.result()  # a stream's failure is raised here
    return results


def default_streams(device: torch.device) -> int:
    """Streams `token_nll` runs when not told: on CPU the most streams, up to ``MAX_AUTO_STREAMS``,
    that split the torch threads evenly (2 threads: 2 of 1; 12: 6 of 2; 7: 7 of 1), and one on a GPU. On CPU one
    forward pass over a ~500-token window does not keep two threads busy (RMSNorm, rotary, GELU,
    casts and the attention's small matmuls split poorly), where two windows side by side, one
    thread each, do (Gemma-3-270m in bf16 on CRUD articles: docs/performance.md)."""
    if device.type != "cpu":
        return 1
    threads = torch.get_num_threads()
    # the most streams that split the threads evenly (12 threads: 6 streams of 2)
    return max(n for n in range(1, min(threads, MAX_AUTO_STREAMS) + 1) if threads % n == 0)


# Each stream holds its own activations and head tiles (~0.3 GB for Gemma-3-270m in bf16), so
# the automatic count stops here; on a bigger CPU each stream then gets several threads.
MAX_AUTO_STREAMS = 8


def plan_batches(
    windows: Sequence[Window], batch_tokens: int, max_batch_size: int, allow_padding: bool
) -> list[list[Window]]:
    """Windows (longest first) packed into forward batches: at most ``max_batch_size`` rows and
    ``batch_tokens`` padded tokens, and only windows of one length unless ``allow_padding``."""
    batches, i = [], 0
    while i < len(windows):
        longest = windows[i].end - windows[i].start
        rows = max(1, min(max_batch_size, batch_tokens // longest))
        batch = list(windows[i : i + rows])
        if not allow_padding:
            batch = [w for w in batch if w.end - w.start == longest]
        batches.append(batch)
        i += len(batch)
    return batches


# Attention implementations that read packed rows natively: from the position ids, transformers
# gives flash-attention its varlen offsets and flex attention a block mask (masking_utils'
# find_packed_sequence_indices), so no FLOP is spent on padding or across windows. SDPA would get a
# dense block-diagonal mask instead (rows x rows per batch), so it keeps padded batches.
PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


def packs_windows(model) -> bool:
    """Whether `token_nll` packs windows for ``model`` by default: where its attention is one of
    ``PACKED_ATTENTION``."""
    from metachunk.models import attention_of

    return attention_of(model) in PACKED_ATTENTION


def plan_packed(windows: Sequence[Window], batch_tokens: int) -> list[list[Window]]:
    """Windows (longest first) put end to end in rows of at most ``batch_tokens`` tokens, one row
    a batch, in the plan's order: no padding, and the same windows in the same order as a padded
    plan would score them."""
    batches, row, used = [], [], 0
    for w in windows:
        n = w.end - w.start
        if row and used + n > batch_tokens:
            batches.append(row)
            row, used = [], 0
        row.append(w)
        used += n
    if row:
        batches.append(row)
    return batches


def assign_batches(batches: Sequence[list[Window]], streams: int) -> list[list[list[Window]]]:
    """Batches dealt to ``streams`` lanes, each to the lane with the least work so far (padded
    tokens; ties to the lower lane), keeping the plan's order within a lane. Depends only on the
    plan, so the same documents always land in the same lane."""
    lanes: list[list[list[Window]]] = [[] for _ in range(streams)]
    work = [0] * streams
    for batch in batches:
        k = min(range(streams), key=lambda j: (work[j], j))
        lanes[k].append(batch)
        work[k] += len(batch) * max(w.end - w.start for w in batch)
    return lanes


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without holding the host until the kernels already
    queued there have run: on a GPU through pinned memory with ``non_blocking``. A plain ``.to()``
    waits for them, and so may a copy from pageable memory even when asked not to (CUDA's "API
    synchronization behavior": https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html).
    torch's caching host allocator keeps the pinned copy until the transfer has run
    (https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _score_batches(
    model,
    sequences: Sequence[Sequence[int]],
    batches: Sequence[list[Window]],
    head: _HeadQueue,
    on_batch: Callable[[int], None] | None,
    stop: threading.Event | None = None,
    pack: bool = False,
) -> None:
    """One stream's forward passes, each batch's scored positions queued for the LM head. A batch
    is padded rows, one window each, or with ``pack`` one row of its windows end to end."""
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    for n, batch in enumerate(batches):
        if stop is not None and stop.is_set():
            return
        # Each window's row and its first column in the batch's input.
        if pack:
            lengths = [w.end - w.start for w in batch]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
            places = [(0, a) for a in starts]
            ids = torch.as_tensor([t for w in batch for t in sequences[w.seq][w.start : w.end]])[None]
            positions = torch.cat([torch.arange(k) for k in lengths])[None]
            inputs = {"position_ids": to_device(positions, device)}
        else:
            longest = max(w.end - w.start for w in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for r, w in enumerate(batch):
                ids[r, : w.end - w.start] = torch.as_tensor(sequences[w.seq][w.start : w.end])
                mask[r, : w.end - w.start] = 1
            places = [(r, 0) for r in range(len(batch))]
            inputs = {"attention_mask": to_device(mask, device)} if bool((mask == 0).any()) else {}
        # Built and sent while the device still runs the last batch (to_device; _HeadQueue for the
        # way back).
        hidden = decoder(input_ids=to_device(ids, device), use_cache=False, **inputs).last_hidden_state

        # Position p is predicted by the hidden state at p - 1 (window-relative).
        rows_idx, cols_idx, targets = [], [], []
        for (r, a), w in zip(places, batch):
            cols = torch.arange(a + w.score_from - w.start - 1, a + w.end - w.start - 1)
            rows_idx.append(torch.full_like(cols, r))
            cols_idx.append(cols)
            targets.append(ids[r, cols + 1])
        rows_t = to_device(torch.cat(rows_idx), device)
        cols_t = to_device(torch.cat(cols_idx), device)
        head.add(hidden[rows_t, cols_t], to_device(torch.cat(targets), device), batch)
        scored = head.run(whole_tiles_only=n + 1 < len(batches))
        if on_batch and scored:
            on_batch(scored)
    head.land()


class _HeadQueue:
    """Scored positions waiting for the LM head, which runs on whole tiles of ``head_rows``
    positions whatever the forward batches were: the head's matmul is most of the FLOPs, and on
    CPU it runs slower on a few hundred rows than on a thousand, and a few hundred is what one
    short document's window gives. Holds at most one
    tile's hidden states beyond the batch just added.

    **Scores land one run late.** A run's scores are copied back without waiting for the device
    (on a GPU, ``non_blocking`` into pinned memory, with an event), and are written into
    ``results`` at the next run, or at `land`: reading them at once would hold the host until the
    device has finished the batch, and leave the device idle while the host builds the next one
    (the Python that plans and packs a batch). On CPU the copy is the tensor itself;
    the order is the same, so the tests exercise it. PyTorch's guide to ``non_blocking``: a copy to
    the host must be synchronized before it is read
    (https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html)."""

    def __init__(self, model, head_rows: int, low: torch.Tensor | None, results: list[np.ndarray]):
        self.model, self.head_rows, self.low, self.results = model, head_rows, low, results
        self.hidden: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.spans: list[tuple[int, int, int]] = []  # (sequence, first position, positions), in row order
        self.rows = 0
        # The last run's scores on their way to the host: (tensor, event or None, their spans).
        self.landing: tuple[torch.Tensor, torch.cuda.Event | None, list[tuple[int, int, int]]] | None = None

    def add(self, hidden: torch.Tensor, targets: torch.Tensor, windows: Sequence[Window]) -> None:
        self.hidden.append(hidden)
        self.targets.append(targets)
        self.spans.extend((w.seq, w.score_from, w.end - w.score_from) for w in windows)
        self.rows += len(targets)

    def run(self, whole_tiles_only: bool) -> int:
        """Score the queued positions (only whole tiles of them if ``whole_tiles_only``); returns
        how many were scored. The scores reach ``results`` at the next run or at `land`."""
        take = self.rows - self.rows % self.head_rows if whole_tiles_only else self.rows
        if take == 0:
            return 0
        hidden, targets = torch.cat(self.hidden), torch.cat(self.targets)
        nll = sliced_nll(self.model, hidden[:take], targets[:take], self.head_rows, self.low)
        ready = None
        if nll.device.type == "cuda":
            stream = torch.cuda.current_stream(nll.device)  # the copy's, whichever GPU is current
            nll = nll.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        elif nll.device.type != "cpu":  # another accelerator: copied at once
            nll = nll.cpu()
        self.land()  # the previous run's, which the device finished before this run's work
        offset, taken, left = 0, [], []
        for seq, first, n in self.spans:
            now = max(0, min(n, take - offset))
            if now:
                taken.append((seq, first, now))
            if now < n:
                left.append((seq, first + now, n - now))
            offset += now
        self.landing = (nll, ready, taken)
        self.hidden, self.targets = [hidden[take:].clone()], [targets[take:].clone()]
        self.spans, self.rows = left, self.rows - take
        return take

    def land(self) -> None:
        """Write the last run's scores into ``results`` (waiting for the device if it has not
        finished them)."""
        if self.landing is None:
            return
        nll, ready, spans = self.landing
        if ready is not None:
            ready.synchronize()
        values, offset = nll.numpy(), 0
        for seq, first, n in spans:
            self.results[seq][first : first + n] = values[offset : offset + n]
            offset += n
        self.landing = None


@torch.inference_mode()
def token_nll_incremental(model, pieces: Sequence[Sequence[int]]) -> np.ndarray:
    """Reference implementation: one forward pass per piece over the KV cache of all earlier pieces.

    This is the literal reading of the paper's Eq. 1 (each sentence scored given all preceding
    text). It is slow and its memory grows with the document; it exists to check `token_nll`
    against and as the baseline in ``bench/ppl_speed.py``.
    """
    device = next(model.parameters()).device
    if sum(len(p) for p in pieces) == 0:
        return np.zeros(0, dtype=np.float32)
    out: list[float] = [float("nan")]
    past, last_logits = None, None
    for piece in pieces:
        if not piece:
            continue
        ids = torch.as_tensor([list(piece)], device=device)
        res = model(input_ids=ids, cache=past, use_cache=True)
        past = res.cache
        logits = res.logits[0].float()
        if last_logits is not None:
            logits = torch.cat([last_logits[None], logits])
            targets = ids[0]
        else:
            targets = ids[0, 1:]
        logp = torch.log_softmax(logits[: len(targets)], dim=-1)
        out.extend((-logp.gather(1, targets[:, None]).squeeze(1)).tolist())
        last_logits = logits[-1]
    return np.asarray(out, dtype=np.float32)


@torch.inference_mode()
def continuation_nll(
    model,
    prefix: Sequence[int],
    continuations: Sequence[Sequence[int]],
    batch_tokens: int = 4096,
    max_batch_size: int = 16,
    head_rows: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """NLL in nats of every token of each continuation, read after one shared ``prefix``.

    Many texts scored after the same context (Chunk Stickiness: every chunk ``q`` after one chunk
    ``d``) run the prefix once; its KV cache is copied into every batch of continuations, so only
    continuation tokens are computed. Continuations are sorted by length and right-padded: a real
    token never attends to padding behind it, so no attention mask is needed and every real
    position sees exactly ``prefix + its own earlier tokens``, as in one forward pass over the
    concatenation. Entry ``t`` of each returned float32 array is the NLL of continuation token
    ``t`` (entry 0 is predicted from the prefix's last position). ``batch_tokens`` caps padded
    continuation tokens per forward pass and ``max_batch_size`` its rows; ``on_batch`` is called
    with the number of tokens scored after each batch. The caller keeps ``prefix + continuation``
    within the model's context.
    """
    import copy

    if not prefix:
        raise ValueError("continuation_nll needs a non-empty prefix (its last position predicts token 0)")
    device = next(model.parameters()).device
    head_rows = head_rows or head_tile(device)[0]
    decoder = model.get_decoder()
    results = [np.zeros(len(c), dtype=np.float32) for c in continuations]
    order = sorted((i for i, c in enumerate(continuations) if len(c)), key=lambda i: -len(continuations[i]))
    if not order:
        return results
    head = decoder(input_ids=torch.as_tensor([list(prefix)], device=device), use_cache=True)
    prefix_cache, prefix_last = head.cache, head.last_hidden_state[0, -1]
    i = 0
    while i < len(order):
        longest = len(continuations[order[i]])
        batch = order[i : i + max(1, min(max_batch_size, batch_tokens // longest))]
        i += len(batch)
        lengths = torch.as_tensor([len(continuations[k]) for k in batch])
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for r, k in enumerate(batch):
            ids[r, : lengths[r]] = torch.as_tensor(list(continuations[k]))
        cache = copy.deepcopy(prefix_cache)
        if len(batch) > 1:
            cache.batch_repeat_interleave(len(batch))
        ids = ids.to(device)
        hidden = decoder(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
        # the state predicting token t: the prefix's last one for t = 0, else the row's own t - 1
        states = torch.cat([prefix_last.expand(len(batch), 1, -1), hidden[:, :-1]], dim=1)
        real = (torch.arange(longest)[None, :] < lengths[:, None]).to(device)
        nll = sliced_nll(model, states[real], ids[real], head_rows).cpu().numpy()
        offset = 0
        for r, k in enumerate(batch):
            n = int(lengths[r])
            results[k] = nll[offset : offset + n]
            offset += n
        if on_batch:
            on_batch(offset)
    return results
