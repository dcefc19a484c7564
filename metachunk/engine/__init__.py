"""The scoring engine: what turns a causal LM into per-token numbers, fast, on CPU and GPU.

- `metachunk.engine.scoring`: per-token NLL over many documents (``token_nll``): length-sorted
  batch plans under a token budget (padded, or packed end to end where the attention reads packed
  rows), windows with a shared context for long documents, the LM head
  in tiles with an exact target logit, batches run side by side in streams; continuation NLL for
  margin sampling and re-ranking.
- `metachunk.engine.attention`: attention on CPU (SDPA where its kernel is fast, blocks of
  queries elsewhere), registered with transformers by `metachunk.models.load_causal_lm`.
- `metachunk.engine.kernels`: the bf16 head's log-sum-exp as a C kernel on CPU and a
  ``torch.compile``-d one on a GPU, built on first use, with torch's ops as the fallback.
- `metachunk.engine.generation`: batched generation (greedy or sampled), the one loop behind the
  chunk students, the MoC experts and eval's local answer generator (the MoC router, one forward
  pass, shares only its left-padded batches).

The chunkers (``metachunk.chunking``) and the evaluation (``metachunk.eval``) call it; it imports
neither, and loads no model itself (`metachunk.models` does).
"""
