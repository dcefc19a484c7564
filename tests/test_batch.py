"""The teacher Batch API (``mode: batch``, ``metachunk/batch.py``) against the loopback server's
``/v1/files`` and ``/v1/batches``, through the unchanged openai client: chained stages as rounds at
the discount, file limits, expired and failed lines retried, a kill mid-poll resumed without a
resubmission, and the export/import pair for ``vllm run-batch``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml
from support.loopback_server import serve_in_subprocess

from metachunk.artifacts import read_run_log
from metachunk.cli import main

ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'
REPLIES = {'"score"': ITEMS}
PRICE = {"input": 2.0, "output": 8.0}  # USD per 1M tokens


def write_job(root, base_url, n=6, markers=None, **teacher):
    root.mkdir(parents=True, exist_ok=True)
    docs, chunks = root / "documents.jsonl", root / "chunks.jsonl"
    with docs.open("w") as d, chunks.open("w") as c:
        for i in range(n):
            text = f"Passage {i}. Emma Woodhouse had lived {i} years in Highbury with very little to vex her."
            text += (markers or {}).get(i, "")
            d.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
            c.write(
                json.dumps({"id": f"d{i}", "chunks": [{"text": text, "start": 0, "end": len(text)}]}) + "\n"
            )
    block = {"model": "loopback", "base_url": base_url, "max_tokens": 64, "timeout": 10.0, "max_retries": 1,
             "mode": "batch", "batch_poll_seconds": 0.02, **teacher}  # fmt: skip
    recipe = {"task": "rewrite", "documents": str(docs), "chunks": str(chunks), "out": str(root / "run"),
              "lang": "en", "progress": False, "prices": {"loopback": PRICE},
              "teachers": {s: dict(block) for s in ("reflection", "refinement", "completion")}}  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def records(root):
    return [json.loads(x) for x in (root / "run" / "rewrite.jsonl").read_text().splitlines()]


def summary(root):
    """The last run's line in ``run/runs.jsonl`` (its batch rounds, requests sent, paid)."""
    return read_run_log(root / "run")[-1]


def test_chained_stages_run_as_batch_rounds_at_the_discount_and_a_rerun_sends_nothing(tmp_path, capsys):
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(tmp_path, server.base_url)
        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0, capsys.readouterr().err
        stats = server.stats()
        assert all(r["status"] == "ok" for r in records(tmp_path))
        batch = summary(tmp_path)["batch"]
        # reflection, refinement, completion: three submitted rounds, then one that finds everything stored
        assert (batch["rounds"], batch["batches"], batch["requests"], batch["answered"]) == (4, 3, 18, 18)
        assert stats["requests"] == 0 and stats["batch_requests"] == 18  # nothing went online
        assert all(n == 1 for n in stats["by_key"].values()) and len(stats["by_key"]) == 18
        with sqlite3.connect(tmp_path / "run" / "answers.sqlite") as db:
            rows = db.execute("SELECT prompt_tokens, completion_tokens, cost FROM answers").fetchall()
        assert len(rows) == 18
        for pt, ct, cost in rows:  # half the online price
            assert abs(cost - 0.5 * (pt * PRICE["input"] + ct * PRICE["output"]) / 1e6) < 1e-12

        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0
        again = server.stats()
        assert again["batch_requests"] == 18 and again["requests"] == 0 and len(again["batches"]) == 3
        assert summary(tmp_path)["batch"]["rounds"] == 1


def test_files_split_at_the_limit_and_expired_or_failed_lines_are_retried_online(tmp_path, capsys):
    markers = {1: " [[batch:expire]]", 4: " [[batch:error]]"}
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(
            tmp_path, server.base_url, markers=markers, batch_max_requests=4, retry_mode="online"
        )
        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0, capsys.readouterr().err
        stats = server.stats()
    assert all(r["status"] == "ok" for r in records(tmp_path))
    batch = summary(tmp_path)["batch"]
    assert batch["expired"] >= 1 and batch["failed"] >= 1
    # 6 requests per round in files of at most 4: two batches per round; the two marked chunks go online.
    assert batch["batches"] == 6 and stats["requests"] == 6  # 2 chunks x 3 stages sent online
    statuses = {b["status"] for b in batch["by_batch"]}
    assert statuses == {"completed", "expired"}


def test_a_kill_mid_poll_resumes_polling_and_never_resubmits_a_live_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with serve_in_subprocess(replies=REPLIES, batch_polls=8) as server:
        recipe = write_job(tmp_path, server.base_url, batch_poll_seconds=0.05)
        cmd = [sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config", str(recipe)]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        # polling the first batch: the server marks it in progress at the client's first poll (the batch id is
        # stored before it); it completes at the 8th, a second or more later
        while list(server.stats().get("batches", {}).values()) != ["in_progress"]:
            assert proc.poll() is None and time.monotonic() < deadline, "no batch polled"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert list(server.stats()["batches"].values()) == ["in_progress"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        stats = server.stats()
    assert len(stats["batches"]) == 3  # one per stage: the live one was polled again, not resubmitted
    assert all(n == 1 for n in stats["by_key"].values()) and stats["requests"] == 0
    assert all(r["status"] == "ok" for r in records(tmp_path))


def test_a_create_whose_answer_was_lost_runs_one_batch(tmp_path, capsys):
    """The provider made the batch but a gateway answered 502. openai's client, which sends no
    idempotency key, sent the create again: two batches of the same requests ran and were billed."""
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(tmp_path, server.base_url, markers={0: " [[batch:lose_create]]"})
        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0, capsys.readouterr().err
        stats = server.stats()
    assert len(stats["batches"]) == 3 and summary(tmp_path)["batch"]["batches"] == 3  # one per stage
    assert all(n == 1 for n in stats["by_key"].values()) and stats["requests"] == 0
    assert all(r["status"] == "ok" for r in records(tmp_path))


def test_a_batch_answer_whose_body_does_not_parse_counts_its_worst_case(tmp_path, capsys):
    """The provider generated (and billed) it: stored at $0, it was outside --max-cost, as online."""
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(tmp_path, server.base_url, n=2, markers={0: " [[batch:malformed]]"}, max_retries=0)
        main(["distill", "rewrite", "--config", str(recipe)])
    with sqlite3.connect(tmp_path / "run" / "answers.sqlite") as db:
        rows = db.execute("SELECT a.cost, c.reserved FROM answers a JOIN batch_items c ON c.key = a.key"
                          " WHERE a.reason = 'batch_http_200'").fetchall()  # fmt: skip
    assert rows and all(cost == reserved > 0 for cost, reserved in rows)


def test_a_create_the_list_showed_late_is_kept_and_the_second_cancelled(tmp_path, capsys):
    """The first create was made but answered 502, and the list read after it did not show it yet:
    the second try made another batch of the same file. Once made, the list is read again and every
    batch of the file but the first is cancelled, before it runs."""
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(tmp_path, server.base_url, markers={0: " [[batch:late_create]]"})
        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0, capsys.readouterr().err
        stats = server.stats()
    states = sorted(stats["batches"].values())
    assert states == ["cancelled"] * 3 + ["completed"] * 3  # one made twice per stage, one of each cancelled
    assert all(n == 1 for n in stats["by_key"].values()) and stats["requests"] == 0
    assert all(r["status"] == "ok" for r in records(tmp_path))


def _upload_then_die_then_wait(path, cfg, base_url: str, payload: dict, then: str = ""):
    """Run A, in a process of its own, claims a batch of one request ``k``, uploads its file, records
    the upload, runs the lines ``then`` (``c`` its client, ``f`` the file) and ends without recording
    a batch. Then this process's `batch.wait` takes the upload over: ``(store, counts)``."""
    from metachunk import batch
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherPool

    run_a = (
        "import sys, openai\nfrom metachunk import batch\nfrom metachunk.store import AnswerStore\n"
        f"s = AnswerStore(sys.argv[1])\nb, _, _ = s.claim_batch({batch.endpoint_name(cfg)!r}, [('k', 0.1)], None, 3600)\n"
        f"line = batch.batch_line('k', {payload!r}, {cfg.batch_endpoint!r})\n"
        f"c = openai.OpenAI(base_url={base_url!r}, api_key='x', max_retries=0)\n"
        "f = c.files.create(file=('a.jsonl', line.encode()), purpose='batch')\n"
        "s.update_batch(b, input_file_id=f.id, status='uploaded')\n" + then
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", run_a, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    store = AnswerStore(path)
    counts = batch.BatchCounts()
    batch.wait(store, {"s": TeacherPool({"s": cfg}, {}, store)["s"]}, counts, progress=False)
    return store, counts


def test_a_run_killed_between_upload_and_create_is_created_once_by_the_next(tmp_path):
    """Run A uploaded its file, then died before batches.create: the next run's wait takes the batch
    over, finds no batch made from the file at the provider, creates one, and collects it."""
    from metachunk.teacher import TeacherConfig

    path = tmp_path / "answers.sqlite"
    with serve_in_subprocess(replies=REPLIES) as server:
        cfg = TeacherConfig("loopback", base_url=server.base_url, mode="batch", batch_poll_seconds=0.02)
        payload = {
            "model": "loopback",
            "messages": [{"role": "user", "content": "Who is Emma?"}],
            "max_tokens": 8,
        }
        store, counts = _upload_then_die_then_wait(path, cfg, server.base_url, payload)
        stats = server.stats()
    assert len(stats["batches"]) == 1 and stats["batch_requests"] == 1
    assert store.live_batches() == [] and store.has_answer("k") and counts.answered == 1
    store.close()


@pytest.mark.parametrize("creates", [1, 2])
def test_a_killed_runs_batches_the_list_hid_or_made_twice_leave_one_running(tmp_path, creates):
    """Run A made a batch of its upload and died before recording it. ``creates=1``: the provider's
    list does not show it yet, so the next run finds nothing and creates another; ``creates=2``: A's
    create was answered with an error and it tried again, so two exist. Either way the run that takes
    the upload over leaves exactly one of the file's batches running (the others are cancelled while
    they validate, unbilled), and collects it."""
    from metachunk.teacher import TeacherConfig

    path = tmp_path / "answers.sqlite"
    with serve_in_subprocess(replies=REPLIES) as server:
        cfg = TeacherConfig("loopback", base_url=server.base_url, mode="batch", batch_poll_seconds=0.02)
        payload = {"model": "loopback", "messages": [{"role": "user", "content": "Who is Emma? [[batch:late_create]]"}],
                   "max_tokens": 8}  # fmt: skip
        create = (
            "c.batches.create(input_file_id=f.id, endpoint='/v1/chat/completions', completion_window='24h')\n"
        )
        then = f"try:\n    {create}except openai.APIStatusError:\n    pass\n"  # made, answered 502, not listed yet
        store, counts = _upload_then_die_then_wait(
            path, cfg, server.base_url, payload, then + create * (creates - 1)
        )
        stats = server.stats()
    assert sorted(stats["batches"].values()) == ["cancelled", "completed"]
    assert store.has_answer("k") and counts.answered == 1
    store.close()


def test_two_runs_recovering_a_killed_runs_upload_create_one_batch(tmp_path):
    """Run A was killed between its upload and batches.create. Runs B and C, on its store, both see it
    gone and find no batch at the provider: only the one that takes it over creates it (the window in
    which a run on another machine counts as live starts again when it takes it)."""
    from metachunk import batch
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherConfig

    cfg = TeacherConfig("loopback", base_url="http://127.0.0.1:9/v1", mode="batch")
    path = tmp_path / "answers.sqlite"

    def in_another_run(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", "import sys\nfrom metachunk.store import AnswerStore\n"
                               f"s = AnswerStore(sys.argv[1])\n{code}", str(path)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    # run A: claimed and uploaded (as its row says), then gone
    in_another_run(f"b, _, _ = s.claim_batch({batch.endpoint_name(cfg)!r}, [('k', 0.1)], None, 3600)\n"
                   "s.update_batch(b, input_file_id='file-1', status='uploaded')")  # fmt: skip
    with sqlite3.connect(path) as db:  # two hours ago: past the upload window A's row started with
        db.execute("UPDATE batches SET created = created - 7200")
    store = AnswerStore(path)  # run B
    (row,) = store.live_batches()
    assert not row["being_submitted"]  # A is gone
    assert store.take_batch(row["id"])
    assert in_another_run(f"print(s.take_batch({row['id']!r}))") == "False"  # run C: B, alive, holds it
    assert store.take_batch(row["id"])  # B may ask again
    store.update_batch(row["id"], batch_id="batch_1", status="submitted")
    store.close()
    assert in_another_run(f"print(s.take_batch({row['id']!r}))") == "False"  # created: nothing to take


def test_export_for_vllm_run_batch_then_import_its_results(tmp_path, capsys):
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")  # never contacted
    exported = tmp_path / "round1.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(exported)]) == 0
    lines = [json.loads(x) for x in exported.read_text().splitlines()]
    assert len(lines) == 6 and {x["url"] for x in lines} == {"/v1/chat/completions"}
    assert all(x["body"]["model"] == "loopback" for x in lines)
    results = tmp_path / "results1.jsonl"
    vllm_results(exported, results)
    exported2 = tmp_path / "round2.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results),
                 "--export-batch", str(exported2)]) == 0  # fmt: skip
    second = [json.loads(x) for x in exported2.read_text().splitlines()]
    assert len(second) == 6 and {x["custom_id"] for x in second}.isdisjoint({x["custom_id"] for x in lines})
    # the next round's prompts carry the imported answers
    assert all("She is Emma." in json.dumps(x["body"], ensure_ascii=False) for x in second)
    assert "6 answers stored" in capsys.readouterr().err


USAGE = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}


def vllm_results(exported, path, usage: dict | None = USAGE) -> None:
    """What `vllm run-batch` writes for ``exported``'s requests; ``usage`` None: a body without it."""
    with path.open("w") as f:
        for x in map(json.loads, exported.read_text().splitlines()):
            body = {"id": "c", "object": "chat.completion", "model": "loopback",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "She is Emma."},
                                 "finish_reason": "stop"}]}  # fmt: skip
            if usage is not None:
                body["usage"] = usage
            f.write(json.dumps({"id": "r", "custom_id": x["custom_id"], "response": {"status_code": 200, "body": body},
                                "error": None}) + "\n")  # fmt: skip


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 100}], ids=["no usage", "no completion count"])
def test_an_imported_answer_without_usage_is_refused_for_a_priced_teacher_and_free_otherwise(
    tmp_path, capsys, usage
):
    """An online answer without usage is counted at its request's upper estimate; an imported one has no
    request to estimate from, so for a priced teacher the file is refused (file, line, field; exit 2), and
    nothing of it is stored. A usage that counts the prompt but not the completion is no usage: its
    completion is not free. A teacher without a price stores it at $0."""
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")  # never contacted
    exported, results = tmp_path / "round1.jsonl", tmp_path / "results1.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(exported)]) == 0
    vllm_results(exported, results, usage)
    capsys.readouterr()
    again = ["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results), "--export-batch",
             str(tmp_path / "round2.jsonl")]  # fmt: skip
    assert main(again) == 2
    err = capsys.readouterr().err
    assert f"{results}:1" in err and "response.body.usage" in err and "Traceback" not in err
    with sqlite3.connect(tmp_path / "run" / "answers.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM answers WHERE status = 'ok'").fetchone() == (0,)

    free = yaml.safe_load(recipe.read_text())
    free["prices"] = {"loopback": {"input": 0.0, "output": 0.0}}
    recipe.write_text(yaml.safe_dump(free))
    assert main(again) == 0
    assert "6 answers stored" in capsys.readouterr().err


def test_an_unreadable_results_file_is_named(tmp_path, capsys):
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")
    for name, content, expected in (("missing.jsonl", None, "no such results file"),
                                    ("latin1.jsonl", b'{"custom_id": "caf\xe9"}\n', ":1: invalid UTF-8")):  # fmt: skip
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}" in err and expected in err and "Traceback" not in err


def test_an_imported_result_that_is_no_answer_is_said_with_its_line(tmp_path, capsys):
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")
    exported = tmp_path / "round1.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(exported)]) == 0
    results = tmp_path / "results.jsonl"
    vllm_results(exported, results)
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    lines[1]["response"] = {"status_code": 500, "body": {"error": {"message": "the model crashed"}}}
    lines[3]["response"]["body"]["choices"] = []
    lines[4] |= {
        "response": None,
        "error": {"code": "batch_expired", "message": "not run in time"},
    }  # OpenAI's
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results),
                 "--export-batch", str(tmp_path / "round2.jsonl")]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "3 answers stored, 3 failed" in err
    assert "results.jsonl: line 5: no response: not run in time" in err  # an error file's line
    assert "results.jsonl: line 2: status 500: the model crashed" in err
    assert "results.jsonl: line 4: status 200, but not a chat completion" in err


def test_an_imported_answer_from_a_model_no_teacher_names_is_refused_when_several_could_be_meant(
    tmp_path, capsys
):
    """With teachers on two models, a result whose body names neither cannot be priced: refused, nothing stored."""
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")
    two = yaml.safe_load(recipe.read_text())
    two["teachers"]["completion"]["model"] = "bigger"
    two["prices"]["bigger"] = {"input": 20.0, "output": 80.0}
    recipe.write_text(yaml.safe_dump(two))
    exported, results = tmp_path / "round1.jsonl", tmp_path / "results1.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(exported)]) == 0
    vllm_results(exported, results)
    results.write_text(results.read_text().replace('"model": "loopback"', '"model": "mystery"'))
    capsys.readouterr()
    assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results)]) == 2
    err = capsys.readouterr().err
    assert f"{results}:1" in err and "response.body.model" in err and "'mystery'" in err
    with sqlite3.connect(tmp_path / "run" / "answers.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM answers WHERE status = 'ok'").fetchone() == (0,)


def test_two_batch_runs_on_one_store_pay_each_request_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with serve_in_subprocess(replies=REPLIES, batch_polls=4) as server:
        recipes = []
        for name in ("a", "b"):
            path = write_job(tmp_path / name, server.base_url)
            recipe = yaml.safe_load(path.read_text())
            recipe["cache"] = str(tmp_path / "shared.sqlite")  # one answer store for both runs
            path.write_text(yaml.safe_dump(recipe))
            recipes.append(path)
        procs = [subprocess.Popen([sys.executable, "-m", "metachunk.cli", "distill", "rewrite", "--config", str(p)],
                                  env=env, stderr=subprocess.PIPE, text=True) for p in recipes]  # fmt: skip
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n\n".join(map(str, errs))  # shown whole
        stats = server.stats()
    assert stats["requests"] == 0 and stats["batch_requests"] == 18  # each of the 18 requests sent once
    assert all(n == 1 for n in stats["by_key"].values())
    with sqlite3.connect(tmp_path / "shared.sqlite") as db:
        assert db.execute("SELECT COUNT(*), COUNT(DISTINCT key) FROM answers").fetchone() == (18, 18)
    for run in ("a", "b"):  # both finish every record: neither stops with pending ones
        assert [r["status"] for r in records(tmp_path / run)] == ["ok"] * 6


def test_a_round_whose_requests_another_run_just_submitted_waits_for_that_batch(
    tmp_path, monkeypatch, capsys
):
    """The race two runs on one store hit under load: run B submits its batch after run A's wait
    and before A's drive, so A's round finds every request in a live batch and nothing to send.
    A must wait for B's batch and go on, not stop with pending records and exit 0."""
    from metachunk import batch

    with serve_in_subprocess(replies=REPLIES, batch_polls=2) as server:
        recipe = write_job(tmp_path, server.base_url)
        exported = tmp_path / "round1.jsonl"
        assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(exported)]) == 0
        round1 = [json.loads(x) for x in exported.read_text().splitlines()]
        real_wait, calls = batch.wait, []

        def wait_as_if_another_run_submitted_after_it(store, teachers, counts, progress=True):
            if not calls:  # the other run's batch appears just after this wait returns
                reflection = teachers["reflection"]
                reflection.spool.update({x["custom_id"]: (x["body"], 0.0) for x in round1})
                batch.submit(store, {"reflection": reflection}, None, batch.BatchCounts())
                reflection.spool.clear()
            calls.append(1)
            if len(calls) > 1:
                real_wait(store, teachers, counts, progress)

        monkeypatch.setattr(batch, "wait", wait_as_if_another_run_submitted_after_it)
        assert main(["distill", "rewrite", "--config", str(recipe)]) == 0, capsys.readouterr().err
        stats = server.stats()
    assert all(r["status"] == "ok" for r in records(tmp_path))
    assert stats["batch_requests"] == 18 and all(n == 1 for n in stats["by_key"].values())


def test_a_batch_another_live_run_is_still_submitting_is_left_to_it(tmp_path):
    """Run A claims a batch and uploads its file (minutes, for a big one); run B's wait must neither drop
    it as a run killed before its upload nor create a second batch from A's file, until A is gone."""
    import threading

    from metachunk import batch
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherConfig, TeacherPool

    cfg = TeacherConfig("loopback", base_url="http://127.0.0.1:9/v1", mode="batch", batch_poll_seconds=0.05)
    path = tmp_path / "answers.sqlite"
    uploading = subprocess.Popen(  # run A, stopped mid-upload: its claimed batch, then nothing
        [sys.executable, "-c", "import sys, time\nfrom metachunk.store import AnswerStore\n"
         f"AnswerStore(sys.argv[1]).claim_batch({batch.endpoint_name(cfg)!r}, [('k', 0.1)], None, 3600)\n"
         "print('claimed', flush=True)\ntime.sleep(120)", str(path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert uploading.stdout.readline().strip() == "claimed"
        store = AnswerStore(path)
        (live,) = store.live_batches()
        assert live["status"] == "claimed" and live["being_submitted"]

        def run_b_waits():  # a store per thread, as per process: SQLite connections stay in their thread
            mine = AnswerStore(path)
            batch.wait(
                mine, {"s": TeacherPool({"s": cfg}, {}, mine)["s"]}, batch.BatchCounts(), progress=False
            )
            mine.close()

        waiting = threading.Thread(target=run_b_waits)
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and len(store.live_batches()) == 1  # left to run A
    finally:
        uploading.kill()
        uploading.wait()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and store.live_batches() == []  # A is dead: nothing was sent, its claims go
    assert store.claims_in_flight() == 0


def test_a_results_line_of_the_wrong_shape_names_its_file_and_line(tmp_path, capsys):
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")  # never contacted
    good = {"custom_id": "k", "response": {"status_code": 500, "body": {}}}
    for bad in ({"custom_id": "k", "response": "x"}, {"custom_id": ["k"], "response": {}}, ["k"]):
        results = tmp_path / "results.jsonl"
        results.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results)]) == 2
        err = capsys.readouterr().err
        assert f"{results}:2: expected a Batch API result line" in err and "Traceback" not in err


def test_an_export_takes_only_the_requests_whose_worst_case_fits_the_cap(tmp_path, capsys):
    """An exported file is paid wherever it runs: --max-cost bounds it as it bounds a submitted batch (it
    exported every request, and the import stored spend far past the cap without a word)."""
    recipe = write_job(tmp_path, "http://127.0.0.1:9/v1")  # never contacted
    everything = tmp_path / "all.jsonl"
    assert main(["distill", "rewrite", "--config", str(recipe), "--export-batch", str(everything)]) == 0
    capped = tmp_path / "capped.jsonl"
    capsys.readouterr()
    cap = "0.005"  # room for some of the six reflection requests' worst cases, not all
    assert (
        main(
            ["distill", "rewrite", "--config", str(recipe), "--export-batch", str(capped), "--max-cost", cap]
        )
        == 0
    )
    err = capsys.readouterr().err
    n = len(capped.read_text().splitlines())
    assert 0 < n < len(everything.read_text().splitlines()) == 6, err
    assert f"{6 - n} more requests left out: their worst cases pass --max-cost {float(cap)}" in err
    results = tmp_path / "results.jsonl"
    vllm_results(
        everything, results, usage={"prompt_tokens": 100000, "completion_tokens": 5, "total_tokens": 100005}
    )
    assert main(["distill", "rewrite", "--config", str(recipe), "--import-batch", str(results), "--max-cost", cap,
                 "--export-batch", str(tmp_path / "next.jsonl")]) == 0  # fmt: skip
    assert "past --max-cost" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["batch", "online"])
def test_a_provider_that_refuses_stops_the_run_in_one_line_without_the_private_path(tmp_path, capsys, monkeypatch,
                                                                                    mode):  # fmt: skip
    """A URL from the environment with a route key in its path, and a server whose 404 quotes the path it
    was sent (OpenAI's "Invalid URL (POST ...)"): the Batch API's refusal was a traceback (exit 1) quoting
    it, and the online one's error line quoted it too."""
    with serve_in_subprocess(replies=REPLIES) as server:
        recipe = write_job(tmp_path, server.base_url, n=2, mode=mode)
        doc = yaml.safe_load(recipe.read_text())
        for block in doc["teachers"].values():
            del block["base_url"]
            block["base_url_env"] = "METACHUNK_TEST_GATEWAY"
        recipe.write_text(yaml.safe_dump(doc))
        monkeypatch.setenv("METACHUNK_TEST_GATEWAY", server.base_url.replace("/v1", "/gw/ROUTESECRET42/v1"))
        code = main(["distill", "rewrite", "--config", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and "HTTP 404" in err and "Traceback" not in err, err
    assert "ROUTESECRET42" not in err
    store = tmp_path / "run" / "answers.sqlite"
    if store.exists():
        assert b"ROUTESECRET42" not in store.read_bytes()


def test_a_long_refusal_is_redacted_before_it_is_cut():
    """A refusal quoting the key past 484 characters was cut first, then redacted: the key's first
    characters, no longer the whole registered key, reached the terminal."""
    import httpx2
    import openai

    from metachunk.batch import provider_errors
    from metachunk.redaction import register_secret
    from metachunk.teacher import FatalTeacherError, TeacherConfig

    key = "sk-test-LONGREFUSAL-1234567890abcdef"
    register_secret(key)
    message = "x" * 455 + " Incorrect API key provided: " + key
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/files")
    refusal = openai.APIStatusError(
        message, response=httpx2.Response(400, request=request), body={"message": message}
    )
    with (
        pytest.raises(FatalTeacherError) as e,
        provider_errors(TeacherConfig("m", base_url="http://127.0.0.1:9/v1")),
    ):
        raise refusal
    assert "HTTP 400" in str(e.value) and key[:12] not in str(e.value)
