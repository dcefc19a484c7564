"""Reading ahead and writing behind the model (``chunking/overlap.py``): the order of the records,
the memory bound, and the stops (a failing document, a failing write, SIGTERM), in the function and
through ``metachunk chunk --prefetch``."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from metachunk.chunking.overlap import overlapped
from support.data import data_file

from metachunk.artifacts import read_run_log
from metachunk.cli import main
from metachunk.stopping import Stopped

STAGE_THREADS = ("chunk-ahead", "chunk-behind")


def stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in STAGE_THREADS]


def jitter(rng: random.Random) -> None:
    time.sleep(rng.random() * 0.004)


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_finish_sees_every_group_in_order_whatever_the_timing(depth):
    rng, lock = random.Random(depth), threading.Lock()

    def sleepy(f):
        def run(x):
            with lock:
                r = random.Random(rng.random())
            jitter(r)
            return f(x)

        return run

    seen: list[int] = []
    overlapped(range(40), sleepy(lambda g: g * 10), sleepy(lambda p: p + 1), sleepy(seen.append), depth)
    assert seen == [g * 10 + 1 for g in range(40)]
    assert not stage_threads()


def test_score_runs_in_the_calling_thread_and_the_others_do_not():
    where: dict[str, set[str]] = {"prepare": set(), "score": set(), "finish": set()}

    def note(stage):
        def run(x):
            where[stage].add(threading.current_thread().name)
            return x

        return run

    overlapped(range(6), note("prepare"), note("score"), note("finish"), depth=2)
    assert where == {
        "prepare": {"chunk-ahead"},
        "score": {threading.current_thread().name},
        "finish": {"chunk-behind"},
    }


def test_reading_ahead_holds_at_most_depth_groups_beyond_the_model():
    depth, prepared, scored, most = 2, [0], [0], [0]
    lock = threading.Lock()

    def prepare(g):
        with lock:
            prepared[0] += 1
            most[0] = max(most[0], prepared[0] - scored[0])
        return g

    def score(p):
        time.sleep(0.01)  # a slow model: the reader would run far ahead if it could
        with lock:
            scored[0] += 1
        return p

    overlapped(range(30), prepare, score, lambda s: None, depth)
    # queued groups, plus the one the reader holds while the queue is full, plus the one scoring
    assert most[0] <= depth + 2


@pytest.mark.parametrize("stage", ["prepare", "score", "finish"])
def test_a_failing_document_stops_every_stage_and_only_a_prefix_is_finished(stage):
    bad = 7

    class BadDocument(ValueError):
        pass

    def maybe_fail(name):
        def run(g):
            if name == stage and g == bad:
                raise BadDocument(f"document {g}")
            return g

        return run

    finished: list[int] = []
    calls = {"prepare": 0}

    def prepare(g):
        calls["prepare"] += 1
        return maybe_fail("prepare")(g)

    def finish(g):
        maybe_fail("finish")(g)
        finished.append(g)

    with pytest.raises(BadDocument, match="document 7"):
        overlapped(range(1000), prepare, maybe_fail("score"), finish, depth=2)
    assert finished == list(range(len(finished))) and len(finished) <= bad  # a prefix, never past it
    assert calls["prepare"] < 20  # the reader stopped too, within its queue's reach
    assert not stage_threads()


def test_a_signal_in_the_calling_thread_stops_both_threads():
    finished: list[int] = []

    def score(g):
        if g == 5:
            raise Stopped(signal.SIGTERM)  # what stopping.stop_on_signals raises for SIGTERM
        return g

    with pytest.raises(Stopped):
        overlapped(range(1000), lambda g: g, score, finished.append, depth=2)
    assert finished == list(range(len(finished))) and len(finished) <= 5
    assert not stage_threads()


# ---- through `metachunk chunk` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def emma_rows() -> list[dict]:
    rows = []
    with open(data_file("gutenqa-emma/paragraphs.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows.append({"id": f"emma-{row['paragraph']}", "text": row["text"]})
            if len(rows) == 48:
                break
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "ppl", "--emit-sentences"],
        # merging counts tokens, so the thread behind the model encodes with its own tokenizer copy
        ["--method", "ppl", "--target-len", 60, "--len-unit", "token"],
        ["--method", "msp"],
    ],
    ids=["ppl", "ppl-token-merge", "msp"],
)
def test_prefetch_writes_the_same_bytes_as_the_sequential_run(
    tmp_path, capsys, emma_rows, tiny_model_dir, extra, monkeypatch
):
    from metachunk.chunking import overlap, shards

    depths = []  # what the run asked of the overlap: the flag reached it
    monkeypatch.setattr(
        shards,
        "overlapped",
        lambda *a, depth, **k: depths.append(depth) or overlap.overlapped(*a, depth=depth, **k),
    )
    src = write_jsonl(tmp_path / "emma.jsonl", emma_rows)
    outs = {}
    for depth in (0, 2):
        out = tmp_path / f"d{depth}.jsonl"
        capsys.readouterr()
        # --batch-size 1: groups of 16 documents, so three groups overlap
        rc = main(["chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--batch-size", "1",
                   "--prefetch", str(depth), *map(str, extra)])  # fmt: skip
        assert rc == 0, capsys.readouterr().err
        outs[depth] = out.read_bytes()
    assert outs[0] == outs[2] and outs[0].count(b"\n") == 48
    assert depths == [0, 2]
    assert not stage_threads()


def test_a_document_that_fails_ahead_of_the_model_writes_nothing(tmp_path, capsys, emma_rows, tiny_model_dir,
                                                                  monkeypatch):  # fmt: skip
    import metachunk.chunking.pipeline as pipeline

    split = pipeline.split_sentences

    def split_or_fail(text, *args, **kwargs):
        if text == emma_rows[30]["text"]:
            raise RuntimeError("the splitter failed on document 30")
        return split(text, *args, **kwargs)

    monkeypatch.setattr(pipeline, "split_sentences", split_or_fail)
    fails_writing_nothing(
        tmp_path, capsys, emma_rows, tiny_model_dir, "RuntimeError: the splitter failed on document 30"
    )


def fails_writing_nothing(tmp_path, capsys, emma_rows, tiny_model_dir, error: str) -> None:
    """A prefetching chunk run of the Emma rows exits 1 with ``error``, leaves no output, half-written
    or whole, and no stage thread."""
    src = write_jsonl(tmp_path / "emma.jsonl", emma_rows)
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    rc = main(["chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--batch-size", "1",
               "--prefetch", "2"])  # fmt: skip
    assert rc == 1 and error in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))
    assert not stage_threads()


# A command run as a user's shell runs it: one torch thread, output unbuffered, no Hub.
RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}


def stop_and_expect_143_at_once(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc`` (its output piped): it exits 143 within 10 s."""
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    proc.wait(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - started < 10, proc.stdout.read().decode()[-3000:]


def a_shard_listed(out: Path) -> bool:
    """The manifest, not the file: a shard is renamed in before its manifest entry is written."""
    manifest = out / "manifest.json"
    return manifest.is_file() and bool(json.loads(manifest.read_text())["shards"]["done"])


def test_sigterm_mid_run_exits_143_and_a_rerun_finishes_byte_identical(tmp_path, emma_rows, tiny_model_dir):
    rows = [{"id": f"{r['id']}-{k}", "text": r["text"]} for k in range(6) for r in emma_rows]  # 288
    src = write_jsonl(tmp_path / "emma.jsonl", rows)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "metachunk", "chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir),
            "--shards", "18", "--batch-size", "1", "--prefetch", "2"]  # fmt: skip
    proc = subprocess.Popen(argv, env=RUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not a_shard_listed(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        stop_and_expect_143_at_once(proc)
    finally:
        proc.kill()
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"]["done"]
    assert not list(out.glob(".*.tmp"))
    rerun = subprocess.run(argv, env=RUN_ENV, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    sequential = tmp_path / "sequential"
    done = subprocess.run([*argv[:6], str(sequential), *argv[7:-1], "0"], env=RUN_ENV, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    shards = lambda folder: {p.name: p.read_bytes() for p in sorted(folder.glob("train-*"))}  # noqa: E731
    assert shards(out) == shards(sequential) and len(shards(out)) == 18


def test_the_first_group_is_read_split_and_tokenized_while_the_model_loads(
    tmp_path, capsys, emma_rows, tiny_model_dir, monkeypatch
):
    """With --prefetch the model loads in the main thread while the thread ahead prepares the first
    group: here the first prepare waits for the load to start and the load for a prepared group, so
    a run that did the two in turn (either order) would time out. The load's seconds are counted
    once in model_load_seconds, and the output is the sequential run's."""
    import metachunk.chunking.pipeline as pipeline

    from metachunk import models

    loading, prepared, load_s = threading.Event(), threading.Event(), []
    real_prepare, real_load = pipeline.Chunker.prepare, models.load_causal_lm_model

    def prepare(self, ids, texts):
        assert loading.wait(20), "the first group was prepared before the model started to load"
        out = real_prepare(self, ids, texts)
        prepared.set()
        return out

    def load_beside_the_first_group(*args, **kwargs):
        assert threading.current_thread() is threading.main_thread()  # where a SIGTERM lands
        started = time.perf_counter()
        loading.set()
        assert prepared.wait(20), "no group was prepared while the model loaded"
        time.sleep(2)  # a load long enough that counting it twice shows
        model = real_load(*args, **kwargs)
        load_s.append(time.perf_counter() - started)
        return model

    monkeypatch.setattr(pipeline.Chunker, "prepare", prepare)
    monkeypatch.setattr(models, "load_causal_lm_model", load_beside_the_first_group)
    src = write_jsonl(tmp_path / "emma.jsonl", emma_rows)
    out = tmp_path / "ahead.jsonl"
    rc = main(["chunk", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--batch-size", "1",
               "--prefetch", "2"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    assert len(load_s) == 1
    run = read_run_log(out)[-1]
    assert round(load_s[0], 2) <= run["model_load_seconds"] < load_s[0] + 1.5

    monkeypatch.setattr(pipeline.Chunker, "prepare", real_prepare)
    monkeypatch.setattr(models, "load_causal_lm_model", real_load)
    sequential = tmp_path / "sequential.jsonl"
    rc = main(["chunk", str(src), "-o", str(sequential), "--model", str(tiny_model_dir), "--batch-size", "1",
               "--prefetch", "0"])  # fmt: skip
    assert rc == 0 and out.read_bytes() == sequential.read_bytes()
    assert not stage_threads()


def test_sigterm_while_the_model_loads_exits_143_at_once(tmp_path, emma_rows, tiny_model_dir):
    """The load runs in the main thread, where the signal handler raises: a stop does not wait for
    the weights (a load that would take a minute here)."""
    src = write_jsonl(tmp_path / "emma.jsonl", emma_rows)
    out = tmp_path / "out.jsonl"
    script = (
        "import sys, time\n"
        "import metachunk.models as models\n"
        "def slow_load(*args, **kwargs):\n"
        "    print('loading', flush=True)\n"
        "    time.sleep(60)\n"
        "models.load_causal_lm_model = slow_load\n"
        "from metachunk.cli import main\n"
        f"sys.exit(main(['chunk', {str(src)!r}, '-o', {str(out)!r}, '--model', {str(tiny_model_dir)!r}, "
        "'--batch-size', '1', '--prefetch', '2']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=RUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert proc.stdout.readline().decode().endswith("loading\n")  # after the bar's first \r-line
        stop_and_expect_143_at_once(proc)
    finally:
        proc.kill()
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_a_model_that_fails_to_load_stops_a_prefetching_run_and_writes_nothing(
    tmp_path, capsys, emma_rows, tiny_model_dir, monkeypatch
):
    from metachunk import models

    def truncated(*args, **kwargs):
        raise OSError("model.safetensors: truncated")

    monkeypatch.setattr(models, "load_causal_lm_model", truncated)
    fails_writing_nothing(tmp_path, capsys, emma_rows, tiny_model_dir, "model.safetensors: truncated")


def test_on_start_runs_in_the_calling_thread_while_the_first_group_is_prepared():
    """What the model needs first (a corpus run loads it) starts once the thread ahead has; it
    waits here for the first prepare, which would never come if that thread were not running."""
    first_prepared, seen = threading.Event(), []

    def prepare(g):
        first_prepared.set()
        return g

    def on_start():
        seen.append(threading.current_thread() is threading.main_thread())
        assert first_prepared.wait(30)

    out = []
    overlapped(range(4), prepare, lambda g: g, out.append, depth=2, on_start=on_start)
    assert seen == [True] and out == [0, 1, 2, 3] and not stage_threads()


@pytest.mark.parametrize("depth", [0, 2])
def test_a_failing_on_start_stops_the_run_before_any_group_is_scored(depth):
    scored = []

    def on_start():
        raise OSError("model.safetensors: truncated")

    with pytest.raises(OSError, match="truncated"):
        overlapped(range(40), lambda g: g, scored.append, lambda g: None, depth=depth, on_start=on_start)
    assert scored == [] and not stage_threads()
