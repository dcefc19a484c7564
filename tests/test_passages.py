"""``metachunk data passages``: chapters and passages from a paragraph corpus (GutenQA's Emma)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.data import data_file

from metachunk.artifacts import EXIT_SKIPPED
from metachunk.cli import main

EMMA = "data:gutenqa-emma/paragraphs.jsonl"  # a named dataset, as a recipe names it: the CLI resolves it


def passages(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["data", "passages", *map(str, argv)])
    return rc, capsys.readouterr().err


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def chapters() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8"):
        row = json.loads(line)
        out.setdefault(row["chapter"], []).append(row["text"])
    return out


def test_whole_chapters_by_position(tmp_path, capsys, chapters):
    rc, err = passages(capsys, "--input", EMMA, "--out", tmp_path / "o.jsonl", "--group-field", "chapter",
                       "--groups", "0:6")  # fmt: skip
    assert rc == 0, err
    got = rows(tmp_path / "o.jsonl")
    names = list(chapters)[:6]
    assert [r["id"] for r in got] == names
    assert [r["text"] for r in got] == ["\n\n".join(chapters[n]) for n in names]


def test_groups_from_the_end_and_a_slice_that_stops_reading(tmp_path, capsys, chapters, monkeypatch):
    """A slice counted from the start stops reading at its end (the rest of a corpus is never
    loaded); one counted from the end reads every group first. Both pick the same chapters."""
    import metachunk.distill.passages as passages_module

    n = len(chapters)
    read = []
    groups = passages_module.read_groups
    monkeypatch.setattr(passages_module, "read_groups", lambda *a: (read.append(g) or g for g in groups(*a)))
    for span in (f"{n - 3}:{n - 1}", "-3:-1"):
        read.clear()
        rc, err = passages(capsys, "--input", EMMA, "--out", tmp_path / "o.jsonl", "--group-field", "chapter",
                           f"--groups={span}")  # fmt: skip
        assert rc == 0, err
        assert [r["id"] for r in rows(tmp_path / "o.jsonl")] == list(chapters)[-3:-1], span
        assert len(read) == (n - 1 if span[0] != "-" else n), span  # from the start: none past the slice


def test_passages_of_a_minimum_size_within_chapters(tmp_path, capsys, chapters):
    rc, err = passages(capsys, "--input", EMMA, "--out", tmp_path / "o.jsonl", "--group-field", "chapter",
                       "--group-prefix", "VOLUME II.", "--min-chars", "900", "--skip", "1", "--limit", "3")  # fmt: skip
    assert rc == 0, err
    got = rows(tmp_path / "o.jsonl")
    assert [r["id"] for r in got] == [f"VOLUME II. CHAPTER I #{k}" for k in (1, 2, 3)]
    first = "\n\n".join(chapters["VOLUME II. CHAPTER I"])
    for r in got:
        assert len(r["text"]) >= 900 and r["text"] in first  # consecutive paragraphs of one chapter
        # a passage ends as soon as it is long enough: without its last paragraph it is too short
        assert len(r["text"].rsplit("\n\n", 1)[0]) < 900 or "\n\n" not in r["text"]


def test_ungrouped_lines_cut_and_limited(tmp_path, capsys):
    src = tmp_path / "news.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "text": "x" * (10 + i)}) + "\n" for i in range(4)))
    rc, err = passages(
        capsys, "--input", src, "--out", tmp_path / "o.jsonl", "--limit", "2", "--max-chars", "10"
    )
    assert rc == 0, err
    assert rows(tmp_path / "o.jsonl") == [{"id": "a0", "text": "x" * 10}, {"id": "a1", "text": "x" * 10}]


def test_bad_input_names_file_line_and_field_and_keeps_the_output(tmp_path, capsys):
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    out.write_text("GOOD\n")
    src.write_text('{"chapter": "I", "text": "a"}\n{"chapter": "I", "body": "b"}\n')
    rc, err = passages(capsys, "--input", src, "--out", out, "--group-field", "chapter")
    assert rc == 2 and f"{src}:2" in err and "'text'" in err and "Traceback" not in err
    assert out.read_text() == "GOOD\n"
    rc, err = passages(capsys, "--input", src, "--out", out, "--group-field", "chapter", "--groups", "5:")
    assert rc == 2 and out.read_text() == "GOOD\n"
    rc, err = passages(capsys, "--input", src, "--out", out, "--groups", "0:1")
    assert rc == 2 and "group_field" in err


def test_each_id_is_written_once(tmp_path, capsys):
    """A repeated id is what `metachunk chunk` refuses downstream: named here, at its line."""
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in [("a", "1"), ("b", "2"), ("a", "3")])
    )
    rc, err = passages(capsys, "--input", src, "--out", out)
    assert rc == 2 and f"{src}:3: duplicate id 'a' again (first at line 1)" in err and not out.exists()
    rc, err = passages(capsys, "--input", src, "--out", out, "--on-bad-row", "skip")
    assert rc == EXIT_SKIPPED and rows(out) == [{"id": "a", "text": "1"}, {"id": "b", "text": "2"}]
    assert [r["line"] for r in rows(tmp_path / "o.rejects.jsonl")] == [3]
    # a chapter whose lines come back after another's would give two documents one id
    src.write_text(
        "".join(
            json.dumps({"chapter": c, "text": t}) + "\n" for c, t in [("I", "a"), ("II", "b"), ("I", "c")]
        )
    )
    rc, err = passages(
        capsys, "--input", src, "--out", out, "--group-field", "chapter", "--on-bad-row", "skip"
    )
    assert rc == 2 and f"{src}:3: field 'chapter': group id 'I' again (first at line 1)" in err
    assert rows(out) == [{"id": "a", "text": "1"}, {"id": "b", "text": "2"}]  # the last good output stays


def test_an_id_is_a_string_or_a_number_and_a_missing_one_is_its_line(tmp_path, capsys):
    """``str()`` of the id field wrote ``"True"`` and ``"{'a': 1}"`` as ids, and two null ids were
    the same id ``"None"``; `metachunk chunk` refuses the first and numbers the second by line."""
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text('{"id": null, "text": "A."}\n{"text": "B."}\n{"id": 7, "text": "C."}\n')
    rc, err = passages(capsys, "--input", src, "--out", out)
    assert rc == 0, err
    assert [r["id"] for r in rows(out)] == ["1", "2", "7"]
    for bad in ("true", '{"a": 1}', "[1]"):
        src.write_text(f'{{"id": {bad}, "text": "A."}}\n')
        rc, err = passages(capsys, "--input", src, "--out", out)
        assert rc == 2 and f"{src}:1: field 'id' must be a string or a number" in err, err
