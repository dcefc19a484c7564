"""A command stopped by a scheduler leaves nothing running (``metachunk/stopping.py``).

Each command that starts processes is stopped mid-run by SIGTERM (what Slurm, Kubernetes,
systemd and ``timeout`` send first) and by SIGKILL (what they send after the grace period); within
10 s no process of the run remains and its port is free. A SIGTERM exits 143 and leaves the
outputs as a Ctrl-C does: nothing half-written replaced, and a rerun finishes the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from metachunk.local_teacher import free_port, llama_cpp_available

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
EN = (
    "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence. "
    "She had lived nearly twenty-one years in the world with very little to distress or vex her. "
)


def start(*argv, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "metachunk", *map(str, argv)], env=ENV,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip


def a_shard_listed(out: Path) -> bool:
    """The manifest lists a finished shard. A shard's file is renamed in before its manifest entry is
    written (``ShardedOutput.commit``), so waiting for the file alone can stop a run between the two:
    that shard is then redone on the rerun, and the manifest lists none yet."""
    try:
        return bool(json.loads((out / "manifest.json").read_text())["shards"]["done"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return False


def wait_for(predicate, timeout: float, what, every: float = 0.2):
    """``what`` (a string, or a function called at the timeout) names what was waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def command_line(c: psutil.Process) -> str:
    """``c``'s command line; "" once it has ended (a zombie has none: psutil raises for it)."""
    try:
        return " ".join(c.cmdline())
    except psutil.Error:
        return ""


def port_free(port: int) -> bool:
    """Free as a server sees it: bound with SO_REUSEADDR (our polling's TIME_WAIT sockets do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def assert_all_gone(proc: subprocess.Popen, children: list[psutil.Process], port: int | None = None):
    proc.wait(timeout=30)

    def running(c: psutil.Process) -> bool:
        try:
            return c.is_running() and c.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # it ended (or became a zombie) between the two calls
            return False

    def names(procs: list[psutil.Process]) -> list:
        out = []
        for c in procs:
            try:
                out.append(c.cmdline()[:4])
            except psutil.Error:  # ended while the message was being written
                out.append(c.pid)
        return out

    alive = lambda: [c for c in children if running(c)]  # noqa: E731
    wait_for(lambda: not alive(), 10, lambda: f"the run's processes to end: {names(alive())} are left")
    if port is not None:
        wait_for(lambda: port_free(port), 10, f"port {port} to be free")


def stop_and_check(proc: subprocess.Popen, sig: int, children: list[psutil.Process], port: int | None = None):
    """Send ``sig``; every process of the run ends within 10 s (the port freed); SIGTERM exits 143."""
    proc.send_signal(sig)
    assert_all_gone(proc, children, port)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, f"exit status {proc.returncode}"


def kill_what_is_left(proc: subprocess.Popen) -> None:
    """After a failed test: nothing of the run outlives it."""
    for c in descendants(proc):
        with contextlib.suppress(psutil.Error):
            c.kill()
    proc.kill()


def serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
            return True
    except Exception:
        return False


def backend() -> str:
    return "llama.cpp" if llama_cpp_available() else "transformers"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_teacher_serve_leaves_no_server(tmp_path, sig):
    port = free_port()
    proc = start("teacher", "serve", "--port", port, "--backend", backend(), log=tmp_path / "log")
    try:
        wait_for(lambda: serving(port) or proc.poll() is not None, 240, "the server")
        assert proc.poll() is None, (tmp_path / "log").read_text()
        children = descendants(proc)
        assert children  # the server runs in a child process
        stop_and_check(proc, sig, children, port)
        if sig == signal.SIGTERM:
            assert "stopped by SIGTERM" in (tmp_path / "log").read_text()
    finally:
        kill_what_is_left(proc)


def test_a_port_left_bound_is_named_with_its_holder(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "metachunk", "teacher", "serve", "--port", str(port),
                               "--backend", backend()], env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert f"port {port} is in use by pid {os.getpid()}" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
def corpus(tmp_path) -> Path:
    """400 documents in 40 shards: after the first shard is listed, a second or more of work is left for the
    stop to land in (with one document a shard, the run could finish first)."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{k}", "text": EN * 6}) + "\n" for k in range(400)))
    return src


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_chunk_workers_end_with_the_run_and_a_rerun_finishes(tmp_path, corpus, tiny_model_dir, sig):
    out = tmp_path / "out"
    argv = ["chunk", corpus, "-o", out, "--model", tiny_model_dir, "--workers", 2, "--shards", 40,
            "--threads-per-worker", 1, "--lang", "en"]  # fmt: skip
    proc = start(*argv, log=tmp_path / "log")
    try:
        wait_for(lambda: len(descendants(proc)) >= 2 and descendants(proc), 120, "the workers")
        wait_for(lambda: a_shard_listed(out) or proc.poll() is not None, 120, "a shard", every=0.02)
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        stop_and_check(proc, sig, descendants(proc))
    finally:
        kill_what_is_left(proc)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and all(
        (out / e["file"]).is_file() for e in manifest["shards"]["done"].values()
    )
    assert not list(out.glob(".*.tmp")) or sig == signal.SIGKILL  # a stop removes its temp files
    rerun = subprocess.run([sys.executable, "-m", "metachunk", *map(str, argv)], env=ENV, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["complete"]


@pytest.mark.parametrize("written", [".train-", "..shards-done.jsonl.", ".manifest.json."])
def test_a_stop_inside_a_temp_file_creation_leaves_no_temp_file(tmp_path, corpus, tiny_model_dir, monkeypatch,
                                                                 capsys, written):  # fmt: skip
    """SIGTERM raises `Stopped` wherever the main thread is, also inside ``tempfile.mkstemp`` after the temp file
    exists and before its writer can clean it up (seen once in a fresh-clone run), for a shard, the folder's
    journal or its manifest: the run removes its temp files on the way out, and exits 143."""
    import tempfile

    from metachunk.cli import main
    from metachunk.stopping import Stopped

    real_mkstemp = tempfile.mkstemp
    shard_temps = []

    def mkstemp_then_stop(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        if Path(path).name.startswith(written):
            shard_temps.append(path)
            if len(shard_temps) == 2:  # the second such write, its temp file on disk
                os.close(fd)
                raise Stopped(signal.SIGTERM)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_stop)
    out = tmp_path / "out"
    argv = [
        "chunk",
        str(corpus),
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--shards",
        "4",
        "--lang",
        "en",
    ]
    assert main(argv) == 143
    assert len(shard_temps) >= 2 and not list(
        out.glob(".*.tmp")
    )  # a third: the stopped run settles its manifest
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_local_ray_cluster_a_run_started_goes_with_it(tmp_path, corpus, tiny_model_dir, sig):
    """``chunk --engine ray`` without ``--ray-address`` starts a local Ray cluster (GCS, raylet, the
    actors' workers): a SIGTERM shuts it down (``ray.shutdown``, exit 143 although ``ray.init``
    installs a SIGTERM handler of its own); after a SIGKILL, Ray's fate sharing ends the GCS and the
    raylet, and our watchdog (``stopping.reap_on_death``) the agents and workers under the raylet."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    argv = ["chunk", corpus, "-o", out, "--model", tiny_model_dir, "--engine", "ray", "--workers", 1, "--shards", 40,
            "--threads-per-worker", 1, "--lang", "en"]  # fmt: skip
    proc = start(*argv, log=tmp_path / "log")
    try:
        wait_for(lambda: a_shard_listed(out) or proc.poll() is not None, 300, "a shard")
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        children = descendants(proc)
        assert any("raylet" in command_line(c) for c in children)
        stop_and_check(proc, sig, children)
    finally:
        kill_what_is_left(proc)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"]["done"]


MIDDLE = """
import subprocess, sys, time
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(sleeper.pid, flush=True)
time.sleep(5)  # the watchdog's scans see the sleeper as the run's, even on a loaded machine
"""
WATCHED = """
import subprocess, sys, time
from metachunk.stopping import reap_on_death

with reap_on_death():
    time.sleep(1)  # the watchdog has noted this process and scans on
    middle = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True, check=True)
    print(middle.stdout.strip(), flush=True)  # its child, handed to init when it ended: no longer ours
    time.sleep(3)  # scans that no longer find it among this process's descendants
    print("ready", flush=True)
    time.sleep(600)
"""


def test_the_watchdog_stops_a_process_that_left_the_tree_before_the_run_died(tmp_path):
    """A local Ray cluster's agents are the raylet's children; the raylet dies with the run, and its
    children are handed to init, possibly between two of the watchdog's scans. Here the middle
    process ends well before the run: the watchdog still stops its child, which it saw as ours.
    The signals a terminal or a scheduler sends the whole process group first do not end the
    watchdog: it is there for the SIGKILL that follows them."""
    run = subprocess.Popen(
        [sys.executable, "-c", WATCHED, MIDDLE], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        orphan = psutil.Process(int(run.stdout.readline()))
        assert run.stdout.readline().strip() == "ready"
        assert orphan.ppid() != run.pid and orphan.is_running()
        (watchdog,) = [c for c in descendants(run) if "--reap" in command_line(c)]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            watchdog.send_signal(sig)
        time.sleep(0.5)
        assert watchdog.is_running() and watchdog.status() != psutil.STATUS_ZOMBIE
        stop_and_check(run, signal.SIGKILL, [orphan, watchdog])
    finally:
        kill_what_is_left(run)
        with contextlib.suppress(NameError, psutil.Error):
            orphan.kill()


LATE_STARTER = """
import subprocess, sys, time
sys.stdin.readline()  # told once the watchdog has scanned: this child is seen, its own child is not
late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(late.pid, flush=True)
time.sleep(600)
"""
WATCHED_ONCE = """
import subprocess, sys, time
from metachunk.stopping import reap_on_death

child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
with reap_on_death(every=600):  # a scan as the block starts, the next in ten minutes
    child.stdin.write("go\\n")
    child.stdin.flush()
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(600)
"""


def test_the_watchdog_stops_a_process_started_after_its_last_scan(tmp_path):
    """A process of the run starts a child between two of the watchdog's scans, and the run is killed
    before the next: the scan the watchdog makes once the run is dead finds that child under a process
    it saw, and stops both. Here the scans are ten minutes apart, so only that last scan can see it."""
    run = subprocess.Popen(
        [sys.executable, "-c", WATCHED_ONCE, LATE_STARTER], env=ENV, stdout=subprocess.PIPE, text=True
    )
    late = []
    try:
        late = [psutil.Process(int(pid)) for pid in run.stdout.readline().split()]
        assert len(late) == 2 and late[1].ppid() == late[0].pid
        stop_and_check(run, signal.SIGKILL, late)
    finally:
        kill_what_is_left(run)
        for p in late:
            with contextlib.suppress(psutil.Error):
                p.kill()


ORPHANED_WORKER = """
import os, sys, time
from metachunk.stopping import die_with_parent

parent = int(sys.argv[1])  # as a chunk worker is given its run's pid (multiprocessing.parent_process)
while os.getppid() == parent:  # its parent ends before this worker asks to die with it
    time.sleep(0.01)
die_with_parent(parent)
print("outlived its parent", flush=True)
"""
SHORT_LIVED_PARENT = """
import os, subprocess, sys
with open(sys.argv[2], "w") as out:
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=out,
                              stderr=subprocess.STDOUT)
print(worker.pid, flush=True)
"""


def test_a_worker_whose_parent_ended_before_it_asked_to_die_with_it_ends_at_once(tmp_path):
    """The death signal covers a parent that dies after it is set (prctl(2)); a chunk worker whose
    run was killed while the worker started checks that its parent is still the one it was given,
    and ends if not."""
    out = tmp_path / "worker.out"
    parent = subprocess.run([sys.executable, "-c", SHORT_LIVED_PARENT, ORPHANED_WORKER, str(out)], env=ENV,
                            capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    worker = int(parent.stdout)

    def running() -> bool:
        try:
            return psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    wait_for(lambda: not running(), 30, "the worker to end")
    assert out.read_text() == ""


@pytest.mark.skipif(
    not llama_cpp_available(), reason="the local teacher of `metachunk run` here is llama.cpp"
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_regeneration_run_stops_its_local_teacher(tmp_path, sig):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{k}", "text": EN * 3}) + "\n" for k in range(6)))
    teacher = {"model": "smollm2", "max_tokens": 256, "concurrency": 1, "timeout": 300, "max_retries": 0}
    recipe = {"name": "stop", "state": str(tmp_path / "state"), "local_teacher": {"model": "smollm2", "backend": "llama.cpp"},
              "stages": [{"name": "moc", "run": "distill moc", "local_teacher": True, "allow_exit": [0, 4],
                          "config": {"documents": str(docs), "out": str(tmp_path / "moc"), "lang": "en",
                                     "moc_tokenizer": "smollm2", "progress": False,
                                     "teachers": {"moc_chunk": teacher}}}]}  # fmt: skip
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    proc = start("run", path, log=tmp_path / "log")
    try:
        server = wait_for(lambda: [c for c in descendants(proc) if "llama_cpp.server" in command_line(c)],
                          240, "the local teacher")  # fmt: skip
        argv = command_line(server[0]).split()  # read once: the launcher execs into the server
        port = int(argv[argv.index("--port") + 1])
        wait_for(lambda: serving(port), 120, "the local teacher to answer")
        time.sleep(2)  # mid-stage: requests in flight
        stop_and_check(proc, sig, descendants(proc), port)
        if sig == signal.SIGTERM:
            assert "stopped by SIGTERM" in (tmp_path / "log").read_text()
    finally:
        kill_what_is_left(proc)
    state = tmp_path / "state" / "state.json"
    assert not state.exists() or "moc" not in json.loads(state.read_text())["stages"]  # a rerun runs it


IN_A_CALLBACK = """
import asyncio, os, signal, sys
from metachunk.stopping import Stopped, stop_on_signals

async def main():
    # the signal is handled inside one of the loop's own callbacks (asyncio.events.Handle._run), as
    # it most often is when a loop is busy
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    await asyncio.sleep(5)
    sys.exit(3)  # not stopped

with stop_on_signals():
    try:
        asyncio.run(main())
    except Stopped as e:
        sys.exit(e.exit_status)
"""


def test_sigterm_stops_an_event_loop_inside_its_callbacks():
    # asyncio logs and drops any BaseException a callback raises but KeyboardInterrupt and
    # SystemExit: a Stopped that was not a KeyboardInterrupt left the loop running
    run = subprocess.run([sys.executable, "-c", IN_A_CALLBACK], capture_output=True, text=True, timeout=60)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert "Exception in callback" not in run.stderr


def test_a_signal_set_to_be_ignored_stays_ignored():
    """`nohup metachunk ...` sets SIGHUP to be ignored; stop_on_signals replaced it, so the closed
    terminal's SIGHUP stopped the run that nohup was meant to keep."""
    from metachunk.stopping import stop_on_signals

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGHUP, before)
