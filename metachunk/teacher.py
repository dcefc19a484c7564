"""The teacher client: every LLM call in metachunk goes through here.

One `Teacher` per pipeline stage (its model and generation params); stages that name the
same ``base_url`` + ``model`` share one `Endpoint` (HTTP client, concurrency, rate limits).

The request path, in order:
1. The request's content hash (model, messages, generation params, prompt-template hash, attempt
   number) is looked up in the `AnswerStore`. An answered request is never
   sent again; a request that only ever failed in transport is sent again.
2. The key is claimed in the store, and in the same transaction the request's worst-case cost is
   reserved against ``--max-cost`` (the spend and reservations of every process on the store). A
   key another live process is sending is waited for, not sent; a request whose reservation does
   not fit is not sent (it stays pending) and the run goes on with what fits. The worst case is the prompt at
   1 token per UTF-8 byte (byte-level BPE never spends more), or the teacher's ``tokenizer`` count,
   plus ``max_tokens`` (`Teacher.prompt_bound`). The endpoint's calibrated tokens per byte (the
   largest it billed for prompts like this one) only size what the tokens-per-minute bucket takes:
   a ratio learnt on prose is no bound for a table of digits, which a tokenizer splits digit by digit.
3. The endpoint's token buckets (requests and tokens per minute) and semaphore admit it.
4. ``openai.AsyncOpenAI`` sends it, over openai's aiohttp transport (httpx2's own connection
   pool costs more CPU per request at 64 connections: bench/distill_throughput.py). The client's
   machinery does the retrying: exponential backoff with jitter on 408/409/429/5xx, timeouts and
   connection errors, honouring ``Retry-After``. An httpx event hook adds what it lacks: after any 429, every request
   to that endpoint (new ones and retries) waits out the ``Retry-After`` pause.
5. The raw response body is stored as received (API keys redacted), then read, and the claim is
   released in the same transaction. We ask the client for the raw HTTP response: no pydantic
   model is built per answer, and the bytes we parse are the bytes we keep. An answer without
   ``usage`` is counted at the same upper bound (its text at 1 token per byte, at most
   ``max_tokens``) and marked ``usage_estimated``.

A send that got no answer may still have been billed (a read timeout, which openai's client
retries; a stream cut mid-answer; a 200 whose body does not parse): each is counted at the
reservation's worst case in the stored row's cost, counted on the wire per request key
(`Endpoint.take_counts`), so that the budget sees it and a rerun sending it again cannot spend
without bound. Each try is counted alone: one whose connection never opened counts nothing, nor
does an error status that says the request was not served (a gateway's 502 or 504 may hide an
upstream that answered, and counts).

The overshoot bound: a run stops before a reservation passes the cap, and a reservation is an upper
bound on one send, so the spend passes the cap by at most what the requests holding a claim when
the cap is reached cost above their reservations. Claims are taken before an endpoint's
concurrency slot, so they number up to the run's workers (docs/reliability.md), and a request may
cost up to ``(max_retries + 1)**2`` worst cases: we retry a broken stream or a 200 that does not
parse, and the client retries each of those tries on a timeout (times the endpoints, with
``base_urls``: a request that fails to connect moves to the next).

**Structured outputs.** A stage whose answer must be JSON passes its answer schema
(`Schema`) with the request, and the teacher's ``structured_output`` says
how its endpoint takes it (`response_format`): ``json_schema`` (OpenAI's
``{"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}``, which vLLM and
SGLang decode under too), ``json_object_schema`` (llama.cpp's server: ``{"type": "json_object",
"schema"}``), ``json_object`` (any JSON object) or ``none`` (nothing is sent: the stage reads and
repairs the answer, `metachunk.structured`). The ``response_format`` is part of the payload,
so of the cache key; the schema's sha256 joins the key too when the request sends the schema. A
request with no ``response_format`` (a stage answering text, or ``none``) has no schema in its
key: its key is the same whatever ``structured_output`` the recipe names.

``finish_reason == "length"`` is not success: the request is repeated with twice the
``max_tokens`` up to ``max_tokens_limit`` (each size is its own cached request), else it ends as
failed with reason ``length``. ``finish_reason == "content_filter"`` is a failure with reason
``content_filter``: stored (it was paid), never a text. Reasoning teachers: the raw content is
kept, ``<think>…</think>`` is stripped for the clean text, and a separate ``reasoning_content``
(DashScope, DeepSeek, SGLang) or ``reasoning`` (vLLM) field is kept too.

**Providers.** A teacher's ``provider`` names a profile (`metachunk.providers`) that fills
every key the recipe left unset: ``structured_output``, ``max_tokens_field``, ``refused_params``,
``stream`` and the batch keys. ``stream`` asks for SSE with ``include_usage`` and assembles the
chunks into one chat completion (`metachunk.streaming`); a stream that breaks is a transport
failure, retried here. ``extra_body`` joins the payload, so the key. A refusal that will repeat
(HTTP 400/422 with a code the profile knows to be permanent, or the same provider error on
``refusals_to_stop`` requests in a row) stops the run (`RequestsRefused`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import functools
import json
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from metachunk import config, providers
from metachunk.artifacts import InputError, json_sha256
from metachunk.config import option
from metachunk.prompts import Schema
from metachunk.providers import PROVIDERS, SAMPLING_PARAMS, STRUCTURED_OUTPUTS, TOKEN_FIELDS
from metachunk.redaction import redact, register_private_url, register_secret, safe_url, url_credentials
from metachunk.store import AnswerStore, StoredAnswer
from metachunk.streaming import REASONING_FIELDS, ChatStream

# openai, httpx2 and aiohttp are imported where used: `metachunk --help` must not pay for them.
if TYPE_CHECKING:
    import openai

T = TypeVar("T")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell takes as a variable name
CONVENTIONAL_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")  # what a variable is named by convention
R = TypeVar("R")

SENDS_SCHEMA = ("json_schema", "json_object_schema")
# Error statuses from a gateway in front of the model server, whose upstream may have received the
# request and generated (and billed) the answer: 502 and 504 (RFC 9110 15.6.3, 15.6.5), and
# Cloudflare's 520 and 524, sent when the origin took the request but did not answer in time
# (https://httpcodes.fyi/524/). Every other error status says the request was not served.
MAYBE_SERVED_STATUSES = frozenset({502, 504, 520, 524})


def response_format(mode: str, schema: Schema | None) -> dict | None:
    """The ``response_format`` a request for an answer of ``schema`` carries under ``mode``; None:
    send none (``none``, or a stage whose answer is text)."""
    if schema is None or mode == "none":
        return None
    if mode == "json_object":
        return {"type": "json_object"}
    if mode == "json_object_schema":  # llama.cpp's server (and llama-cpp-python's) form
        return {"type": "json_object", "schema": schema.data}
    return {
        "type": "json_schema",
        "json_schema": {"name": schema.name, "schema": schema.data, "strict": True},
    }


@functools.lru_cache(maxsize=64)
def json_instruction(schema: Schema) -> str:
    """The note itself, rendered once per schema (a Schema hashes by its name and file hash)."""
    shape = json.dumps(schema.data, ensure_ascii=False, indent=1)
    return f"Answer with one JSON object (json only, no other text) valid under this JSON Schema:\n{shape}"


def with_json_instruction(messages: list[dict], schema: Schema) -> list[dict]:
    """``messages`` with the system message saying JSON and showing the schema: what a
    ``json_object`` endpoint needs, since it is not sent the schema and refuses a request whose
    messages never say "json" (OpenAI, DeepSeek, DashScope)."""
    note = json_instruction(schema)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def wire_body(cfg: TeacherConfig, payload: dict) -> dict:
    """The body sent online: the keyed payload, asking for a stream when the teacher streams.
    Streamed or not, an answer is the same cached request; batch lines never stream."""
    if not cfg.stream:
        return payload
    return {**payload, "stream": True, "stream_options": {"include_usage": True}}


# Fields of the body metachunk owns: extra_body may not replace them (the budget reserves against
# the token limit, the cache keys the rest).
OWNED_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                "response_format")  # fmt: skip


@dataclass
class TeacherConfig:
    """One stage's teacher. Stages with the same ``base_url`` and ``model`` share its limits."""

    model: str = option(None, "model name sent to the endpoint (and the key of the price table)")
    base_url: str = option(
        "http://127.0.0.1:8000/v1", "OpenAI-compatible endpoint, ending in /v1", runtime=True
    )
    base_url_env: str | None = option(
        None,
        "name of an environment variable holding the endpoint URL; overrides base_url when set",
        runtime=True,
    )
    base_urls: list[str] | None = option(
        None,
        "several endpoints serving this model (vLLM replicas, gateways): each request goes to the one with "
        "the fewest in flight, each keeps its own concurrency and rate limits, and one that fails to connect "
        "is paused and retried later while the others carry the load; overrides base_url",
        runtime=True,
    )
    base_url_envs: list[str] | None = option(
        None,
        "names of environment variables holding those endpoints' URLs; overrides base_urls",
        runtime=True,
    )
    serve_preset: bool = option(
        False,
        "the endpoint is `metachunk teacher serve` (transformers serve), which answers only requests "
        "naming the served folder: send the local path of the preset named by `model`",
    )
    api_key_env: str | None = option(
        None,
        "name of the environment variable holding the API key; the key never goes in a file",
        runtime=True,
    )
    temperature: float | None = option(None, "sampling temperature; unset: the server's default")
    top_p: float | None = option(None, "nucleus sampling; unset: the server's default")
    seed: int | None = option(None, "sampling seed, for servers that honour it")
    frequency_penalty: float | None = option(
        None, "penalise repeated tokens (transformers serve maps it to repetition_penalty = 1 + value)"
    )
    stop: list[str] | None = option(None, "stop sequences: the answer ends before any of them")
    max_tokens: int = option(1024, "completion token limit per request")
    max_tokens_limit: int | None = option(
        None, "on finish_reason=length, retry with twice max_tokens up to this; unset: record as failed"
    )
    concurrency: int = option(16, "requests in flight to this endpoint", runtime=True)
    rpm: float | None = option(
        None, "requests per minute allowed by the endpoint; unset: no limit", runtime=True
    )
    tpm: float | None = option(None, "tokens (prompt + completion) per minute; unset: no limit", runtime=True)
    timeout: float = option(600.0, "seconds before one HTTP attempt is abandoned", runtime=True)
    max_retries: int = option(5, "retries per request on 429, 5xx, timeouts and connection errors")
    max_connection_errors: int = option(
        8,
        "stop the run after this many requests in a row failed to connect (each after its retries): "
        "the endpoint is down or the URL is wrong",
        runtime=True,
    )
    tokenizer: str | None = option(
        None,
        "the teacher's tokenizer (preset or local HF dir): count prompt tokens with it for budget "
        "reservations and answers without usage; unset: calibrate from the tokens the endpoint bills",
    )
    provider: str | None = option(
        None,
        "the provider this endpoint is: its profile (metachunk/providers.py, written from the provider's "
        "documentation) fills every key below left unset: how a schema is asked for, the token-limit field, "
        "refused sampling parameters, stream-only models, the batch path, limits and discount. Unset: a "
        "generic OpenAI-compatible server",
        choices=list(PROVIDERS),
    )
    structured_output: str | None = option(
        None,
        "how this endpoint takes the answer schema of a JSON stage (refinement, moc_chunk): json_schema "
        "(OpenAI's response_format, which vLLM and SGLang also decode under), json_object_schema "
        "(llama.cpp's server: json_object with the schema), json_object (any JSON object; the system message "
        "says JSON and shows the schema), none (send nothing; the answer's JSON is repaired). Stages whose "
        "answer is text send nothing. Unset: the provider's profile, else none",
        choices=list(STRUCTURED_OUTPUTS),
    )
    stream: bool | None = option(
        None,
        "ask for the answer as a stream (stream_options.include_usage) and assemble it into one chat "
        "completion; a stream cut before its end is retried. Unset: the provider's profile (models that "
        "answer only in stream mode), else off",
    )
    stream_idle_timeout: float = option(
        120.0,
        "stream: seconds without a chunk before the attempt is abandoned (timeout bounds the whole stream)",
        runtime=True,
    )
    max_tokens_field: str | None = option(
        None,
        "the field carrying the token limit: max_tokens, or max_completion_tokens (OpenAI). Unset: the profile",
        choices=list(TOKEN_FIELDS),
    )
    refused_params: list[str] | None = option(
        None,
        "sampling parameters not sent because the model refuses or ignores them (OpenAI's reasoning models: "
        "temperature, top_p). Unset: the provider's profile",
    )
    extra_body: dict[str, object] | None = option(
        None,
        "fields merged into every request body (enable_thinking, thinking_budget, chat_template_kwargs, "
        "reasoning_effort, top_k); part of the request's cache key",
    )
    refusals_to_stop: int = option(
        3,
        "stop the run when this many requests in a row were refused (HTTP 400/422) with the same provider "
        "error; an error code the profile knows to be permanent stops it at once",
    )

    mode: str = option(
        "online",
        "online: each request as it comes; batch: the provider's Batch API (OpenAI's, or any server with "
        "/v1/files and /v1/batches), at its discount: requests are collected, submitted in files of at most "
        "batch_max_requests / batch_max_bytes, polled, and their answers stored like online ones; chained "
        "stages run as successive rounds (distill only)",
        choices=["online", "batch"],
    )
    retry_mode: str = option(
        "batch",
        "mode: batch: a request that expired or failed in a batch is sent again in a new batch, or online",
        choices=["batch", "online"],
    )
    completion_window: str = option("24h", "mode: batch: the batch's completion window")
    batch_poll_seconds: float = option(
        30.0,
        "mode: batch: first wait between polls of a live batch (then x1.5, at most 10 minutes)",
        runtime=True,
    )
    batch_endpoint: str | None = option(
        None, "mode: batch: the path in each batch line and the batch's endpoint. Unset: the profile"
    )
    batch_max_requests: int | None = option(
        None, "mode: batch: most requests per batch file. Unset: the profile (OpenAI: 50,000)"
    )
    batch_max_bytes: int | None = option(
        None, "mode: batch: most bytes per batch file. Unset: the profile (OpenAI: 200 MB)"
    )
    batch_discount: float | None = option(
        None,
        "mode: batch: share of the online price a batch request costs, when the model's price does not say. "
        "Unset: the profile (OpenAI: 0.5)",
    )

    def __post_init__(self):
        config.check_choices(self)
        if not self.model:
            raise ValueError("'model' is required")
        # Every key the recipe left unset comes from the provider's profile.
        for name, value in providers.resolve(self.provider, self.model).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        config.check_choices(self)
        unknown = sorted(set(self.refused_params) - set(SAMPLING_PARAMS))
        if unknown:
            raise ValueError(f"'refused_params' may name only {', '.join(SAMPLING_PARAMS)}, got {unknown}")
        owned = sorted(set(self.extra_body or {}) & set(OWNED_FIELDS))
        if owned:
            raise ValueError(f"'extra_body' may not set {', '.join(owned)}: they have keys of their own")
        if self.mode == "batch" and not self.batch_endpoint:
            raise ValueError(
                f"provider {self.provider!r} has no Batch API: set 'batch_endpoint' or use mode: online"
            )
        if self.api_key_env is not None and not ENV_NAME.fullmatch(str(self.api_key_env)):
            # a key pasted here by mistake: refused without repeating it (it would reach the error and the records)
            raise ValueError(
                "'api_key_env' must name an environment variable (letters, digits and _), not hold the key "
                "itself; the value given is not shown"
            )
        for name, url in [("base_url", self.base_url)] + [("base_urls", u) for u in self.base_urls or []]:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"{name!r} must be an http(s) URL, got {safe_url(str(url))!r}")
            if credentials := url_credentials(url):
                raise ValueError(
                    f"{name!r} holds {credentials}: name the key's environment variable in "
                    "'api_key_env' instead, so that it never reaches a file"
                )
        for name in ("max_tokens", "concurrency", "max_connection_errors", "refusals_to_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name!r} must be >= 1")
        # Checked here, not by the server: a NaN cannot be sent as JSON (the request fails after the
        # run has started), and a rate of 0 or less would wait forever.
        for name, low, high, strict in (("temperature", 0.0, None, False), ("top_p", 0.0, 1.0, False),
                                        ("frequency_penalty", None, None, False), ("rpm", 0.0, None, True),
                                        ("tpm", 0.0, None, True), ("timeout", 0.0, None, True),
                                        ("stream_idle_timeout", 0.0, None, True),
                                        ("batch_poll_seconds", 0.0, None, True), ("batch_discount", 0.0, 1.0, False)):  # fmt: skip
            if getattr(self, name) is not None:
                config.check_number(self, name, low, high, strict)
        if self.max_retries < 0:
            raise ValueError("'max_retries' must be >= 0")
        if self.max_tokens_limit is not None and self.max_tokens_limit < self.max_tokens:
            raise ValueError("'max_tokens_limit' must be >= 'max_tokens'")

    def endpoint_url(self) -> str:
        """The endpoint's URL, without a trailing ``/``: the one in the environment variable that
        ``base_url_env`` names when that is set, else ``base_url``."""
        if self.base_url_env:
            return self._url_from_environment(self.base_url_env)
        return self.base_url.rstrip("/")

    def endpoint_urls(self) -> list[str]:
        """Every endpoint of this teacher: base_url_envs, base_urls, or the one endpoint_url()."""
        if self.base_url_envs:
            return [self._url_from_environment(name) for name in self.base_url_envs]
        if self.base_urls:
            return [u.rstrip("/") for u in self.base_urls]
        return [self.endpoint_url()]

    def _url_from_environment(self, name: str) -> str:
        """The URL in environment variable ``name``. One with credentials (``user:key@host``) is refused,
        as in ``base_url``: the client sends the key as a bearer token (``api_key_env``), and aiohttp
        refuses a URL's credentials beside an Authorization header."""
        url = os.environ.get(name, "")
        if not url:
            raise FatalTeacherError(f"teacher {self.model!r}: environment variable {name} is not set")
        if not url.startswith(("http://", "https://")):
            raise FatalTeacherError(
                f"teacher {self.model!r}: environment variable {name} must hold an http(s) URL"
            )
        if credentials := url_credentials(url):
            raise FatalTeacherError(
                f"teacher {self.model!r}: the URL in environment variable {name} holds {credentials}: "
                "put the key in the variable that 'api_key_env' names instead"
            )
        register_private_url(url.rstrip("/"))  # printed and stored as its host only (safe_url)
        return url.rstrip("/")

    def generation_params(self) -> dict:
        """Sent with every request, and part of its cache key."""
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "stop": self.stop,
        }
        return {k: v for k, v in params.items() if v is not None and k not in self.refused_params}


@dataclass
class Price:
    input: float = option(0.0, "USD per 1M prompt tokens")
    output: float = option(0.0, "USD per 1M completion tokens")
    batch_discount: float | None = option(
        None,
        "share of the price a Batch API request costs; unset: the teacher's batch_discount (OpenAI: 0.5)",
    )

    def __post_init__(self):
        # A NaN price made every paid answer unstorable (and paid again on each rerun); a negative
        # one lowered the store's spend, which every run sharing the store counts against its cap.
        for name in ("input", "output"):
            config.check_number(self, name, low=0.0)
        if self.batch_discount is not None:
            config.check_number(self, "batch_discount", low=0.0, high=1.0)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input + completion_tokens * self.output) / 1e6


class BudgetExceeded(Exception):
    """This request's reservation could push the spend past ``--max-cost``: it is not sent (a
    smaller one may still fit)."""


class FatalTeacherError(Exception):
    """The endpoint refuses every request (bad key, unknown model, wrong URL): stop the run."""


def estimate_tokens(text: str) -> int:
    """A length estimate (UTF-8 bytes / 3) for sizing windows and dry-run tables: ~4 bytes per
    English token and ~3 bytes per Chinese character put real counts 25-40% below it. It is not
    an upper bound (byte-level BPE can spend a token per byte): budget reservations use
    `prompt_bytes` and the endpoint's calibration instead."""
    return len(text.encode("utf-8")) // 3 + 1


# Tokens counted for each message's chat-template markers (role, separators) and for the
# assistant turn's header, on top of the contents: templates add 3-5 per message.
TEMPLATE_TOKENS = 8


def non_ascii_quarter(contents: list[str]) -> int:
    """The share of non-ASCII bytes in ``contents``, in quarters (0 to 4): prompts are calibrated
    apart by it, since a BPE spends about twice the tokens per byte on Chinese as on English, and a
    ratio learnt on English prompts is no upper bound for Chinese ones."""
    size = sum(len(c.encode("utf-8")) for c in contents)
    non_ascii = size - sum(len(c.encode("ascii", "ignore")) for c in contents)
    return round(4 * non_ascii / max(1, size))


def endpoint_name(cfg: TeacherConfig) -> str:
    """``MODEL @ HOST``: how the answer store names a teacher's endpoint (its calibration, its
    batches). Replicas (``base_urls``) bill alike, so the first names them all."""
    return f"{cfg.model} @ {safe_url(cfg.endpoint_urls()[0])}"


def template_tokens(messages: list[dict]) -> int:
    """What a chat template adds to a prompt's contents, counted high: `TEMPLATE_TOKENS` per message
    and for the answer's header."""
    return TEMPLATE_TOKENS * (len(messages) + 1)


def prompt_bytes(messages: list[dict]) -> int:
    """The UTF-8 bytes of a prompt's contents: what prompt tokens are calibrated against."""
    return sum(len(m["content"].encode("utf-8")) for m in messages)


def split_reasoning(content: str, reasoning_content: str | None) -> tuple[str, str]:
    """``(answer, reasoning)``. QwQ-style servers often drop the opening ``<think>`` tag, so
    everything before the last ``</think>`` is reasoning. An unclosed ``<think>`` means the answer
    was cut inside the reasoning: there is no answer."""
    reasoning = reasoning_content or ""
    if "</think>" in content:
        thought, _, answer = content.rpartition("</think>")
        thought = thought.replace("<think>", "", 1).strip()
        return answer.strip(), "\n".join(x for x in (reasoning, thought) if x)
    if content.lstrip().startswith("<think>"):
        return "", "\n".join(x for x in (reasoning, content.lstrip()[len("<think>") :].strip()) if x)
    return content.strip(), reasoning


# A stream cut before its finish_reason, or an error event inside it, is a transport failure too.
TRANSPORT_FAILURES = (
    "timeout",
    "connection",
    "malformed_response",
    "stream_cut",
    "stream_error",
    "cancelled",
    "killed_in_flight",  # a dead sender's claim, charged by the store (`AnswerStore.claim`)
)


def is_transport_failure(reason: str) -> bool:
    """A failed answer's ``reason`` says no answer came back (timeout, connection, HTTP error,
    malformed body): the store keeps the error, with what its sends may have been billed as its
    cost, and the next run sends the request again."""
    return reason in TRANSPORT_FAILURES or reason.startswith("http_")


@dataclass
class Answer:
    """What a stage gets back. ``status``: ok, failed (``reason`` says why) or pending (not sent:
    dry run, status report, or the budget stopped the run)."""

    key: str
    model: str
    status: str
    reason: str = ""
    raw: str = ""  # the response body as received (or the transport error)
    content: str = ""  # the message content as returned, <think> included
    reasoning: str = ""
    text: str = ""  # the clean answer that feeds the next stage
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    cached: bool = False
    params: dict = field(default_factory=dict)
    estimate: tuple[int, int] = (0, 0)  # (prompt, completion) tokens, for pending answers
    usage_estimated: bool = False  # the server sent no usage: the tokens are our upper estimate
    # Usage of every request behind this answer (shorter tries cut at max_tokens included).
    spent: tuple[int, int, float] = (0, 0, 0.0)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_stored(cls, row: StoredAnswer, params: dict, cached: bool) -> Answer:
        answer = cls(
            row.key,
            row.model,
            "ok" if row.ok else "failed",
            row.reason,
            row.raw,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cost=row.cost,
            cached=cached,
            params=params,
            usage_estimated=row.usage_estimated,
        )
        if row.ok:
            answer._read_body()
        return answer

    def _read_body(self) -> None:
        body = json.loads(self.raw)
        choice = body["choices"][0]
        message = choice.get("message") or {}
        self.content = message.get("content") or ""
        self.finish_reason = choice.get("finish_reason") or ""
        thought = "\n".join(
            message[f] for f in REASONING_FIELDS if isinstance(message.get(f), str) and message[f]
        )
        self.text, self.reasoning = split_reasoning(self.content, thought or None)

    def to_record(self) -> dict:
        """The stage's entry in an output record."""
        record = {
            "status": self.status,
            "reason": self.reason,
            "teacher": self.model,
            "params": self.params,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "cost": round(self.cost, 8),
            # A record says what the answer is, not how this run got it (the run log counts answers from
            # the store), so a rerun writes the same bytes.
            "request_key": self.key,
        }
        if self.usage_estimated:
            record["usage_estimated"] = True
        if self.status == "pending":
            record["estimate"] = {"prompt_tokens": self.estimate[0], "completion_tokens": self.estimate[1]}
        else:
            answered = bool(self.finish_reason)  # a paid answer (maybe cut at length), not a transport error
            record.update(raw=self.content if answered else self.raw, reasoning=self.reasoning)
            record["text"] = self.text
            record["finish_reason"] = self.finish_reason
        return record


def plain_json(raw: str) -> str:
    """A 200 body re-serialised with no escape JSON does not need (``\\u002d`` for "-", ``\\/``, escaped
    non-ASCII), as the Batch API's output lines are: a key a server echoed escaped its own way (.NET's and
    Go's encoders escape ``+``, ``&``, ``<``) is then the text `redact` masks, not a string that parses
    back into the key. A body that is not JSON is kept as received; one holding a lone surrogate
    escape (``\\ud83d``, as JavaScript encoders cut an emoji) keeps its non-ASCII escaped, which
    UTF-8, the store's encoding, could not hold otherwise (the escaped forms of a key are masked too)."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    plain = json.dumps(parsed, ensure_ascii=False)
    try:
        plain.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(parsed)
    return plain


def read_usage(raw: str) -> tuple[int | None, int | None, str, bool]:
    """``(prompt, completion, answer text, well-formed)`` from a 200 body; the token counts are
    None when the server sent no usage, a usage without the completion's count (neither
    ``completion_tokens`` nor ``total_tokens``), or one with a negative count (``total_tokens``
    below ``prompt_tokens`` included): the caller then counts the answer at its upper estimate,
    never at 0 or below. A body that is not a chat completion is ``malformed_response`` (retried
    like a transport error).

    A chat completion's ``usage`` has ``prompt_tokens``, ``completion_tokens`` and ``total_tokens``
    (their sum): https://platform.openai.com/docs/api-reference/chat/object"""
    try:
        body = json.loads(raw)
        choice = body["choices"][0]
        message = choice.get("message")
        if not isinstance(message, dict):
            return None, None, "", False
        text = (message.get("content") or "") + "".join(message.get(f) or "" for f in REASONING_FIELDS)
        usage = body.get("usage")
        if not isinstance(usage, dict) or usage.get("prompt_tokens") is None:
            return None, None, text, True
        prompt = int(usage["prompt_tokens"])
        if usage.get("completion_tokens") is not None:
            completion = int(usage["completion_tokens"])
        elif usage.get("total_tokens") is not None:
            completion = int(usage["total_tokens"]) - prompt
        else:
            return None, None, text, True
        if prompt < 0 or completion < 0:  # a count no server bills: the usage is not to be trusted
            return None, None, text, True
        return prompt, completion, text, True
    except (ValueError, KeyError, IndexError, TypeError):
        return None, None, "", False


class TokenBucket:
    """``rate`` units per minute with a burst of one minute's worth. ``take`` waits for capacity;
    a single request larger than the burst is let through once the bucket is full."""

    def __init__(self, per_minute: float):
        self.capacity = float(per_minute)
        self.level = self.capacity
        self.rate = per_minute / 60.0
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, amount: float) -> None:
        amount = min(amount, self.capacity)
        self._refill()
        while self.level < amount:
            await asyncio.sleep((amount - self.level) / self.rate)
            self._refill()
        self.level -= amount

    def give_back(self, estimated: float, used: float) -> None:
        """Return what ``take(estimated)`` took beyond the real usage, once it is known (``take`` takes at most
        the capacity: an estimate past it gets back only what it took)."""
        unused = max(0.0, min(estimated, self.capacity) - used)
        self.level = min(self.capacity, self.level + unused)


def retry_after_seconds(headers) -> float | None:
    """A 429's wait: ``retry-after-ms`` (OpenAI's), else ``retry-after`` in seconds or as an HTTP date;
    None when neither says (a malformed value included)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) / scale
        except ValueError:
            pass
        if name == "retry-after":  # an HTTP date (RFC 9110 section 10.2.3); anything else is no hint
            try:
                return email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                return None
    return None


def api_key(cfg: TeacherConfig) -> str:
    """The key named by ``api_key_env`` (registered for redaction), or "EMPTY" for local servers."""
    if not cfg.api_key_env:
        return "EMPTY"  # local servers (transformers serve, vLLM without --api-key) ignore it
    raw = os.environ.get(cfg.api_key_env, "")
    # a key pasted with its newline (`export K=$(cat key.txt)` keeps none, an .env file may)
    key = raw.strip()
    if raw and raw != key:
        register_secret(raw)
    if not key:
        # Named only when it reads as a variable's name: a key pasted there (gsk_..., hf_...) passes ENV_NAME.
        name = (
            cfg.api_key_env if CONVENTIONAL_ENV_NAME.fullmatch(cfg.api_key_env) else "that api_key_env names"
        )
        raise FatalTeacherError(f"teacher {cfg.model!r}: the environment variable {name} is not set")
    register_secret(key)  # from here on, redact() masks it in everything written or printed
    return key


class Endpoint:
    """One ``base_url`` + ``model``: an AsyncOpenAI client over one pooled HTTP client, a
    concurrency cap, token buckets and the shared 429 pause."""

    def __init__(self, cfg: TeacherConfig, url: str | None = None):
        import httpx2
        import openai

        self.cfg = cfg
        url = url or cfg.endpoint_url()
        key = api_key(cfg)
        self.url = safe_url(url)  # what messages and the calibration table name
        self.in_flight = 0  # requests this endpoint is answering now (EndpointGroup picks the fewest)
        self.down_until = 0.0  # monotonic time before which a group sends it nothing (failed to connect)
        self.down_for = 0.0  # the next pause after a failed connection: doubles, at most a minute
        self.pause_until = 0.0  # monotonic time before which no request may leave (after a 429)
        # The aiohttp transport keeps the httpx2 client in front (its event hooks, and openai's retries,
        # work unchanged) but replaces httpcore2's pool, which scans every pooled connection on each
        # request: at 64 connections that alone costs ~1 ms of CPU per request.
        http = _wire_client_class()(
            self._note_unopened,
            limits=httpx2.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency),
            timeout=cfg.timeout,
            event_hooks={"request": [self._wait_out_pause], "response": [self._note_rate_limit]},
        )
        self.client = openai.AsyncOpenAI(
            base_url=url,
            api_key=key,
            max_retries=cfg.max_retries,
            timeout=cfg.timeout,
            http_client=http,
        )
        self.slots = asyncio.Semaphore(cfg.concurrency)
        self.requests = TokenBucket(cfg.rpm) if cfg.rpm else None
        self.tokens = TokenBucket(cfg.tpm) if cfg.tpm else None
        self.sent = 0
        # Per request key, every try counted (openai's retries included): the HTTP requests that left,
        # those answered by an error status that says the request was not served, and those whose
        # connection never opened. The rest may have been billed: `Teacher._send` counts them.
        self.requests_sent: dict[str, int] = {}
        self.not_served: dict[str, int] = {}
        self.unopened: dict[str, int] = {}
        # When each key's last try left: a stream's deadline counts from it.
        self.left_at: dict[str, float] = {}
        # Told of each try as it leaves (`AnswerStore.note_sent`): a SIGKILLed run's sends are then paid
        # by the run that takes its claims over.
        self.on_sent: Callable[[str], None] | None = None

    def take_counts(self, key: str) -> tuple[int, int]:
        """``(requests sent, of which never served)`` for ``key`` since the last call."""
        self.left_at.pop(key, None)
        sent = self.requests_sent.pop(key, 0)
        return sent, self.not_served.pop(key, 0) + self.unopened.pop(key, 0)

    async def _wait_out_pause(self, request) -> None:
        while (delay := self.pause_until - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        key = request.headers.get("X-Request-Key")
        if key is not None:  # counted as it leaves: a stop during the pause sent nothing
            self.requests_sent[key] = self.requests_sent.get(key, 0) + 1
            self.left_at[key] = asyncio.get_running_loop().time()
            if self.on_sent is not None:
                self.on_sent(key)

    def _note_unopened(self, request) -> None:
        key = request.headers.get("X-Request-Key")
        if key is not None:
            self.unopened[key] = self.unopened.get(key, 0) + 1

    async def _note_rate_limit(self, response) -> None:
        key = response.request.headers.get("X-Request-Key")
        if (
            key is not None
            and response.status_code >= 400
            and response.status_code not in MAYBE_SERVED_STATUSES
        ):
            self.not_served[key] = self.not_served.get(key, 0) + 1
        if response.status_code == 429:
            delay = retry_after_seconds(response.headers)
            delay = 1.0 if delay is None or delay <= 0 else min(delay, 120.0)
            self.pause_until = max(self.pause_until, time.monotonic() + delay)

    async def post(self, payload: dict, key: str, estimated_tokens: int) -> str:
        """The response body: as received, or assembled from the stream when the teacher streams.
        A stream that breaks after its headers raises `StreamBroken`."""
        import httpx2
        import openai

        if self.requests:
            await self.requests.take(1)
        if self.tokens:
            await self.tokens.take(estimated_tokens)
        async with self.slots:
            self.sent += 1
            options = {"headers": {"X-Request-Key": key}}
            if not self.cfg.stream:
                response = await self.client.post(
                    "/chat/completions", body=payload, cast_to=httpx2.Response, options=options
                )
                return response.text
            # openai's client sends it (its retries cover everything before the first byte of the
            # stream) and parses the SSE events; an error event inside the stream raises APIError.
            stream = await self.client.post(
                "/chat/completions",
                body=wire_body(self.cfg, payload),
                cast_to=object,
                stream=True,
                stream_cls=openai.AsyncStream[object],
                options=options,
            )
            # ``timeout`` after the try that answered left: not after the first, nor a 429's pause
            loop = asyncio.get_running_loop()
            return await self._read_stream(stream, self.left_at.get(key, loop.time()) + self.cfg.timeout)

    async def _read_stream(self, stream, end: float) -> str:
        """Assemble the chunks, by ``end`` (``timeout`` after the answering try left) and within
        ``stream_idle_timeout`` between two chunks."""
        import openai

        loop = asyncio.get_running_loop()
        idle = self.cfg.stream_idle_timeout
        assembled = ChatStream()
        try:
            async with asyncio.timeout_at(min(end, loop.time() + idle)) as clock:
                async for chunk in stream:
                    if isinstance(chunk, dict):
                        assembled.add(chunk)
                    clock.reschedule(min(end, loop.time() + idle))
        except TimeoutError:
            raise StreamBroken("timeout", "the stream stalled or ran past the timeout") from None
        except openai.APIError as e:  # an error event in the stream
            raise StreamBroken("stream_error", provider_message(e)) from None
        except ValueError as e:  # a chunk that is not JSON
            raise StreamBroken("malformed_response", str(e)) from None
        except Exception as e:  # the connection broke mid-stream (reset, closed, bad chunked framing)
            raise StreamBroken("stream_cut", f"{type(e).__name__}: {e}") from None
        finally:
            await stream.close()
        if not assembled.finished:
            raise StreamBroken("stream_cut", "the stream ended before a finish_reason")
        return assembled.body()

    async def close(self) -> None:
        await self.client.close()


class EndpointGroup:
    """A teacher's endpoints (one, or ``base_urls``): the `Endpoint` interface over all of
    them. A request goes to the endpoint with the fewest in flight among those not paused; one that
    fails to connect is paused (1 s, doubling up to a minute, until it answers again) and the request
    goes to another. The run stops as unreachable only when requests fail on every endpoint."""

    def __init__(self, cfg: TeacherConfig):
        self.cfg = cfg
        self.endpoints = [Endpoint(cfg, url) for url in cfg.endpoint_urls()]
        self.url = ", ".join(e.url for e in self.endpoints)
        self.connection_errors = 0
        self.refusal: tuple = ()  # the last refusal's (status, code, message), and how many in a row
        self.refusals = 0
        self.refused_for_good = ""  # set: the run stops with this line (RequestsRefused)
        self.stopped: EndpointStop | None = None  # once raised, the stop every later send meets
        self.permanent_codes = providers.permanent_codes(cfg.provider)

    @property
    def sent(self) -> int:
        return sum(e.sent for e in self.endpoints)

    @property
    def concurrency(self) -> int:
        return self.cfg.concurrency * len(self.endpoints)

    def note_connection(self, failed: bool) -> None:
        """Count requests in a row that failed to connect on every endpoint (any answer resets it)."""
        self.connection_errors = self.connection_errors + 1 if failed else 0

    def note_refusal(self, error: openai.APIStatusError | None) -> None:
        """Count requests in a row refused with the same provider error (anything else resets it).
        A code the profile knows to be permanent, or ``refusals_to_stop`` of the same refusal in a
        row, means every request like them will be refused: `check_reachable` stops the run."""
        if error is None:
            self.refusal, self.refusals = (), 0
            return
        code = error.code or ""
        message = provider_message(error)
        signature = (error.status_code, code, message)
        self.refusals = self.refusals + 1 if signature == self.refusal else 1
        self.refusal = signature
        if code in self.permanent_codes or self.refusals >= self.cfg.refusals_to_stop:
            why = f"code {code}" if code in self.permanent_codes else f"{self.refusals} requests in a row"
            self.refused_for_good = redact(
                f"teacher {self.cfg.model!r} at {self.url} refuses the request ({why}): HTTP "
                f"{error.status_code}{' ' + code if code else ''}: {_short(redact(message))}"
            )

    def check_reachable(self) -> None:
        """Past ``max_connection_errors`` such requests in a row, or a refusal that will repeat, stop the run.
        The stop holds: an answer that arrives after it (a send that was in flight) does not undo it."""
        if self.stopped is not None:
            raise self.stopped
        if self.refused_for_good:
            self.stopped = RequestsRefused(
                self.refused_for_good + " (the records are written; a rerun sends them again)"
            )
        elif self.connection_errors >= self.cfg.max_connection_errors:
            self.stopped = EndpointUnreachable(
                f"teacher {self.cfg.model!r}: cannot connect to {self.url} "
                f"({self.connection_errors} requests in a row failed to connect); is the server running?"
            )
        if self.stopped is not None:
            raise self.stopped

    def _pick(self, tried: set[int]) -> Endpoint:
        now = time.monotonic()
        candidates = [e for e in self.endpoints if id(e) not in tried]
        up = [e for e in candidates if e.down_until <= now]
        # All paused: the one whose pause ends first is probed rather than leaving the request waiting.
        return min(up, key=lambda e: e.in_flight) if up else min(candidates, key=lambda e: e.down_until)

    async def post(self, payload: dict, key: str, estimated_tokens: int) -> tuple[str, Endpoint]:
        """The response body, and the endpoint that gave it (its token bucket gets the unused estimate back)."""
        import openai

        tried: set[int] = set()
        while True:
            endpoint = self._pick(tried)
            endpoint.in_flight += 1
            try:
                response = await endpoint.post(payload, key, estimated_tokens)
            except openai.APIConnectionError as e:
                reason = _transport_reason(e)
                if len(self.endpoints) == 1 or reason != "connection":
                    raise
                endpoint.down_for = min(60.0, max(1.0, 2 * endpoint.down_for))
                endpoint.down_until = time.monotonic() + endpoint.down_for
                tried.add(id(endpoint))
                if len(tried) == len(self.endpoints):
                    raise
                continue
            finally:
                endpoint.in_flight -= 1
            endpoint.down_for = 0.0
            return response, endpoint

    def sends_maybe_billed(self, key: str, answered: bool = False) -> int:
        """How many of the requests sent for ``key`` since the last call, on any endpoint, may have
        been billed without an answer: every try that left, less those never served (an error status
        that says so, a connection that never opened) and the answer itself (``answered``)."""
        sent = unserved = 0
        for endpoint in self.endpoints:
            s, u = endpoint.take_counts(key)
            sent, unserved = sent + s, unserved + u
        return max(0, sent - unserved - int(answered))

    async def close(self) -> None:
        for endpoint in self.endpoints:
            await endpoint.close()


class Budget:
    """The cap on the spend of every run on one answer store, all processes together.

    The reservations themselves live in the store (`AnswerStore.claim`), so that two jobs
    sharing a store share the cap; this object holds the limit, whether it was reached, and what
    this process paid."""

    def __init__(self, limit: float | None, store: AnswerStore):
        self.limit, self.store = limit, store
        self.exhausted = False
        self.paid = 0.0  # billed to this process's requests (settled answers)

    @property
    def spent(self) -> float:
        """Every answer in the store, whichever process paid for it."""
        return self.store.spent()


class EndpointStop(FatalTeacherError):
    """The endpoint cannot answer this run: stop sending, keep what was answered (exit status 4)."""


class EndpointUnreachable(EndpointStop):
    """Every recent request failed to connect: the server is down or the URL is wrong."""


class RequestsRefused(EndpointStop):
    """The endpoint refuses the requests for a reason that will repeat (a rejected parameter)."""


class StreamBroken(Exception):
    """A streamed answer broke after its headers: ``reason`` (stream_cut, stream_error, timeout,
    malformed_response) is a transport failure, retried and never stored as an answer."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def provider_message(error: openai.APIError) -> str:
    """The provider's own words: the ``message`` of its error body, else the client's summary."""
    body = error.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return error.message


def retry_delay(attempt: int) -> float:
    """Seconds before retry ``attempt + 1`` of what openai's client does not retry itself (a broken
    stream, a 200 whose body does not parse, a batch's create): openai's own backoff, 0.5 s doubling
    up to 8 s, less up to a quarter at random so that many senders do not retry in step (its
    ``INITIAL_RETRY_DELAY``, ``MAX_RETRY_DELAY`` and jitter, ``openai/_base_client.py``)."""
    return min(0.5 * 2**attempt, 8.0) * (1 - 0.25 * random.random())


WAIT_POLL_SECONDS = 0.2  # how often a request another sender (process or coroutine) holds is looked for


class Teacher:
    """A stage's view of a teacher: its config, prices and params over a shared endpoint.

    `TeacherPool` builds one per stage (``pool[stage]``), the stages sharing endpoints and the cost
    budget. ``cfg`` is its [`TeacherConfig`][metachunk.teacher.TeacherConfig]; ``store`` the answer
    store every request is looked up in before it is sent, and kept in once answered; ``endpoint``
    None is offline (a dry run, a status): answers come from the store only.
    """

    def __init__(
        self,
        cfg: TeacherConfig,
        endpoint: EndpointGroup | None,
        store: AnswerStore,
        price: Price,
        budget: Budget,
    ):
        self.cfg, self.endpoint, self.store, self.price, self.budget = cfg, endpoint, store, price, budget
        self.params = cfg.generation_params()
        # The name on the wire; the cache key keeps `cfg.model`, so a served preset's answers stay
        # valid whatever folder it is served from.
        self.wire_model = cfg.model
        if cfg.serve_preset:
            from metachunk.models import resolve

            self.wire_model = str(resolve(cfg.model))
        self.offline = endpoint is None  # dry run / status: answer from the store or say "pending"
        self.cached = 0  # answers served from the store
        # By request key: the sends in flight that may be billed, in $.
        self.maybe_billed: dict[str, float] = {}
        # Answers another sender (a process, or a request of this one) was paying for when wanted.
        self.waited = 0
        self.tokens_used = 0  # prompt + completion tokens of answers paid for in this run
        # One calibration for the model across its endpoints: replicas bill the same tokens.
        self.calibration_key = endpoint_name(cfg) if endpoint else ""
        # Loaded here, so that a tokenizer that cannot be found stops the run before anything is sent.
        self._tokenizer = None
        if cfg.tokenizer:
            from metachunk.models import load_tokenizer

            self._tokenizer = load_tokenizer(cfg.tokenizer)
        # Dry run: the first body this teacher would send (`distill --dry-run` prints it).
        self.first_request: dict | None = None
        # mode: batch: requests this round could not answer from the store, (key, body, reservation),
        # for metachunk.batch to submit; a key appears once however many items ask for it.
        self.spool: dict[str, tuple[dict, float]] = {}
        # mode: batch: requests left pending because a live batch (this run's or another's on the
        # store) holds them; the round loop waits for those batches rather than stop.
        self.in_live_batch: set[str] = set()

    def request(
        self,
        messages: list[dict],
        prompt_sha: str,
        attempt: int,
        max_tokens: int,
        schema: Schema | None = None,
    ) -> tuple[dict, str]:
        """The request's body and its cache key. Without a ``response_format`` neither says anything
        of a schema."""
        fmt = response_format(self.cfg.structured_output, schema)
        if fmt is not None and self.cfg.structured_output == "json_object":
            messages = with_json_instruction(messages, schema)
        limit = self.cfg.max_tokens_field
        payload = {"model": self.cfg.model, "messages": messages, limit: max_tokens, **self.params}
        if self.cfg.extra_body:
            payload.update(self.cfg.extra_body)
        keyed = {"request": payload, "prompt_sha256": prompt_sha, "attempt": attempt}
        if fmt is not None:
            payload["response_format"] = fmt
            if self.cfg.structured_output in SENDS_SCHEMA:
                keyed["schema_sha256"] = schema.sha256
        key = json_sha256(keyed)
        if self.wire_model != self.cfg.model:
            payload["model"] = self.wire_model
        return payload, key

    # -- token counts for reservations and for answers without usage

    def calibrated_as(self, contents: list[str]) -> str:
        """The calibration row that an answer to a prompt of ``contents`` raises."""
        return self._calibration_row(non_ascii_quarter(contents))

    def _calibration_row(self, quarter: int) -> str:
        return f"{self.calibration_key} #{quarter}/4 non-ASCII"

    def _tokens_per_byte(self, contents: list[str]) -> float:
        """The largest billed prompt tokens per byte so far for texts like ``contents`` or with more
        non-ASCII bytes (which spend more tokens a byte); 1.0 before any such answer."""
        rows = [self._calibration_row(q) for q in range(non_ascii_quarter(contents), 5)]
        return max(self.store.tokens_per_byte(*rows) or 0.0, 0.0) or 1.0

    def prompt_bound(self, messages: list[dict]) -> int:
        """An upper bound on the prompt tokens billed for ``messages``: what a claim reserves against
        the cap. The teacher's tokenizer (``tokenizer:``) counts the prompt as its chat template
        renders it (default system prompts and date headers included); else 1 token per UTF-8 byte
        of the contents, which byte-level BPE never exceeds. Either way plus `template_tokens`."""
        if self._tokenizer is None:
            return prompt_bytes(messages) + template_tokens(messages)
        if self._tokenizer.chat_template:
            try:
                rendered = self._tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except Exception:  # noqa: BLE001 - a template that refuses a system role: the byte bound holds
                return prompt_bytes(messages) + template_tokens(messages)
            return len(self._tokenizer.encode(rendered, add_special_tokens=False)) + template_tokens(messages)
        body = sum(len(self._tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)
        return body + template_tokens(messages)

    def answer_bound(self, text: str) -> int:
        """An upper bound on the completion tokens of an answer ``text`` the endpoint did not count
        (no ``usage``): the tokenizer's count, else its UTF-8 bytes, plus one for the end token."""
        if self._tokenizer is None:
            return len(text.encode("utf-8")) + 1
        return len(self._tokenizer.encode(text, add_special_tokens=False)) + 1

    def expected_prompt_tokens(self, messages: list[dict], bound: int | None = None) -> int:
        """The prompt's tokens as the endpoint has billed prompts like it (`_tokens_per_byte`), or
        `prompt_bound` where the recipe names a tokenizer (``bound``: already counted, so the chat
        template is not rendered again): what the tokens-per-minute bucket takes. It can fall short
        of the bill (a ratio learnt on prose, then a table of digits), which only the rate limit
        feels: the money is reserved at `prompt_bound`."""
        if self._tokenizer is not None:
            return self.prompt_bound(messages) if bound is None else bound
        contents = [m["content"] for m in messages]
        return math.ceil(prompt_bytes(messages) * self._tokens_per_byte(contents)) + template_tokens(messages)

    async def complete(
        self, messages: list[dict], prompt_sha: str, attempt: int = 0, schema: Schema | None = None
    ) -> Answer:
        """Answer ``messages``; ``attempt`` > 0 asks again for a fresh answer (the previous one
        could not be parsed), which is a different cached request. ``schema``: the answer must be
        JSON of this schema, asked for as ``structured_output`` says."""
        max_tokens = self.cfg.max_tokens
        spent = (0, 0, 0.0)
        while True:
            answer = await self._once(messages, prompt_sha, attempt, max_tokens, schema)
            spent = (
                spent[0] + answer.prompt_tokens,
                spent[1] + answer.completion_tokens,
                spent[2] + answer.cost,
            )
            answer.spent = spent
            if answer.ok and answer.finish_reason == "content_filter":
                # Paid for, and stored so a rerun pays nothing, but what came before the cut is
                # never an answer: no text reaches a parser or a training target.
                answer.status, answer.reason, answer.text = "failed", "content_filter", ""
                return answer
            if answer.ok and answer.finish_reason == "length":
                if self.cfg.max_tokens_limit and max_tokens < self.cfg.max_tokens_limit:
                    max_tokens = min(2 * max_tokens, self.cfg.max_tokens_limit)
                    continue
                answer.status, answer.reason = "failed", "length"
            return answer

    async def _once(
        self, messages: list[dict], prompt_sha: str, attempt: int, max_tokens: int, schema: Schema | None
    ) -> Answer:
        payload, key = self.request(messages, prompt_sha, attempt, max_tokens, schema)
        messages = payload["messages"]  # as sent: a json_object endpoint's carry the schema
        if self.offline and self.first_request is None:  # dry run: what this teacher sends
            self.first_request = wire_body(self.cfg, payload)
        params = {**self.params, "max_tokens": max_tokens, "attempt": attempt}
        if "response_format" in payload:
            params["structured_output"] = self.cfg.structured_output
        if self.store.has_answer(key):
            self.cached += 1
            return Answer.from_stored(self.store.get(key), params, cached=True)
        if self.offline:  # the dry run's table: the same bound a live run reserves
            prompt_estimate = self.prompt_bound(messages)
            stored = self.store.get(key)  # only a transport error, if anything: the next run retries it
            if stored is not None:
                return Answer.from_stored(stored, params, cached=False)
            return Answer(
                key, self.cfg.model, "pending", params=params, estimate=(prompt_estimate, max_tokens)
            )
        if self.cfg.mode == "batch":
            state, tries, _ = self.store.batch_item(key)
            if state == "submitted":  # in a live batch: its answer comes when the batch is done
                self.in_live_batch.add(key)
                return Answer(key, self.cfg.model, "pending", params=params)
            gave_up = state in ("failed", "expired") and tries > self.cfg.max_retries
            if gave_up:
                stored = self.store.get(key)
                if stored is not None:
                    return Answer.from_stored(stored, params, cached=False)
                return Answer(key, self.cfg.model, "failed", reason="batch_expired", params=params)
            if not (state in ("failed", "expired") and self.cfg.retry_mode == "online"):
                prompt_bound = self.prompt_bound(messages)
                reserve = self.price.cost(prompt_bound, max_tokens) * self.price.batch_discount
                self.spool[key] = (payload, reserve)
                return Answer(
                    key, self.cfg.model, "pending", params=params, estimate=(prompt_bound, max_tokens)
                )
        self.store.start_heartbeat()
        waited = refused = False
        prompt_bound = self.prompt_bound(messages)
        worst_case = self.price.cost(prompt_bound, max_tokens)
        while True:  # claim the key, with its reservation, or wait for whoever is sending it
            claim = self.store.claim(key, worst_case, self.budget.limit)
            if claim.outcome == "claimed":
                break
            if claim.outcome == "answered":
                self.cached += 1
                self.waited += waited
                return Answer.from_stored(self.store.get(key), params, cached=True)
            if claim.outcome == "over_budget":
                # Requests in flight usually settle below their reservation: only a refusal with
                # nothing in flight online (in any process) is final, so that a rerun under the same
                # cap finds nothing more that fits. It is asked once more after dead owners' claims
                # are cleared. A live batch's reservations are not waited for: it may take a day.
                if self.store.claims_in_flight() == 0:
                    if refused:
                        self.budget.exhausted = True
                        raise BudgetExceeded
                    refused = True
                    continue
            else:  # busy: another sender (a process, or a request of this one) has this very request
                waited = True
            await asyncio.sleep(WAIT_POLL_SECONDS)
        row = None
        try:
            self.endpoint.check_reachable()  # a stopped endpoint sends nothing more (the sends in flight finish)
            row = await self._send(payload, key, messages, prompt_bound, max_tokens)
            self._keep(row, messages)
        except BaseException:  # stopped, cancelled (Ctrl-C, SIGTERM), or the endpoint is gone
            # A second signal (`stopping.run`), or a failed put: keep the answer if it can.
            if row is not None:
                if self.store.holds(key):
                    self._keep(row, messages)
                raise
            # A send that left may be billed, answer or not: it is counted at its worst case, as a transport
            # failure the next run sends again. One that never left only gives its reservation back.
            sends = self.endpoint.sends_maybe_billed(key)
            earlier = self.maybe_billed.pop(key, 0.0)  # what _send had counted before it was cut short
            if sends or earlier:
                cost = earlier + sends * self.price.cost(prompt_bound, max_tokens)
                self.store.put(StoredAnswer(key, self.cfg.model, "error", "cancelled", "stopped while in flight",
                                            0, 0, cost))  # fmt: skip
            else:
                self.store.release(key)
            raise
        self.endpoint.check_reachable()  # after the put: the failure is recorded for the rerun
        self.budget.paid += row.cost
        self.tokens_used += row.prompt_tokens + row.completion_tokens
        return Answer.from_stored(row, params, cached=False)

    def _keep(self, row: StoredAnswer, messages: list[dict]) -> None:
        """Store ``row`` (its claim released with it); an answer with the billed usage calibrates."""
        calibration = None
        if row.ok and not row.usage_estimated:
            calibration = (self.calibrated_as([m["content"] for m in messages]),
                           row.prompt_tokens / max(1, prompt_bytes(messages)))  # fmt: skip
        self.store.put(row, calibration)

    async def _send(
        self, payload: dict, key: str, messages: list[dict], prompt_bound: int, max_tokens: int
    ) -> StoredAnswer:
        """One request to a stored row, secrets redacted. Transport retries happen inside the openai
        client; a 200 whose body is not a chat completion is retried here with the same backoff."""
        import openai

        model = self.cfg.model
        # What the tokens-per-minute bucket takes: the expected tokens, not the money's bound.
        estimated_tokens = self.expected_prompt_tokens(messages, prompt_bound) + max_tokens
        # A send that got no answer may still be billed: the server may have generated it (a read timeout, a
        # stream cut mid-answer, a 200 whose body did not parse). Each is counted at the reservation's worst
        # case, in the row's cost, so that the budget sees it and a rerun that sends it again cannot spend
        # without bound. A try whose connection never opened is not, nor one answered by an error status
        # that says it was not served.
        worst_case = self.price.cost(prompt_bound, max_tokens)
        # By key, on the teacher: an exception out of here (a 401 after a timeout, Ctrl-C) leaves it for _once.
        billed = self.maybe_billed
        billed[key] = 0.0

        def count_sends(answered: bool = False) -> None:  # this try's sends that may have been billed
            billed[key] += worst_case * self.endpoint.sends_maybe_billed(key, answered=answered)

        def error_row(reason: str, detail: str) -> StoredAnswer:  # no answer; what the sends may cost
            return StoredAnswer(key, model, "error", reason, detail, 0, 0, billed.pop(key))

        for attempt in range(self.cfg.max_retries + 1):
            try:
                raw, via = await self.endpoint.post(payload, key, estimated_tokens)
            except openai.APIConnectionError as e:  # APITimeoutError included
                reason = _transport_reason(e)
                self.endpoint.note_connection(reason == "connection")
                count_sends()
                return error_row(reason, redact(str(e)))
            except openai.APIStatusError as e:
                self.endpoint.note_connection(False)
                count_sends()
                detail = _short(redact(e.message))
                if e.status_code in (401, 403, 404):
                    raise FatalTeacherError(
                        redact(f"teacher {model!r} at {self.endpoint.url}: HTTP {e.status_code}: {detail}")
                    ) from None
                self.endpoint.note_refusal(e if e.status_code in (400, 422) else None)
                return error_row(f"http_{e.status_code}", detail)
            except StreamBroken as e:  # after the headers: retried here, like a malformed body
                self.endpoint.note_connection(False)
                self.endpoint.note_refusal(None)
                count_sends()
                raw = f"{e.reason}: {e.detail}"
                if attempt < self.cfg.max_retries:
                    await asyncio.sleep(retry_delay(attempt))
                    continue
                return error_row(e.reason, _short(redact(raw)))
            self.endpoint.note_connection(False)
            self.endpoint.note_refusal(None)
            raw = redact(plain_json(raw), headers=False)
            prompt_tokens, completion_tokens, text, well_formed = read_usage(raw)
            count_sends(answered=well_formed)
            if well_formed:
                estimated = prompt_tokens is None
                if estimated:  # counted, never free: the same upper bound the reservation used
                    prompt_tokens = prompt_bound
                    completion_tokens = min(max_tokens, self.answer_bound(text))
                if via.tokens:  # replace the estimate by the real usage
                    via.tokens.give_back(estimated_tokens, prompt_tokens + completion_tokens)
                cost = self.price.cost(prompt_tokens, completion_tokens) + billed.pop(key)
                return StoredAnswer(key, model, "ok", "", raw, prompt_tokens, completion_tokens, cost,
                                    usage_estimated=estimated)  # fmt: skip
            if attempt < self.cfg.max_retries:
                await asyncio.sleep(retry_delay(attempt))
        return error_row("malformed_response", _short(redact(raw)))


def _transport_reason(error: openai.APIConnectionError) -> str:
    """``timeout`` or ``connection``. The aiohttp transport reports every failed connection (refused,
    reset, closed early) as a connect timeout; the aiohttp error underneath tells them apart. A
    connection that never opened (refused, or a connect timeout: a host that drops packets) is
    ``connection``: it counts towards ``max_connection_errors`` and moves the request to another of
    ``base_urls``."""
    import aiohttp
    import openai

    cause = error.__cause__.__cause__ if error.__cause__ is not None else None
    cut = isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(cause, TimeoutError)
    if _never_opened(cause) or cut or not isinstance(error, openai.APITimeoutError):
        return "connection"
    return "timeout"


def _never_opened(error: BaseException | None) -> bool:
    """Whether aiohttp's ``error`` says the connection never opened: the request never left, so no
    server saw it."""
    import aiohttp

    return isinstance(error, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


@functools.cache
def _wire_client_class():
    """openai's aiohttp client, telling ``on_unopened(request)`` of each try whose connection never
    opened: openai's client retries those as it retries a read timeout and shows only the last try's
    error, yet only the timeout may have been served (and billed). ``send`` is the public method
    openai's client calls for every try (https://www.python-httpx.org/advanced/clients/)."""
    import openai

    class WireClient(openai.DefaultAioHttpClient):
        def __init__(self, on_unopened: Callable, **kwargs):
            super().__init__(**kwargs)
            self.on_unopened = on_unopened

        async def send(self, request, **kwargs):
            try:
                return await super().send(request, **kwargs)
            except Exception as e:  # httpx2's error, raised from aiohttp's
                if _never_opened(e.__cause__):
                    self.on_unopened(request)
                raise

    return WireClient


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class MapResult:
    """What `TeacherPool.map` returns."""

    results: list  # fn(item) for each item, in input order; None for an item that never finished
    # Why the run stopped early: "budget", "unreachable", "refused", or "" when it went through.
    stopped: str = ""
    message: str = ""  # stopped by the endpoint: the one line saying why (unreachable, or refusing)
    seconds: float = 0.0
    error: EndpointStop | None = None  # that stop, for callers with nothing to go on without it


class TeacherPool:
    """Builds one `Teacher` per stage, sharing endpoints and the budget; `map` runs a
    function over many items with a pool of workers, the one worker loop every caller uses."""

    def __init__(
        self,
        teachers: dict[str, TeacherConfig],
        prices: dict[str, Price],
        store: AnswerStore,
        max_cost: float | None = None,
        offline: bool = False,
    ):
        self.store = store
        self.budget = Budget(max_cost, store)
        self.endpoints: dict[tuple[tuple[str, ...], str], EndpointGroup] = {}
        self.stages: dict[str, Teacher] = {}
        for stage, cfg in teachers.items():
            endpoint = None
            if not offline:
                where = (tuple(cfg.endpoint_urls()), cfg.model)
                if where not in self.endpoints:
                    self.endpoints[where] = EndpointGroup(cfg)
                    for one in self.endpoints[where].endpoints:
                        one.on_sent = store.note_sent
                endpoint = self.endpoints[where]
            if max_cost is not None and cfg.model not in prices:  # $0 a request: the cap would never bind
                raise InputError(
                    "max_cost",  # --max-cost, or chunk's --lumber-max-cost
                    f"a cost cap is set but the {stage!r} teacher's model {cfg.model!r} has no entry under prices: "
                    "(USD per 1M prompt/completion tokens, by model name), so nothing it sends would count against it",
                )
            price = prices.get(cfg.model) or Price()
            if price.batch_discount is None:  # the model's price does not say: the teacher's provider does
                price = dataclasses.replace(price, batch_discount=cfg.batch_discount)
            self.stages[stage] = Teacher(cfg, endpoint, store, price, self.budget)

    def __getitem__(self, stage: str) -> Teacher:
        return self.stages[stage]

    @property
    def sent(self) -> int:
        return sum(e.sent for e in self.endpoints.values())

    @property
    def waited(self) -> int:
        """Answers this run waited for because another sender on the store (a process, or a request of this
        run) was paying for them."""
        return sum(t.waited for t in self.stages.values())

    @property
    def slots(self) -> int:
        """Requests this pool may have in flight: its endpoints' concurrency (64 offline)."""
        return sum(e.concurrency for e in self.endpoints.values()) or 64

    async def map(
        self,
        items: Sequence[T],
        fn: Callable[[T], Awaitable[R]],
        *,
        workers: int | None = None,
        desc: str = "",
        unit: str = "it",
        progress: bool = True,
        postfix: bool = True,
        close: bool = True,
        results: MutableSequence | None = None,
    ) -> MapResult:
        """``await fn(item)`` for every item, ``workers`` (default `slots`) at a time, with a
        progress bar (rate and ETA; ``postfix``: requests per second, tokens and dollars paid).

        Each item is taken by exactly one worker, in input order, so a run sends its requests in the
        same order every time. The budget does not stop the loop: every later item still asks, and
        the requests whose reservation does not fit end ``BudgetExceeded`` inside ``fn`` (which
        records them as pending, or raises to stop), so the run sends everything that fits the cap.
        An endpoint that cannot answer (unreachable, or refusing every request for the same reason)
        stops it: no new request is sent, the ones in flight finish and are stored, and what
        finished is kept.
        Any other error (or a KeyboardInterrupt) cancels every worker and is raised. ``close``: the
        pool's HTTP clients are closed at the end (pass False to map again over the same pool).
        ``results``: where ``fn(item)`` goes, index by index (default a new list; a disk-backed
        sequence keeps a long run's memory flat)."""
        from metachunk.progress import bar as progress_bar

        if results is None:
            results = [None] * len(items)
        queue = iter(enumerate(items))
        started = shown = time.perf_counter()
        bar = progress_bar(total=len(items), unit=unit, desc=desc, enabled=progress)

        def show() -> None:  # at most twice a second, and at the end
            nonlocal shown
            now = time.perf_counter()
            if now - shown < 0.5 and bar.n < bar.total:
                return
            shown = now
            tokens = sum(t.tokens_used for t in self.stages.values())
            rate = self.sent / max(now - started, 1e-9)
            bar.set_postfix_str(f"{rate:.1f} req/s, {tokens:,} tok, ${self.budget.paid:.4f}", refresh=False)

        async def worker() -> None:
            for i, item in queue:  # one shared iterator: each item is taken by exactly one worker
                results[i] = await fn(item)
                bar.update(1)
                if postfix:
                    show()

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(len(items), workers or self.slots) or 1)]
        stop: EndpointStop | None = None
        try:
            try:
                try:
                    await asyncio.gather(*tasks)
                except EndpointStop:
                    # Nothing more is sent (each send checks its endpoint first), but the sends in flight are
                    # let finish and be stored: the server may be generating them, and billing them, already.
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
            except EndpointStop:
                raise
            except BaseException:  # any other error (or a cancellation, Ctrl-C) cancels the rest
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        except EndpointStop as e:  # stop sending; what was answered is kept
            stop = e
        finally:
            bar.close()
            if close:
                await self.close()
        if stop is not None:
            stopped = "refused" if isinstance(stop, RequestsRefused) else "unreachable"
        else:
            stopped = "budget" if self.budget.exhausted else ""
        return MapResult(results, stopped, str(stop or ""), time.perf_counter() - started, stop)

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.close()


def point_at(block: dict, served) -> dict:
    """A recipe's teacher block (a mapping) pointed at a served teacher (``served``: its
    ``base_url``, ``model``, ``serve_preset`` and ``structured_output``, as
    `metachunk.local_teacher.LocalTeacher` has them). A block that asks for structured
    output gets the way this server takes a schema."""
    block = {**block, "base_url": served.base_url, "model": served.model, "serve_preset": served.serve_preset}
    if block.get("structured_output", "none") != "none":
        block["structured_output"] = served.structured_output
    return block
