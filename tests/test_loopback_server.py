"""The loopback OpenAI-compatible server: normal answers, replies, scripted faults and /stats."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest
from support.loopback_server import LoopbackServer, serve_in_subprocess

REPLIES = {r"capital of France": "Paris", r"capital": "some capital", r"^\s*$": "nothing"}


@pytest.fixture(scope="module")
def server():
    with serve_in_subprocess(replies=REPLIES, hang_seconds=30) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=10) as c:
        yield c


def new_key() -> str:
    return uuid.uuid4().hex


def ask(client, text: str, key: str | None = None, **kwargs):
    headers = {"X-Request-Key": key} if key else None
    return client.chat.completions.create(
        model="teacher-model", messages=[{"role": "user", "content": text}], extra_headers=headers, **kwargs
    )


def post_raw(server, text: str, key: str | None = None) -> tuple[int, dict, bytes]:
    """POST a chat request with urllib; (status, headers, raw body), also for error statuses."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["X-Request-Key"] = key
    request = urllib.request.Request(server.base_url + "/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, json.loads(response.read())


def test_fixed_endpoints(server):
    assert get_json(server.base_url + "/models") == (
        200,
        {"object": "list", "data": [{"id": "loopback", "object": "model"}]},
    )
    assert get_json(server.url + "/health") == (200, {"status": "ok"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/nope", timeout=10)
    assert info.value.code == 404
    assert "error" in json.loads(info.value.read())


def test_normal_answer(client):
    key = new_key()
    response = ask(client, "hello there", key=key)
    assert response.object == "chat.completion"
    assert response.model == "teacher-model"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "answer " + key[:12]
    assert choice.finish_reason == "stop"
    usage = response.usage
    assert usage.prompt_tokens >= 1 and usage.completion_tokens == len(choice.message.content) // 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_default_key_is_body_hash(server):
    status, _, raw = post_raw(server, "no key header")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "no key header"}]}).encode()
    assert status == 200
    assert (
        json.loads(raw)["choices"][0]["message"]["content"]
        == "answer " + hashlib.sha256(body).hexdigest()[:12]
    )


def test_replies_first_matching_regex(client):
    assert ask(client, "What is the capital of France?").choices[0].message.content == "Paris"
    assert ask(client, "What is the capital of Spain?").choices[0].message.content == "some capital"
    assert ask(client, "   ").choices[0].message.content == "nothing"


def test_429_with_retry_after(client):
    with pytest.raises(openai.RateLimitError) as info:
        ask(client, "x [[fault:429]]")
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.response.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError) as info:
        ask(client, "x [[fault:429@0.2]]")
    assert info.value.response.headers["retry-after"] == "0.2"


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors(client, status):
    with pytest.raises(openai.InternalServerError) as info:
        ask(client, f"x [[fault:{status}]]")
    assert info.value.status_code == status
    assert "error" in info.value.response.json()


def test_hang_hits_client_timeout(server, client):
    start = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        ask(client, "x [[fault:hang]]", timeout=0.5)
    assert time.monotonic() - start < 3
    assert get_json(server.url + "/health") == (200, {"status": "ok"})
    assert server.log() == ""  # the client hanging up leaves no traceback behind


def test_malformed_is_invalid_json(server):
    status, headers, raw = post_raw(server, "x [[fault:malformed]]")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(raw)
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)


def test_empty_length_think(client):
    key = new_key()
    assert ask(client, "x [[fault:empty]]", key=key).choices[0].message.content == ""
    choice = ask(client, "x [[fault:length]]", key=key).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == ("answer " + key[:12])[: len("answer " + key[:12]) // 2]
    choice = ask(client, "x [[fault:think]]", key=key).choices[0]
    assert choice.message.content == "<think>I reason about it.</think>answer " + key[:12]
    assert choice.finish_reason == "stop"


def test_reasoning_content_in_raw_json(server):
    status, _, raw = post_raw(server, "the capital of France [[fault:reasoning]]")
    message = json.loads(raw)["choices"][0]["message"]
    assert status == 200
    assert message["reasoning_content"] == "I reason about it."
    assert message["content"] == "Paris"


def test_first_n_arrivals_and_stats(server, client):
    before = server.stats()
    key = new_key()
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            ask(client, "x [[fault:500*2]]", key=key)
    assert ask(client, "x [[fault:500*2]]", key=key).choices[0].message.content == "answer " + key[:12]

    # The first marker that applies to this arrival wins.
    other = new_key()
    with pytest.raises(openai.RateLimitError) as info:
        ask(client, "[[fault:429@0.5*1]] then [[fault:503*2]]", key=other)
    assert info.value.response.headers["retry-after"] == "0.5"
    with pytest.raises(openai.InternalServerError) as info:
        ask(client, "[[fault:429@0.5*1]] then [[fault:503*2]]", key=other)
    assert info.value.status_code == 503
    assert (
        ask(client, "[[fault:429@0.5*1]] then [[fault:503*2]]", key=other).choices[0].finish_reason == "stop"
    )

    stats = server.stats()
    assert stats["by_key"][key] == 3 and stats["by_key"][other] == 3
    assert stats["requests"] == before["requests"] + 6
    delta = {k: v - before["by_outcome"].get(k, 0) for k, v in stats["by_outcome"].items()}
    assert {k: v for k, v in delta.items() if v} == {"500": 2, "ok": 2, "429": 1, "503": 1}


def test_bad_request_json(server):
    request = urllib.request.Request(server.base_url + "/chat/completions", data=b"{not json")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
    assert "error" in json.loads(info.value.read())


def test_random_faults_follow_the_seed():
    probabilities = {"500": 0.3, "429": 0.2}
    with serve_in_subprocess(random_faults=probabilities, seed=7) as handle:
        statuses = [post_raw(handle, f"q{i}")[0] for i in range(30)]
        stats = handle.stats()
    rng = random.Random(7)
    expected = []
    for _ in range(30):
        draw = rng.random()
        expected.append(500 if draw < 0.3 else 429 if draw < 0.5 else 200)
    assert statuses == expected
    assert stats["by_outcome"].get("ok", 0) == expected.count(200)


def test_startup_error_is_reported():
    with pytest.raises(RuntimeError, match="unknown fault kind"):
        with serve_in_subprocess(random_faults={"teapot": 0.5}):
            pass


def test_in_process_keep_alive_pipelining_and_close():
    """Two pipelined requests on one connection come back in order; Connection: close ends it."""

    def request(content: str, key: str, close: bool = False) -> bytes:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Key: {key}\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
        )
        return head.encode() + body

    async def read_response(reader) -> tuple[int, dict, bytes]:
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        body = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), headers, body

    async def main():
        server = LoopbackServer(latency=0.05)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request("a [[fault:length]]", "first") + request("b", "second", close=True))
            await writer.drain()
            first = await read_response(reader)
            second = await read_response(reader)
            assert await reader.read() == b""  # the server closed the connection
            writer.close()
            return first, second, server.stats()
        finally:
            await server.stop()

    first, second, stats = asyncio.run(main())
    assert first[0] == 200 and first[1]["connection"] == "keep-alive"
    assert json.loads(first[2])["choices"][0]["finish_reason"] == "length"
    assert second[0] == 200 and second[1]["connection"] == "close"
    assert json.loads(second[2])["choices"][0]["message"]["content"] == "answer second"
    assert stats == {"requests": 2, "by_key": {"first": 1, "second": 1}, "by_outcome": {"length": 1, "ok": 1}}
