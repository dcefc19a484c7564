"""Hostile inputs: nothing is dropped, nothing is half-written, no traceback.

* every non-empty document gets chunks that tile it, whitespace-only ones included, with every
  chunking path; only the empty string gets none;
* ``fixed`` chunks never cut inside a grapheme cluster;
* lone surrogates, duplicate ids and bad chunk files are ``file:line`` errors (exit 2);
* ``metachunk chunk`` replaces its output and manifest together or not at all; an OS error is one
  line and exit 1; ``-o`` equal to the input is refused;
* directory outputs (datasets, exports) are swapped in by one helper that never loses the old one.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.baselines import fixed_chunks, semantic_chunks, sentence_chunks
from metachunk.chunking.pipeline import ChunkConfig, Chunker
from metachunk.chunking.sentences import split_sentences
from metachunk.chunking.types import Chunk, Sentence, chunks_from_boundaries

from metachunk import artifacts
from metachunk.artifacts import InputError
from metachunk.cli import main
from metachunk.sources import read_documents

BLANKS = [" ", " " * 12, "   \n\t \n", "\u3000\n", "\n\n\n", "\r\n"]
EN = "Emma was clever and rich. She had lived nearly twenty-one years!\n\nMr. Knightley came in."


def assert_tiles(text: str, chunks) -> None:
    """Chunks are contiguous, start at 0, end at len(text), and each is the exact slice."""
    if not text:
        assert chunks == []
        return
    assert chunks, f"no chunks for a non-empty document {text!r}"
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for left, right in zip(chunks, chunks[1:]):
        assert left.end == right.start
    for c in chunks:
        assert c.end > c.start and c.text == text[c.start : c.end]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def chunk_cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["chunk", *map(str, argv)])
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, expected_rc: int, *pieces: str) -> None:
    assert rc == expected_rc, err
    assert "Traceback" not in err and err.count("metachunk: error: ") == 1, err
    line = err.strip().splitlines()[-1]  # after any progress bar
    assert line.startswith("metachunk: error: "), err
    for piece in pieces:
        assert piece in line, (piece, err)


# --------------------------------------------------------------------------------------------
# 1. Whitespace-only documents are chunks too
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", BLANKS)
def test_a_whitespace_document_is_one_sentence(text):
    assert split_sentences(text) == [Sentence(0, len(text))]
    assert split_sentences("") == []


@pytest.mark.parametrize("text", [*BLANKS, ""])
def test_every_baseline_tiles_a_whitespace_document(text):
    sentences = split_sentences(text)
    assert_tiles(text, fixed_chunks(text, 5, "char"))
    assert_tiles(text, fixed_chunks(text, 2, "word"))
    assert_tiles(text, sentence_chunks(text, sentences, 10, "char"))
    assert_tiles(text, sentence_chunks(text, sentences, 3, "word"))
    assert_tiles(text, chunks_from_boundaries(text, sentences, []))

    def embed(texts):
        raise AssertionError("nothing to compare in a one-sentence document")

    assert_tiles(text, semantic_chunks(text, sentences, embed)[0])


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("ppl", {}),
        ("ppl", {"target_len": 20}),
        ("msp", {}),
        ("msp", {"msp_mode": "accumulated"}),
        ("fixed", {"target_len": 4}),
        ("fixed", {"target_len": 1, "len_unit": "word"}),
        ("sentence", {"target_len": 10}),
    ],
)
def test_chunker_tiles_whitespace_documents(tiny_model_dir, method, extra):
    texts = ["", EN, *BLANKS]
    cfg = ChunkConfig(method=method, model=str(tiny_model_dir), device="cpu", **extra)
    out = Chunker(cfg).chunk([str(i) for i in range(len(texts))], texts)
    for text, doc in zip(texts, out):
        assert_tiles(text, doc.chunks)


def test_lumber_units_cover_a_whitespace_document():
    from metachunk.chunking.lumber import make_units

    for text in BLANKS:
        units, _ = make_units(text, split_sentences(text), 550)
        assert [(u.start, u.end) for u in units] == [(0, len(text))]  # one unit: no teacher call


def test_cli_keeps_the_whitespace_of_a_blank_document(tmp_path, capsys):
    texts = [" " * 12, EN, "\t\n", ""]
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "o.jsonl"
    rc, err = chunk_cli(capsys, src, "-o", out, "--method", "fixed", "--target-len", "5")
    assert rc == 0, err
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    for text, record in zip(texts, records):
        assert "".join(c["text"] for c in record["chunks"]) == text  # 12 spaces are 12 spaces
        assert_tiles(text, [Chunk(c["text"], c["start"], c["end"]) for c in record["chunks"]])
    manifest = json.loads((tmp_path / "o.meta.json").read_text(encoding="utf-8"))
    assert manifest["summary"]["chunks"] == sum(len(r["chunks"]) for r in records)


def test_data_sample_chunks_tile_every_drawn_document(tmp_path, tiny_model_dir):
    from metachunk.distill.sample import SampleConfig, sample

    texts = [" " * 400, EN * 4, "\n" * 350, EN * 5]
    pool = write_jsonl(tmp_path / "pool.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(texts)])
    sample(SampleConfig(pool=pool, out=tmp_path / "s", n_docs=10, min_doc_chars=300, model=str(tiny_model_dir),
                        device="cpu", progress=False))  # fmt: skip
    docs = {d.id: d.text for d in read_documents(tmp_path / "s" / "documents.jsonl")}
    for line in (tmp_path / "s" / "chunks.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        text = docs[record["id"]]
        assert_tiles(text, [Chunk(c["text"], c["start"], c["end"]) for c in record["chunks"]])
        for i in record["selected"]:  # a teacher is never asked to rewrite whitespace
            assert record["chunks"][i]["text"].strip()


# Any text: code points of every kind, plus the whitespace and combining marks that trip splitters.
HOSTILE = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from([" ", "\n", "\r\n", "\t", "\u3000", "\u2029", "\u0301", "\u200d", "👩", "。", ". "]),
    ),
    max_size=80,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=HOSTILE, n=st.integers(1, 12), cut_every=st.integers(1, 4))
def test_chunks_tile_any_text(text, n, cut_every):
    sentences = split_sentences(text, max_chars=max(n, 2))
    assert_tiles(text, fixed_chunks(text, n, "char"))
    assert_tiles(text, fixed_chunks(text, n, "word"))
    assert_tiles(text, sentence_chunks(text, sentences, n, "char"))
    assert_tiles(text, sentence_chunks(text, sentences, n, "word"))
    assert_tiles(text, chunks_from_boundaries(text, sentences, range(0, len(sentences), cut_every)))
    for method, unit in (("fixed", "char"), ("fixed", "word"), ("sentence", "char")):
        (doc,) = Chunker(ChunkConfig(method=method, target_len=n, len_unit=unit)).chunk(["x"], [text])
        assert_tiles(text, doc.chunks)


# --------------------------------------------------------------------------------------------
# 5. fixed chunking never cuts inside a grapheme cluster
# --------------------------------------------------------------------------------------------

FAMILY = "👩\u200d👩\u200d👧\u200d👦"  # one grapheme cluster, seven code points


def grapheme_bounds(text: str) -> set[int]:
    return {0, *(m.end() for m in regex.finditer(r"\X", text))}


def test_fixed_chunks_keep_emoji_sequences_and_combining_marks_whole():
    text = FAMILY * 3 + "e\u0301" * 5 + "x"
    chunks = fixed_chunks(text, 2, "char")
    assert [c.text for c in chunks] == [FAMILY * 2, FAMILY + "e\u0301", "e\u0301" * 2, "e\u0301" * 2, "x"]
    assert_tiles(text, chunks)
    # A combining mark after a space belongs to the space: the word cut moves past it.
    text = "a \u0301b c"
    chunks = fixed_chunks(text, 1, "word")
    assert_tiles(text, chunks)
    assert {c.end for c in chunks} <= grapheme_bounds(text)


@settings(max_examples=300, deadline=None)
@given(text=HOSTILE, n=st.integers(1, 8), unit=st.sampled_from(["char", "word"]))
def test_fixed_cuts_fall_on_grapheme_boundaries(text, n, unit):
    chunks = fixed_chunks(text, n, unit)
    assert_tiles(text, chunks)
    assert {c.end for c in chunks} <= grapheme_bounds(text)
    if unit == "char":  # n clusters per chunk, the last possibly fewer
        sizes = [len(regex.findall(r"\X", c.text)) for c in chunks]
        assert all(s == n for s in sizes[:-1]) and (not sizes or 1 <= sizes[-1] <= n)


# --------------------------------------------------------------------------------------------
# 2, 3. Lone surrogates and duplicate ids: file:line, before any model loads
# --------------------------------------------------------------------------------------------


def test_a_lone_surrogate_is_a_file_line_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:2: field 'text' .*surrogate.*character 5"):
        list(read_documents(path))
    path.write_text('{"id": "x\\udfff", "text": "fine"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:1: field 'id' .*surrogate"):
        list(read_documents(path))
    path.write_text('{"text": "a pair is fine: \\ud83d\\ude00"}\n', encoding="utf-8")
    assert [d.text for d in read_documents(path)] == ["a pair is fine: 😀"]


def test_duplicate_ids_are_refused_with_both_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n\n{"id": "a", "text": "y"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:3: duplicate id 'a': first seen at line 1"):
        list(read_documents(path))
    # A line without an id is its line number, which may collide with an explicit id.
    path.write_text('{"id": 3, "text": "x"}\n{"text": "y"}\n{"text": "z"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"d\.jsonl:3: duplicate id '3': first seen at line 1"):
        list(read_documents(path))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"text": "ok"}\n{"text": "bad \\udc80"}\n', ["d.jsonl:2", "surrogate"]),
        (
            '{"id": "a", "text": "ok"}\n{"id": "a", "text": "again"}\n',
            ["d.jsonl:2", "duplicate id 'a'", "line 1"],
        ),
    ],
)
def test_cli_refuses_them_before_loading_a_model(tmp_path, capsys, content, expected):
    src = tmp_path / "d.jsonl"
    src.write_text(content, encoding="utf-8")
    # No such model: the input error must come first.
    rc, err = chunk_cli(capsys, src, "-o", tmp_path / "o.jsonl", "--model", str(tmp_path / "no-model"))
    assert_one_line_error(rc, err, 2, *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


# --------------------------------------------------------------------------------------------
# 4. Output and manifest together; OS errors are one line
# --------------------------------------------------------------------------------------------


def _old_pair(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}, {"text": "Second one."}])
    out = tmp_path / "out" / "chunks.jsonl"
    out.parent.mkdir()
    out.write_text("OLD OUTPUT\n", encoding="utf-8")
    out.with_suffix(".meta.json").write_text('{"old": true}\n', encoding="utf-8")
    return src, out, snapshot(out.parent)


def test_enospc_writing_the_manifest_keeps_the_old_pair(tmp_path, capsys, monkeypatch):
    src, out, before = _old_pair(tmp_path)
    real_fsync = os.fsync

    def fsync(fd):
        if ".meta.json" in os.readlink(f"/proc/self/fd/{fd}"):  # the new manifest's (temp) file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rc, err = chunk_cli(capsys, src, "-o", out, "--method", "fixed", "--target-len", "9")
    assert_one_line_error(rc, err, 1, f"{out.with_suffix('.meta.json')}: No space left on device")
    assert snapshot(out.parent) == before  # the old output beside its own manifest, no temp files

    monkeypatch.setattr(os, "fsync", real_fsync)
    rc, err = chunk_cli(capsys, src, "-o", out, "--method", "fixed", "--target-len", "9")
    assert rc == 0, err
    assert sorted(snapshot(out.parent)) == ["chunks.jsonl", "chunks.meta.json", "chunks.runs.jsonl"]
    assert json.loads(out.with_suffix(".meta.json").read_text())["summary"]["documents"] == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("output", ["chunks.jsonl", "chunks/"])
def test_a_full_disk_while_writing_names_the_output_and_leaves_no_temp_file(
    tmp_path, capsys, monkeypatch, output
):
    """write(2) on a full disk names no file: the error line names the output it was for, and the
    temp file whose buffer could not be flushed is removed all the same. Every temp file is written
    through /dev/full, which answers each write with ENOSPC (full(4))."""
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"id": str(i), "text": EN} for i in range(200)])
    out = tmp_path / "out"
    out.mkdir()
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)
    rc, err = chunk_cli(capsys, src, "-o", f"{out}/{output}", "--method", "fixed", "--target-len", "9")
    assert_one_line_error(rc, err, 1, f"{out / output.rstrip('/')}", "No space left on device")
    assert [p.name for p in out.rglob("*.tmp")] == []


def test_sqlite_full_is_said_as_no_space_naming_the_store(tmp_path):
    """SQLite's SQLITE_FULL names no file; `no_space_error` makes it the OSError the CLI prints in one
    line. A real SQLITE_FULL: the database may not grow past max_page_count
    (https://www.sqlite.org/pragma.html#pragma_max_page_count)."""
    import sqlite3

    from metachunk.store import no_space_error

    path = tmp_path / "answers.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (x TEXT)")
    db.execute("PRAGMA max_page_count = 2")
    with pytest.raises(sqlite3.OperationalError) as raised:
        db.execute("INSERT INTO t VALUES (?)", ("x" * 100_000,))
    db.close()
    error = no_space_error(raised.value, path)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    assert "database or disk is full" in str(error)
    assert no_space_error(sqlite3.OperationalError("no such table: t"), path) is None
    assert no_space_error(OSError(errno.ENOSPC, "full"), path) is None


def test_permission_denied_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    import tempfile

    src, out, before = _old_pair(tmp_path)

    def mkstemp(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    rc, err = chunk_cli(capsys, src, "-o", out, "--method", "fixed", "--target-len", "9")
    assert_one_line_error(rc, err, 1, "Permission denied", str(out.parent))
    assert snapshot(out.parent) == before


def test_output_under_a_file_is_bad_input_named(tmp_path, capsys):
    src, _, _ = _old_pair(tmp_path)
    rc, err = chunk_cli(capsys, src, "-o", src / "o.jsonl", "--method", "fixed", "--target-len", "9")
    assert_one_line_error(rc, err, 2, f"{src}: a file, where a folder is to be written")


def test_output_equal_to_the_input_is_refused(tmp_path, capsys):
    src, _, _ = _old_pair(tmp_path)
    original = src.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    for out in (src, src.parent / ".." / "in" / src.name, link):
        rc, err = chunk_cli(capsys, src, "-o", out, "--method", "fixed", "--target-len", "9")
        assert_one_line_error(rc, err, 2, "is the input")
    assert src.read_bytes() == original and sorted(p.name for p in src.parent.iterdir()) == ["d.jsonl"]


def test_no_command_writes_over_what_it_reads(tmp_path, capsys):
    """An output that is an input, lies in an input folder, or is a folder holding an input was
    written over the input: `data passages` replaced its own input, `chunk` replaced a shard of its
    corpus (or read its own shards back on resume), `data prepare-crud` replaced its news file, and
    `eval compare` replaced a run's metrics.json with its own."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(json.dumps({"id": "a", "text": EN}) + "\n")
    paras = tmp_path / "paras.jsonl"
    paras.write_text(json.dumps({"id": "p", "text": EN, "chapter": 1}) + "\n")
    news = corpus / "news.jsonl"
    news.write_text(json.dumps({"id": "n", "title": "t", "text": EN}) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"metrics": {"hits@8": 0.5}}\n')
    before = {p: p.read_bytes() for p in (*corpus.iterdir(), paras, run / "metrics.json")}
    for argv, expected in (
        (["data", "passages", "--input", str(paras), "--out", str(paras)], "is the input"),
        (
            [
                "chunk",
                str(corpus),
                "-o",
                str(corpus / "a.jsonl"),
                "--method",
                "sentence",
                "--target-len",
                "50",
            ],
            "inside the input folder",
        ),
        (
            ["chunk", str(corpus), "-o", str(corpus / "out"), "--method", "sentence", "--target-len", "50"],
            "inside the input folder",
        ),
        (["data", "prepare-crud", "--news", str(news), "--qa", str(paras), "--out", str(corpus)], "holding"),
        (
            ["eval", "compare", str(run), str(run), "--out", str(run / "metrics.md")],
            "inside the input folder",
        ),
    ):
        assert_one_line_error(main(argv), capsys.readouterr().err, 2, expected)
    assert {p: p.read_bytes() for p in before} == before and not (corpus / "out").exists()


def test_bad_values_a_probe_found_are_one_line_errors(tmp_path, capsys):
    """Each of these ended in a traceback (exit 1)."""
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": EN}) + "\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"input: d.jsonl\nnote: caf\xe9\n")
    latin.with_suffix("").write_text("a file named without a suffix")
    state = tmp_path / "state.yaml"
    state.write_text("state: 5\nstages:\n  - {name: a, run: chunk, config: {input: d.jsonl, output: o.jsonl,"
                     " method: sentence, target_len: 50}}\n")  # fmt: skip
    runs = []
    for name, length in (("one", 100.0), ("two", "100")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"metrics": {"avg_chunk_chars": length}}))
        runs.append(str(tmp_path / name))
    three = tmp_path / "three"  # a good run whose items.jsonl is not UTF-8
    three.mkdir()
    (three / "metrics.json").write_text(json.dumps({"metrics": {"avg_chunk_chars": 100.0}}))
    (three / "items.jsonl").write_bytes(b'{"id": "q1", "hits@8": 1}\n{"id": "q\xff"}\n')
    qa_dir = tmp_path / "qa"
    qa_dir.mkdir()
    distill = tmp_path / "distill.yaml"
    distill.write_text(f"task: summary\nchunks: {docs}\ndocuments: {docs}\nout: {tmp_path / 'run'}\n"
                       "teachers:\n  summary_global: &t {model: m}\n  summary_local: *t\n  summary_fuse: *t\n")  # fmt: skip
    lumber = ["chunk", str(docs), "-o", str(tmp_path / "l.jsonl"), "--method", "lumber", "--teacher-config"]
    for argv, expected in (
        (["chunk", "--config", str(latin)], "not UTF-8 text (byte 24)"),
        (["run", str(latin)], "not UTF-8 text"),
        ([*lumber, str(latin)], f"{latin}: not UTF-8 text (byte 24)"),
        ([*lumber, str(qa_dir)], f"{qa_dir}: a folder, not a teacher config"),
        (["run", str(state)], "state: a folder path, got 5"),
        (
            [
                "chunk",
                str(docs),
                "-o",
                str(tmp_path / "o.jsonl"),
                "--method",
                "sentence",
                "--mean-chunk-chars",
                "inf",
            ],
            "finite number > 0",
        ),
        (
            ["eval", "compare", *runs, "--out", str(tmp_path / "r.md")],
            "'metrics.avg_chunk_chars': not a number",
        ),
        (["eval", "compare", *runs[:1], "--out", str(tmp_path / "r.json")], "name it .md"),
        (
            ["eval", "compare", runs[0], str(three), "--out", str(tmp_path / "r.md")],
            "items.jsonl:2: invalid UTF-8",
        ),
        (
            ["data", "prepare-crud", "--news", str(docs), "--qa", str(qa_dir), "--out", str(tmp_path / "pc")],
            "a folder, not a file",
        ),
        (["eval", "compare", runs[0], "--seed", "-1"], "field 'seed' must be >= 0"),
        (
            ["distill", "summary", "--config", str(distill), "--dry-run", "--threshold", "nan"],
            "'threshold' must be",
        ),
        (
            ["distill", "summary", "--config", str(distill), "--dry-run", "--max-context-chars", "0"],
            f"{distill} or the command line: 'max_context_chars' must be >= 1",
        ),
        # exit 1 with "File exists": a name without a suffix is a folder
        (
            [
                "chunk",
                str(docs),
                "-o",
                str(latin.with_suffix("")),
                "--method",
                "sentence",
                "--target-len",
                "50",
            ],
            "-o without a .jsonl suffix names a folder, and this is a file",
        ),
        # accepted silently: NaN turned the lost-content filter off; the others ran and wrote results
        (
            [
                "data",
                "build-sft",
                "rewrite",
                "--distilled",
                str(docs),
                "--out",
                str(tmp_path / "s"),
                "--min-overlap",
                "nan",
            ],
            "field 'min_overlap' must be a finite number >= 0.0 and <= 1.0, got nan",
        ),
        (
            ["eval", "chunk-quality", "--chunks", str(docs), "--out", str(tmp_path / "cq"), "--limit", "-1"],
            "field 'limit' must be >= 1, got -1",
        ),
        (
            [
                "eval",
                "chunk-quality",
                "--chunks",
                str(docs),
                "--out",
                str(tmp_path / "cq"),
                "--batch-size",
                "0",
            ],
            "field 'batch_size' must be >= 1, got 0",
        ),
        (
            [
                "eval",
                "qa",
                "--chunks",
                str(docs),
                "--qa",
                str(docs),
                "--out",
                str(tmp_path / "q"),
                "--fuzzy-threshold",
                "200",
            ],
            "field 'fuzzy_threshold' must be a finite number >= 0.0 and <= 100.0",
        ),
    ):
        rc, err = main(argv), capsys.readouterr().err
        assert (
            rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and expected in err
        ), err


# --------------------------------------------------------------------------------------------
# 6. Bad chunk files for `metachunk distill`
# --------------------------------------------------------------------------------------------

DOC = "First chunk here. Second chunk here."
CHUNKS = [
    {"text": "First chunk here. ", "start": 0, "end": 18},
    {"text": "Second chunk here.", "start": 18, "end": 36},
]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"id": "d", "chunks": CHUNKS, "selected": [0, 2]}, "'selected': 2 is not a chunk index (0-1)"),
        ({"id": "d", "chunks": CHUNKS}, "document 'd' has a record already, at line 1"),  # distilled twice
        ({"id": "d", "chunks": CHUNKS, "selected": [-1]}, "'selected': -1 is not a chunk index (0-1)"),
        ({"id": "d", "chunks": CHUNKS, "selected": "0"}, "'selected' must be a list of chunk indices"),
        ({"id": "d", "chunks": CHUNKS, "selected": [True]}, "'selected': True is not a chunk index"),
        ({"id": "d", "chunks": CHUNKS, "selected": [1, 0, 1]}, "'selected' names chunk 1 more than once"),
        ({"id": "d", "chunks": [{"text": "First", "end": 5}]}, "chunks[0]: missing field 'start'"),
        ({"id": "d", "chunks": [{"text": "First", "start": "0", "end": 5}]}, "chunks[0]: 'start' must be"),
        (
            {"id": "d", "chunks": [{"text": "x", "start": 30, "end": 99}]},
            "chunks[0]: 30:99 is outside the document",
        ),
        ({"id": "d", "chunks": [{"text": 5, "start": 0, "end": 5}]}, "chunks[0]: 'text' must be a string"),
        ({"id": "d", "chunks": ["First"]}, "chunks[0] must be an object"),
        ({"id": "d", "chunks": {"0": CHUNKS[0]}}, "'chunks' must be a list"),
    ],
)
def test_bad_chunk_files_are_file_line_errors(tmp_path, capsys, record, expected):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "d", "text": DOC}])
    chunks = write_jsonl(tmp_path / "chunks.jsonl", [{"id": "d", "chunks": CHUNKS}, record])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"task: summary\nchunks: {chunks}\ndocuments: {docs}\nout: {tmp_path / 'run'}\n"
        "teachers:\n  summary_global: &t {model: m}\n  summary_local: *t\n  summary_fuse: *t\n",
        encoding="utf-8",
    )
    capsys.readouterr()
    rc = main(["distill", "summary", "--config", str(recipe), "--dry-run"])
    err = capsys.readouterr().err
    assert_one_line_error(rc, err, 2, f"{chunks}:2", expected)


# --------------------------------------------------------------------------------------------
# 7. Directory outputs are swapped in, never deleted first
# --------------------------------------------------------------------------------------------


def _dir(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "f.txt").write_text(content)
    return path


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, r"x\.json: no such file"),
        (b'{"a": 1,\n"b": ', r"x\.json:2: invalid JSON"),
        (b'{"a": "\xff"}', r"x\.json: invalid UTF-8 at byte 7"),
        (b"[1, 2]", r"x\.json: expected a JSON object, got list"),
    ],
)
def test_read_json_names_the_file_and_line_of_what_is_wrong(tmp_path, content, expected):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=expected):
        artifacts.read_json(path)


def test_replace_dir_swaps_and_cleans_up(tmp_path):
    out = tmp_path / "ds"
    artifacts.replace_dir(_dir(tmp_path / ".ds.new1", "one"), out)  # no previous one
    assert (out / "f.txt").read_text() == "one"
    artifacts.replace_dir(_dir(tmp_path / ".ds.new2", "two"), out)
    assert (out / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no staging, no trash left


def test_replace_dir_keeps_the_old_dir_when_the_swap_fails(tmp_path, monkeypatch):
    out = _dir(tmp_path / "ds", "old")
    staging = _dir(tmp_path / ".ds.new", "new")
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src) == staging:
            raise OSError(errno.EIO, "I/O error")
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        artifacts.replace_dir(staging, out)
    assert (out / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.new", "ds"]


def test_replace_dir_recovers_after_a_crash_mid_swap(tmp_path):
    # A crash after the old dir was moved aside and before the new one arrived: the old one is
    # whole under its trash name, and the next swap puts a new dir in place and removes the trash.
    _dir(tmp_path / ".ds.old-12345", "old")
    artifacts.replace_dir(_dir(tmp_path / ".ds.new", "new"), tmp_path / "ds")
    assert (tmp_path / "ds" / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_build_sft_keeps_the_old_dataset_when_the_swap_fails(tmp_path, tiny_model_dir, monkeypatch):
    from metachunk.distill.sft import BuildSftConfig, build_sft

    doc = "Emma was clever and rich. She had lived nearly twenty-one years in the world."
    chunk = "She had lived nearly twenty-one years in the world."
    stage = {"status": "ok", "teacher": "t", "prompt_sha256": "ab" * 32, "usage": {}, "cost": 0.0}
    start = doc.index(chunk)
    record = {"schema_version": 1, "task": "rewrite", "doc_id": "d", "chunk_index": 1, "start": start,
              "end": start + len(chunk), "text": chunk, "lang": "en", "context_spans": [[0, len(doc)]],
              "status": "ok", "reason": "", "output": "Emma " + chunk.lower(),
              "stages": {"reflection": stage, "refinement": stage, "completion": stage}}  # fmt: skip
    write_jsonl(tmp_path / "docs.jsonl", [{"id": "d", "text": doc}])
    write_jsonl(tmp_path / "rewrite.jsonl", [record])
    out = _dir(tmp_path / "ds", "the previous build")
    cfg = BuildSftConfig(task="rewrite", distilled=tmp_path / "rewrite.jsonl", out=out, documents=tmp_path / "docs.jsonl",
                         cards_dir=tmp_path / "cards", tokenizer=str(tiny_model_dir))  # fmt: skip
    real_rename, real_replace = os.rename, os.replace

    into_place = []

    def failing(real):
        def move(src, dst, *args, **kwargs):
            if Path(dst) == out and not into_place:  # the first move into place: the new build's
                into_place.append(src)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "rename", failing(real_rename))
    monkeypatch.setattr(os, "replace", failing(real_replace))
    with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)):
        build_sft(cfg, progress=False)
    assert into_place  # the failure was the swap's, not an earlier one
    assert (out / "f.txt").read_text() == "the previous build"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cards", "docs.jsonl", "ds", "rewrite.jsonl"]
    monkeypatch.undo()
    build_sft(cfg, progress=False)
    assert (out / "README.md").is_file() and not (out / "f.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cards", "docs.jsonl", "ds", "rewrite.jsonl"]


@pytest.mark.parametrize("mask", [0o022, 0o007])
def test_outputs_get_the_modes_the_umask_gives_not_a_temp_files(tmp_path, mask):
    """``mkstemp`` makes 0600 files and ``mkdtemp`` 0700 folders: renamed into place as they were, a
    team's dataset on a shared disk would be readable by its writer alone."""
    before = os.umask(mask)
    try:
        with artifacts.AtomicWriter(tmp_path / "a.jsonl") as f:
            f.write("{}\n")
        artifacts.write_bytes(tmp_path / "b.bin", b"x")
        artifacts.write_json(tmp_path / "c.json", {})
        staging = Path(tempfile.mkdtemp(dir=tmp_path))
        artifacts.replace_dir(staging, tmp_path / "d")
    finally:
        os.umask(before)
    for name in ("a.jsonl", "b.bin", "c.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~mask


def test_a_folder_where_a_file_is_written_is_named_not_its_temp_file(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(artifacts.InputError) as e:
        with artifacts.AtomicWriter(tmp_path / "out") as f:
            f.write("x")
    assert e.value.path == tmp_path / "out"
    with pytest.raises(artifacts.InputError, match="a folder, where a file is to be written"):
        artifacts.write_bytes(tmp_path / "out", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not list((tmp_path / "out").iterdir())


def test_a_file_where_a_folder_is_written_is_kept_and_named(tmp_path, monkeypatch, capsys):
    """`data build-sft --out precious.jsonl` renamed the user's file aside, put the dataset folder in
    its place and exited 0 (replace_dir took any path for a folder). A file where a folder's path
    goes (``-o precious.jsonl/x.jsonl``) was an OS error, exit 1."""
    precious = tmp_path / "precious.jsonl"
    precious.write_text("mine\n")
    staging = Path(tempfile.mkdtemp(dir=tmp_path))
    with pytest.raises(InputError, match="a file, where a folder is to be written"):
        artifacts.replace_dir(staging, precious)
    assert precious.read_text() == "mine\n" and staging.is_dir()
    monkeypatch.chdir(tmp_path)
    Path("docs.jsonl").write_text('{"id": "a", "text": "Emma was clever. She was rich."}\n')
    code = main(
        ["chunk", "docs.jsonl", "-o", "precious.jsonl/x.jsonl", "--method", "fixed", "--target-len", "10"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "precious.jsonl: a file, where a folder is to be written" in err, err
    assert precious.read_text() == "mine\n"


def test_recipes_cp_into_a_folder_named_with_a_trailing_slash(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "cp", "demo", "new/recipes/"]) == 0
    assert (tmp_path / "new" / "recipes" / "demo.yaml").is_file()


def test_a_replaced_output_keeps_the_mode_its_owner_gave_it(tmp_path):
    path = tmp_path / "private.jsonl"
    path.write_text("old\n")
    path.chmod(0o600)
    with artifacts.AtomicWriter(path) as f:
        f.write("new\n")
    assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o600


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    """kill -9 between a temp file's creation and its rename left ``.OUT.xxxx.tmp`` for good (the
    reviewer found 3 MB of them beside one output). A temp file names its writer (PID@HOST+PIDNS): the
    next writer of the same output removes the ones whose process is gone, never a live writer's, another
    host's (a shared file system) or another container's on this host."""
    import socket
    import subprocess
    import sys

    from metachunk import artifacts

    host, namespace = socket.gethostname(), os.stat("/proc/self/ns/pid").st_ino
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    owners = [f"{gone}@{host}+{namespace}", f"{os.getpid()}@{host}+{namespace}", f"{gone}@other-host+1",
              f"{gone}@{host}+1", f"{gone}@{host}.cluster+{namespace}"]  # fmt: skip
    dead, live, *elsewhere = (tmp_path / f".out.jsonl.{owner}.abcd1234.tmp" for owner in owners)
    for stale in (dead, live, *elsewhere):
        stale.write_text("half an output")
    with artifacts.AtomicWriter(tmp_path / "out.jsonl") as f:
        f.write("{}\n")
    assert not dead.exists() and live.exists() and all(p.exists() for p in elsewhere)
    plot = tmp_path / ".plot.png.1@x.tmp"  # another file's temp names are not this output's
    plot.write_text("x")
    with artifacts.AtomicWriter(tmp_path / "out.jsonl") as f:
        f.write("{}\n")
    assert plot.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name[0] != ".") == ["out.jsonl"]


def test_a_stop_between_an_output_and_its_manifest_waits_for_both(tmp_path, monkeypatch):
    """A SIGTERM that landed between the output's rename and its manifest's left the new records
    beside no manifest (the old one was already removed). The renames now finish together first."""
    import signal

    from metachunk.stopping import Stopped, stop_on_signals

    out = tmp_path / "o.jsonl"
    with artifacts.OutputPair(out) as pair:
        pair.file.write("old\n")
        pair.commit({"run": 1})
    real_replace, renamed = os.replace, []

    def replace_then_sigterm(src, dst):
        real_replace(src, dst)
        renamed.append(Path(dst).name)
        if len(renamed) == 1:  # the output is in place, its manifest not yet
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "replace", replace_then_sigterm)
    with pytest.raises(Stopped), stop_on_signals():
        with artifacts.OutputPair(out) as pair:
            pair.file.write("new\n")
            pair.commit({"run": 2})
    assert renamed == ["o.jsonl", "o.meta.json"]
    assert out.read_text() == "new\n" and json.loads(out.with_suffix(".meta.json").read_text()) == {"run": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "o.meta.json"]  # no temp file left


def test_a_stop_as_an_output_file_is_opened_leaves_no_temp_file(tmp_path, monkeypatch):
    """A SIGTERM right after the temp file was made, before it was registered for removal: the block
    ends with `Stopped` inside ``__enter__``, whose ``__exit__`` never runs; the temp file stayed."""
    import signal

    from metachunk.stopping import Stopped, stop_on_signals

    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_sigterm(*args, **kwargs):
        made = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_sigterm)
    with pytest.raises(Stopped), stop_on_signals():
        with artifacts.OutputPair(tmp_path / "o.jsonl"):
            pass
    assert list(tmp_path.iterdir()) == []
