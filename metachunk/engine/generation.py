"""Batched generation with a local causal LM: the one loop behind the chunk students
(`metachunk.chunking.students.Student`), the MoC experts (`metachunk.chunking.moc`; the router uses only
`padded_batches`) and eval's
local answer generator (`metachunk.eval.generate.LocalGenerator`).

It lives in the engine, beside scoring, because both ``chunking/`` and ``eval/`` run it and neither
may import the other's rooms for it.

Prompts are token ids (the caller applies its chat template). They are batched longest first, so
memory trouble shows in the first batch and rows of similar length share a batch (little
padding), and padded on the left, so every row's new tokens start at the same position. A row's
answer is its new tokens up to the first stop token, each row cut to its own budget when budgets
are given: with greedy decoding an answer does not depend on its batch neighbours.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


def prepare_tokenizer(tokenizer) -> None:
    """Left padding, with the end-of-sequence token as the pad token when the model has none."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def stop_token_ids(generation_config, tokenizer) -> set[int]:
    """The tokens that end an answer: the generation config's end-of-sequence id(s), else the
    tokenizer's."""
    eos = generation_config.eos_token_id
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` as a chat model is asked: its chat template with the generation
    prompt (the template holds the special tokens, so none are added)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def padded_batches(tokenizer, ids: Sequence[list[int]], batch_size: int, device) -> Iterator[tuple]:
    """``(indices, input_ids, attention_mask)`` per batch of ``batch_size`` prompts, longest first,
    padded on the left (tensors on ``device``)."""
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        padded = tokenizer.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
        yield batch, padded["input_ids"].to(device), padded["attention_mask"].to(device)


@dataclass
class Generation:
    text: str  # the new tokens up to the stop (or the budget), decoded without special tokens, stripped
    new_tokens: int  # how many new tokens the text holds
    stopped: bool  # a stop token ended it (False: the budget or max_new_tokens did)


def generate_batched(
    model,
    tokenizer,
    ids: Sequence[list[int]],
    generation_config,
    batch_size: int,
    *,
    stop_ids: set[int],
    budgets: Sequence[int] | None = None,
    seed: int | None = None,
    on_batch: Callable[[int], object] | None = None,
    logits_processor: Callable[[list[int]], list] | None = None,
) -> list[Generation]:
    """One `Generation` per prompt of ``ids``, in the order given.

    ``budgets``: each prompt's most new tokens; a batch then generates up to its largest budget
    and each row is cut to its own (else ``generation_config.max_new_tokens`` holds for all).
    ``seed``: ``torch.manual_seed(seed)`` before every batch (sampling that does not depend on the
    batches before; leave None to seed once yourself). ``on_batch(n)`` after each batch of ``n``.
    ``logits_processor(indices)``: the logits processors of one batch (the indices of its prompts in
    ``ids``, in batch order), made anew for every ``generate`` call (a grammar's matchers hold the
    state of one call's rows); they run before the sampling warpers (temperature, top-p).
    """
    import torch

    out: list[Generation | None] = [None] * len(ids)
    for batch, input_ids, mask in padded_batches(tokenizer, ids, batch_size, model.device):
        config = generation_config
        if budgets is not None:
            config = copy.deepcopy(generation_config)
            config.max_new_tokens = max(budgets[i] for i in batch)
        if seed is not None:
            torch.manual_seed(seed)
        extra = {}
        if logits_processor is not None:
            from transformers import LogitsProcessorList

            extra["logits_processor"] = LogitsProcessorList(logits_processor(batch))
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids, attention_mask=mask, generation_config=config, **extra
            )
        for row, i in zip(generated[:, input_ids.shape[1] :].tolist(), batch):  # the echoed prompt cut off
            new = row if budgets is None else row[: budgets[i]]
            stop = next((k for k, t in enumerate(new) if t in stop_ids), None)
            kept = new if stop is None else new[:stop]
            text = tokenizer.decode(kept, skip_special_tokens=True).strip()
            out[i] = Generation(text, len(kept), stop is not None)
        if on_batch is not None:
            on_batch(len(batch))
    return out
