"""Corpus-scale chunking: every input layout, the sharded dataset folder, resume after kill -9,
refusal of a changed run, and the same bytes from 1 worker, 2 workers, 2 torchrun ranks and 2 Ray
actors (``chunking/shards.py``, ``metachunk/sources.py``)."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.shards import shards_done
from support.data import data_file

from metachunk.artifacts import RUN_LOG, InputError, append_run_log, read_run_log
from metachunk.cli import main
from metachunk.sources import DocumentSource

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def emma() -> list[dict]:
    """60 real Emma paragraphs as {id, text}."""
    rows = []
    with open(data_file("gutenqa-emma/paragraphs.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows.append({"id": f"emma-{row['paragraph']}", "text": row["text"]})
            if len(rows) == 60:
                break
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("train-*"))}


def chunk(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["chunk", *map(str, argv)])
    return rc, capsys.readouterr().err


# ---- inputs -------------------------------------------------------------------------------------


def test_the_run_log_keeps_whole_lines_and_skips_a_cut_one(tmp_path, emma):
    """runs.jsonl: a line a kill cut inside a character is skipped and ended before the next; a value
    with U+2028 (JSON leaves it raw) stays one line; a folder read as input leaves the log out."""
    append_run_log(tmp_path, {"note": "first \u2028 line"})
    with (tmp_path / RUN_LOG).open("ab") as f:
        f.write('{"note": "cut in é'.encode()[:-1])  # half of a two-byte character
    append_run_log(tmp_path, {"note": "third"})
    assert [r["note"] for r in read_run_log(tmp_path)] == ["first \u2028 line", "third"]
    assert all(r["finished"].endswith("+00:00") for r in read_run_log(tmp_path))
    write_jsonl(tmp_path / "docs.jsonl", emma[:2])
    assert [d.id for d in DocumentSource(tmp_path)] == [r["id"] for r in emma[:2]]


def test_every_input_layout_reads_the_same_documents(tmp_path, emma):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"doc": r["id"], "body": r["text"]} for r in emma]  # not called id and text
    write_jsonl(tmp_path / "one.jsonl", rows)
    with gzip.open(tmp_path / "one.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet", row_group_size=7)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    shards = tmp_path / "shards"
    write_jsonl(shards / "a.jsonl", rows[:25])
    pq.write_table(pa.Table.from_pylist(rows[25:]), shards / "b.parquet")
    (shards / ".hidden.jsonl").write_text("not json\n")  # hidden files are skipped
    texts = [r["text"] for r in emma]
    for path in ("one.jsonl", "one.jsonl.gz", "one.parquet", "hf", "shards"):
        source = DocumentSource(tmp_path / path, text_field="body", id_field="doc")
        docs = list(source)
        assert [d.text for d in docs] == texts, path
        assert [d.id for d in docs] == [r["id"] for r in emma], path

    lines = tmp_path / "raw" / "documents_dup_part_1_part_1"  # the raw CRUD layout: no suffix
    lines.parent.mkdir()
    lines.write_text("first article\n\nsecond article\n", encoding="utf-8")
    docs = list(DocumentSource(lines.parent, input_format="lines"))
    assert [(d.id, d.text) for d in docs] == [
        ("documents_dup_part_1_part_1:1", "first article"),
        ("documents_dup_part_1_part_1:3", "second article"),
    ]


def test_a_named_input_format_is_read_as_named_or_refused(tmp_path, emma):
    """It used to be ignored wherever a suffix was known: ``parquet`` on a folder read its JSONL too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = emma[:6]
    write_jsonl(tmp_path / "corpus.json", rows)  # a suffix that says nothing: read as named
    with gzip.open(tmp_path / "part-0.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    write_jsonl(tmp_path / "lines.txt", rows)  # as it was before: .txt read as the format named
    for name in ("corpus.json", "part-0.gz", "lines.txt"):
        assert [d.text for d in DocumentSource(tmp_path / name, "jsonl")] == [r["text"] for r in rows]
    with pytest.raises(InputError, match="no input shards|must be"):
        DocumentSource(tmp_path / "corpus.json")  # auto: the suffix is no format
    write_jsonl(tmp_path / "c.jsonl", rows)
    for fmt, says in (("parquet", "jsonl"), ("txt", "jsonl")):
        with pytest.raises(InputError, match=f"c.jsonl: --input-format {fmt}, but its name says {says}"):
            DocumentSource(tmp_path / "c.jsonl", fmt)
    shards = tmp_path / "shards"
    write_jsonl(shards / "a.jsonl", rows[:3])
    pq.write_table(pa.Table.from_pylist(rows[3:]), shards / "b.parquet")
    assert [d.text for d in DocumentSource(shards, "parquet")] == [r["text"] for r in rows[3:]]
    assert [d.text for d in DocumentSource(shards, "jsonl")] == [r["text"] for r in rows[:3]]
    with pytest.raises(InputError, match="a folder: --input-format txt"):
        DocumentSource(shards, "txt")


@settings(max_examples=40, deadline=None)
@given(start=st.integers(0, 60), length=st.integers(0, 60))
def test_any_range_reads_from_its_checkpoint(tmp_path_factory, emma, start, length):
    folder = tmp_path_factory.mktemp("ranges")
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(folder / "a.jsonl", emma[:20])
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in emma[20:40])
    pq.write_table(pa.Table.from_pylist(emma[40:]), folder / "c.parquet", row_group_size=3)
    source = DocumentSource(folder)
    index = source.scan(every=3)  # many checkpoints: most ranges start between two
    assert index.documents == 60
    stop = min(60, start + length)
    assert [d.text for d in source.documents(start, stop, index)] == [r["text"] for r in emma[start:stop]]


def test_consecutive_ranges_follow_on_and_any_other_range_reads_from_its_checkpoint(tmp_path, emma):
    """A worker's consecutive shards: the next range goes on from where the last one stopped, where a gzip
    or parquet file used to be read again up to each shard's start (bench/shard_reads.py measures it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    with gzip.open(folder / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in emma[:30])
    pq.write_table(pa.Table.from_pylist(emma[30:]), folder / "b.parquet")
    source = DocumentSource(folder)
    index = source.scan(every=7)
    texts = [r["text"] for r in emma]
    for start, stop in [(0, 10), (10, 25), (25, 60), (5, 12), (12, 31), (31, 31), (31, 45), (3, 4), (44, 60)]:
        assert [d.text for d in source.documents(start, stop, index)] == texts[start:stop], (start, stop)
    partly = source.documents(0, 20, index)
    next(partly)  # a range not read to its end is not followed on
    assert [d.text for d in source.documents(20, 40, index)] == texts[20:40]


@pytest.mark.parametrize(
    "name, content, fmt, expected",
    [
        (
            "bad.jsonl",
            b'{"text": "a"}\n{"body": "b"}\n',
            "auto",
            ["bad.jsonl:2", "missing field 'text'", "body"],
        ),
        ("dup", b"", "auto", ["b.jsonl:1", "duplicate id 'x'", "a.jsonl:1"]),
        ("raw.txt", b"fine\n\xff\xfe broken\n", "lines", ["raw.txt:2", "invalid UTF-8"]),
        ("t.parquet", None, "auto", ["t.parquet", "no column 'text'", "body"]),
    ],
)
def test_bad_input_is_a_file_line_error_before_any_model_loads(
    tmp_path, capsys, name, content, fmt, expected
):
    path = tmp_path / name
    if name == "dup":
        write_jsonl(path / "a.jsonl", [{"id": "x", "text": "one"}])
        write_jsonl(path / "b.jsonl", [{"id": "x", "text": "two"}])
    elif content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{"body": "b"}]), path)
    else:
        path.write_bytes(content)
    rc, err = chunk(capsys, path, "-o", tmp_path / "out", "--input-format", fmt, "--model", "no-such-model")
    assert rc == 2, err
    assert "Traceback" not in err
    for piece in expected:
        assert piece in err, (piece, err)
    assert not (tmp_path / "out").exists()  # nothing written, no model resolved


# ---- the sharded folder -------------------------------------------------------------------------


def test_folder_loads_with_datasets_and_chunks_tile_their_documents(tmp_path, capsys, emma, tiny_model_dir):
    import datasets

    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    texts = {r["id"]: r["text"] for r in emma}
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"out_{fmt}"
        rc, err = chunk(capsys, src, "-o", out, "--model", tiny_model_dir, "--shards", 5, "--output-format", fmt,
                        "--emit-sentences")  # fmt: skip
        assert rc == 0, err
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] and manifest["shards"]["count"] == 5
        assert sorted(manifest["shards"]["done"]) == [f"{i:05d}" for i in range(5)]
        assert manifest["summary"]["documents"] == 60
        ds = datasets.load_dataset({"jsonl": "json"}.get(fmt, fmt), data_dir=str(out), split="train")
        assert ds["id"] == [r["id"] for r in emma]  # shards in name order are the input in order
        for row in ds:
            doc = texts[row["id"]]
            assert "".join(c["text"] for c in row["chunks"]) == doc
            for c in row["chunks"]:
                assert c["text"] == doc[c["start"] : c["end"]]
        # contiguous ranges: shard i holds positions floor(i*n/N) .. floor((i+1)*n/N)-1
        assert [e["documents"] for e in manifest["shards"]["done"].values()] == [12] * 5


def test_one_and_two_workers_write_the_same_bytes(tmp_path, capsys, emma, tiny_model_dir):
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    outs, manifests = {}, {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        rc, err = chunk(capsys, src, "-o", out, "--model", tiny_model_dir, "--shards", 4, "--workers", workers,
                        "--threads-per-worker", 1, "--emit-sentences")  # fmt: skip
        assert rc == 0, err
        outs[workers] = shard_bytes(out)
        assert read_run_log(out)[-1]["workers"] == workers
        manifests[workers] = (out / "manifest.json").read_bytes()
    assert (
        len(outs[1]) == 4 and outs[1] == outs[2] and manifests[1] == manifests[2]
    )  # how it ran is in runs.jsonl


def test_a_folder_of_many_shards_enters_them_in_a_journal_and_a_resume_reads_both(tmp_path):
    """`ShardedOutput`: each shard's entry is one journal line; the manifest takes the journal in after
    each of the first 16 shards, then once the new ones reach a sixteenth of those it lists, so its
    rewrites (and bytes) grow with the shards, not with their square. A run killed between rewrites
    loses nothing: the next open reads the manifest and the journal, keeps the shards whose files
    still hold their hash (not a cut journal line, not a changed file), and starts a fresh journal.
    A stopped run's manifest takes the journal in (`settle`). A run with another config that takes the
    folder over stops this one at its next shard."""
    from metachunk.chunking.shards import JOURNAL, ShardedOutput, ShardPlan

    plan = ShardPlan(documents=2000, shards=200)
    head = {
        "fingerprint": "a",
        "fingerprint_of": {"config": "a"},
        "shards": {"count": 200, "format": "jsonl"},
    }
    out = ShardedOutput(tmp_path, plan, "jsonl")
    assert out.open(head, overwrite=False) == set()
    writes = []
    real_write = out.write_manifest
    out.write_manifest = lambda m: (writes.append(len(m["shards"]["done"])), real_write(m))[1]
    for i in range(150):
        out.commit(i, f"shard {i}\n".encode(), {"documents": 10, "chunks": 1, "chunk_chars": 8})
    assert writes[:16] == list(range(1, 17))  # every one of the first 16
    assert all(b - a >= a // 16 for a, b in zip(writes, writes[1:]))  # then ever more rarely
    assert len(writes) < 60
    listed = json.loads((tmp_path / "manifest.json").read_text())["shards"]["done"]
    assert len(listed) == writes[-1] < 150  # the last shards are in the journal only: as a kill leaves them
    with (tmp_path / JOURNAL).open("ab") as f:
        f.write(b'{"shard": "00150", "entry": {"fi')  # a line a kill cut short
    (tmp_path / plan.name(149, "jsonl")).write_text("changed after the run\n")

    again = ShardedOutput(tmp_path, plan, "jsonl")
    assert again.open(head, overwrite=False) == set(range(149))  # 149: its file no longer has its hash
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(manifest["shards"]["done"]) == [f"{i:05d}" for i in range(149)]
    assert (tmp_path / JOURNAL).read_text() == '{"fingerprint": "a"}\n'

    for i in range(149, 200):
        again.commit(i, f"shard {i}\n".encode(), {"documents": 10, "chunks": 1, "chunk_chars": 8})
    assert (
        len(shards_done(tmp_path))
        == 200
        > len(json.loads((tmp_path / "manifest.json").read_text())["shards"]["done"])
    )
    again.settle()  # a stopped run's last act: the manifest lists every shard done
    assert len(json.loads((tmp_path / "manifest.json").read_text())["shards"]["done"]) == 200

    other = ShardedOutput(tmp_path, plan, "jsonl")  # another config, let in by --overwrite
    other.open({**head, "fingerprint": "b", "fingerprint_of": {"config": "b"}}, overwrite=True)
    other.commit(150, b"the other run's\n", {"documents": 10, "chunks": 1, "chunk_chars": 4})
    with pytest.raises(InputError, match="took this folder over"):
        again.commit(150, b"late\n", {"documents": 10, "chunks": 1, "chunk_chars": 4})
    assert (tmp_path / plan.name(150, "jsonl")).read_bytes() == b"the other run's\n"  # not replaced
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_shards_temp_file_is_removed_only_when_its_writer_is_gone(tmp_path):
    """A run's start removes the temp files a killed writer left for its shards, never a live run's
    (the same command started twice); a stopped run removes its own too (``mine``)."""
    from metachunk.chunking.shards import ShardedOutput, ShardPlan

    from metachunk.artifacts import process_space

    plan = ShardPlan(documents=20, shards=2)
    out = ShardedOutput(tmp_path, plan, "jsonl")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        temps = {who: tmp_path / f".{plan.name(0, 'jsonl')}.{pid}@{process_space()}.x1y2.tmp"
                 for who, pid in (("live", live.pid), ("dead", dead.pid), ("mine", os.getpid()))}  # fmt: skip
        for t in temps.values():
            t.write_text("part of a shard")
        out.remove_stale_temps([0, 1])
        assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == sorted(
            temps[w].name for w in ("live", "mine")
        )
        out.remove_stale_temps([0, 1], mine=True)
        assert [p.name for p in tmp_path.glob(".*.tmp")] == [temps["live"].name]
    finally:
        live.kill()


def test_kill_9_then_rerun_skips_done_shards_and_ends_byte_identical(tmp_path, emma, tiny_model_dir):
    docs = [{"id": f"{r['id']}-{k}", "text": r["text"]} for k in range(8) for r in emma]  # 480
    src = write_jsonl(tmp_path / "emma.jsonl", docs)
    argv = [sys.executable, "-m", "metachunk.cli", "chunk", str(src), "--model", str(tiny_model_dir),
            "--shards", "16", "--batch-size", "1", "--emit-sentences"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    subprocess.run([*argv, "-o", str(whole)], check=True, env=env, capture_output=True)

    out = tmp_path / "killed"
    proc = subprocess.Popen([*argv, "-o", str(out)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill -9 once a few shards are in, before the end
        if len(shards_done(out)) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    killed = json.loads((out / "manifest.json").read_text())
    assert proc.returncode == -signal.SIGKILL and not killed["complete"], "the run ended before the kill"
    n_done = len(shards_done(out))  # the manifest's and the journal's (a kill can fall between the two)
    (out / ".manifest.json.x1y2z3.tmp").write_text('{"schema_ver')  # as a kill inside a manifest write leaves

    resumed = subprocess.run([*argv, "-o", str(out)], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {n_done} of 16 shards done" in resumed.stderr
    assert "\r" not in resumed.stderr  # stderr is a pipe: a bar there is whole lines, not redraws
    runs = read_run_log(out)  # the killed attempt finished nothing, so wrote no line
    assert len(runs) == 1 and runs[0]["shards_skipped"] == n_done
    assert runs[0]["documents_chunked"] == 480 - 30 * n_done  # only the shards not done: 30 documents each
    assert shard_bytes(out) == shard_bytes(whole)
    assert (out / "manifest.json").read_bytes() == (whole / "manifest.json").read_bytes()
    assert not list(out.glob(".*.tmp"))  # the killed run's temp files are gone, its manifest's too


def test_a_changed_config_or_input_is_refused_unless_overwrite(tmp_path, capsys, emma):
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    out = tmp_path / "out"
    base = [src, "-o", out, "--method", "sentence", "--target-len", 80, "--shards", 3]
    assert chunk(capsys, *base)[0] == 0
    first = shard_bytes(out)
    rc, err = chunk(capsys, *base)  # the same command again: every shard is done, nothing rewritten
    assert rc == 0 and "resuming: 3 of 3 shards done, 0 to chunk" in err
    rc, err = chunk(capsys, *base[:-2], "--target-len", 120)
    assert rc == 2 and "changed: config" in err and "--overwrite" in err
    write_jsonl(src, emma[:-1])
    rc, err = chunk(capsys, *base)
    assert rc == 2 and "changed: input" in err
    assert shard_bytes(out) == first  # a refusal touches nothing
    rc, err = chunk(capsys, *base, "--overwrite")
    assert rc == 0, err
    assert json.loads((out / "manifest.json").read_text())["summary"]["documents"] == 59
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    rc, err = chunk(capsys, src, "-o", tmp_path / "mine", "--method", "sentence", "--target-len", 80)
    assert rc == 2 and "holds no manifest.json" in err
    for broken, says in (
        (b'{"a": "\xff"}', "invalid UTF-8 at byte 7"),
        (b'{"schema_version": 1', "cut short?"),
        (b"[]", "got list"),
    ):
        (out / "manifest.json").write_bytes(broken)  # as a disk fault or another tool leaves it
        rc, err = chunk(capsys, *base)
        assert rc == 2 and err.strip().endswith("--overwrite to start again") and says in err, err
        assert "Traceback" not in err


@contextlib.contextmanager
def stopped_after_one_shard(monkeypatch):
    """Within it, a run enters one shard and is then stopped, as SIGTERM stops it."""
    from metachunk.chunking.shards import ShardedOutput

    from metachunk.stopping import Stopped

    commit = ShardedOutput.commit

    def stopped(self, i, data, stats):
        commit(self, i, data, stats)
        raise Stopped(signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(ShardedOutput, "commit", stopped)
        yield


def test_a_replacement_stopped_part_way_leaves_the_complete_folder_whole(tmp_path, capsys, emma, monkeypatch):
    """--overwrite of a complete folder writes beside it and swaps once complete: a stop part-way (here a
    SIGTERM after the first shard) leaves the good run as it was, and the same command resumes the rest."""
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    out = tmp_path / "out"
    base = [src, "-o", out, "--method", "sentence", "--shards", 3]
    assert chunk(capsys, *base, "--target-len", 80)[0] == 0
    good = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with stopped_after_one_shard(monkeypatch):
        rc, err = chunk(capsys, *base, "--target-len", 120, "--overwrite")
    assert rc == 143 and "replaces it once complete" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == good  # the good run, whole
    staging = tmp_path / ".out.replacing"
    assert len(shards_done(staging)) == 1

    assert "unfinished replacement" in chunk(capsys, *base, "--target-len", 80)[1]  # the old command: told

    rc, err = chunk(capsys, *base, "--target-len", 120, "--overwrite")
    assert rc == 0 and "resuming: 1 of 3 shards done" in err, err
    assert not staging.exists() and not list(tmp_path.glob(".out.*"))
    assert (
        len(read_run_log(out)) == 3
    )  # the folder's history goes on: the first run, then the replacement's two
    fresh = tmp_path / "fresh"
    assert chunk(capsys, src, "-o", fresh, "--method", "sentence", "--shards", 3, "--target-len", 120)[0] == 0
    assert shard_bytes(out) == shard_bytes(fresh)
    assert (out / "manifest.json").read_bytes() == (fresh / "manifest.json").read_bytes()

    # a swap stopped between its two renames: no folder, a complete replacement beside it; the rerun swaps
    out.rename(staging)
    assert chunk(capsys, *base, "--target-len", 120)[0] == 0
    assert shard_bytes(out) == shard_bytes(fresh) and not staging.exists()

    monkeypatch.chdir(
        out
    )  # `-o .`: the folder the process is in cannot be renamed away, so it is cleared in place
    rc, err = chunk(
        capsys, src, "-o", ".", "--method", "sentence", "--shards", 3, "--target-len", 80, "--overwrite"
    )
    assert rc == 0 and "replaces it once complete" not in err, err
    assert shard_bytes(out) != shard_bytes(fresh) and not staging.exists()


def test_a_replacement_keeps_the_complete_folders_rejects_until_the_swap(tmp_path, capsys, emma, monkeypatch):
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    src.write_text(src.read_text() + "{not json\n")  # a bad row, left out and recorded beside the folder
    out, rejects = tmp_path / "out", tmp_path / "out.rejects.jsonl"
    base = [src, "-o", out, "--method", "sentence", "--shards", 3, "--on-bad-row", "skip"]
    assert chunk(capsys, *base, "--target-len", 80)[0] == 6  # EXIT_SKIPPED: rows were left out
    recorded = rejects.read_bytes()
    write_jsonl(src, emma)  # the replacement's input has no bad row
    with stopped_after_one_shard(monkeypatch):
        assert chunk(capsys, *base, "--target-len", 120, "--overwrite")[0] == 143
    assert rejects.read_bytes() == recorded  # beside the complete folder, still its own
    assert chunk(capsys, *base, "--target-len", 120, "--overwrite")[0] == 0
    assert not rejects.exists()  # swapped in: the new run left nothing out
    assert json.loads((out / "manifest.json").read_text())["rejects"] == {"rows": 0}


def test_a_folder_takes_plots_and_names_them_by_input_position(tmp_path, capsys, emma, tiny_model_dir):
    """--plot works with a folder as with a file: one PNG per document, named by its input position,
    whichever shard holds it; the plots folder is the file run's."""
    src = write_jsonl(tmp_path / "emma.jsonl", emma[:6])
    args = [str(src), "--model", str(tiny_model_dir), "--target-len", 200, "--lang", "en"]
    rc, err = chunk(capsys, *args, "-o", tmp_path / "one.jsonl", "--plot", tmp_path / "plots-one")
    assert rc == 0, err
    rc, err = chunk(capsys, *args, "-o", tmp_path / "dir", "--shards", 3, "--plot", tmp_path / "plots-dir")
    assert rc == 0, err
    names = sorted(p.name for p in (tmp_path / "plots-dir").glob("*.png"))
    assert names == sorted(p.name for p in (tmp_path / "plots-one").glob("*.png")) and len(names) == 6
    assert b"".join(shard_bytes(tmp_path / "dir").values()) == (tmp_path / "one.jsonl").read_bytes()


def test_torchrun_ranks_split_the_shards_and_write_the_same_bytes(tmp_path, capsys, emma, tiny_model_dir):
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    args = [str(src), "--model", str(tiny_model_dir), "--shards", "5", "--emit-sentences"]
    assert chunk(capsys, *args, "-o", tmp_path / "local")[0] == 0
    ranks = tmp_path / "ranks"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "metachunk.cli", "chunk",
         *args, "-o", str(ranks)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(rank 0 of 2)" in proc.stderr and "(rank 1 of 2)" in proc.stderr
    assert shard_bytes(ranks) == shard_bytes(tmp_path / "local")
    manifest = json.loads((ranks / "manifest.json").read_text())
    assert manifest["complete"] and [r["engine"] for r in read_run_log(ranks)] == ["torchrun (2 ranks)"] * 2


def test_ray_actors_write_the_same_bytes_as_the_local_engine(tmp_path, capsys, emma, tiny_model_dir):
    ray = pytest.importorskip("ray")
    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    args = [src, "--model", tiny_model_dir, "--shards", 4, "--threads-per-worker", 1, "--emit-sentences"]
    assert chunk(capsys, *args, "-o", tmp_path / "local")[0] == 0
    # Half of it first, then the rest on Ray: only the shards not done are submitted.
    half = tmp_path / "ray"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rc, err = chunk(capsys, *args, "-o", half, "--engine", "ray", "--workers", 2)
        assert rc == 0, err
        assert shard_bytes(half) == shard_bytes(tmp_path / "local")
        manifest = json.loads((half / "manifest.json").read_text())
        assert read_run_log(half)[-1]["engine"] == "ray" and manifest["complete"]
        manifest["shards"]["done"].pop("00003")
        (half / "manifest.json").write_text(json.dumps(manifest))
        next(half.glob("train-00003-*")).unlink()  # so the bytes below are the rerun's, not the old file's
        rc, err = chunk(capsys, *args, "-o", half, "--engine", "ray", "--workers", 2)
        assert rc == 0 and "resuming: 3 of 4 shards done, 1 to chunk" in err, err
        assert shard_bytes(half) == shard_bytes(tmp_path / "local")
    finally:
        ray.shutdown()


def test_ray_data_says_only_warnings_during_a_run_and_is_put_back_after(monkeypatch):
    """Our bar stands for the run: Ray Data's bar is off and its console drops INFO (ten lines every
    few seconds off a terminal) while a run is on; a caller's own settings come back after it."""
    pytest.importorskip("ray")
    import logging

    import ray.data
    from metachunk.chunking.shards import ray_data_quiet

    monkeypatch.delenv("RAY_DATA_LOGGING_CONFIG", raising=False)
    logger = logging.getLogger("ray.data")
    console = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]
    assert console
    context = ray.data.DataContext.get_current()
    before = context.enable_progress_bars

    def shown(level: int, message: str) -> list[bool]:
        record = logger.makeRecord("ray.data", level, __file__, 1, message, None, None)
        return [bool(h.filter(record)) for h in console]

    with ray_data_quiet():
        assert context.enable_progress_bars is False
        assert shown(logging.INFO, "Starting execution of Dataset") == [False] * len(console)
        assert shown(logging.WARNING, "Progress bars disabled. To enable, ...") == [False] * len(console)
        assert shown(logging.WARNING, "an actor ran out of memory") == [True] * len(console)
    assert context.enable_progress_bars == before
    assert shown(logging.INFO, "Starting execution of Dataset") == [True] * len(console)


def test_read_chunk_records_refuses_an_unfinished_folder(tmp_path, capsys, emma):
    from metachunk.chunking.shards import read_chunk_records

    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    out = tmp_path / "out"
    assert chunk(capsys, src, "-o", out, "--method", "sentence", "--target-len", 80, "--shards", 3)[0] == 0
    assert [r["id"] for r in read_chunk_records(out)] == [r["id"] for r in emma]
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="not complete"):
        list(read_chunk_records(out))


def test_eval_reads_a_folder_as_it_reads_the_file(tmp_path, capsys, emma):
    from metachunk.eval.chunk_quality import read_chunk_docs
    from metachunk.eval.index import read_chunks

    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    args = [src, "--method", "sentence", "--target-len", 80]
    assert chunk(capsys, *args, "-o", tmp_path / "one.jsonl")[0] == 0
    assert chunk(capsys, *args, "-o", tmp_path / "folder", "--shards", 3)[0] == 0
    assert chunk(capsys, *args, "-o", tmp_path / "pq", "--shards", 3, "--output-format", "parquet")[0] == 0
    for folder in ("folder", "pq"):
        assert read_chunks(tmp_path / folder) == read_chunks(tmp_path / "one.jsonl")
        assert read_chunk_docs(tmp_path / folder) == read_chunk_docs(tmp_path / "one.jsonl")


def test_data_sample_chunks_through_the_shards_and_a_rerun_resumes(tmp_path, capsys, emma, tiny_model_dir):
    from metachunk.distill.sample import SampleConfig, sample

    pool = write_jsonl(tmp_path / "pool.jsonl", [r for r in emma if len(r["text"]) >= 300])
    cfg = SampleConfig(pool=pool, out=tmp_path / "s", n_docs=12, min_doc_chars=300, model=str(tiny_model_dir),
                       lang="en", device="cpu", workers=2, threads_per_worker=1, progress=False)  # fmt: skip
    first = sample(cfg)
    chunks = (tmp_path / "s" / "chunks.jsonl").read_bytes()
    manifest = json.loads((tmp_path / "s" / "ppl" / "manifest.json").read_text())
    ran = read_run_log(tmp_path / "s" / "ppl")[-1]
    assert manifest["complete"] and ran["workers_asked"] == 2 and ran["workers"] == 1  # one shard: one worker
    assert first["documents"] == 12 == manifest["summary"]["documents"]
    capsys.readouterr()
    assert sample(cfg)["selected_chunks"] == first["selected_chunks"]
    assert "resuming: 1 of 1 shards done, 0 to chunk" in capsys.readouterr().err
    assert (tmp_path / "s" / "chunks.jsonl").read_bytes() == chunks


def test_a_run_whose_folder_another_config_took_over_enters_no_shard(tmp_path):
    """A folder with no shard done starts again on a changed config without --overwrite: the first run,
    still loading its model, must then not enter its shards in the second run's manifest."""
    from metachunk.chunking.shards import ShardedOutput, ShardPlan

    plan = ShardPlan(4, 2)

    def head(fingerprint):
        return {"fingerprint": fingerprint, "fingerprint_of": {"config": fingerprint},
                "shards": {"count": 2, "format": "jsonl"}}  # fmt: skip

    first, second = (
        ShardedOutput(tmp_path / "out", plan, "jsonl"),
        ShardedOutput(tmp_path / "out", plan, "jsonl"),
    )
    assert first.open(head("a"), overwrite=False) == set()
    assert second.open(head("b"), overwrite=False) == set()  # nothing done: it starts again
    stats = {"documents": 2, "chunks": 2, "chunk_chars": 10}
    with pytest.raises(InputError, match="another run with another config took this folder over"):
        first.commit(0, b"{}\n", stats)
    second.commit(1, b"{}\n", stats)
    assert list(json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]["done"]) == ["00001"]


def test_a_rerun_of_a_complete_folder_never_marks_it_incomplete(tmp_path, emma, monkeypatch):
    """A rerun wrote "complete": false while it checked the done shards: a reader alongside it (or a
    stop before its end) saw a whole, unchanged output refused as "not complete"."""
    from metachunk.chunking.shards import ShardedOutput

    from metachunk.cli import main

    src = write_jsonl(tmp_path / "emma.jsonl", emma)
    argv = ["chunk", str(src), "-o", str(tmp_path / "out"), "--method", "fixed", "--target-len", "300",
            "--shards", "4"]  # fmt: skip
    assert main(argv) == 0
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    written = []
    real = ShardedOutput.write_manifest

    def recording(self, manifest):
        written.append(manifest["complete"])
        real(self, manifest)

    monkeypatch.setattr(ShardedOutput, "write_manifest", recording)
    assert main(argv) == 0
    assert False not in written and (tmp_path / "out" / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.txt", "a.lines"])
def test_a_byte_order_mark_opening_a_file_is_not_text(tmp_path, name):
    """Windows tools open UTF-8 files with a BOM; RFC 8259 section 8.1 lets a JSON parser ignore it.
    It is not part of the first document (it would start its first chunk), and the documents after it
    still resume from their byte offsets."""
    rows = [{"id": "a", "text": "Hello there."}, {"id": "b", "text": "\ufeffSecond, kept as written."}]
    if name == "a.txt":
        body = "Hello there.\nSecond line.\n"
    elif name == "a.lines":
        body = "Hello there.\nSecond line.\n"
    else:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    data = b"\xef\xbb\xbf" + body.encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    source = DocumentSource(path, input_format="lines" if name == "a.lines" else "auto")
    texts = [d.text for d in source.documents()]
    if name == "a.txt":
        assert texts == [body]
    elif name == "a.lines":
        assert texts == ["Hello there.", "Second line."]
    else:
        assert texts == [r["text"] for r in rows]  # a BOM inside a later text is text
        index = source.scan(every=1)
        assert [d.text for d in source.documents(1, 2, index)] == [rows[1]["text"]]


def test_a_setting_the_method_does_not_read_does_not_refuse_a_resume(tmp_path, capsys, emma, tiny_model_dir):
    """A fixed-size folder had been refused a rerun ("changed: config: model") when only --model or
    --msp-prompt differed, settings fixed-size chunking never reads; one it reads still refuses. The run
    log says how many workers ran (one shard: one), beside how many were asked for."""
    src = write_jsonl(tmp_path / "emma.jsonl", emma[:10])
    out = tmp_path / "fixed"
    args = [src, "-o", out, "--method", "fixed", "--target-len", 80, "--len-unit", "char", "--shards", 1]
    rc, err = chunk(capsys, *args, "--workers", 4)
    assert rc == 0, err
    assert read_run_log(out)[-1]["workers"] == 1 and read_run_log(out)[-1]["workers_asked"] == 4
    assert 0 < read_run_log(out)[-1]["seconds"] < 600  # its own timer (a worker count had stood in for it)
    rc, err = chunk(capsys, *args, "--model", tiny_model_dir, "--msp-prompt", "table7", "--moc-top-p", 0.5)
    assert rc == 0 and "resuming: 1 of 1 shards done" in err, err
    rc, err = chunk(capsys, *args[:-4], "--target-len", 81, "--len-unit", "char", "--shards", 1)
    assert rc == 2 and "changed: config: target_len" in err, err
