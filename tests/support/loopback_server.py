"""A small, fast OpenAI-compatible HTTP server on 127.0.0.1 with scripted faults.

This is test and benchmark infrastructure for the teacher client: reliability tests (retries,
timeouts, broken answers) and a throughput benchmark that must reach hundreds of requests per
second on a 2-core machine while sharing the cores with the client. The server therefore uses
only the standard library and keeps its CPU per request tiny: a raw ``asyncio.Protocol``,
HTTP/1.1 keep-alive, a hand-written parser (request line, headers, ``Content-Length`` body), one
``json.loads`` of the body, pre-rendered response templates and no logging per request.

Endpoints
---------
``POST /v1/chat/completions``
    Chat completion, streamed (SSE, chunked) when the request says ``stream: true``, with the
    usage in a last chunk only when ``stream_options.include_usage`` is true. The answer comes
    after ``latency`` seconds. The content is
    ``"answer " + key[:12]`` unless a ``replies`` regex matches the concatenated message contents
    (the first regex, in order, that ``re.search``-es them selects its reply).
    ``max_tokens`` / ``max_completion_tokens`` are accepted and ignored (use ``[[fault:length]]``).
``GET /v1/models``, ``GET /health``
    Fixed answers.
``POST /v1/files`` (multipart, ``purpose=batch``), ``GET /v1/files/{id}/content``,
``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches``
    OpenAI's Batch API, enough for the openai client to use unchanged. A batch goes
    ``validating`` -> ``in_progress`` -> ``completed`` over ``--batch-polls`` retrievals (2 by
    default) and answers every line as the chat endpoint would (``replies``, billing), counted in
    ``by_key`` by ``custom_id`` and in ``batch_requests``. Markers in a line's messages:
    ``[[batch:error]]`` puts that line in the error file (status 500); ``[[batch:expire]]`` leaves it
    unanswered and ends the batch ``expired`` (the other lines in the output file); ``[[batch:fail]]``
    fails the whole batch in validation (no output); ``[[batch:malformed]]`` answers that line 200 with
    a body that is no chat completion (no ``choices``). A file with ``[[batch:lose_create]]`` in a line:
    its first ``POST /v1/batches`` makes the batch but answers 502, as a gateway that lost the answer;
    with ``[[batch:late_create]]`` that batch is also left out of ``GET /v1/batches`` until the file's
    next create (a list that lags). ``POST /v1/batches/{id}/cancel`` cancels a batch.
``GET /stats``
    ``{"requests": n, "by_key": {key: n}, "by_outcome": {"ok": n, "429": n, ...},
    "response_format": {key: the last response_format that key's request carried}}`` over chat
    requests (``response_format`` only once a request carried one, and only those keys). The
    request key is the ``X-Request-Key`` header if present, else the sha256 hex of the raw body.
    Counting happens on arrival, before latency and faults.

A ``response_format`` is checked as OpenAI-compatible servers check it: its ``type`` is ``text``,
``json_object`` (an optional ``schema`` object, llama.cpp's form) or ``json_schema`` (with a
``json_schema`` object holding a ``name`` string and a ``schema`` object); anything else is
answered 400 (counted ``400``). It does not change the answer: replies stay scripted.

The ``/v1`` prefix is optional on the two API paths. Anything else gets a 404 JSON error quoting the path, as OpenAI's does.

Faults
------
Two deterministic ways to script them:

1. Markers in the message contents::

       [[fault:KIND]]            every arrival gets the fault
       [[fault:KIND*N]]          only the first N arrivals of this request key get the fault
       [[fault:429@0.2]]         429 with Retry-After 0.2 s instead of --retry-after
       [[fault:429@0.2*2]]       both: Retry-After 0.2 s, first 2 arrivals only

   With several markers, the first one (in text order) that applies to this arrival wins, so
   ``[[fault:429*1]][[fault:500*2]]`` answers 429, then 500, then normally.
2. ``--random-faults '{"429": 0.05, "500": 0.02}'`` with ``--seed``: every chat arrival draws
   from one ``random.Random(seed)`` and gets a fault with those probabilities (markers win).

Kinds: ``400`` (a refusal), ``401``, ``429`` (with ``Retry-After``), ``500``, ``503`` (JSON error
bodies; these five are answered at once, without the latency), ``hang`` (answers normally after ``--hang-seconds``; a
client that gives up is no problem), ``malformed`` (200 with a truncated JSON body), ``empty``
(content ""), ``length`` (half the content, ``finish_reason`` "length"), ``think`` (content
prefixed by ``<think>I reason about it.</think>``) and ``reasoning`` (an extra
``reasoning_content`` field in the message). ``by_outcome`` counts each kind by name, ``ok``
for normal answers and ``400`` for unreadable requests.

Billing
-------
``--billing`` sets the ``usage`` each answer reports, so that budget tests can meet every kind of
endpoint: ``quarter`` (the default: a token per 4 bytes of the request body), ``byte`` (a token per
UTF-8 byte of the message contents: what byte-level BPE can cost at worst), ``low`` (a token per
16 bytes of the contents: less than any estimate) and ``none`` (no ``usage`` field at all).

``--echo-auth`` makes a careless server: every error body, and every answer's content, quotes the
request's ``Authorization`` header (a secret-redaction test).

Use
---
Command line (writes the bound port to ``--port-file`` atomically once listening)::

    python tests/support/loopback_server.py --port 0 --port-file PATH [--latency 0.2] \\
        [--random-faults JSON] [--seed 0] [--replies JSON] [--retry-after 1] [--hang-seconds 3600]

In process: ``server = LoopbackServer(latency=0.2); await server.start(); server.port; await
server.stop()``. In a subprocess (what tests and benchmarks use, so the server has its own
interpreter and CPU)::

    with serve_in_subprocess(latency=0.2, random_faults={"429": 0.05}) as handle:
        client = openai.OpenAI(base_url=handle.base_url, api_key="x")
        ...
        handle.stats()
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

if __package__:  # imported as support.loopback_server
    from .providers import FAKES
else:  # run as a script: its folder is on sys.path
    from providers import FAKES

FAULT_KINDS = (
    "400", "401", "429", "500", "503", "504", "hang", "malformed", "empty", "length", "think", "reasoning", "filter",
    "stream_error", "stall",
)  # fmt: skip
THINK_TEXT = "I reason about it."

_MARKER_PREFIX = b"[[fault:"
_MARKER = re.compile(r"\[\[fault:(" + "|".join(FAULT_KINDS) + r")(?:@([0-9]*\.?[0-9]+))?(?:\*([0-9]+))?\]\]")

_MAX_HEAD_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    401: "Unauthorized",
}
BILLING = ("quarter", "byte", "low", "none")

_CHAT_TEMPLATE = (
    '{"id":"chatcmpl-loopback-%d","object":"chat.completion","created":%d,"model":%s,'
    '"choices":[{"index":0,"message":{"role":"assistant","content":%s%s},"finish_reason":"%s"}]%s}'
)
_USAGE_TEMPLATE = ',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
_MALFORMED_BODY = b'{"id": "x", "choices": ['


def _error_body(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


def _not_found_body(method: str, path: str) -> bytes:
    """OpenAI's 404 for an unknown route, which quotes the request's path, as gateways' do too."""
    return _error_body(f"Invalid URL ({method} {path})", "invalid_request_error")


_ERROR_BODIES = {
    "400": _error_body("this request is refused", "invalid_request_error"),
    "401": _error_body("invalid api key", "authentication_error"),
    "429": _error_body("rate limited", "rate_limit_error"),
    "500": _error_body("internal server error", "server_error"),
    "503": _error_body("service unavailable", "server_error"),
    "504": _error_body("upstream timed out", "server_error"),  # a gateway's: the upstream may have answered
}


def _response(status: int, body: bytes, keep_alive: bool, extra_headers: str = "") -> bytes:
    """One complete HTTP/1.1 response (head and body) with a correct Content-Length."""
    connection = "keep-alive" if keep_alive else "close"
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra_headers}Connection: {connection}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _joined_content(messages: list) -> str:
    """All message contents concatenated (string contents and the text of content parts)."""
    pieces = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
    return "\n".join(pieces)


def _check_response_format(fmt) -> None:
    """Raise ValueError unless ``fmt`` is a response_format an OpenAI-compatible server takes."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and isinstance(spec.get("schema"), dict)
        ):
            raise ValueError(
                "response_format json_schema needs a json_schema object with 'name' and 'schema'"
            )
    elif kind == "json_object":
        if not isinstance(fmt.get("schema", {}), dict):
            raise ValueError("response_format json_object: 'schema' must be an object")
    elif kind != "text":
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _html_safe_json(text: str) -> str:
    """``text`` as a JSON string the way .NET's default encoder writes it, HTML-sensitive characters
    (``+ < > & ' `` and the backtick) as ``\\u002B``-style escapes, non-ASCII too:
    https://learn.microsoft.com/en-us/dotnet/standard/serialization/system-text-json/character-encoding
    (an echoed key then reaches the client in a form no literal match finds)."""
    escaped = json.dumps(text)  # ensure_ascii: non-ASCII escaped already
    for c in "+<>&'`":
        escaped = escaped.replace(c, f"\\u{ord(c):04X}")
    return escaped


def _parse_random_faults(random_faults: Mapping[str, float] | None) -> list[tuple[float, str]]:
    """Cumulative (upper bound, kind) table for one uniform draw."""
    table = []
    total = 0.0
    for kind, probability in (random_faults or {}).items():
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        probability = float(probability)
        if probability < 0:
            raise ValueError(f"negative probability for fault {kind!r}")
        total += probability
        table.append((total, kind))
    if total > 1.0 + 1e-9:
        raise ValueError(f"fault probabilities add up to {total} > 1")
    return table


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them one at a time, in order."""

    def __init__(self, server: LoopbackServer):
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._busy = False  # an answer is scheduled and not written yet
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        self._transport = transport
        self._server._connections.add(self)

    def connection_lost(self, exc):
        self._server._connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None

    def data_received(self, data):
        self._buffer += data
        if not self._busy:
            self._process()

    def close(self):
        if self._transport is not None:
            self._transport.close()

    def send(self, data: bytes, keep_alive: bool) -> None:
        """Write one complete response now (and close the connection unless keep-alive)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if not keep_alive:
            transport.close()

    def send_later(self, delay: float, data: bytes, keep_alive: bool) -> None:
        """Write the response after ``delay`` seconds; later requests on this connection wait."""
        if delay <= 0:
            self.send(data, keep_alive)
            return
        self._busy = True
        self._timer = self._server._loop.call_later(delay, self._deliver, data, keep_alive)

    def send_parts(self, parts: list[tuple[float, bytes]], keep_alive: bool) -> None:
        """Write each ``(delay, data)`` part after its delay (a stream with pauses); later
        requests on this connection wait for the last part."""
        delay, data = parts[0]
        rest = parts[1:]
        if not rest:
            self.send_later(delay, data, keep_alive)
            return
        self._busy = True

        def write() -> None:
            transport = self._transport
            if transport is None or transport.is_closing():
                self._busy = False
                return
            transport.write(data)
            self._timer = None
            self._busy = False
            self.send_parts(rest, keep_alive)

        self._timer = self._server._loop.call_later(delay, write)

    def _deliver(self, data: bytes, keep_alive: bool) -> None:
        self._busy = False
        self._timer = None
        self.send(data, keep_alive)
        if self._buffer:
            self._process()

    def _fail(self, status: int, message: str) -> None:
        self._buffer.clear()
        self.send(_response(status, _error_body(message, "invalid_request_error"), False), False)

    def _process(self) -> None:
        buffer = self._buffer
        transport = self._transport
        while buffer and not self._busy and transport is not None and not transport.is_closing():
            while buffer[:2] == b"\r\n":  # stray line breaks between requests are allowed
                del buffer[:2]
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD_BYTES:
                    self._fail(431, "request head too large")
                return
            lines = buffer[:end].decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                self._fail(400, "bad request line")
                return
            method, target, version = parts
            headers = {}
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if colon:
                    headers[name.strip().lower()] = value.strip()
            if "transfer-encoding" in headers:
                self._fail(501, "chunked request bodies are not supported")
                return
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                length = -1
            if length < 0:
                self._fail(400, "bad Content-Length")
                return
            if length > _MAX_BODY_BYTES:
                self._fail(413, "request body too large")
                return
            total = end + 4 + length
            if len(buffer) < total:
                if headers.get("expect", "").lower() == "100-continue" and len(buffer) == end + 4:
                    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                return
            body = bytes(buffer[end + 4 : total])
            del buffer[:total]
            connection = headers.get("connection", "").lower()
            if version == "HTTP/1.1":
                keep_alive = connection != "close"
            else:
                keep_alive = connection == "keep-alive"
            self._server._handle(self, method, target, headers, body, keep_alive)


class LoopbackServer:
    """The server, usable in-process: ``await start()``, then ``port`` / ``base_url``, ``await stop()``."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        latency: float = 0.0,
        random_faults: Mapping[str, float] | None = None,
        seed: int = 0,
        replies: Mapping[str, str] | None = None,
        retry_after: float = 1.0,
        hang_seconds: float = 3600.0,
        billing: str = "quarter",
        echo_auth: bool = False,
        batch_polls: int = 2,
        provider: str | None = None,
    ):
        if billing not in BILLING:
            raise ValueError(f"unknown billing {billing!r}; expected one of {', '.join(BILLING)}")
        self.billing = billing
        self.echo_auth = echo_auth
        self.provider = FAKES[provider] if provider else None
        self.streams = 0  # chat requests answered as a stream
        self.host = host
        self._requested_port = port
        self.latency = float(latency)
        self.retry_after = float(retry_after)
        self.hang_seconds = float(hang_seconds)
        self._fault_table = _parse_random_faults(random_faults)
        self._rng = random.Random(seed)
        self._replies = [(re.compile(pattern), str(reply)) for pattern, reply in (replies or {}).items()]
        self._ids = itertools.count(1)
        self._connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None
        self.requests = 0
        self.by_key: dict[str, int] = {}
        self.by_outcome: dict[str, int] = {}
        self.response_formats: dict[str, object] = {}
        self.batch_polls = batch_polls
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict] = {}
        self._polls: dict[str, int] = {}
        self._unlisted: set[str] = set()  # batches the list does not show yet ([[batch:late_create]])
        self.batch_requests = 0
        self._models_body = json.dumps(
            {"object": "list", "data": [{"id": "loopback", "object": "model"}]}
        ).encode()
        self._health_body = json.dumps({"status": "ok"}).encode()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), self.host, self._requested_port, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None

    def stats(self) -> dict:
        stats = {"requests": self.requests, "by_key": dict(self.by_key), "by_outcome": dict(self.by_outcome)}
        if self.batches:  # only once a batch was made: the plain stats keep their shape
            stats["batch_requests"] = self.batch_requests
            stats["batches"] = {b["id"]: b["status"] for b in self.batches.values()}
        if self.streams:  # only once a stream was asked for: the plain stats keep their shape
            stats["streams"] = self.streams
        if self.response_formats:  # only once a request carried one: the plain stats keep their shape
            stats["response_format"] = dict(self.response_formats)
        return stats

    def _handle(
        self, connection: _Connection, method: str, target: str, headers: dict, body: bytes, keep_alive: bool
    ):
        path = target.partition("?")[0]
        if method == "POST" and (path == "/v1/chat/completions" or path == "/chat/completions"):
            self._chat(connection, headers, body, keep_alive)
            return
        if path.startswith(("/v1/files", "/v1/batches")):
            status, data = self._batch_api(method, path, headers, body)
            connection.send(_response(status, data, keep_alive), keep_alive)
            return
        if method not in ("GET", "POST"):
            connection.send(
                _response(405, _error_body("method not allowed", "invalid_request_error"), False), False
            )
            return
        if method == "GET" and (path == "/v1/models" or path == "/models"):
            data = self._models_body
        elif method == "GET" and path == "/health":
            data = self._health_body
        elif method == "GET" and path == "/stats":
            data = json.dumps(self.stats()).encode()
        else:
            connection.send(_response(404, _not_found_body(method, path), keep_alive), keep_alive)
            return
        connection.send(_response(200, data, keep_alive), keep_alive)

    # -- the Batch API

    def _batch_api(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        parts = path.strip("/").split("/")  # v1, files|batches, [id], [content|cancel]
        now = int(time.time())
        if parts[1] == "files" and method == "POST" and len(parts) == 2:
            from email.parser import BytesParser
            from email.policy import HTTP

            message = BytesParser(policy=HTTP).parsebytes(
                b"Content-Type: " + headers.get("content-type", "").encode() + b"\r\n\r\n" + body
            )
            fields = {
                part.get_param("name", header="content-disposition"): part for part in message.iter_parts()
            }
            if "file" not in fields:
                return 400, _error_body("no file", "invalid_request_error")
            data = fields["file"].get_payload(decode=True)
            file_id = f"file-{len(self.files) + 1}"
            self.files[file_id] = data
            name = fields["file"].get_filename() or "batch.jsonl"
            return 200, json.dumps({"id": file_id, "object": "file", "bytes": len(data), "created_at": now,
                                    "filename": name, "purpose": "batch", "status": "processed"}).encode()  # fmt: skip
        if parts[1] == "files" and method == "GET" and len(parts) == 4 and parts[3] == "content":
            if parts[2] not in self.files:
                return 404, _error_body("no such file", "invalid_request_error")
            return 200, self.files[parts[2]]
        if parts[1] == "batches" and method == "POST" and len(parts) == 2:
            request = json.loads(body)
            if request.get("input_file_id") not in self.files:
                return 400, _error_body("unknown input_file_id", "invalid_request_error")
            batch_id = f"batch_{len(self.batches) + 1}"
            made = [b["id"] for b in self.batches.values() if b["input_file_id"] == request["input_file_id"]]
            late = b"[[batch:late_create]]" in self.files[request["input_file_id"]] and not made
            lose = late or (b"[[batch:lose_create]]" in self.files[request["input_file_id"]] and not made)
            self._unlisted.difference_update(made)
            if late:
                self._unlisted.add(batch_id)
            self.batches[batch_id] = {
                "id": batch_id, "object": "batch", "endpoint": request.get("endpoint"), "errors": None,
                "input_file_id": request["input_file_id"], "completion_window": request.get("completion_window"),
                "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                "in_progress_at": None, "expires_at": now + 86400, "completed_at": None, "failed_at": None,
                "expired_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
                "metadata": request.get("metadata"),
            }  # fmt: skip
            self._polls[batch_id] = 0
            if lose:
                return 502, _error_body("bad gateway", "server_error")
            return 200, json.dumps(self.batches[batch_id]).encode()
        if parts[1] == "batches" and method == "GET" and len(parts) == 2:
            listed = [
                b for b in reversed(self.batches.values()) if b["id"] not in self._unlisted
            ]  # newest first
            return 200, json.dumps({"object": "list", "data": listed, "has_more": False,
                                    "first_id": None, "last_id": None}).encode()  # fmt: skip
        if parts[1] == "batches" and method == "POST" and len(parts) == 4 and parts[3] == "cancel":
            if parts[2] not in self.batches:
                return 404, _error_body("no such batch", "invalid_request_error")
            self.batches[parts[2]].update(status="cancelled", cancelled_at=now)
            return 200, json.dumps(self.batches[parts[2]]).encode()
        if parts[1] == "batches" and method == "GET" and len(parts) == 3:
            batch = self.batches.get(parts[2])
            if batch is None:
                return 404, _error_body("no such batch", "invalid_request_error")
            self._advance(batch, now)
            return 200, json.dumps(batch).encode()
        return 404, _not_found_body(method, path)

    def _advance(self, batch: dict, now: int) -> None:
        if batch["status"] not in ("validating", "in_progress"):
            return
        self._polls[batch["id"]] += 1
        lines = [json.loads(x) for x in self.files[batch["input_file_id"]].splitlines() if x.strip()]
        batch["request_counts"]["total"] = len(lines)
        if batch["status"] == "validating":
            if any("[[batch:fail]]" in _joined_content(x["body"]["messages"]) for x in lines):
                batch.update(
                    status="failed",
                    failed_at=now,
                    errors={"object": "list", "data": [{"code": "invalid_file", "message": "failed"}]},
                )
                return
            batch.update(status="in_progress", in_progress_at=now)
        if self._polls[batch["id"]] < self.batch_polls:
            return
        output, errors, expired = [], [], False
        for line in lines:
            key, payload = line["custom_id"], line["body"]
            text = _joined_content(payload["messages"])
            if "[[batch:expire]]" in text:
                expired = True
                continue
            self.by_key[key] = self.by_key.get(key, 0) + 1
            self.batch_requests += 1
            if "[[batch:error]]" in text:
                errors.append({"id": f"br-{key[:8]}", "custom_id": key, "error": None,
                               "response": {"status_code": 500, "request_id": "r",
                                            "body": {"error": {"message": "server error", "type": "server_error"}}}})  # fmt: skip
                continue
            content = next(
                (reply for pattern, reply in self._replies if pattern.search(text)), "answer " + key[:12]
            )
            if "[[batch:malformed]]" in text:
                output.append({"id": f"br-{key[:8]}", "custom_id": key, "error": None,
                               "response": {"status_code": 200, "request_id": "r", "body": {"id": "x"}}})  # fmt: skip
                continue
            body = json.dumps(payload)
            usage = {"prompt_tokens": max(1, len(body) // 4), "completion_tokens": max(1, len(content) // 4)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            completion = {"id": f"chatcmpl-batch-{next(self._ids)}", "object": "chat.completion", "created": now,
                          "model": payload.get("model", "loopback"),
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                       "finish_reason": "stop"}], "usage": usage}  # fmt: skip
            output.append({"id": f"br-{key[:8]}", "custom_id": key, "error": None,
                           "response": {"status_code": 200, "request_id": "r", "body": completion}})  # fmt: skip
        for name, rows in (("output_file_id", output), ("error_file_id", errors)):
            if rows:
                file_id = f"file-{len(self.files) + 1}"
                self.files[file_id] = "".join(json.dumps(r) + "\n" for r in rows).encode()
                batch[name] = file_id
        batch["request_counts"].update(completed=len(output), failed=len(errors))
        batch.update(status="expired", expired_at=now) if expired else batch.update(
            status="completed", completed_at=now
        )

    def _count(self, outcome: str) -> None:
        self.by_outcome[outcome] = self.by_outcome.get(outcome, 0) + 1

    def _chat(self, connection: _Connection, headers: dict, body: bytes, keep_alive: bool) -> None:
        key = headers.get("x-request-key") or hashlib.sha256(body).hexdigest()
        arrival = self.by_key.get(key, 0) + 1
        self.by_key[key] = arrival
        self.requests += 1
        draw = self._rng.random() if self._fault_table else None

        try:
            payload = json.loads(body)
            if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
                raise ValueError("expected a JSON object with a 'messages' list")
            messages = payload["messages"]
            if "response_format" in payload:
                self.response_formats[key] = payload["response_format"]
                _check_response_format(payload["response_format"])
        except (ValueError, RecursionError) as e:
            self._count("400")
            message = f"invalid request: {e}"
            connection.send(
                _response(400, _error_body(message, "invalid_request_error"), keep_alive), keep_alive
            )
            return

        text = None
        if self.provider is not None:
            text = _joined_content(messages)
            refusal = self.provider.refusal(payload, text)
            if refusal is not None:
                self._count(str(refusal.status))
                data = json.dumps(self.provider.error_body(refusal)).encode()
                connection.send(_response(refusal.status, data, keep_alive), keep_alive)
                return
        streamed = payload.get("stream") is True
        fault = None
        retry_after = self.retry_after
        if _MARKER_PREFIX in body:
            text = _joined_content(messages)
            for match in _MARKER.finditer(text):
                limit = match.group(3)
                if limit is None or arrival <= int(limit):
                    fault = match.group(1)
                    if match.group(2):
                        retry_after = float(match.group(2))
                    break
        if fault is None and draw is not None:
            for bound, kind in self._fault_table:
                if draw < bound:
                    fault = kind
                    break
        self._count(fault or "ok")
        auth = headers.get("authorization", "") if self.echo_auth else ""

        if fault == "stream_error" and not streamed:
            fault = "500"
        if fault in _ERROR_BODIES:
            body = _ERROR_BODIES[fault]
            if auth:
                body = _error_body(f"request refused; it had Authorization: {auth}", "server_error")
            extra = f"Retry-After: {retry_after:g}\r\n" if fault == "429" else ""
            connection.send(_response(int(fault), body, keep_alive, extra), keep_alive)
            return
        if fault == "malformed" and not streamed:
            body = _MALFORMED_BODY + (f' "Authorization: {auth}"'.encode() if auth else b"")
            connection.send_later(self.latency, _response(200, body, keep_alive), keep_alive)
            return

        content = None
        if self._replies:
            if text is None:
                text = _joined_content(messages)
            for pattern, reply in self._replies:
                if pattern.search(text):
                    content = reply
                    break
        if content is None:
            content = "answer " + key[:12]
        if auth:
            content += f" (you sent {auth})"
        finish_reason = "stop"
        model = payload.get("model", "loopback")
        model = model if isinstance(model, str) else str(model)
        reasoning_field = self.provider.reasoning_field if self.provider else "reasoning_content"
        reasoning = THINK_TEXT if self.provider and reasoning_field and self.provider.thinks(model) else ""
        if fault == "empty":
            content = ""
        elif fault == "length":
            content = content[: len(content) // 2]
            finish_reason = "length"
        elif fault == "filter":  # what came before the cut, marked as the safety filter marks it
            content = content[: len(content) // 2]
            finish_reason = "content_filter"
        elif fault == "think":
            content = "<think>" + THINK_TEXT + "</think>" + content
        elif fault == "reasoning":
            reasoning = THINK_TEXT
            reasoning_field = reasoning_field or "reasoning_content"

        usage = None
        if self.billing != "none":
            if self.billing == "quarter":
                prompt_tokens, completion_tokens = max(1, len(body) // 4), max(1, len(content) // 4)
            else:
                if text is None:
                    text = _joined_content(messages)
                per = 1 if self.billing == "byte" else 16
                prompt_tokens = max(1, len(text.encode("utf-8")) // per)
                completion_tokens = max(1, len(content.encode("utf-8")) // per)
            usage = (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        delay = self.hang_seconds if fault == "hang" else self.latency
        if streamed:
            self.streams += 1
            options = payload.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            if self.provider is not None and not self.provider.stream_usage:
                include_usage = False
            parts = self._stream(model, content, reasoning_field, reasoning, finish_reason,
                                 usage if include_usage else None, include_usage, fault, auth)  # fmt: skip
            parts[0] = (delay, parts[0][1])
            connection.send_parts(parts, keep_alive and fault != "malformed")
            return
        extra = f",{json.dumps(reasoning_field)}:{json.dumps(reasoning)}" if reasoning else ""
        usage_text = _USAGE_TEMPLATE % usage if usage else ""
        data = _CHAT_TEMPLATE % (
            next(self._ids),
            time.time(),
            json.dumps(model),
            _html_safe_json(content) if auth else json.dumps(content),
            extra,
            finish_reason,
            usage_text,
        )
        connection.send_later(delay, _response(200, data.encode(), keep_alive), keep_alive)

    def _stream(self, model, content, reasoning_field, reasoning, finish_reason, usage, include_usage, fault, auth
                ) -> list[tuple[float, bytes]]:  # fmt: skip
        """The SSE answer as OpenAI streams it (https://platform.openai.com/docs/api-reference/chat-streaming):
        chunked ``chat.completion.chunk`` events, the finish_reason in the last choice chunk, then,
        with include_usage, a chunk whose ``choices`` is empty and which carries ``usage`` (every
        earlier chunk has ``usage: null``), then ``data: [DONE]``. Faults: ``malformed`` cuts the
        connection after the first piece of content; ``stream_error`` sends an error event there
        (quoting the Authorization header under --echo-auth); ``stall`` pauses there for
        --hang-seconds."""
        head = {"id": f"chatcmpl-loopback-{next(self._ids)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}  # fmt: skip

        def event(choices: list, **extra) -> bytes:
            chunk = {**head, "choices": choices, **extra}
            if include_usage and "usage" not in extra:
                chunk["usage"] = None
            data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        def delta(**fields) -> dict:
            return {"index": 0, "delta": fields, "finish_reason": None}

        first = [event([delta(role="assistant", content="")])]
        if reasoning:
            first.append(event([delta(**{reasoning_field: reasoning})]))
        half = len(content) // 2
        first.append(event([delta(content=content[:half])]))
        status = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        opening = status.encode() + b"".join(first)
        if fault == "malformed":  # cut: no more bytes, the connection closes
            return [(0.0, opening)]
        if fault == "stream_error":
            message = f"stream failed; it had Authorization: {auth}" if auth else "stream failed"
            error = json.dumps({"error": {"message": message, "type": "server_error"}}).encode()
            data = b"data: " + error + b"\n\n"
            rest = b"%x\r\n%s\r\n" % (len(data), data)
        else:
            rest = event([delta(content=content[half:])])
            rest += event([{"index": 0, "delta": {}, "finish_reason": finish_reason}])
            if usage is not None:
                rest += event([], usage={"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                         "total_tokens": usage[2]})  # fmt: skip
        done = b"data: [DONE]\n\n"
        rest += b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
        pause = self.hang_seconds if fault == "stall" else 0.0
        return [(0.0, opening), (pause, rest)]


# ---------------------------------------------------------------------------------------------
# Subprocess use


class ServerHandle:
    """A running subprocess server: ``base_url``, ``stats()``, ``process``."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path):
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"
        self._log_path = log_path

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as response:
            return json.loads(response.read())

    def log(self) -> str:
        """What the server wrote to stdout/stderr so far."""
        return self._log_path.read_text(errors="replace")


def _options_to_args(
    latency: float,
    random_faults: Mapping[str, float] | None,
    seed: int,
    replies: Mapping[str, str] | None,
    retry_after: float,
    hang_seconds: float,
    billing: str = "quarter",
    echo_auth: bool = False,
    batch_polls: int = 2,
    provider: str | None = None,
) -> list[str]:
    args = ["--latency", repr(float(latency)), "--seed", str(seed), "--batch-polls", str(batch_polls)]
    args += ["--provider", provider] if provider else []
    args += ["--retry-after", repr(float(retry_after)), "--hang-seconds", repr(float(hang_seconds))]
    args += ["--billing", billing] + (["--echo-auth"] if echo_auth else [])
    if random_faults:
        args += ["--random-faults", json.dumps(dict(random_faults))]
    if replies:
        args += ["--replies", json.dumps(dict(replies))]
    return args


@contextlib.contextmanager
def serve_in_subprocess(
    *,
    latency: float = 0.0,
    random_faults: Mapping[str, float] | None = None,
    seed: int = 0,
    replies: Mapping[str, str] | None = None,
    retry_after: float = 1.0,
    hang_seconds: float = 3600.0,
    billing: str = "quarter",
    echo_auth: bool = False,
    batch_polls: int = 2,
    provider: str | None = None,
    startup_timeout: float = 30.0,
) -> Iterator[ServerHandle]:
    """Run this file (standard library only) in a subprocess and yield its ``ServerHandle``.

    Waits for the port file (``startup_timeout`` seconds); raises RuntimeError with the server's
    output if it dies first. On exit sends SIGTERM, then kills after 5 s.
    """
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="loopback-server-") as tmp:
        port_file = Path(tmp) / "port"
        log_path = Path(tmp) / "server.log"
        command = [
            sys.executable,
            str(here),
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ]
        command += _options_to_args(
            latency,
            random_faults,
            seed,
            replies,
            retry_after,
            hang_seconds,
            billing,
            echo_auth,
            batch_polls,
            provider,
        )
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=here.parent,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + startup_timeout
            while not port_file.exists():
                if process.poll() is not None:
                    output = log_path.read_text(errors="replace")
                    raise RuntimeError(f"loopback server exited with code {process.returncode}:\n{output}")
                if time.monotonic() > deadline:
                    output = log_path.read_text(errors="replace")
                    raise RuntimeError(f"loopback server did not start within {startup_timeout} s:\n{output}")
                time.sleep(0.01)
            port = int(port_file.read_text())
            yield ServerHandle(process, port, log_path)
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


# ---------------------------------------------------------------------------------------------
# Command line


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    server = LoopbackServer(
        host=args.host,
        port=args.port,
        latency=args.latency,
        random_faults=json.loads(args.random_faults) if args.random_faults else None,
        seed=args.seed,
        replies=json.loads(args.replies) if args.replies else None,
        retry_after=args.retry_after,
        hang_seconds=args.hang_seconds,
        billing=args.billing,
        echo_auth=args.echo_auth,
        batch_polls=args.batch_polls,
        provider=args.provider,
    )
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.port_file:
        _write_port_file(args.port_file, server.port)
    else:
        print(f"loopback server on {server.base_url}", file=sys.stderr, flush=True)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--random-faults", help='JSON like {"429": 0.05, "500": 0.02}')
    parser.add_argument("--seed", type=int, default=0, help="seed for --random-faults")
    parser.add_argument("--replies", help='JSON {"regex": "reply", ...}; the first match is the content')
    parser.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds of 429 faults")
    parser.add_argument("--hang-seconds", type=float, default=3600.0, help="how long a hang fault waits")
    parser.add_argument("--billing", choices=BILLING, default="quarter", help="the usage each answer reports")
    parser.add_argument("--echo-auth", action="store_true", help="quote the Authorization header back")
    parser.add_argument("--batch-polls", type=int, default=2, help="retrievals before a batch is done")
    parser.add_argument(
        "--provider", choices=sorted(FAKES), help="answer as this provider (support/providers.py)"
    )
    args = parser.parse_args(argv)
    # Fail on bad options before binding, so a parent waiting for the port file sees the error.
    try:
        random_faults = json.loads(args.random_faults) if args.random_faults else {}
        replies = json.loads(args.replies) if args.replies else {}
        if not isinstance(random_faults, dict) or not isinstance(replies, dict):
            raise ValueError("--random-faults and --replies take JSON objects")
        _parse_random_faults(random_faults)
        for pattern in replies:
            re.compile(pattern)
    except (ValueError, re.error) as e:
        parser.error(str(e))
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
