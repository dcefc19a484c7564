"""The distillation client under faults, end to end against the loopback server.

Every request ends answered or failed with its reason and nothing hangs; a 429 pauses every
request to the endpoint; a ``kill -9`` loses no record and re-sends no answered request; the
budget stops at the cap and resumes when it is raised; the API key never reaches a file or a log;
``--dry-run`` sends nothing; a parser change re-reads stored answers and sends only the requests
whose prompts changed.

Fault markers (``[[fault:KIND]]``, see ``support.loopback_server``) ride inside the chunk texts, so
the server sees them in every prompt that quotes the chunk. A chunk with a marker is its own
document, so its marker does not leak into the context of other chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import metachunk.distill.pipelines
import pytest
from metachunk.distill.pipelines import STAGES
from metachunk.distill.run import run_task as run
from metachunk.distill.run import write_records
from support.distill_jobs import KEY_ENV, Job, cli_env, make_job
from support.fixtures import EMMA_SENTENCES
from support.loopback_server import THINK_TEXT, serve_in_subprocess

from metachunk.artifacts import read_run_log
from metachunk.teacher import Endpoint, TeacherConfig

REPO = Path(__file__).resolve().parents[1]
REWRITE, SUMMARY = STAGES["rewrite"], STAGES["summary"]
SECRET = (
    "sk-test+SECRET-1234567890"  # a "+": the echo escapes it as \u002B (tests/support/loopback_server.py)
)

# The refinement prompt (and only it) contains '"score"': its answers must parse as items.
ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'
REPLIES = {'"score"': ITEMS}

SENTENCES = EMMA_SENTENCES


def chunk_text(n: int, marker: str = "") -> str:
    """A unique English chunk (unique texts make unique requests), optionally with a fault marker."""
    return f"Passage {n}. {SENTENCES[n % len(SENTENCES)]} {marker}".strip()


@pytest.fixture(autouse=True)
def watchdog():
    """Nothing may hang. Without pytest-timeout: dump every thread's stack and exit after 600 s.
    (CLI runs also have their own subprocess timeout.)"""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def one_chunk_per_doc(chunks: dict[str, str]) -> dict[str, list[str]]:
    return {name: [text] for name, text in chunks.items()}


# --------------------------------------------------------------------------------------------
# 1. Every request ends answered or failed with its reason; nothing hangs
# --------------------------------------------------------------------------------------------

FAULTS = {  # chunk name -> marker
    "normal": "",
    "rate_limited": "[[fault:429@0.2*2]]",  # two 429s per request, then answered
    "error_500_once": "[[fault:500*1]]",
    "error_503_once": "[[fault:503*1]]",
    "error_500": "[[fault:500]]",
    "hang": "[[fault:hang]]",
    "malformed_once": "[[fault:malformed*1]]",
    "malformed": "[[fault:malformed]]",
    "empty": "[[fault:empty]]",
    "length": "[[fault:length]]",
    "think": "[[fault:think]]",
    "reasoning": "[[fault:reasoning]]",
}
MAX_RETRIES = 2
PARSE_RETRIES = 2
# chunk -> (reason the record fails with at reflection, arrivals of the failing request)
FAILS = {
    "error_500": ("http_500", MAX_RETRIES + 1),
    "hang": ("timeout", MAX_RETRIES + 1),
    "malformed": ("malformed_response", MAX_RETRIES + 1),
    "empty": ("empty", 1),  # ... for each of the PARSE_RETRIES + 1 attempts
    "length": ("length", 1),
}
# chunk -> arrivals of each stage's request before it is answered
ANSWERED = {
    "normal": 1,
    "rate_limited": 3,
    "error_500_once": 2,
    "error_503_once": 2,
    "malformed_once": 2,
    "think": 1,
    "reasoning": 1,
}


def test_every_request_ends_answered_or_failed_with_its_reason(tmp_path):
    chunks = {name: chunk_text(i, marker) for i, (name, marker) in enumerate(FAULTS.items())}
    with serve_in_subprocess(latency=0.01, replies=REPLIES, hang_seconds=30) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            one_chunk_per_doc(chunks),
            teacher={"timeout": 3.0, "max_retries": MAX_RETRIES},  # a normal answer takes 0.01 s
            parse_retries=PARSE_RETRIES,
        )
        done = job.cli("rewrite", timeout=60)  # raises TimeoutExpired if the run hangs
        stats = server.stats()
    # 5 of 12 chunks fail by design: past the default --max-failure-rate 0.25, so status 4, with
    # every record written.
    assert done.returncode == 4, done.stderr
    assert "5 of 12 chunks failed" in done.stderr and "Traceback" not in done.stderr
    by_key, records = stats["by_key"], job.records_by_doc()
    assert set(records) == set(FAULTS)

    for name, arrivals in ANSWERED.items():
        record = records[name]
        assert (record["status"], record["reason"]) == ("ok", ""), name
        assert record["output"], name
        for stage in REWRITE:
            entry = record["stages"][stage]
            assert entry["status"] == "ok" and entry["attempts"] == 1, (name, stage)
            assert by_key[entry["request_key"]] == arrivals, (name, stage)

    for name, (reason, arrivals) in FAILS.items():
        record = records[name]
        assert (record["status"], record["reason"], record["stage"]) == ("failed", reason, "reflection"), name
        assert list(record["stages"]) == ["reflection"], name  # nothing asked after the failure
        entry = record["stages"]["reflection"]
        assert (entry["status"], entry["reason"]) == ("failed", reason), name
        assert by_key[entry["request_key"]] == arrivals, name
        assert record["output"] is None

    assert records["error_500"]["stages"]["reflection"]["raw"]  # the error message is kept
    empty = records["empty"]["stages"]["reflection"]
    assert empty["attempts"] == PARSE_RETRIES + 1 and empty["text"] == ""
    assert records["length"]["stages"]["reflection"]["finish_reason"] == "length"
    assert records["length"]["stages"]["reflection"]["params"]["max_tokens"] == 64

    for stage in REWRITE:  # think: <think> kept in raw, stripped from the text, reasoning extracted
        entry = records["think"]["stages"][stage]
        assert entry["raw"].startswith("<think>" + THINK_TEXT + "</think>")
        assert "<think>" not in entry["text"] and "</think>" not in entry["text"]
        assert entry["reasoning"] == THINK_TEXT
        entry = records["reasoning"]["stages"][stage]
        assert entry["reasoning"] == THINK_TEXT and "<think>" not in entry["raw"]
    assert "<think>" not in records["think"]["output"]

    # Server and store agree: every request the server saw ended as a row in the store.
    assert {key for (key,) in job.query("SELECT DISTINCT key FROM answers")} == set(by_key)
    outcome = stats["by_outcome"]
    assert outcome["429"] == 2 * len(REWRITE)
    assert outcome["hang"] == MAX_RETRIES + 1
    assert outcome["empty"] == PARSE_RETRIES + 1
    meta = job.meta()
    assert meta["summary"]["outcome"] == {"ok": len(ANSWERED), "failed": len(FAILS)}


def test_length_is_asked_again_with_doubled_max_tokens_up_to_the_limit(tmp_path):
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            {"length": [chunk_text(0, "[[fault:length]]")]},
            teacher={"max_tokens": 64, "max_tokens_limit": 256},
        )
        result = run(job.config())
        first = server.stats()
        again = run(job.config())  # each size is its own stored request: nothing is sent again
        second = server.stats()
    # 64, 128 and 256 tokens: three requests, each cut short, since the fault is "always".
    assert first["by_outcome"] == {"length": 3}
    assert sorted(first["by_key"].values()) == [1, 1, 1]
    (record,) = result.records
    assert (record["status"], record["reason"], record["stage"]) == ("failed", "length", "reflection")
    entry = record["stages"]["reflection"]
    assert entry["finish_reason"] == "length" and entry["params"]["max_tokens"] == 256
    assert second["requests"] == first["requests"] and again.sent == 0
    assert again.records[0]["stages"]["reflection"]["request_key"] == entry["request_key"]


# --------------------------------------------------------------------------------------------
# 2. After a 429 every request to the endpoint waits out the pause
# --------------------------------------------------------------------------------------------


def test_429_pauses_every_request_to_the_endpoint():
    sends: list[tuple[str, float]] = []  # (request key, when it left, after any pause)

    noted: list[float] = []  # when the 429's response reached the endpoint's hook

    class Probe(Endpoint):
        async def _wait_out_pause(self, request):
            await super()._wait_out_pause(request)
            sends.append((request.headers["x-request-key"], time.monotonic()))

        async def _note_rate_limit(self, response):
            noted.append(time.monotonic())
            await super()._note_rate_limit(response)

    def payload(text: str) -> dict:
        return {"model": "loopback", "messages": [{"role": "user", "content": text}], "max_tokens": 8}

    async def scenario(base_url: str):
        endpoint = Probe(TeacherConfig(model="loopback", base_url=base_url, concurrency=4, max_retries=2))
        try:
            limited = asyncio.ensure_future(
                endpoint.post(payload("limited [[fault:429@1*1]]"), "limited", 10)
            )
            while endpoint.pause_until == 0.0:  # wait for the 429 to come back
                await asyncio.sleep(0.002)
            noticed, pause_end = time.monotonic(), endpoint.pause_until
            others = [endpoint.post(payload(f"normal {i}"), f"normal-{i}", 10) for i in range(6)]
            responses = await asyncio.gather(limited, *others)
            return noticed, pause_end, responses
        finally:
            await endpoint.close()

    with serve_in_subprocess(latency=0.0) as server:
        noticed, pause_end, responses = asyncio.run(asyncio.wait_for(scenario(server.base_url), 20))
        stats = server.stats()

    assert all(json.loads(body)["choices"][0]["finish_reason"] == "stop" for body in responses)
    assert len(responses) == 7 and stats["by_outcome"] == {"429": 1, "ok": 7}
    # Retry-After: 1, counted from the response (a stall of the polling loop above must not count)
    assert abs(pause_end - noted[0] - 1.0) < 0.05 and pause_end - noticed <= 1.1
    assert [key for key, _ in sends].count("limited") == 2
    first_limited = next(t for key, t in sends if key == "limited")
    later = [(key, t) for key, t in sends if t > first_limited]
    assert len(later) == 7  # the retry and the six new requests
    for key, t in later:
        assert t >= pause_end, f"{key} left {pause_end - t:.3f} s before the pause ended"


def test_a_stop_between_an_answer_and_its_row_keeps_the_answer(tmp_path):
    """SIGTERM raises `Stopped` wherever the main thread is. Between a paid answer's arrival and its
    row in the store it lost the answer (and its claim's reservation), and the rerun paid again."""
    from metachunk.stopping import Stopped
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherPool

    class StoppedAtThePut(AnswerStore):
        stops = 1

        def put(self, answer, calibration=None):
            if self.stops and answer.ok:  # the signal lands just before the answer's row is written
                self.stops -= 1
                raise Stopped(signal.SIGTERM)
            super().put(answer, calibration)

    store = StoppedAtThePut(tmp_path / "a.sqlite")
    with serve_in_subprocess(latency=0.0) as server:
        pool = TeacherPool(
            {"s": TeacherConfig("loopback", base_url=server.base_url, max_retries=0)}, {}, store
        )
        with pytest.raises(Stopped):
            asyncio.run(asyncio.wait_for(pool["s"].complete([{"role": "user", "content": "hi"}], "sha"), 20))
        assert server.stats()["requests"] == 1
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT status FROM answers").fetchall() == [("ok",)]
    assert store.claims_held() == 0
    store.close()


def test_a_real_sigterm_after_the_answer_arrived_keeps_it(tmp_path, monkeypatch):
    """A real SIGTERM delivered while the answer is being read (before any row exists) raised `Stopped`
    right there, and the paid answer was stored as a cancelled send: the rerun paid again. Under
    `stopping.run` the signal cancels the run's task at its next ``await``, after the answer's row."""
    import metachunk.teacher as teacher
    from metachunk.stopping import Stopped, run, stop_on_signals
    from metachunk.store import AnswerStore
    from metachunk.teacher import Price, TeacherPool

    real, fired = teacher.read_usage, []

    def read_usage_then_sigterm(raw):
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode boundary
        return real(raw)

    monkeypatch.setattr(teacher, "read_usage", read_usage_then_sigterm)
    messages = [{"role": "user", "content": "hi there"}]
    with serve_in_subprocess(latency=0.0) as server:
        for attempt in (1, 2):
            store = AnswerStore(tmp_path / "a.sqlite")
            config = TeacherConfig("loopback", base_url=server.base_url, max_retries=0)
            pool = TeacherPool({"s": config}, {"loopback": Price(1.0, 1.0)}, store)
            with stop_on_signals():
                if attempt == 1:
                    with pytest.raises(Stopped):
                        run(pool["s"].complete(messages, "sha"))
                else:
                    assert run(pool["s"].complete(messages, "sha")).cached
            with sqlite3.connect(store.path) as db:
                assert db.execute("SELECT status FROM answers").fetchall() == [("ok",)]
            assert store.claims_held() == 0
            store.close()
        assert server.stats()["requests"] == 1  # paid once


def test_a_streams_timeout_counts_from_the_try_that_answered():
    """``timeout`` bounds a stream from when its request left. It was counted from the first try,
    so a 429's pause longer than the timeout cut the answered stream at its first byte: a send
    counted at its worst case, and sent again."""

    async def scenario(base_url: str) -> str:
        cfg = TeacherConfig(model="loopback", base_url=base_url, stream=True, timeout=1.0, max_retries=2)
        endpoint = Endpoint(cfg)
        try:
            text = "paused longer than the timeout [[fault:429@1.5*1]][[fault:stall*2]]"
            payload = {"model": "loopback", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
            return await endpoint.post(payload, "paused", 10)
        finally:
            await endpoint.close()

    with serve_in_subprocess(latency=0.0, hang_seconds=0.3) as server:  # the answer stalls 0.3 s mid-stream
        body = asyncio.run(asyncio.wait_for(scenario(server.base_url), 20))
        stats = server.stats()
    assert json.loads(body)["choices"][0]["finish_reason"] == "stop"
    assert stats["by_outcome"] == {"429": 1, "stall": 1}


# --------------------------------------------------------------------------------------------
# 3. kill -9 mid-run: no record lost, no answered request sent again
# --------------------------------------------------------------------------------------------


STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])


@STREAMED
def test_kill_9_loses_nothing_and_resends_nothing_answered(tmp_path, stream):
    docs = {f"doc{d:02d}": [chunk_text(3 * d + i) for i in range(3)] for d in range(40)}
    n_chunks = sum(len(texts) for texts in docs.values())
    total = n_chunks * len(REWRITE)  # every chunk keeps its item, so it needs all three stages
    # seeded: a failure reruns at the same kill point
    target = random.Random(15).randint(total // 5, total * 7 // 10)
    with serve_in_subprocess(latency=0.03, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, docs, teacher={"concurrency": 8, "stream": stream})
        with open(tmp_path / "first.stderr", "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config", str(job.recipe)],
                cwd=REPO,
                env=cli_env(),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            deadline = time.monotonic() + 60
            while count_rows(job) < target:
                assert process.poll() is None, (tmp_path / "first.stderr").read_text()  # ended too soon
                assert time.monotonic() < deadline, "the run made no progress"
                time.sleep(0.003)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()  # no-op once it is dead
            process.wait()
        answered = {key for (key,) in job.query("SELECT key FROM answers WHERE status = 'ok'")}
        assert target <= len(answered) < total, f"killed too late to test anything ({len(answered)} rows)"
        before = server.stats()

        rerun = job.cli("rewrite")
        after = server.stats()

    assert rerun.returncode == 0, rerun.stderr
    assert bool(after.get("streams")) == stream  # the answers really came as streams
    records = job.records()
    assert len(records) == n_chunks
    assert {(r["doc_id"], r["chunk_index"]) for r in records} == {(d, i) for d in docs for i in range(3)}
    assert all(r["status"] == "ok" and r["output"] for r in records)

    resent = {key for key in answered if after["by_key"][key] != 1}
    assert not resent, f"{len(resent)} answered requests were sent again"
    # Only the requests in flight at the kill (never answered) are sent twice.
    in_flight = {key for key, n in after["by_key"].items() if n > 1}
    assert len(in_flight) <= 8 and in_flight <= set(before["by_key"]) - answered
    wanted = {r["stages"][s]["request_key"] for r in records for s in REWRITE}
    assert set(after["by_key"]) <= wanted  # nothing asked that the records do not need

    assert job.query("SELECT key FROM answers WHERE status = 'ok' GROUP BY key HAVING COUNT(*) > 1") == []
    ok_keys = {key for (key,) in job.query("SELECT key FROM answers WHERE status = 'ok'")}
    assert ok_keys == {r["stages"][s]["request_key"] for r in records for s in REWRITE}
    assert len(ok_keys) == total


def count_rows(job: Job) -> int:
    try:
        return job.query("SELECT COUNT(*) FROM answers")[0][0]
    except sqlite3.OperationalError:  # not created yet
        return 0


# --------------------------------------------------------------------------------------------
# 4. The budget stops at the cap and resumes when it is raised
# --------------------------------------------------------------------------------------------

# Every request costs exactly $1, so the cap's arithmetic is exact: output only, at $1/16 per
# token, and every answer is exactly max_tokens = 16 tokens long (the server counts 4 chars a token).
# Concurrency 1 runs two chunks at a time, so the budget stops the run before most chunks start.
EXACT_TEACHER = {"max_tokens": 16, "concurrency": 1}
EXACT_PRICES = {"loopback": {"input": 0.0, "output": 1e6 / 16}}
EXACT_REPLIES = {
    '"score"': '[{"missing": "who", "supplement": "Emma", "score": 9}]'.ljust(64),
    "^": "A rewritten chunk that says who she is.".ljust(64, "."),
}


def outcomes(records: list[dict]) -> list[tuple]:
    """What a record says and which answers it holds."""
    return [
        (r["doc_id"], r["status"], r["reason"], r.get("stage"), r["output"])
        + tuple(
            (s, e["status"], e.get("request_key") if e["status"] == "ok" else "")
            for s, e in r["stages"].items()
        )
        for r in records
    ]


def test_budget_stops_at_the_cap_and_resumes_when_raised(tmp_path, capsys):
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(8)})
    with serve_in_subprocess(latency=0.01, replies=EXACT_REPLIES) as server:
        job = make_job(tmp_path, server.base_url, docs, teacher=EXACT_TEACHER, prices=EXACT_PRICES)

        assert job.main("rewrite", "--max-cost", "10.5") == 3
        err = capsys.readouterr().err
        assert "stopped at the budget: the store's spend is $10.0000 against --max-cost 10.5" in err
        first = server.stats()
        records = job.records()
        assert len(records) == 8
        assert {r["status"] for r in records} == {"ok", "pending"}
        for record in records:
            if record["status"] == "pending":
                assert record["reason"] == "budget"
                assert record["stages"][record["stage"]]["status"] == "pending"
        assert first["requests"] == 10
        assert job.query("SELECT COUNT(*), SUM(cost), MIN(status), MAX(status) FROM answers") == [
            (10, 10.0, "ok", "ok")
        ]
        assert job.last_run()["stopped"] == "budget"
        assert job.meta()["summary"]["cost"] == 10.0

        assert job.main("rewrite", "--max-cost", "10.5") == 3
        assert server.stats()["requests"] == first["requests"]  # nothing more fits under the cap
        assert outcomes(job.records()) == outcomes(records)  # and the records still show every answer

        assert job.main("rewrite", "--max-cost", "100") == 0
        final = server.stats()
    assert all(r["status"] == "ok" for r in job.records())
    assert final["requests"] == 24 and set(final["by_key"].values()) == {1}  # nothing sent twice
    assert set(first["by_key"]) <= set(final["by_key"])
    assert job.query("SELECT COUNT(*), SUM(cost) FROM answers") == [(24, 24.0)]


def test_budget_with_estimated_prompt_cost_never_passes_the_cap(tmp_path):
    """Real prices: each request reserves its estimated worst case, so the spend stays under the cap."""
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(12)})
    prices = {"loopback": {"input": 1.0, "output": 2.0}}
    cap = 0.01
    with serve_in_subprocess(latency=0.01, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, docs, teacher={"concurrency": 4}, prices=prices)
        stopped = run(job.config(max_cost=cap))
        first = server.stats()
        ((spent,),) = job.query("SELECT SUM(cost) FROM answers")
        raised = run(job.config(max_cost=1.0))
        final = server.stats()
    assert stopped.stopped == "budget"
    assert 0 < first["requests"] < 3 * 12
    assert 0 < spent <= cap
    assert {r["status"] for r in stopped.records} == {"ok", "pending"}
    assert raised.stopped == "" and all(r["status"] == "ok" for r in raised.records)
    assert set(final["by_key"].values()) == {1}


# --------------------------------------------------------------------------------------------
# 5. The API key never reaches a file or a log
# --------------------------------------------------------------------------------------------


def test_api_key_never_reaches_a_file_or_a_log(tmp_path):
    chunks = {
        "normal": chunk_text(0),
        "error_500": chunk_text(1, "[[fault:500]]"),
        "rate_limited": chunk_text(2, "[[fault:429@0.1*1]]"),
        "malformed": chunk_text(3, "[[fault:malformed]]"),
        "empty": chunk_text(4, "[[fault:empty]]"),
    }
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            one_chunk_per_doc(chunks),
            teacher={"api_key_env": KEY_ENV, "max_retries": 1},
            prices={"loopback": {"input": 1.0, "output": 2.0}},
            progress=True,
        )
        done = job.cli("rewrite", "--max-failure-rate", "1", env=cli_env(**{KEY_ENV: SECRET}))
        # The same run with the variable unset: a clear error naming it, and nothing else
        # (OPENAI_API_KEY must not be picked up as a fallback either).
        missing = job.cli("rewrite", env=cli_env(OPENAI_API_KEY=SECRET))
    assert done.returncode == 0, done.stderr
    assert {r["status"] for r in job.records()} == {"ok", "failed"}  # errors were recorded
    assert job.query("SELECT COUNT(*) FROM answers WHERE status = 'error'")[0][0] > 0

    assert missing.returncode == 2
    assert KEY_ENV in missing.stderr and "not set" in missing.stderr
    assert "Traceback" not in missing.stderr

    leaks = [p for p in sorted(tmp_path.rglob("*")) if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
    files = {p.name for p in job.out.iterdir()}
    assert {"rewrite.jsonl", "rewrite.meta.json", "answers.sqlite"} <= files
    for captured in (done, missing):
        assert SECRET not in captured.stdout and SECRET not in captured.stderr


def test_api_key_is_read_from_the_named_variable(monkeypatch):
    """The key the client sends is the variable's value (so the scan above is not vacuous)."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    endpoint = Endpoint(TeacherConfig(model="loopback", api_key_env=KEY_ENV))
    try:
        assert endpoint.client.api_key == SECRET
    finally:
        asyncio.run(endpoint.close())


# --------------------------------------------------------------------------------------------
# 6. --dry-run sends nothing; status after a partial run
# --------------------------------------------------------------------------------------------


def table(stdout: str, first_words: tuple[str, ...]) -> dict[str, list[str]]:
    """Rows of a printed table by their first word (whitespace-split)."""
    rows = {}
    for line in stdout.splitlines():
        words = line.split()
        if words and words[0] in first_words:
            rows[words[0]] = words[1:]
    return rows


def test_dry_run_sends_nothing_and_status_counts_a_partial_run(tmp_path):
    chunks = {
        "c0": chunk_text(0),
        "c1": chunk_text(1, "[[fault:empty]]"),
        "c2": chunk_text(2, "[[fault:length]]"),
        "c3": chunk_text(3, "[[fault:500]]"),
        **{f"c{i}": chunk_text(i) for i in range(4, 8)},
    }
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            one_chunk_per_doc(chunks),
            teacher={"max_retries": 1},
            prices={"loopback": {"input": 1.0, "output": 2.0}},
        )
        dry = job.cli("rewrite", "--dry-run")
        assert server.stats()["requests"] == 0
        assert not job.records_path.exists()
        partial = job.main("rewrite", "--limit", "4", "--max-failure-rate", "1")  # c0-c3 only, 3 fail
        sent = server.stats()["requests"]
        status = job.cli("status")
        dry_after = job.cli("rewrite", "--dry-run")
        assert server.stats()["requests"] == sent

    assert dry.returncode == 0, dry.stderr
    assert "nothing sent" in dry.stdout
    rows = table(dry.stdout, (*REWRITE, "total"))
    assert [rows[stage][1:3] for stage in REWRITE] == [["8", "0"]] * 3  # model, calls, cached
    calls, cached, _, _, cost = rows["total"]
    assert (calls, cached) == ("24", "0") and float(cost) > 0

    assert partial == 0
    outcome = {r["doc_id"]: (r["status"], r["reason"]) for r in job.records()}
    assert outcome == {
        "c0": ("ok", ""),
        "c1": ("failed", "empty"),
        "c2": ("failed", "length"),
        "c3": ("failed", "http_500"),
    }

    # Status replays all 8 chunks against the store. The transport failure (c3) shows as failed
    # with its reason (the next run sends it again, and the dry run counts it as a call to send).
    # Empty and cut-short answers are paid answers: they stay failed.
    assert status.returncode == 0, status.stderr
    assert "rewrite: 8 chunks" in status.stdout
    rows = table(status.stdout, REWRITE)
    counts = {stage: [int(x) for x in rows[stage][:3]] for stage in REWRITE}  # done, failed, pending
    assert counts == {"reflection": [1, 3, 4], "refinement": [1, 0, 0], "completion": [1, 0, 0]}
    assert "empty 1, http_500 1, length 1" in " ".join(rows["reflection"])

    assert dry_after.returncode == 0, dry_after.stderr
    rows = table(dry_after.stdout, ("total",))
    assert rows["total"][:2] == ["15", "5"]  # c3-c7 still need 3 calls; c0-c2 read 5 answers


# --------------------------------------------------------------------------------------------
# 7. A parser change re-reads stored answers and sends only the prompts it changed
# --------------------------------------------------------------------------------------------


def test_parser_change_rereads_stored_answers(tmp_path, monkeypatch):
    two_items = (
        '[{"missing": "who she is", "supplement": "Emma Woodhouse", "score": 9},'
        ' {"missing": "where", "supplement": "at Hartfield", "score": 8}]'
    )
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(4)})
    with serve_in_subprocess(latency=0.0, replies={'"score"': two_items}) as server:
        job = make_job(tmp_path, server.base_url, docs)
        first = run(job.config())
        before = server.stats()

        original = metachunk.distill.pipelines.parse_items

        def first_item_only(text):
            items = original(text)
            return None if items is None else items[:1]

        monkeypatch.setattr(metachunk.distill.pipelines, "parse_items", first_item_only)
        second = run(job.config())
        after = server.stats()

    assert before["requests"] == 3 * 4
    assert all(r["status"] == "ok" for r in [*first.records, *second.records])
    assert second.sent == 4 and second.cached == 2 * 4
    new_keys = set(after["by_key"]) - set(before["by_key"])
    assert after["requests"] - before["requests"] == len(new_keys) == 4
    for old, new in zip(first.records, second.records, strict=True):
        for stage in ("reflection", "refinement"):
            key = new["stages"][stage]["request_key"]
            assert key == old["stages"][stage]["request_key"] and after["by_key"][key] == 1  # from the store
        assert len(old["stages"]["refinement"]["kept"]) == 2
        assert len(new["stages"]["refinement"]["kept"]) == 1
        assert new["stages"]["completion"]["request_key"] in new_keys


# --------------------------------------------------------------------------------------------
# Summary pipeline smoke run
# --------------------------------------------------------------------------------------------


def test_summary_pipeline_against_the_loopback_server(tmp_path):
    docs = {"doc0": [chunk_text(0), chunk_text(1)], "doc1": [chunk_text(2)]}
    with serve_in_subprocess(latency=0.005) as server:
        job = make_job(tmp_path, server.base_url, docs, task="summary")
        cfg = job.config()
        result = run(cfg)
        summary = write_records(cfg, result)
        stats = server.stats()
    assert stats["by_outcome"] == {"ok": 3 * 3} and set(stats["by_key"].values()) == {1}
    assert summary["outcome"] == {"ok": 3}
    for record in job.records():
        assert record["status"] == "ok" and record["task"] == "summary"
        assert [record["stages"][s]["status"] for s in SUMMARY] == ["ok"] * 3
        fuse = record["stages"]["summary_fuse"]
        assert record["output"] == fuse["text"] == "answer " + fuse["request_key"][:12]


def test_a_stop_as_the_records_land_still_logs_what_the_attempt_paid(tmp_path, monkeypatch):
    """A SIGTERM between the records' rename and the run-log line left a paid attempt unlogged."""
    import signal

    from metachunk import artifacts
    from metachunk.stopping import Stopped, stop_on_signals

    docs = {"doc0": [chunk_text(0)]}
    with serve_in_subprocess(latency=0.0) as server:
        job = make_job(tmp_path, server.base_url, docs, task="summary")
        cfg = job.config()
        result = run(cfg)
    real_commit = artifacts.OutputPair.commit

    def commit_then_sigterm(pair, manifest):
        real_commit(pair, manifest)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(artifacts.OutputPair, "commit", commit_then_sigterm)
    with pytest.raises(Stopped), stop_on_signals():
        write_records(cfg, result)
    (line,) = (Path(cfg.out) / "runs.jsonl").read_text().splitlines()
    assert json.loads(line)["requests_sent"] == result.sent == 3
    assert [r["status"] for r in job.records()] == ["ok"]


# --------------------------------------------------------------------------------------------
# 8. The budget holds whatever the server bills; a rerun under the same cap sends nothing
# --------------------------------------------------------------------------------------------

# $10 per 1M tokens each way: a ~1.5 KB prompt billed a token per byte costs ~$0.015.
BILLED_PRICES = {"loopback": {"input": 10.0, "output": 10.0}}
BILLED_CONCURRENCY = 4


@STREAMED
@pytest.mark.parametrize("billing, cap", [("byte", 0.1), ("none", 0.1), ("low", 0.04)])
def test_budget_holds_whatever_the_server_bills(tmp_path, capsys, billing, cap, stream):
    """``byte``: a token per prompt byte (more than the old bytes/3 estimate); ``none``: no usage
    at all; ``low``: a token per 16 bytes (far below any estimate). Streamed: the usage comes in
    the stream's last chunk (``none``: it never comes)."""
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(16)})
    with serve_in_subprocess(latency=0.02, replies=REPLIES, billing=billing) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            docs,
            teacher={"concurrency": BILLED_CONCURRENCY, "stream": stream},
            prices=BILLED_PRICES,
            max_cost=cap,
        )
        code = job.main("rewrite")
        err = capsys.readouterr().err
        first = server.stats()["requests"]
        again = job.main("rewrite")
        second = server.stats()["requests"]

    rows = job.query("SELECT cost, usage_estimated, prompt_tokens, completion_tokens FROM answers")
    spent = sum(cost for cost, *_ in rows)
    # The stated bound: what the requests in flight when the cap was reached were billed.
    in_flight_bound = BILLED_CONCURRENCY * max(cost for cost, *_ in rows)
    assert code == 3 and again == 3, err
    assert 0 < spent <= cap + in_flight_bound
    # Reservations are upper bounds from the first request on (1 token per byte until the
    # endpoint is calibrated), so in fact nothing passes the cap at all.
    assert spent <= cap
    assert f"the store's spend is ${spent:.4f} against --max-cost {cap}" in err
    assert second == first  # the rerun under the same cap found nothing more that fits
    assert all(cost > 0 and p > 0 and c > 0 for cost, _, p, c in rows)  # never $0, never 0 tokens
    estimated = {bool(e) for _, e, *_ in rows}
    assert estimated == ({True} if billing == "none" else {False})
    if billing == "none":
        entries = [e for r in job.records() for e in r["stages"].values() if e["status"] == "ok"]
        assert entries and all(e["usage_estimated"] for e in entries)
    else:  # the endpoint's largest billed tokens per prompt byte is kept in the store
        ((ratio,),) = job.query("SELECT tokens_per_byte FROM calibration")
        assert ratio == pytest.approx(1.0 if billing == "byte" else 1 / 16, rel=0.05)


# --------------------------------------------------------------------------------------------
# 9. Two runs sharing one answer store never pay twice, and share the cap
# --------------------------------------------------------------------------------------------


def start_cli(job: Job, *flags: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "metachunk.cli", "distill", job.task, "--config", str(job.recipe), *flags],
            cwd=REPO,
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=f,
        )


@STREAMED
def test_two_runs_sharing_a_store_never_pay_twice(tmp_path, stream):
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(24)})
    # 0.2 s a request: a run needs 3 s or more, so the second starts while the first still sends
    with serve_in_subprocess(latency=0.2, replies=REPLIES) as server:
        teacher = {"concurrency": 4, "stream": stream}
        job = make_job(tmp_path, server.base_url, docs, teacher=teacher, prices=BILLED_PRICES)
        store = str(tmp_path / "shared.sqlite")
        runs = [
            start_cli(job, "--cache", store, "--out", str(tmp_path / f"run{n}"), log=tmp_path / f"{n}.log")
            for n in (1, 2)
        ]
        codes = [p.wait(timeout=120) for p in runs]
        stats = server.stats()
    logs = [(tmp_path / f"{n}.log").read_text() for n in (1, 2)]
    assert codes == [0, 0], "\n\n".join(logs)  # a str is shown whole; a list of logs would be cut
    assert set(stats["by_key"].values()) == {1}  # every request body reached the server once
    assert stats.get("streams", 0) == (stats["requests"] if stream else 0)
    assert stats["requests"] == 24 * len(REWRITE)
    for n in (1, 2):
        records = [json.loads(line) for line in (tmp_path / f"run{n}" / "rewrite.jsonl").open()]
        assert len(records) == 24 and all(r["status"] == "ok" and r["output"] for r in records)
    waited = [read_run_log(tmp_path / f"run{n}")[-1] for n in (1, 2)]
    assert sum(s["requests_sent"] for s in waited) == stats["requests"]  # each paid only its own share
    # They ran at once: both sent, or one waited for answers the other had claimed and was still paying for
    # (a run that started after the other finished would have read them all from the store, waiting for none).
    assert all(s["requests_sent"] > 0 for s in waited) or any(s["answers_waited_for"] > 0 for s in waited)
    db = sqlite3.connect(store)
    assert db.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0  # every claim was released
    db.close()


def test_two_runs_sharing_a_store_share_one_cap(tmp_path):
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(24)})
    cap = 0.05
    with serve_in_subprocess(latency=0.05, replies=REPLIES, billing="byte") as server:
        job = make_job(tmp_path, server.base_url, docs, teacher={"concurrency": 4}, prices=BILLED_PRICES)
        store = str(tmp_path / "shared.sqlite")
        flags = ("--cache", store, "--max-cost", str(cap))
        runs = [
            start_cli(job, *flags, "--out", str(tmp_path / f"run{n}"), log=tmp_path / f"{n}.log")
            for n in (1, 2)
        ]
        codes = [p.wait(timeout=120) for p in runs]
        stats = server.stats()
    assert codes == [3, 3], [(tmp_path / f"{n}.log").read_text() for n in (1, 2)]
    assert set(stats["by_key"].values()) == {1}
    db = sqlite3.connect(store)
    spent, most = db.execute("SELECT SUM(cost), MAX(cost) FROM answers").fetchone()
    db.close()
    assert 0 < spent <= cap + 2 * 4 * most  # the cap plus what both runs had in flight
    assert spent <= cap  # in fact: the reservations are upper bounds and shared


# --------------------------------------------------------------------------------------------
# 10. Exit codes a script can trust
# --------------------------------------------------------------------------------------------


def test_failure_rate_sets_the_exit_status_and_a_rerun_retries_transport_failures(tmp_path):
    chunks = {f"c{i}": chunk_text(i) for i in range(4)} | {"bad": chunk_text(9, "[[fault:500]]")}
    with serve_in_subprocess(latency=0.0, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, one_chunk_per_doc(chunks), teacher={"max_retries": 0})
        assert job.main("rewrite") == 0  # 1 of 5 failed: within the default 0.25
        first = server.stats()["by_outcome"]["500"]
        assert job.main("rewrite", "--max-failure-rate", "0.1") == 4
        assert server.stats()["by_outcome"]["500"] == first + 1  # the transport failure was sent again
        assert {r["status"] for r in job.records()} == {"ok", "failed"}  # and recorded, not dropped
        all_bad = make_job(
            tmp_path / "all", server.base_url, one_chunk_per_doc({"bad": chunk_text(9, "[[fault:500]]")}),
            teacher={"max_retries": 0},
        )  # fmt: skip
        assert all_bad.main("rewrite", "--max-failure-rate", "1") == 4  # every record failed


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_stops_the_run_early_with_one_line(tmp_path):
    port = closed_port()
    url = f"http://127.0.0.1:{port}/v1"
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(40)})
    teacher = {"max_retries": 1, "concurrency": 4, "max_connection_errors": 6, "api_key_env": KEY_ENV}
    job = make_job(tmp_path, url, docs, teacher=teacher)
    started = time.monotonic()
    done = job.cli("rewrite", timeout=120, env=cli_env(**{KEY_ENV: SECRET}))
    seconds = time.monotonic() - started
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr and SECRET not in done.stderr + done.stdout
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("metachunk:")]
    assert f"cannot connect to {url}" in line
    records = job.records()  # written, every one failed in transport or never sent
    assert len(records) == 40 and {r["status"] for r in records} <= {"failed", "pending"}
    errors = job.query("SELECT COUNT(*) FROM answers WHERE reason = 'connection'")[0][0]
    # the bound, plus the requests already in flight (finished, not cancelled): up to the run's 8 workers
    # (concurrency 4, two chunks per slot)
    assert 6 <= errors <= 6 + 8
    assert seconds < 60


@contextlib.contextmanager
def dropping_connections():
    """A port whose accept queue is full and never read: the kernel drops each new SYN, as a host behind
    a firewall does, so a connection times out rather than being refused."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for s in [*fillers, listener]:
            s.close()


def test_an_endpoint_whose_connections_time_out_stops_the_run_as_unreachable(tmp_path):
    """A connect timeout (packets dropped) was taken for a read timeout: it reset the count of
    requests in a row that failed to connect, so the run sent every request to a dead host, each
    waiting out its timeout. It is a failed connection: never billed, and counted towards the stop."""
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(30)})
    teacher = {"timeout": 1.0, "max_retries": 0, "concurrency": 2, "max_connection_errors": 3}
    with dropping_connections() as url:
        job = make_job(
            tmp_path, url, docs, teacher=teacher, prices={"loopback": {"input": 1.0, "output": 2.0}}
        )
        done = job.cli("rewrite", timeout=120)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("metachunk:")]
    assert f"cannot connect to {url}" in line
    reasons = dict(job.query("SELECT reason, COUNT(*) FROM answers GROUP BY reason"))
    assert (
        set(reasons) == {"connection"} and 3 <= reasons["connection"] <= 3 + 4
    )  # the bound, and those in flight
    assert job.query("SELECT SUM(cost) FROM answers")[0][0] == 0.0  # nothing reached a server


def test_summary_stops_at_an_unreachable_endpoint_whichever_stage_meets_it(tmp_path):
    """Summary asks two stages at once: the one that finds the endpoint unreachable stops the run
    even when the other stage failed first (its record is not written half-asked)."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i) for i in range(12)})
    teacher = {"max_retries": 0, "concurrency": 3, "max_connection_errors": 2}
    job = make_job(tmp_path, url, docs, task="summary", teacher=teacher)
    done = job.cli("summary", timeout=120)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    records = job.records()
    assert len(records) == 12 and {r["status"] for r in records} <= {"failed", "pending"}
    assert all("status" in entry for r in records for entry in r["stages"].values())


def test_distill_help_lists_the_exit_codes():
    done = subprocess.run(
        [sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0
    for code in ("0 ", "1 ", "2 ", "3 ", "4 "):
        assert f"\n  {code}" in done.stdout
    assert "--max-failure-rate" in done.stdout


# --------------------------------------------------------------------------------------------
# 11. No secret in any file, ever: a server that echoes the key back
# --------------------------------------------------------------------------------------------


@STREAMED
def test_a_server_echoing_the_key_never_gets_it_into_a_file_or_a_log(tmp_path, stream):
    chunks = {
        "normal": chunk_text(0),
        "error_500": chunk_text(1, "[[fault:500]]"),
        "rate_limited": chunk_text(2, "[[fault:429@0.1*1]]"),
        "malformed": chunk_text(3, "[[fault:malformed]]"),  # streamed: cut after its first piece
        "stream_error": chunk_text(4, "[[fault:stream_error]]"),  # streamed: an error event quoting the key
    }
    env = cli_env(**{KEY_ENV: SECRET})
    with serve_in_subprocess(latency=0.0, replies=REPLIES, echo_auth=True) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            one_chunk_per_doc(chunks),
            teacher={"api_key_env": KEY_ENV, "max_retries": 1, "stream": stream},
            prices={"loopback": {"input": 1.0, "output": 2.0}},
            progress=True,
        )
        done = job.cli("rewrite", env=env)
        refused = make_job(
            tmp_path / "refused", server.base_url, one_chunk_per_doc({"x": chunk_text(5, "[[fault:401]]")}),
            teacher={"api_key_env": KEY_ENV, "max_retries": 0},
        )  # fmt: skip
        unauthorized = refused.cli("rewrite", env=env)
    # The echo spoils the refinement JSON too: every record fails (status 4), with its answers kept.
    assert done.returncode == 4, done.stderr
    assert unauthorized.returncode == 2 and "HTTP 401" in unauthorized.stderr
    assert "Bearer [REDACTED]" in unauthorized.stderr  # the echoed header, masked
    # The echo did reach us (so the scan below is not vacuous), masked before it was written.
    raw = job.query("SELECT raw FROM answers")
    assert any("[REDACTED]" in r for (r,) in raw if "Bearer" in r)
    assert any("(you sent Bearer [REDACTED])" in (e.get("raw") or "")
               for r in job.records() for e in r["stages"].values())  # fmt: skip
    leaks = [p for p in sorted(tmp_path.rglob("*")) if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
    if stream:  # the error event inside the stream was read, and its echo masked
        failed = job.records_by_doc()["stream_error"]
        assert failed["reason"] == "stream_error" and SECRET not in json.dumps(failed)
    for captured in (done, unauthorized):
        assert SECRET not in captured.stdout and SECRET not in captured.stderr


def test_one_run_with_repeated_documents_pays_each_request_once(tmp_path):
    """Copies of a document ask the same requests at once in one process: one sends, the others wait
    for its answer, as a second process would (the store's claim is busy for its own holder too)."""
    docs = one_chunk_per_doc({f"c{i}": chunk_text(i % 3) for i in range(9)})  # three copies of three texts
    with serve_in_subprocess(latency=0.2, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, docs, teacher={"concurrency": 9}, prices=BILLED_PRICES)
        assert job.main("rewrite", "--max-cost", "100") == 0
        stats = server.stats()
    assert set(stats["by_key"].values()) == {1} and stats["requests"] == 3 * len(REWRITE)
    records = job.records()
    assert len(records) == 9 and all(r["status"] == "ok" and r["output"] for r in records)
    summary = job.last_run()
    assert summary["requests_sent"] == stats["requests"] and summary["answers_waited_for"] > 0
    assert summary["paid"] == pytest.approx(job.query("SELECT SUM(cost) FROM answers")[0][0])  # paid once


# --------------------------------------------------------------------------------------------
# 12. A send that got no answer may still be billed: counted, at its worst case, in the store
# --------------------------------------------------------------------------------------------


def _failed_row_cost(
    tmp_path: Path, base_url: str, marker: str, max_retries: int, stream: bool = False
) -> float:
    """The store's cost for one reflection request (marker in the chunk) that ends failed."""
    job = make_job(tmp_path, base_url, {"d": [chunk_text(7, marker)]},
                   teacher={"timeout": 1.0, "max_retries": max_retries, "concurrency": 1, "stream": stream},
                   prices={"loopback": {"input": 1000.0, "output": 2000.0}})  # fmt: skip
    done = job.cli("rewrite", timeout=120)
    assert done.returncode == 4, done.stderr
    ((cost,),) = job.query("SELECT cost FROM answers WHERE status = 'error'")
    return cost


def test_sends_that_may_be_billed_without_an_answer_are_counted_at_their_worst_case(tmp_path):
    """A read timeout (the server may have generated the answer), a stream cut mid-answer and a 200 whose
    body does not parse were stored at $0 and sent again by every rerun, outside any --max-cost. Each send
    now counts at the reservation's worst case: openai's own retries of a timeout included (counted on the
    wire, by the X-Request-Key of each HTTP request); an error status that says the request was not
    served (500) is not, but a gateway's timeout (504: its upstream may have answered) is."""
    with serve_in_subprocess(latency=0.0, replies=REPLIES, hang_seconds=30) as server:
        once = _failed_row_cost(tmp_path / "hang0", server.base_url, "[[fault:hang]]", max_retries=0)
        thrice = _failed_row_cost(tmp_path / "hang2", server.base_url, "[[fault:hang]]", max_retries=2)
        malformed = _failed_row_cost(
            tmp_path / "malformed", server.base_url, "[[fault:malformed]]", max_retries=1
        )
        cut = _failed_row_cost(
            tmp_path / "cut", server.base_url, "[[fault:malformed]]", max_retries=1, stream=True
        )
        refused = _failed_row_cost(tmp_path / "500", server.base_url, "[[fault:500]]", max_retries=2)
        gateway = _failed_row_cost(tmp_path / "504", server.base_url, "[[fault:504]]", max_retries=2)
        # answered on the second send: the answer's own usage, plus the first send at its worst case
        job = make_job(tmp_path / "once", server.base_url, {"d": [chunk_text(7, "[[fault:malformed*1]]")]},
                       teacher={"max_retries": 1, "concurrency": 1},
                       prices={"loopback": {"input": 1000.0, "output": 2000.0}})  # fmt: skip
        assert job.cli("rewrite", timeout=120).returncode in (0, 4)
        first = job.query("SELECT prompt_tokens, completion_tokens, cost FROM answers ORDER BY id LIMIT 1")[0]
        stats = server.stats()
    # a server that is down is billed nothing, however often openai's client tried to connect
    down = _failed_row_cost(tmp_path / "down", f"http://127.0.0.1:{closed_port()}/v1", "", max_retries=2)
    assert once > 0 and thrice == pytest.approx(3 * once)  # the same prompt, the same worst case
    assert malformed > 0 and cut > 0 and refused == 0.0 and down == 0.0
    assert gateway == pytest.approx(3 * once, rel=0.01)  # openai's client retried the 504 twice
    assert stats["by_outcome"]["500"] == 3 and stats["by_outcome"]["504"] == 3
    billed = (1000.0 * first[0] + 2000.0 * first[1]) / 1e6
    assert first[2] > billed * 1.5  # the malformed first send's worst case is more than its answer


@contextlib.contextmanager
def takes_one_request_then_goes_down():
    """A server that takes one request, never answers it, and stops listening: openai's client retries
    the read timeout and finds the port closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        connection, _ = listener.accept()
        held.append(connection)
        listener.close()
        connection.recv(1 << 16)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        listener.close()
        for connection in held:
            connection.close()


def test_a_timeout_then_a_server_that_went_down_counts_the_timeout(tmp_path):
    """The tries of one request are counted one by one: the first was read (and may have been
    generated and billed), the two after it found the port closed. The request used to count $0,
    because its last try never connected."""
    with serve_in_subprocess(latency=0.0, replies=REPLIES, hang_seconds=30) as server:
        once = _failed_row_cost(tmp_path / "hang0", server.base_url, "[[fault:hang]]", max_retries=0)
    with takes_one_request_then_goes_down() as url:
        mixed = _failed_row_cost(tmp_path / "mixed", url, "[[fault:hang]]", max_retries=2)
    assert once > 0 and mixed == pytest.approx(once)


def test_a_stop_lets_the_sends_in_flight_finish_and_keeps_their_answers(tmp_path):
    """A refusal that stops the run used to cancel every request in flight: the server had generated
    (and billed) them, the store kept nothing, and the rerun paid for them again."""
    docs = {f"c{i}": [chunk_text(i, "[[fault:400]]" if i == 0 else "")] for i in range(6)}
    with serve_in_subprocess(latency=1.0, replies=REPLIES) as server:
        job = make_job(
            tmp_path,
            server.base_url,
            docs,
            teacher={"concurrency": 4, "refusals_to_stop": 1, "max_retries": 0},
        )
        done = job.cli("rewrite", timeout=120)
        first = server.stats()
    assert done.returncode == 4 and "refuses the request" in done.stderr, done.stderr
    answered = job.query("SELECT COUNT(*) FROM answers WHERE status = 'ok'")[0][0]
    assert answered == first["by_outcome"]["ok"] >= 3  # every answer the server gave was kept
    assert first["requests"] == first["by_outcome"]["ok"] + 1  # and nothing was sent after the stop


def test_a_send_stopped_in_flight_is_counted_as_maybe_billed(tmp_path):
    """SIGTERM (or Ctrl-C) cancels the sends in flight: each had left, so the server may bill it; it was
    given its reservation back and counted nothing. It is now stored at its worst case, and sent again."""
    docs = {f"c{i}": [chunk_text(i)] for i in range(4)}
    with serve_in_subprocess(latency=30.0, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, docs, teacher={"concurrency": 2, "max_retries": 0, "timeout": 60},
                       prices={"loopback": {"input": 1000.0, "output": 2000.0}})  # fmt: skip
        run = subprocess.Popen([sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config",
                                str(job.recipe)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while server.stats()["requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
        sent = server.stats()["requests"]
    assert run.returncode == 143 and "Traceback" not in err, err
    rows = job.query("SELECT reason, cost FROM answers")
    assert len(rows) == sent == 2 and all(reason == "cancelled" and cost > 0 for reason, cost in rows), rows
    assert not job.query("SELECT COUNT(*) FROM claims")[0][0]  # no reservation outlives the run


def test_a_sigkilled_runs_send_in_flight_is_paid_by_the_run_after_it(tmp_path):
    """A SIGKILL cannot be caught: the send in flight was billed by the server, yet no row counted it,
    and the next run took the dead claim over with its reservation. The endpoint notes each try on
    its claim as it leaves, and whoever takes the claim over pays it."""
    from metachunk.store import AnswerStore

    path = tmp_path / "a.sqlite"
    with serve_in_subprocess(latency=30.0) as server:
        sender = (
            "import asyncio, sys\nfrom metachunk.store import AnswerStore\n"
            "from metachunk.teacher import Price, TeacherConfig, TeacherPool\n"
            f"cfg = TeacherConfig('loopback', base_url={server.base_url!r}, max_retries=0, timeout=60.0)\n"
            "pool = TeacherPool({'s': cfg}, {'loopback': Price(1.0, 1.0)}, AnswerStore(sys.argv[1]))\n"
            "asyncio.run(pool['s'].complete([{'role': 'user', 'content': 'hi'}], 'sha'))\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", sender, str(path)])
        try:
            deadline = time.monotonic() + 60
            while server.stats()["requests"] == 0 and time.monotonic() < deadline:  # the send has left
                time.sleep(0.1)
        finally:
            proc.kill()
            proc.wait()
        assert server.stats()["requests"] == 1
    store = AnswerStore(path)
    assert store.claims_in_flight() == 0  # the dead claim is cleared, and its send paid
    with sqlite3.connect(path) as db:
        ((reason, cost),) = db.execute("SELECT reason, cost FROM answers").fetchall()
    assert reason == "killed_in_flight" and cost > 0 and store.total_cost == cost
    store.close()
