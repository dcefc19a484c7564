"""A local teacher that dies is caught, not carried on with: on its first completion (``start``
raises, naming the signal), and during a stage (the runner stops and does not record the stage as
done). A llama.cpp built with -march=native died this way on a CPU with AMX, and ``make demo``
exited 0 with nothing distilled (``metachunk/local_teacher.py``, ``metachunk/regen.py``)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from metachunk.local_teacher import LocalTeacher  # bound here: one test patches the module's name

# Answers its health check; on a POST it answers, or (with "first") dies of SIGSEGV as llama.cpp did.
FAKE_SERVER = r"""
import http.server, os, signal, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        if sys.argv[2] == "first":
            os.kill(os.getpid(), signal.SIGSEGV)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"choices": [{"message": {"role": "assistant", "content": "Hi"}}]}')

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def fake_teacher(tmp_path, model_dir, crash: str):
    teacher = LocalTeacher(str(model_dir), backend="transformers", log=tmp_path / "teacher.log")
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    teacher.command = [sys.executable, str(script), str(teacher.port), crash]
    return teacher


def test_a_server_that_dies_on_its_first_completion_is_not_ready(tmp_path, tiny_model_dir):
    teacher = fake_teacher(tmp_path, tiny_model_dir, "first")
    with pytest.raises(RuntimeError, match="was killed by SIGSEGV on its first completion"):
        teacher.start(timeout=60)
    assert teacher.failure() == "was killed by SIGSEGV"


def test_a_server_that_answers_is_ready(tmp_path, tiny_model_dir):
    teacher = fake_teacher(tmp_path, tiny_model_dir, "never")
    with teacher:
        assert teacher.failure() is None
    assert teacher.failure() == "was killed by SIGTERM"  # stop()'s own signal


def test_a_stop_while_the_server_starts_stops_the_server(tmp_path, tiny_model_dir, monkeypatch):
    """A SIGTERM (`Stopped`) that lands in ``start``'s wait for the server stops the server there, as
    ``with`` would: ``start`` is not inside its own ``with``."""
    import urllib.request

    from metachunk.stopping import Stopped

    teacher = fake_teacher(tmp_path, tiny_model_dir, "never")
    real = urllib.request.urlopen

    def stopped_at_the_health_check(url, *args, **kwargs):
        if str(url).endswith(teacher.health_path):
            raise Stopped(15)
        return real(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", stopped_at_the_health_check)
    try:
        with pytest.raises(Stopped):
            teacher.start(timeout=60)
        assert teacher.failure() == "was killed by SIGTERM"  # stop()'s own signal, sent by start
    finally:
        teacher.stop()


def test_the_runner_stops_when_the_local_teacher_dies_during_a_stage(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    import metachunk.local_teacher
    from metachunk.regen import Runner, load_recipe

    served = []

    def local_teacher(model, backend, threads, log):  # what the runner constructs
        served.append(fake_teacher(tmp_path, tiny_model_dir, "never"))
        return served[-1]

    monkeypatch.setattr(metachunk.local_teacher, "LocalTeacher", local_teacher)
    for name in ("chunks.jsonl", "documents.jsonl"):
        (tmp_path / name).write_text(json.dumps({"id": "d", "text": "Emma."}) + "\n")
    teacher = {"model": "anything"}
    config = {
        "chunks": str(tmp_path / "chunks.jsonl"),
        "documents": str(tmp_path / "documents.jsonl"),
        "out": str(tmp_path / "out"),
        "teachers": {s: teacher for s in ("reflection", "refinement", "completion")},
    }
    recipe = {"name": "crash", "state": str(tmp_path / "state"),
              "stages": [{"name": "ask", "run": "distill rewrite", "local_teacher": True, "allow_exit": [0, 4],
                          "config": config}]}  # fmt: skip
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    def stage_kills_the_server(argv):  # the stage runs while the server dies under it; its status says 4
        served[0].process.kill()
        served[0].process.wait()
        return Result(4)

    from metachunk import cli, config
    from metachunk.command import Registry, Result

    commands = Registry(cli.COMMANDS, cli.parse, stage_kills_the_server, config.computed)
    result = Runner(load_recipe(path), commands).run()
    assert result == {"failed": "ask", "exit": 4}
    err = capsys.readouterr().err
    assert "the local teacher was killed by SIGKILL during stage 'ask'" in err
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert "ask" not in state["stages"]  # a rerun runs it again
