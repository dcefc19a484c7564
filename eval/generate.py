"""Answering the questions from the retrieved chunks: an OpenAI-compatible endpoint or a local model.

The prompt is ``eval/prompts/rag_answer.{zh,en}.txt`` (``<<<system>>>`` / ``<<<user>>>``, filled
with ``{context}`` and ``{question}``); its sha256 is recorded in the run's metrics.json and on
every answer. The context lists the passages best first, numbered ``[1]``, ``[2]``, ...

* **Endpoint** (``--generator BASE_URL:MODEL``): every request goes through the teacher client
  (`metachunk.teacher`: retries, rate limits, budget) and its answer store (``answers.sqlite``):
  an answered request is never sent again, so a rerun pays nothing. An answer cut at
  ``max_tokens`` (``finish_reason == "length"``) keeps its text and is marked ``length``.
* **Local** (``--generator-model PRESET_OR_DIR``): transformers ``generate`` on the chat template
  (or, for a base model without one, the system and user parts joined by a blank line), prompts of
  similar length batched and padded on the left (`metachunk.engine.generation.generate_batched`),
  sampling with the run's settings from one seed.

Default sampling is the paper's (§4.3): top_p 0.9, top_k 5, temperature 0.1, 1280 new tokens. The
OpenAI API has no ``top_k``; it is sent to an endpoint only when ``--endpoint-top-k`` is set
(vLLM, SGLang and llama.cpp accept it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from metachunk import stopping
from metachunk.engine.generation import chat_prompt_ids, generate_batched, prepare_tokenizer, stop_token_ids
from metachunk.prompts import Prompt, load_prompt_file
from metachunk.redaction import url_credentials

PROMPT_NAME = "rag_answer"


def load_rag_prompt(lang: str) -> Prompt:
    return load_prompt_file("metachunk.eval", PROMPT_NAME, lang)


def format_context(passages: Sequence[str]) -> str:
    return "\n\n".join(f"[{i}] {p.strip()}" for i, p in enumerate(passages, start=1))


def rag_messages(prompt: Prompt, question: str, passages: Sequence[str]) -> list[dict]:
    return prompt.messages(context=format_context(passages), question=question.strip())


def parse_generator(spec: str) -> tuple[str, str]:
    """``"http://host:8000/v1:Qwen/Qwen2-7B-Instruct"`` -> ``(base_url, model)``.

    The model starts after the first ``:`` of the URL's path, so ports and model names with
    colons (``qwen2:7b``) both work; the URL needs a path (``/v1``)."""
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"--generator must be BASE_URL:MODEL with an http(s) URL, got {spec!r}")
    host, slash, path = rest.partition("/")
    base_path, colon, model = path.partition(":")
    if not slash or not colon or not model or not host:
        raise ValueError(
            f"--generator must be BASE_URL:MODEL with a path in the URL, e.g. "
            f"http://127.0.0.1:8000/v1:Qwen2-7B-Instruct; got {spec!r}"
        )
    if credentials := url_credentials(spec):
        raise ValueError(f"--generator's URL holds {credentials}: put the key in the environment variable "
                         "that --api-key-env names, so that it never reaches a file")  # fmt: skip
    return f"{scheme}://{host}/{base_path}".rstrip("/"), model


@dataclass
class Generated:
    text: str
    status: str  # ok | failed | pending (not sent: the budget ran out)
    reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False
    finish_reason: str = ""


# ------------------------------------------------------------------------------------ endpoint


class EndpointGenerator:
    """Answers through `metachunk.teacher.Teacher`, cached in an `AnswerStore`."""

    def __init__(
        self,
        teacher_cfg,
        store_path: Path,
        max_cost: float | None = None,
        extra: dict | None = None,
        prices: dict | None = None,
    ):
        self.cfg, self.store_path, self.max_cost = teacher_cfg, Path(store_path), max_cost
        self.extra, self.prices = extra or {}, prices or {}
        self.sent = self.cached = self.tokens = 0
        self.stopped = ""

    def generate(
        self, prompts: Sequence[list[dict]], prompt_sha: str, progress: bool = True
    ) -> list[Generated]:
        from metachunk.store import AnswerStore

        store = AnswerStore(self.store_path)
        try:
            return stopping.run(self._run(store, prompts, prompt_sha, progress))
        finally:
            store.close()

    async def _run(self, store, prompts, prompt_sha, progress) -> list[Generated]:
        from metachunk.teacher import BudgetExceeded, TeacherPool

        pool = TeacherPool({"generator": self.cfg}, self.prices, store, self.max_cost)
        teacher = pool["generator"]
        teacher.params.update(self.extra)  # part of the payload and of the cache key

        async def ask(messages: list[dict]) -> Generated | None:
            if pool.budget.exhausted:  # the budget ends the run: every later question stays pending
                return None
            try:
                answer = await teacher.complete(messages, prompt_sha)
            except BudgetExceeded:
                return None
            # an answer cut at max_tokens keeps its text, as a local model's would
            cut = answer.reason == "length"
            return Generated(
                answer.text,
                "ok" if answer.ok or cut else "failed",
                answer.reason,
                answer.prompt_tokens,
                answer.completion_tokens,
                answer.cached,
                answer.finish_reason,
            )

        done = await pool.map(
            prompts, ask, workers=2 * self.cfg.concurrency, desc="generate", unit="q", progress=progress
        )
        if done.error is not None:  # no answers to evaluate: an error, as any other teacher error
            raise done.error
        self.sent, self.cached, self.tokens = pool.sent, teacher.cached, teacher.tokens_used
        self.stopped = done.stopped
        return [g or Generated("", "pending", "budget") for g in done.results]


# ------------------------------------------------------------------------------------ local


class LocalGenerator:
    """A causal LM (preset or local dir) generating with sampling, batched."""

    def __init__(
        self,
        model: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int = 4,
        temperature: float = 0.1,
        top_p: float = 0.9,
        top_k: int | None = 5,
        max_new_tokens: int = 1280,
        seed: int = 0,
    ):
        import copy

        from metachunk.models import load_causal_lm

        self.name = model
        started = time.perf_counter()
        self.model, self.tokenizer = load_causal_lm(model, device=device, dtype=dtype)
        self.load_seconds = time.perf_counter() - started
        tok = self.tokenizer
        prepare_tokenizer(tok)
        config = copy.deepcopy(self.model.generation_config)
        config.do_sample = temperature > 0
        config.temperature = temperature if temperature > 0 else None
        config.top_p = top_p if temperature > 0 else None
        config.top_k = top_k if temperature > 0 else None
        config.max_new_tokens = max_new_tokens
        if config.pad_token_id is None:
            config.pad_token_id = tok.pad_token_id
        self.generation = config
        self.stop_ids = stop_token_ids(config, tok)
        self.batch_size, self.seed = batch_size, seed
        self.seconds = 0.0

    def encode(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template:
            return chat_prompt_ids(tok, messages)
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        return tok(text, add_special_tokens=True)["input_ids"]

    def generate(self, prompts: Sequence[list[dict]], progress: bool = True) -> list[Generated]:
        import torch

        from metachunk.progress import bar as progress_bar

        started = time.perf_counter()
        torch.manual_seed(self.seed)  # once per run: the batches draw from one stream
        ids = [self.encode(p) for p in prompts]
        with progress_bar(total=len(ids), unit="q", desc="generate", enabled=progress) as bar:
            done = generate_batched(self.model, self.tokenizer, ids, self.generation, self.batch_size,
                                    stop_ids=self.stop_ids, on_batch=bar.update)  # fmt: skip
        self.seconds += time.perf_counter() - started
        return [
            Generated(g.text, "ok", "" if g.stopped else "length", len(p), g.new_tokens, False,
                      "stop" if g.stopped else "length")
            for g, p in zip(done, ids)
        ]  # fmt: skip
