"""The distillation engine's pure parts: answer parsing, prompts, the store, budget, config."""

import contextlib
import json
import multiprocessing
import os
import socket
import sqlite3
import string
import subprocess
import sys
import time
from datetime import UTC

import pytest
from metachunk.chunking.students import window_span
from metachunk.distill.pipelines import NOTHING_MISSING, STAGES, Item, format_items, parse_items
from metachunk.distill.prompts import LANGS, load_prompt
from metachunk.distill.run import DistillConfig

from metachunk.artifacts import InputError
from metachunk.config import load_yaml
from metachunk.store import AnswerStore, StoredAnswer
from metachunk.teacher import Price, TeacherConfig, estimate_tokens, read_usage, split_reasoning

PLACEHOLDERS = {
    "reflection": {"context", "chunk"},
    "refinement": {"context", "chunk", "reflection"},
    "completion": {"context", "chunk", "items"},
    "summary_global": {"context", "chunk"},
    "summary_local": {"chunk"},
    "summary_fuse": {"chunk", "global_summary", "local_summary"},
}


# --------------------------------------------------------------------------- reasoning teachers


@pytest.mark.parametrize(
    "content, reasoning_content, answer, reasoning",
    [
        ("plain answer", None, "plain answer", ""),
        ("<think>step 1\nstep 2</think>\n\nthe answer", None, "the answer", "step 1\nstep 2"),
        ("no opening tag, QwQ style</think>the answer", None, "the answer", "no opening tag, QwQ style"),
        ("<think>cut off inside the reasoning", None, "", "cut off inside the reasoning"),
        ("the answer", "separate reasoning", "the answer", "separate reasoning"),
        ("<think>inline</think>answer", "separate", "answer", "separate\ninline"),
    ],
)
def test_split_reasoning(content, reasoning_content, answer, reasoning):
    assert split_reasoning(content, reasoning_content) == (answer, reasoning)


# --------------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    "usage, counts",
    [
        ({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}, (100, 5)),
        ({"prompt_tokens": 100, "completion_tokens": 0, "total_tokens": 100}, (100, 0)),
        ({"prompt_tokens": 100, "total_tokens": 105}, (100, 5)),  # the completion is the rest of the total
        ({"prompt_tokens": 100}, (None, None)),  # the completion uncounted: no usage, never free
        ({"completion_tokens": 5}, (None, None)),
        (None, (None, None)),
        # counts no server bills: a cost below zero would hide spend from the budget
        ({"prompt_tokens": 900, "total_tokens": 40}, (None, None)),
        ({"prompt_tokens": -1000000, "completion_tokens": 5}, (None, None)),
        ({"prompt_tokens": 10, "completion_tokens": -3}, (None, None)),
    ],
)
def test_read_usage_counts_an_answer_only_when_its_usage_counts_both_sides(usage, counts):
    body = {"choices": [{"message": {"role": "assistant", "content": "She is Emma."}}]}
    if usage is not None:
        body["usage"] = usage
    assert read_usage(json.dumps(body)) == (*counts, "She is Emma.", True)


@pytest.mark.parametrize(
    "url, refused",
    [
        ("http://127.0.0.1:8000/v1/", None),
        ("127.0.0.1:8000/v1", "must hold an http(s) URL"),
        ("https://user:s3cret-key@api.example/v1", "holds credentials"),
        ("https://s3cret-key@api.example/v1", "holds credentials"),
        ("https://api.example/v1?api_key=s3cret-key", "a credential in its query string (api_key=...)"),
    ],
)
def test_a_teacher_url_from_the_environment_is_checked_as_base_url_is(monkeypatch, url, refused):
    from metachunk.teacher import FatalTeacherError

    monkeypatch.setenv("TEACHER_URL", url)
    for cfg in (
        TeacherConfig("m", base_url_env="TEACHER_URL"),
        TeacherConfig("m", base_url_envs=["TEACHER_URL"]),
    ):
        if refused is None:
            assert cfg.endpoint_urls() == ["http://127.0.0.1:8000/v1"]
            continue
        with pytest.raises(FatalTeacherError) as e:
            cfg.endpoint_urls()
        assert "TEACHER_URL" in str(e.value) and refused in str(e.value) and "s3cret" not in str(e.value)


# ------------------------------------------------------------------------------ refinement JSON


def test_parse_items_reads_the_array_inside_fences_and_prose():
    text = 'Here you go:\n```json\n[{"missing": "who", "supplement": "Emma", "score": 9}]\n```'
    assert parse_items(text) == [Item("who", "Emma", 9.0)]


def test_parse_items_empty_array_is_a_valid_answer():
    assert parse_items("[]") == []


@pytest.mark.parametrize(
    "text", ["NONE", "[{broken json", '{"missing": "x"}', '[{"missing": "x", "score": "high"}]']
)
def test_parse_items_rejects_off_format(text):
    assert parse_items(text) is None


def test_parse_items_drops_unusable_elements_but_keeps_good_ones():
    text = '[{"missing": "a", "supplement": "b", "score": "8"}, {"missing": "c"}, 3]'
    assert parse_items(text) == [Item("a", "b", 8.0)]


def test_format_items_per_language():
    items = [Item("who", "Emma", 9)]
    assert format_items(items, "en") == "1. missing: who / supplement: Emma"
    assert format_items(items, "zh") == "1. 缺失：who／补充：Emma"
    assert {"none", "无"} <= NOTHING_MISSING


# ---------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.parametrize("name", sorted(PLACEHOLDERS))
def test_prompt_files_have_exactly_their_placeholders(name, lang):
    prompt = load_prompt(name, lang)
    found = {field for _, field, _, _ in string.Formatter().parse(prompt.user) if field}
    assert found == PLACEHOLDERS[name]
    assert "{" not in prompt.system.replace("{{", "")
    messages = prompt.messages(**dict.fromkeys(PLACEHOLDERS[name], "X"))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert len(prompt.sha256) == 64


def test_every_stage_has_a_prompt():
    assert {s for stages in STAGES.values() for s in stages} == set(PLACEHOLDERS)


def test_unknown_prompt_language_is_an_error():
    with pytest.raises(ValueError, match="no prompts for language"):
        load_prompt("reflection", "fr")


# ------------------------------------------------------------------------------------------ store


def _row(key, status="ok", cost=0.0, raw='{"choices": []}'):
    return StoredAnswer(key, "m", status, "" if status == "ok" else "timeout", raw, 1, 2, cost)


def test_store_is_append_only_and_a_success_wins(tmp_path):
    path = tmp_path / "answers.sqlite"
    store = AnswerStore(path)
    store.put(_row("a", "error"))
    assert store.get("a").status == "error" and not store.has_answer("a")
    store.put(_row("a", "ok", cost=0.5))
    store.put(_row("a", "error"))  # a later transport error never hides an answer
    assert store.has_answer("a") and store.get("a").ok
    store.close()

    reopened = AnswerStore(path)
    assert reopened.has_answer("a") and reopened.total_cost == 0.5
    with contextlib.closing(sqlite3.connect(path)) as db:  # the file as any SQLite reader sees it
        assert db.execute("SELECT COUNT(*) FROM answers").fetchone()[0] == 3  # nothing updated or deleted
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert reopened.totals()["m"]["answered"] == 1 and reopened.totals()["m"]["errors"] == 2


# ----------------------------------------------------------------------------------------- budget


def test_claims_reserve_worst_case_and_refuse_past_the_limit(tmp_path):
    store = AnswerStore(tmp_path / "a.sqlite")
    store.put(StoredAnswer("paid", "m", "ok", "", "{}", 1, 1, 0.25))
    assert store.claim("a", reserve=0.5, limit=1.0).outcome == "claimed"
    assert store.claim("b", reserve=0.5, limit=1.0).outcome == "over_budget"  # 0.25 + 0.5 + 0.5 > 1
    assert store.claim("paid", reserve=0.5, limit=1.0).outcome == "answered"
    store.put(StoredAnswer("a", "m", "ok", "", "{}", 1, 1, 0.1))  # settles: the reservation is gone
    assert store.claims_held() == 0 and store.spent() == pytest.approx(0.35)
    assert store.claim("b", reserve=0.5, limit=1.0).outcome == "claimed"
    store.close()


def test_a_cap_without_the_teachers_price_is_refused(tmp_path):
    from metachunk.teacher import TeacherPool

    store = AnswerStore(tmp_path / "a.sqlite")
    with pytest.raises(
        InputError, match="max_cost: a cost cap is set but the 'stage' teacher's model 'm' has no entry"
    ):
        TeacherPool({"stage": TeacherConfig("m")}, {"other": Price(1.0, 1.0)}, store, max_cost=1.0)
    TeacherPool({"stage": TeacherConfig("m")}, {}, store)  # no cap: no price needed
    store.close()


def test_a_refusal_is_final_while_another_jobs_batch_holds_its_reservations(tmp_path):
    """A live batch's reservations settle when it does, up to a day later: an online request the
    cap refuses stops the run now instead of waiting for them."""
    import asyncio

    from metachunk.teacher import BudgetExceeded, TeacherPool

    store = AnswerStore(tmp_path / "a.sqlite")
    store.claim_batch("other @ http://batch.example/v1", [("b", 1.0)], 1.0, 3600)
    assert store.claims_in_flight() == 0  # not counted as online requests in flight
    cfg = TeacherConfig("m", base_url="http://127.0.0.1:9/v1")  # nothing listens: nothing may be sent
    pool = TeacherPool({"s": cfg}, {"m": Price(1.0, 1.0)}, store, max_cost=1.0)
    with pytest.raises(BudgetExceeded):
        asyncio.run(asyncio.wait_for(pool["s"].complete([{"role": "user", "content": "hi"}], "sha"), 10))
    assert pool.budget.exhausted and pool.sent == 0
    store.close()


def test_a_claim_is_busy_for_its_own_holder_too(tmp_path):
    store = AnswerStore(tmp_path / "a.sqlite")
    assert store.claim("k", reserve=0.6, limit=1.0).outcome == "claimed"
    assert store.claim("k", reserve=0.6, limit=1.0).outcome == "busy"  # a second request of one process waits
    assert store.claim("j", reserve=0.6, limit=1.0).outcome == "over_budget"  # the first one's reserve holds
    store.close()


def test_a_claim_is_shared_across_processes_and_taken_over_from_a_dead_owner(tmp_path):
    first, second = AnswerStore(tmp_path / "a.sqlite"), AnswerStore(tmp_path / "a.sqlite")
    assert first.claim("k", reserve=0.5, limit=1.0).outcome == "claimed"
    assert second.claim("k").outcome == "busy"  # the owner is alive: wait for its answer
    # the other process's reservation counts against this one's cap
    assert second.claim("other", reserve=0.6, limit=1.0).outcome == "over_budget"
    first.put(StoredAnswer("k", "m", "ok", "", "{}", 1, 1, 0.5))
    assert second.claim("k").outcome == "answered" and second.get("k").cost == 0.5
    # A dead owner (a pid that no longer runs) loses its claim at once; an expired lease too.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    with contextlib.closing(sqlite3.connect(first.path, isolation_level=None)) as db:  # claims by other runs
        db.execute(
            "INSERT INTO claims (key, owner, host, pid, expires, reserved) VALUES ('d', 'gone', ?, ?, ?, 0.4)",
            (first.host, int(dead.stdout), time.time() + 60),
        )
        db.execute(
            "INSERT INTO claims (key, owner, host, pid, expires, reserved) VALUES ('e', 'far', 'elsewhere', 1, ?, 0.4)",
            (time.time() - 1,),
        )
        # The same pid in another container on this host (its host name, another PID namespace): alive
        # there for all this process can tell, so its claim holds until its lease runs out.
        db.execute(
            "INSERT INTO claims (key, owner, host, pid, expires, reserved) VALUES ('c', 'container', ?, ?, ?, 0.0)",
            (
                f"{socket.gethostname()}+{os.stat('/proc/self/ns/pid').st_ino + 1}",
                int(dead.stdout),
                time.time() + 60,
            ),
        )
    assert second.claim("d", reserve=0.1, limit=1.0).outcome == "claimed"
    assert second.claim("e", reserve=0.1, limit=1.0).outcome == "claimed"
    assert second.claim("c").outcome == "busy"
    # A claim an older version wrote names the host alone: it may be another container's, so only its
    # lease decides; a batch such a version began submitting is asked as that version asked it.
    with contextlib.closing(sqlite3.connect(first.path, isolation_level=None)) as db:
        db.execute("INSERT INTO claims (key, owner, host, pid, expires, reserved) VALUES ('l', 'old', ?, ?, ?, 0.0)",
                   (socket.gethostname(), int(dead.stdout), time.time() + 60))  # fmt: skip
    assert second.claim("l").outcome == "busy"
    assert not second.being_submitted(socket.gethostname(), int(dead.stdout), time.time())
    # which is why a claim names its owner's PID namespace beside the host (`artifacts.process_space`)
    assert first.host == f"{socket.gethostname()}+{os.stat('/proc/self/ns/pid').st_ino}"
    first.close()
    second.close()


def test_the_tries_a_killed_sender_made_are_paid_by_whoever_takes_its_claims(tmp_path):
    """A SIGKILLed run's sends in flight may have been billed, yet nothing counted them: the next run
    took the dead claims over (or cleared them) and their reservations went with them. Each try that
    left (`note_sent`) is now an error row at the reservation, one send's worst case; a claim whose
    request never left costs nothing."""
    path = tmp_path / "a.sqlite"
    killed = (
        "import os, sys\nfrom metachunk.store import AnswerStore\ns = AnswerStore(sys.argv[1])\n"
        "for key, tries in (('sent', 2), ('queued', 0), ('swept', 1)):\n"
        "    s.claim(key, reserve=0.25)\n    for _ in range(tries):\n        s.note_sent(key)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", killed, str(path)], timeout=60)
    store = AnswerStore(path)
    assert store.claim("sent", reserve=0.25).outcome == "claimed"  # taken over: its 2 tries are paid
    assert store.claim("queued", reserve=0.25).outcome == "claimed"  # never left: nothing to pay
    assert store.claims_in_flight() == 2  # this store's two; the dead 'swept' claim is cleared and paid
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = sorted(db.execute("SELECT key, reason, cost FROM answers").fetchall())
    assert rows == [("sent", "killed_in_flight", 0.5), ("swept", "killed_in_flight", 0.25)]
    assert store.total_cost == 0.75 and not store.has_answer("sent")  # a transport failure: sent again
    store.close()


def test_a_live_owner_in_this_process_space_keeps_its_claim_past_its_lease(tmp_path):
    """A process stopped (Ctrl-Z), or waiting on the store's lock, longer than the 30 s lease cannot
    renew it, yet sends once it goes on: another run that took its claim paid for the request too.
    A pid reused by another process (its start time differs) is not that owner."""
    from metachunk.artifacts import process_started

    store = AnswerStore(tmp_path / "a.sqlite")
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_started(stopped.pid)
        with contextlib.closing(sqlite3.connect(store.path, isolation_level=None)) as db:
            for key, when in (("s", started), ("r", started - 1)):  # r: the same pid, another process
                db.execute("INSERT INTO claims (key, owner, host, pid, expires, reserved, started)"
                           " VALUES (?, 'stopped', ?, ?, ?, 0.4, ?)",
                           (key, store.host, stopped.pid, time.time() - 60, when))  # fmt: skip
        assert store.claim("s").outcome == "busy"
        assert store.claim("t", reserve=0.7, limit=1.0).outcome == "over_budget"  # its reservation counts
        assert store.claim("r", reserve=0.1).outcome == "claimed"
    finally:
        stopped.kill()
        stopped.wait()
    assert store.claim("s").outcome == "claimed"  # gone: taken at once
    store.close()


def test_a_dead_runs_claims_do_not_refuse_a_batch(tmp_path):
    """A claim in this process space counts for up to an hour past its lease while its owner may
    live; a batch's claim clears the dead owners' first, as an online claim does before a refusal."""
    store = AnswerStore(tmp_path / "a.sqlite")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    with contextlib.closing(sqlite3.connect(store.path, isolation_level=None)) as db:
        db.execute("INSERT INTO claims (key, owner, host, pid, expires, reserved) VALUES ('d', 'gone', ?, ?, ?, 0.9)",
                   (store.host, int(dead.stdout), time.time() - 60))  # fmt: skip
    _, claimed, refused = store.claim_batch("m @ url", [("k1", 0.2)], 1.0, 3600)
    assert claimed == ["k1"] and refused == 0
    store.close()


def open_a_store_after(barrier, path, errors):
    barrier.wait()  # every process opens the new file at the same moment
    try:
        AnswerStore(path).close()
    except Exception as error:  # noqa: BLE001 - the test reports whatever it was
        errors.put(repr(error))


def test_processes_opening_one_new_store_at_once_all_succeed(tmp_path):
    # Two distill runs started together on a new --cache file once failed: switching a new file
    # to WAL takes a lock SQLite does not wait for ("database is locked").
    fork = multiprocessing.get_context("fork")
    errors = fork.Queue()
    for trial in range(10):
        barrier = fork.Barrier(6)
        procs = [
            fork.Process(target=open_a_store_after, args=(barrier, tmp_path / f"s{trial}.sqlite", errors))
            for _ in range(6)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []


def test_price_and_token_estimate():
    assert Price(input=2.0, output=8.0).cost(1_000_000, 500_000) == pytest.approx(6.0)
    english = "The quick brown fox jumps over the lazy dog. " * 20
    assert estimate_tokens(english) >= len(english.split())  # errs high
    assert estimate_tokens("中文文本" * 10) >= 40


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_dry_run_counts_each_later_stage_at_the_bound_a_live_run_reserves(lang):
    """A later stage's dry-run prompt is at least its real prompt at 1 token per byte, the earlier
    answers at their ``max_tokens`` (bytes / 3 plus 400 had put a completion prompt at 641 tokens
    against 2,026 bytes sent), so that a --max-cost picked from the dry run does not stop the run."""
    from metachunk.distill.pipelines import ChunkJob, estimate_pending, new_record

    from metachunk.teacher import prompt_bytes, template_tokens

    document = ("艾玛聪明富有，住在海伯里。" if lang == "zh" else "Emma was clever and rich. ") * 40
    job = ChunkJob("d", 0, 0, 60, lang, document, ((0, len(document)),))
    teachers = {stage: TeacherConfig("m", max_tokens=100) for stage in STAGES["rewrite"]}
    estimated = {
        stage: prompt for stage, prompt, _ in estimate_pending(new_record("rewrite", job), job, teachers)
    }
    answer = "x" * 100  # an answer of max_tokens tokens, at one byte a token
    values = {"context": job.context, "chunk": job.text}
    sent = {
        "reflection": load_prompt("reflection", lang).messages(**values),
        "refinement": load_prompt("refinement", lang).messages(reflection=answer, **values),
        "completion": load_prompt("completion", lang).messages(items=answer + answer, **values),
    }
    for stage, messages in sent.items():
        assert estimated[stage] >= prompt_bytes(messages) + template_tokens(messages), stage


# ----------------------------------------------------------------------------------------- config


def _recipe(tmp_path, body: str):
    path = tmp_path / "r.yaml"
    path.write_text(body, encoding="utf-8")
    return path


def test_nested_teacher_blocks_load_and_errors_name_the_dotted_key(tmp_path):
    good = _recipe(
        tmp_path,
        "task: summary\nchunks: c.jsonl\ndocuments: d.jsonl\nout: o\n"
        "teachers:\n  summary_global: &t {model: m, max_tokens: 64}\n  summary_local: *t\n  summary_fuse: *t\n"
        "prices: {m: {input: 1, output: 2}}\n",
    )
    cfg = DistillConfig(**load_yaml(DistillConfig, good))
    assert cfg.teachers["summary_fuse"] == TeacherConfig(model="m", max_tokens=64)
    assert cfg.prices["m"].output == 2.0

    bad = _recipe(tmp_path, "teachers:\n  reflection: {model: m, temprature: 0.5}\n")
    with pytest.raises(InputError, match=r"r\.yaml: unknown field\(s\) 'teachers\.reflection\.temprature'"):
        load_yaml(DistillConfig, bad)
    wrong_type = _recipe(tmp_path, "teachers:\n  reflection: {model: m, max_tokens: lots}\n")
    with pytest.raises(InputError, match="'teachers.reflection.max_tokens' must be int"):
        load_yaml(DistillConfig, wrong_type)


def test_a_recipe_without_a_stage_teacher_is_rejected():
    with pytest.raises(ValueError, match="lacks a block for stage"):
        DistillConfig(
            task="rewrite", chunks="c", documents="d", out="o", teachers={"reflection": TeacherConfig("m")}
        )


def test_teacher_config_validates():
    with pytest.raises(ValueError, match="'model' is required"):
        TeacherConfig()
    with pytest.raises(ValueError, match="max_tokens_limit"):
        TeacherConfig("m", max_tokens=100, max_tokens_limit=50)


@pytest.mark.parametrize(
    "field, value, says",
    [("temperature", float("nan"), ">= 0.0"), ("top_p", float("inf"), "<= 1.0"), ("top_p", 1.5, "<= 1.0"),
     ("frequency_penalty", float("nan"), "got nan"), ("rpm", -1, "> 0.0"), ("rpm", 0, "> 0.0"),
     ("tpm", -5.0, "> 0.0"), ("timeout", -1.0, "> 0.0"), ("stream_idle_timeout", 0, "> 0.0"),
     ("batch_discount", 2.0, "<= 1.0"), ("temperature", "hot", "got .hot.")],
)  # fmt: skip
def test_a_sampling_value_or_rate_that_cannot_work_is_refused(field, value, says):
    # a NaN cannot be sent as JSON (the run failed at its first send); a rate <= 0 waited forever
    with pytest.raises(ValueError, match=f"field '{field}' must be a finite number.*{says}"):
        TeacherConfig("m", **{field: value})
    assert TeacherConfig("m", temperature=0, top_p=1, rpm=0.5, frequency_penalty=-1.5).rpm == 0.5


@pytest.mark.parametrize("price", [{"input": float("nan")}, {"output": -1.0}, {"batch_discount": 1.5}])
def test_a_price_that_would_lose_answers_or_lift_the_cap_is_refused(price):
    # NaN: a paid answer's cost could not be stored (paid again on each rerun); negative: the
    # shared store's spend went down, and every run on it could spend past its --max-cost
    with pytest.raises(ValueError, match="must be a finite number >= 0.0"):
        Price(**price)
    assert Price(0, 0, 0).cost(10, 10) == 0


def test_pool_map_keeps_input_order_and_stops_at_an_unreachable_endpoint(tmp_path):
    import asyncio

    from metachunk.teacher import EndpointUnreachable, TeacherPool

    store = AnswerStore(tmp_path / "answers.sqlite")
    taken = []

    async def work(i: int) -> int:
        taken.append(i)
        await asyncio.sleep(0.002 * (i % 3))  # items finish out of order
        if i == 5:
            raise EndpointUnreachable("teacher 'm': cannot connect")
        return 10 * i

    def pool():
        return TeacherPool({"stage": TeacherConfig("m", concurrency=2)}, {}, store)

    done = asyncio.run(pool().map(range(8), work, workers=3, progress=False))
    assert done.stopped == "unreachable" and done.message == "teacher 'm': cannot connect"
    finished = [i for i, r in enumerate(done.results) if r is not None]
    assert 5 not in finished and all(done.results[i] == 10 * i for i in finished) and 0 in finished
    assert taken == sorted(set(taken))  # taken in input order, each by one worker

    taken.clear()
    done = asyncio.run(pool().map(list(range(5)), work, progress=False))  # 2 workers: the concurrency
    assert done.results == [0, 10, 20, 30, 40] and done.stopped == "" and taken == [0, 1, 2, 3, 4]

    async def broken(i: int) -> int:
        if i == 2:
            raise ValueError("a bug")
        await asyncio.sleep(1)
        return i

    with pytest.raises(ValueError, match="a bug"):  # any other error cancels the rest and is raised
        asyncio.run(asyncio.wait_for(pool().map(range(6), broken, workers=6, progress=False), 0.5))
    store.close()


def test_window_is_the_whole_text_or_centred_on_the_chunk():
    text = "".join(str(i % 10) for i in range(100))

    def window(text: str, start: int, end: int, limit: int) -> str:
        left, right = window_span(len(text), start, end, limit)
        return text[left:right]

    assert window(text, 10, 20, 200) == text
    cut = window(text, 50, 60, 30)
    assert len(cut) == 30 and text[50:60] in cut
    assert window(text, 0, 5, 30) == text[:30] and window(text, 95, 100, 30) == text[70:]


# ------------------------------------------------------------------ long documents: related context


@pytest.mark.integration
def test_related_context_is_the_most_similar_other_chunks_in_document_order(tmp_path):
    import json

    from metachunk.distill.pipelines import read_jobs

    from metachunk.models import ModelNotFoundError, resolve

    try:
        resolve("minilm")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    pieces = [
        "The harbour froze in January. ",
        "Emma painted a portrait of Harriet. ",
        "Ice covered the harbour until March. ",
        "Mr. Elton admired the portrait of Harriet. ",
        "Ships waited outside the frozen harbour. ",
    ]
    text = "".join(pieces)
    chunks, start = [], 0
    for p in pieces:
        chunks.append({"text": p, "start": start, "end": start + len(p)})
        start += len(p)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "d", "text": text}) + "\n")
    (tmp_path / "chunks.jsonl").write_text(
        json.dumps({"id": "d", "chunks": chunks, "selected": [0, 1]}) + "\n"
    )
    cfg = DistillConfig(
        task="summary",
        chunks=tmp_path / "chunks.jsonl",
        documents=tmp_path / "docs.jsonl",
        out=tmp_path / "out",
        teachers=dict.fromkeys(STAGES["summary"], TeacherConfig("m")),
        context="related",
        context_top_k=2,
    )
    jobs = read_jobs(cfg)
    assert [j.index for j in jobs] == [0, 1]  # only the selected chunks are distilled
    harbour, portrait = jobs
    assert harbour.context == pieces[2] + "\n…\n" + pieces[4]  # the two other harbour chunks, in order
    # the other portrait chunk and one more (which one is the embedder's call), in document order
    shown = [i for i, p in enumerate(pieces) if p.strip() in portrait.context]
    assert 3 in shown and len(shown) == 2 and 1 not in shown  # never the chunk itself
    assert [portrait.context.index(pieces[i].strip()) for i in shown] == sorted(
        portrait.context.index(pieces[i].strip()) for i in shown
    )


def test_reservations_are_a_token_per_byte_and_calibration_sizes_only_the_rate_limit(
    tmp_path, tiny_model_dir
):
    """A reservation is an upper bound on the bill: 1 token per UTF-8 byte (byte-level BPE spends no
    more), or the teacher's tokenizer. A ratio the endpoint billed for prose (calibration) fell 3-4x
    short of a table of digits, so it sizes only the tokens-per-minute bucket's share."""
    from transformers import AutoTokenizer

    from metachunk.teacher import TEMPLATE_TOKENS, Budget, Teacher

    store = AnswerStore(tmp_path / "a.sqlite")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Emma 爱 Knightley"}]
    overhead = TEMPLATE_TOKENS * 3
    plain = Teacher(TeacherConfig(model="m"), None, store, Price(), Budget(None, store))
    size = len("Be brief.Emma 爱 Knightley".encode())
    assert plain.prompt_bound(messages) == plain.expected_prompt_tokens(messages) == size + overhead
    key = plain.calibrated_as([m["content"] for m in messages])
    store.put(StoredAnswer("k", "m", "ok", "", "{}", 1, 1, 0.0), calibration=(key, 0.25))
    store.put(StoredAnswer("k2", "m", "ok", "", "{}", 1, 1, 0.0), calibration=(key, 0.2))  # lower: kept max
    assert store.tokens_per_byte(key) == 0.25
    assert plain.expected_prompt_tokens(messages) == -(-size // 4) + overhead
    assert plain.prompt_bound(messages) == size + overhead  # calibrated or not: the bound
    assert plain.answer_bound("12345 67890") == 12  # an answer without usage: its bytes and an end token
    # Chinese is calibrated apart: a ratio learnt on (mostly) English prompts is not its rate
    chinese = [{"role": "user", "content": "爱玛" * 10}]
    assert plain.calibrated_as(["爱玛"]) != key
    assert plain.expected_prompt_tokens(chinese) == len(("爱玛" * 10).encode()) + TEMPLATE_TOKENS * 2
    store.put(
        StoredAnswer("k3", "m", "ok", "", "{}", 1, 1, 0.0), calibration=(plain.calibrated_as(["爱玛"]), 0.5)
    )
    assert plain.expected_prompt_tokens(chinese) == len(("爱玛" * 10).encode()) // 2 + TEMPLATE_TOKENS * 2
    # a ratio learnt on prompts with more non-ASCII bytes sizes these too
    assert plain.expected_prompt_tokens(messages) == -(-size // 2) + overhead
    counted = Teacher(TeacherConfig(model="m", tokenizer=str(tiny_model_dir)), None, store, Price(),
                      Budget(None, store))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the prompt as the teacher's chat template renders it: its markers, and what it adds unasked
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    templated = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert counted.prompt_bound(messages) == counted.expected_prompt_tokens(messages) == templated + overhead
    user_only = [messages[1]]
    body = len(tokenizer.encode(user_only[0]["content"], add_special_tokens=False))
    # Qwen's template adds its default system prompt to a user-only prompt (~40 tokens): 8 per message missed it
    assert counted.prompt_bound(user_only) > body + TEMPLATE_TOKENS * 2 + 30
    store.close()


def test_a_retry_after_header_is_read_in_ms_seconds_or_a_date_and_anything_else_is_no_hint():
    from datetime import datetime, timedelta
    from email.utils import format_datetime

    from metachunk.teacher import retry_after_seconds

    assert retry_after_seconds({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after_seconds({"retry-after": "2"}) == 2.0
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < retry_after_seconds({"retry-after": later}) <= 30
    assert retry_after_seconds({"retry-after": "soon"}) is None and retry_after_seconds({}) is None


def test_the_token_bucket_gets_back_only_what_it_took_beyond_the_usage():
    import asyncio

    from metachunk.teacher import TokenBucket

    bucket = TokenBucket(1000)
    asyncio.run(bucket.take(5000))  # past the burst: takes the whole bucket, once
    bucket.give_back(5000, 400)  # the estimate was 5,000, but only 1,000 was taken: 600 unused
    assert 600 <= bucket.level < 610  # (a few tokens refill while the test runs)


def test_api_key_env_names_a_variable_and_a_pasted_key_is_not_repeated(monkeypatch):
    from metachunk.teacher import api_key

    pasted = "sk-proj-PASTEDKEY1234567890"
    with pytest.raises(ValueError, match="must name an environment variable") as e:
        TeacherConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=pasted)
    assert pasted not in str(e.value)
    from metachunk.teacher import FatalTeacherError

    for shaped_like_a_name in (
        "gsk_abcDEF123456789xyz",
        "hf_AbCdEfGhIjKlMnOpQrSt",
    ):  # keys ENV_NAME lets through
        monkeypatch.delenv(shaped_like_a_name, raising=False)
        cfg = TeacherConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=shaped_like_a_name)
        with pytest.raises(FatalTeacherError, match="the environment variable that api_key_env names") as e:
            api_key(cfg)
        assert shaped_like_a_name not in str(e.value)
    monkeypatch.delenv("TEACHER_API_KEY", raising=False)
    with pytest.raises(FatalTeacherError, match="the environment variable TEACHER_API_KEY is not set"):
        api_key(TeacherConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key_env="TEACHER_API_KEY"))
    monkeypatch.setenv("METACHUNK_TEST_KEY", "sk-test-with-newline\n")  # as an .env file may hold it
    cfg = TeacherConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key_env="METACHUNK_TEST_KEY")
    assert api_key(cfg) == "sk-test-with-newline"


def test_a_key_a_server_echoes_json_escaped_is_masked_before_the_body_is_parsed():
    """A raw body is redacted, then parsed: a key whose ``/`` the server wrote as ``\\/`` (PHP's default)
    passed the mask and came back whole from json.loads, into the records."""
    from metachunk.redaction import MASK, redact, register_secret

    key = "Ab3/xYz9+SeCrEt/KEY42-é"
    register_secret(key)
    for encoded in (
        json.dumps(key),
        json.dumps(key).replace("/", "\\/"),
        json.dumps(key, ensure_ascii=False),
    ):
        raw = '{"choices": [{"message": {"content": "seen key ' + encoded[1:-1] + '"}}]}'
        assert (
            json.loads(redact(raw, headers=False))["choices"][0]["message"]["content"] == f"seen key {MASK}"
        )


def test_what_follows_the_host_of_a_url_from_the_environment_is_masked(monkeypatch):
    """base_url_env keeps a gateway's URL out of the recipe; a token in its path reached stderr and the
    answer store (the calibration table's endpoint)."""
    from metachunk.redaction import MASK, redact, safe_url

    monkeypatch.setenv("METACHUNK_TEST_URL", "https://gateway.example.com/v1/acct-7f3a9c2e51/openai/")
    cfg = TeacherConfig(model="m", base_url_env="METACHUNK_TEST_URL")
    url = cfg.endpoint_url()
    assert url == "https://gateway.example.com/v1/acct-7f3a9c2e51/openai"
    assert safe_url(url) == f"https://gateway.example.com/{MASK}"
    assert safe_url(f"{url}/chat/completions") == f"https://gateway.example.com/{MASK}/chat/completions"
    # a path is no secret to mask in every answer (headers=False): an Azure deployment is named after its model
    answer = "an answer about /v1/acct-7f3a9c2e51/openai and gpt-4o-2024-08-06"
    assert redact(answer, headers=False) == answer
    # ...but an error text that quotes it (OpenAI's 404: "Invalid URL (POST /v1/...)") is masked, the
    # whole path or a long segment of it
    assert redact("Invalid URL (POST /v1/acct-7f3a9c2e51/openai/files)") == f"Invalid URL (POST {MASK}/files)"
    assert redact("no route acct-7f3a9c2e51") == f"no route {MASK}"
    # a segment that reads as a word is masked only as part of the whole path
    monkeypatch.setenv("METACHUNK_TEST_URL2", "https://gw.example.com/openai/deployments/production")
    TeacherConfig(model="m", base_url_env="METACHUNK_TEST_URL2").endpoint_url()
    assert (
        redact("runs/production/records.jsonl: no such file") == "runs/production/records.jsonl: no such file"
    )
    assert redact("POST /openai/deployments/production/chat") == f"POST {MASK}/chat"


def test_a_key_a_server_escaped_its_own_way_is_masked_once_the_body_is_plain_json():
    """.NET's default encoder writes "+" as \\u002B, Go's "&" as \\u0026: no literal form of the key
    matched, and the parsed answer read back as the key (into the records, then SFT rows)."""
    from metachunk.redaction import MASK, redact, register_secret
    from metachunk.teacher import plain_json

    key = "sk-test+SECRET&1234567890"
    register_secret(key)
    escaped = key.replace("+", "\\u002B").replace("&", "\\u0026").replace("-", "\\u002d")
    raw = '{"choices": [{"message": {"content": "seen key ' + escaped + ' \\u00e9"}}]}'
    assert key not in raw and json.loads(raw)["choices"][0]["message"]["content"].startswith(
        f"seen key {key}"
    )
    plain = redact(plain_json(raw), headers=False)
    assert json.loads(plain)["choices"][0]["message"]["content"] == f"seen key {MASK} \u00e9"
    assert plain_json("not json {") == "not json {"  # kept as received: a malformed body is retried
    cut = '{"content": "half an emoji \\ud83d, and \\u00e9"}'  # a lone surrogate: UTF-8 cannot hold it
    assert plain_json(cut).encode("utf-8") and json.loads(plain_json(cut)) == json.loads(cut)


def test_a_short_key_is_masked_in_error_texts_but_never_garbles_an_answer():
    """vLLM's ``--api-key`` takes any string (``secret1``): keys under 8 characters were never masked.
    In an answer's body a key like "1234" would garble numbers ("created": 17[REDACTED]5678, the
    usage counts: every answer malformed and paid again), so it is masked in error texts only; a
    placeholder of letters alone ("EMPTY", "none") is masked nowhere."""
    from metachunk.redaction import MASK, redact, register_secret

    register_secret("Xk7q2Zp")
    register_secret("1234")
    register_secret("dummy")
    assert (
        redact("HTTP 401: Incorrect API key provided: Xk7q2Zp")
        == f"HTTP 401: Incorrect API key provided: {MASK}"
    )
    body = '{"created": 1712345678, "usage": {"prompt_tokens": 1234}, "content": "Xk7q2Zp"}'
    assert redact(body, headers=False) == body
    assert redact("a dummy run") == "a dummy run"


@pytest.mark.parametrize(
    "text, shown",
    [
        ("GET https://h/v1?subscription-key=SUBKEY123", "GET https://h/v1?subscription-key=[REDACTED]"),
        ("https://b.s3/x?X-Amz-Security-Token=TOK123&X-Amz-Signature=ab12",
         "https://b.s3/x?X-Amz-Security-Token=[REDACTED]&X-Amz-Signature=[REDACTED]"),
        ("https://h/t?client_secret=CS123;auth_token=AT123", "https://h/t?client_secret=[REDACTED];auth_token=[REDACTED]"),
        ("https://h/t?monkey=banana&api-version=2024-10-21", "https://h/t?monkey=banana&api-version=2024-10-21"),
        ("Ocp-Apim-Subscription-Key: 0123abcd", "Ocp-Apim-Subscription-Key: [REDACTED]"),
        ("X-Auth-Token: tok-42", "X-Auth-Token: [REDACTED]"),
        ('{"detail": "{\\"authorization\\": \\"Bearer sk-abc\\"}"}',
         '{"detail": "{\\"authorization\\": \\"Bearer [REDACTED]\\"}"}'),
        # a value's escaped "/" is part of it; a name ending in "code" is no credential, "code" is
        ('{"authorization": "Basic dXNlcjpwYXNz\\/d29yZA=="}', '{"authorization": "Basic [REDACTED]"}'),
        ("https://h/f?country_code=FR&code=AzFn123", "https://h/f?country_code=FR&code=[REDACTED]"),
    ],
)  # fmt: skip
def test_more_credential_names_are_masked_in_error_texts(text, shown):
    """An Azure API Management key, a presigned S3 URL's token and signature, an OAuth client secret,
    and an auth header quoted inside a JSON string, all passed the mask, and a recipe holding one was
    accepted (its text reaches the regen manifest and the dataset card)."""
    from metachunk.redaction import redact, url_credentials

    assert redact(text) == shown
    if text.startswith(("GET https", "https")) and "monkey" not in text:  # what a config refuses
        assert url_credentials(text.removeprefix("GET ")) is not None


@pytest.mark.parametrize(
    "text, shown",
    [
        (
            "cannot connect to http://h:9/v1?key=QUERYLEAK1234&x=1",
            "cannot connect to http://h:9/v1?key=[REDACTED]&x=1",
        ),
        (
            "GET https://h/v1?api-version=2024-10-21&token=abc",
            "GET https://h/v1?api-version=2024-10-21&token=[REDACTED]",
        ),
        ("at https://TOKENABC@host/v1", "at https://[REDACTED]@host/v1"),  # a token as the user name
        ("at https://u:p@ss@h/x", "at https://[REDACTED]@h/x"),  # a password holding an "@"
        # compact JSON: the userinfo stops at a quote, so a later e-mail address is no URL's
        (
            '{"base":"https://api.example.com","contact":"help@example.com"}',
            '{"base":"https://api.example.com","contact":"help@example.com"}',
        ),
    ],
)
def test_credentials_in_a_url_are_masked_in_error_texts(text, shown):
    from metachunk.redaction import redact

    assert redact(text) == shown


def test_a_base_url_with_a_credential_in_its_query_is_refused_and_not_repeated():
    """It reached the run's TASK.meta.json and the regen manifest a push uploads (a base_url is written
    as given); only the value's name is said."""
    for url in (
        "https://api.example/v1?key=QUERYLEAK1234",
        "https://api.example/v1?x=1&access_token=QUERYLEAK1234",
    ):
        with pytest.raises(ValueError, match="query string") as e:
            TeacherConfig("m", base_url=url)
        assert "QUERYLEAK1234" not in str(e.value)
    TeacherConfig("m", base_url="https://res.openai.azure.com/openai/v1?api-version=preview")  # no credential
    from metachunk.eval.generate import parse_generator

    with pytest.raises(ValueError, match="query string") as e:
        parse_generator("http://h:8000/v1?token=QUERYLEAK1234:qwen2")
    assert "QUERYLEAK1234" not in str(e.value)


def test_the_request_key_hash_never_changes():
    """Every stored (paid) answer is found by this hash of its request: a change of its JSON form
    (key order, escaping, encoding) would re-key the store and pay for every answer again."""
    from metachunk.artifacts import json_sha256

    request = {"request": {"model": "m", "messages": [{"role": "user", "content": "今天 café"}], "max_tokens": 8},
               "prompt_sha256": "ab", "attempt": 0}  # fmt: skip
    assert json_sha256(request) == "ffa5b97be854a3049df0b54a4e8d2c0c4d5b91b842e44a13471fa25bdf7ae19f"
    assert json_sha256(dict(reversed(request.items()))) == json_sha256(request)
