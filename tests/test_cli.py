"""``metachunk chunk`` driven in-process: input formats, output schema, every method, precise
errors that never touch an existing output, empty documents, and YAML recipes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.data import data_file

from metachunk.artifacts import SCHEMA_VERSION, read_run_log
from metachunk.cli import main

EN = "Emma was clever and rich. She had lived nearly twenty-one years!\n\nMr. Knightley came in. Was he sensible? He was."
ZH = "今天天气很好，我们去公园散步。北京是中国的首都，上海是最大的城市！\n\n模型训练完成后，我们在测试集上评估了它的表现。"
MIXED = "Mixed 中英文 text: RAG 系统 uses chunking 分块 to work well. The answer is 1.\nThe answer is 2."
SENTINEL = "SENTINEL: a previous good output\n"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["chunk", *map(str, argv)])
    return rc, capsys.readouterr().err


def assert_tiles(record: dict, text: str) -> None:
    chunks = record["chunks"]
    if not text:
        assert chunks == []  # only the empty document has no chunk
        return
    assert "".join(c["text"] for c in chunks) == text
    for c in chunks:
        assert c["text"] == text[c["start"] : c["end"]] and c["text"]
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(text)


# --------------------------------------------------------------------------------------------
# Inputs, outputs, manifest
# --------------------------------------------------------------------------------------------


def test_jsonl_ids_schema_and_manifest(tmp_path, capsys, tiny):
    src = write_jsonl(
        tmp_path / "docs.jsonl",
        [{"id": "en-1", "text": EN}, "\n", {"text": ZH}, {"id": 7, "text": MIXED, "extra": [1]}],
    )
    out = tmp_path / "res" / "chunks.jsonl"  # the output dir is created
    rc, err = run(capsys, src, "-o", out, "--model", tiny, "--method", "ppl", "--threshold", "0")
    assert rc == 0, err
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["en-1", "3", "7"]  # a missing id is the line number
    for r, text in zip(records, [EN, ZH, MIXED]):
        assert set(r) == {"schema_version", "id", "method", "chunks"}
        assert r["schema_version"] == SCHEMA_VERSION and r["method"] == "ppl"
        assert_tiles(r, text)
        for c in r["chunks"]:
            assert set(c) == {"text", "start", "end"}

    manifest = json.loads((tmp_path / "res" / "chunks.meta.json").read_text(encoding="utf-8"))
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["command"] == "chunk"
    assert manifest["config"]["method"] == "ppl" and manifest["config"]["model"] == tiny
    assert manifest["config"]["input"] == str(src) and manifest["threshold"] == 0.0
    assert manifest["summary"]["documents"] == 3
    assert manifest["summary"]["chunks"] == sum(len(r["chunks"]) for r in records)
    assert manifest["prompt_sha256"] == {}
    assert str(out) in err and "3 documents" in err
    assert "seconds" not in manifest["summary"] and "dtype" not in manifest  # how it ran: the run log
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "chunks.jsonl",
        "chunks.meta.json",
        "chunks.runs.jsonl",
    ]
    attempt = read_run_log(out)[-1]
    assert attempt["seconds"] >= attempt["model_load_seconds"] > 0
    assert attempt["workers_report"][0]["dtype"]["dtype"] in ("float32", "bfloat16")  # auto: by the CPU


def test_txt_input_emit_sentences_and_plot(tmp_path, capsys, tiny):
    src = tmp_path / "my doc.txt"
    src.write_text(EN, encoding="utf-8")
    out, plots = tmp_path / "out.jsonl", tmp_path / "plots"
    rc, err = run(capsys, src, "-o", out, "--model", tiny, "--emit-sentences", "--plot", plots)
    assert rc == 0, err
    (record,) = read_jsonl(out)
    assert record["id"] == "my doc"  # the file stem
    assert_tiles(record, EN)
    sents = record["sentences"]
    assert len(sents) == 5
    assert sents[0]["start"] == 0 and sents[-1]["end"] == len(EN)
    for a, b in zip(sents, sents[1:]):
        assert a["end"] == b["start"]
    for s in sents:
        assert set(s) == {"start", "end", "score"}
        assert s["score"] is None or isinstance(s["score"], float)
    assert all(isinstance(s["score"], float) for s in sents)  # ppl: every sentence has a scored token
    chunk_ends = {c["end"] for c in record["chunks"]}
    assert chunk_ends <= {s["end"] for s in sents}  # chunks end on sentence ends
    assert [p.name for p in plots.iterdir()] == ["00000_my_doc.png"]
    assert (plots / "00000_my_doc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_one_png_per_document(tmp_path, capsys, tiny):
    src = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "a/b c", "text": EN}, {"id": "zh", "text": ZH}, {"id": "e", "text": " "}],
    )
    plots = tmp_path / "plots"
    rc, err = run(
        capsys, src, "-o", tmp_path / "o.jsonl", "--model", tiny, "--method", "msp", "--plot", plots
    )
    assert rc == 0, err
    assert sorted(p.name for p in plots.iterdir()) == [
        "00000_a_b_c.png",
        "00001_zh.png",
    ]  # no plot for an empty doc
    for p in plots.iterdir():
        assert p.stat().st_size > 1000


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("ppl", []),
        ("ppl", ["--target-len", "30", "--overlap", "--max-context", "16"]),
        ("msp", []),
        (
            "msp",
            [
                "--msp-mode",
                "accumulated",
                "--dynamic-threshold",
                "--threshold-window",
                "2",
                "--msp-prompt",
                "table7",
            ],
        ),
        ("msp", ["--msp-prompt", "released"]),
        ("fixed", ["--target-len", "50"]),
        ("fixed", ["--target-len", "7", "--len-unit", "word"]),
        ("sentence", ["--target-len", "50", "--len-unit", "char"]),
        ("sentence", ["--target-len", "12", "--len-unit", "token"]),
    ],
)
def test_every_method_tiles(tmp_path, capsys, tiny, method, extra):
    texts = [EN, ZH, MIXED, EN + "\n\n" + ZH]
    src = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    out = tmp_path / "o.jsonl"
    rc, err = run(capsys, src, "-o", out, "--model", tiny, "--method", method, "--emit-sentences", *extra)
    assert rc == 0, err
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["0", "1", "2", "3"]
    for r, text in zip(records, texts):
        assert r["method"] == method
        if "--overlap" in extra:
            chunks = r["chunks"]
            assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(text)
            assert all(c["text"] == text[c["start"] : c["end"]] for c in chunks)
            assert all(a["end"] > b["start"] for a, b in zip(chunks, chunks[1:]))  # overlap
        else:
            assert_tiles(r, text)
        if method == "fixed" and "char" not in extra and "word" not in extra and r["id"] == "1":
            assert all(len(c["text"]) <= 50 for c in r["chunks"])  # zh: characters by default
        if method == "sentence" and "char" in extra:
            assert all(
                len(c["text"].strip()) <= 50 or c["end"] - c["start"] == _one_sentence(r, c)
                for c in r["chunks"]
            )
        if method == "msp":
            assert all(s["score"] is None or -1 <= s["score"] <= 1 for s in r["sentences"])
            assert r["sentences"][0]["score"] is None
    manifest = json.loads((tmp_path / "o.meta.json").read_text(encoding="utf-8"))
    if method == "msp":
        variant = next((v for v in ("table7", "released") if v in extra), "table6")
        assert set(manifest["prompt_sha256"]) == {f"msp_{variant}.en", f"msp_{variant}.zh"}


def _one_sentence(record: dict, chunk: dict) -> int:
    """Length of the sentence that spans ``chunk`` exactly, or -1."""
    for s in record["sentences"]:
        if s["start"] == chunk["start"] and s["end"] == chunk["end"]:
            return s["end"] - s["start"]
    return -1


@pytest.mark.integration
def test_semantic_method_minilm(tmp_path, capsys, tiny):
    pytest.importorskip("sentence_transformers")
    texts = [EN * 3, ZH, ""]
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "o.jsonl"
    rc, err = run(
        capsys,
        src,
        "-o",
        out,
        "--method",
        "semantic",
        "--threshold",
        "50",
        "--emit-sentences",
        "--device",
        "cpu",
    )
    assert rc == 0, err
    records = read_jsonl(out)
    for r, text in zip(records, texts):
        assert r["method"] == "semantic"
        assert_tiles(r, text)
    scores = [s["score"] for s in records[0]["sentences"]]
    assert scores[0] is None and all(0 <= s <= 2 for s in scores[1:])
    assert len(records[0]["chunks"]) > 1  # the 50th percentile cuts somewhere


# --------------------------------------------------------------------------------------------
# Bad input: exit code 2, a precise message, the old output untouched, no temp file left
# --------------------------------------------------------------------------------------------


GOOD = b'{"text": "Fine. Really fine."}\n'  # no id: each line's id is its line number

BAD_INPUTS = {
    "invalid-json": (
        "bad.jsonl",
        GOOD * 3 + b'{"text": oops}\n' + GOOD,
        ["bad.jsonl:4", "invalid JSON", "column 10"],
    ),
    "truncated-json": ("bad.jsonl", GOOD + b'{"text": "unterminated\n', ["bad.jsonl:2", "invalid JSON"]),
    # the column of an error at the line's end was its newline's: "column 1" of the next line
    "cut-short-json": (
        "bad.jsonl",
        GOOD + b'{"text": "x"\n' + GOOD,
        ["bad.jsonl:2", "at the end: cut short?"],
    ),
    "missing-text": (
        "bad.jsonl",
        GOOD + GOOD + b'{"id": "x", "body": "hi"}\n',
        ["bad.jsonl:3", "missing field 'text'"],
    ),
    "text-not-string": (
        "bad.jsonl",
        GOOD + b'{"text": 5}\n',
        ["bad.jsonl:2", "'text' must be a string", "int"],
    ),
    "text-null": ("bad.jsonl", b'{"text": null}\n', ["bad.jsonl:1", "'text' must be a string"]),
    "not-an-object": ("bad.jsonl", GOOD + b'["text", "x"]\n', ["bad.jsonl:2", "JSON object"]),
    "lone-surrogate": (
        "bad.jsonl",
        GOOD + b'{"text": "half a pair: \\ud800."}\n',
        ["bad.jsonl:2", "field 'text' holds a lone surrogate \\ud800 at character 13"],
    ),
    "duplicate-id": (
        "bad.jsonl",
        GOOD + b'{"id": "x", "text": "a"}\n' + GOOD + b'{"id": "x", "text": "b"}\n',
        ["bad.jsonl:4", "duplicate id 'x': first seen at line 2"],
    ),
    "explicit-id-is-a-line-number": (
        "bad.jsonl",
        b'{"id": 3, "text": "a"}\n' + GOOD + GOOD,
        ["bad.jsonl:3", "duplicate id '3': first seen at line 1"],
    ),
    "invalid-utf8": ("bad.jsonl", GOOD + b'{"text": "caf\xe9 \xff"}\n', ["bad.jsonl:2", "UTF-8"]),
    "invalid-utf8-txt": ("bad.txt", b"Hello \xff\xfe world.", ["bad.txt", "UTF-8"]),
    "wrong-extension": ("bad.csv", b"id,text\n1,hello\n", ["bad.csv", ".jsonl"]),
    "json-extension": ("bad.json", b'{"text": "x"}', ["bad.json", ".jsonl"]),
}


def _prepare_output(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "chunks.jsonl").write_text(SENTINEL, encoding="utf-8")
    (out_dir / "chunks.meta.json").write_text('{"sentinel": true}\n', encoding="utf-8")
    return out_dir / "chunks.jsonl", _snapshot(out_dir)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_clean_failure(rc: int, err: str, out: Path, before: dict[str, bytes], expected: list[str]):
    assert rc == 2, err
    assert err.startswith("metachunk: error: ")
    for piece in expected:
        assert piece in err, (piece, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _snapshot(out.parent) == before  # the old output and manifest untouched, no temp files


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(tmp_path, capsys, tiny, case):
    name, content, expected = BAD_INPUTS[case]
    src = tmp_path / "in" / name
    src.parent.mkdir()
    src.write_bytes(content)
    out, before = _prepare_output(tmp_path)
    rc, err = run(capsys, src, "-o", out, "--model", tiny)
    _assert_clean_failure(rc, err, out, before, [str(src.parent / expected[0]), *expected[1:]])
    assert os.listdir(src.parent) == [name]


def test_nonexistent_input(tmp_path, capsys, tiny):
    out, before = _prepare_output(tmp_path)
    missing = tmp_path / "nope" / "missing.jsonl"
    rc, err = run(capsys, missing, "-o", out, "--model", tiny)
    _assert_clean_failure(rc, err, out, before, [str(missing), "no such file"])
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = run(capsys, empty, "-o", out, "--model", tiny)  # a folder is read as shards: it has none
    _assert_clean_failure(rc, err, out, before, [str(empty), "a folder with no input shards"])


@pytest.mark.parametrize("model", ["no-such-model", "{tmp}/empty-dir", "{tmp}/absent/dir"])
def test_unknown_model(tmp_path, capsys, model):
    model = model.format(tmp=tmp_path)
    (tmp_path / "empty-dir").mkdir()
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}])
    out, before = _prepare_output(tmp_path)
    for method in ("ppl", "msp"):
        rc, err = run(capsys, src, "-o", out, "--model", model, "--method", method)
        _assert_clean_failure(rc, err, out, before, [repr(model)])
    rc, err = run(
        capsys,
        src,
        "-o",
        out,
        "--model",
        model,
        "--method",
        "sentence",
        "--target-len",
        "5",
        "--len-unit",
        "token",
    )
    _assert_clean_failure(rc, err, out, before, [repr(model)])


def test_failure_while_writing_keeps_old_output(tmp_path, capsys, tiny, monkeypatch):
    """A crash or Ctrl-C in the middle of chunking leaves the previous output in place."""
    from metachunk.chunking.pipeline import Chunker

    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}] * 40)  # two groups of 16+ docs
    out, before = _prepare_output(tmp_path)
    real_decide = Chunker.decide  # the model's stage of a corpus run (chunking/shards.py), once per group
    calls = []

    def flaky(self, prepared):
        calls.append(prepared)
        if len(calls) == 2:
            raise error
        return real_decide(self, prepared)

    monkeypatch.setattr(Chunker, "decide", flaky)
    args = ("-o", out, "--method", "fixed", "--target-len", "5", "--batch-size", "1")
    error = RuntimeError("boom")
    rc, err = run(capsys, src, *args)  # a bug: status 1 and its (redacted) traceback
    assert rc == 1 and "RuntimeError: boom" in err and "Traceback" in err
    assert _snapshot(out.parent) == before

    calls.clear()
    error = KeyboardInterrupt()
    rc, err = run(capsys, src, *args)
    assert rc == 130 and "no complete output was replaced by a partial one" in err
    assert _snapshot(out.parent) == before


# --------------------------------------------------------------------------------------------
# Empty documents
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("ppl", []),
        ("ppl", ["--target-len", "20", "--overlap"]),
        ("msp", []),
        ("msp", ["--msp-mode", "accumulated"]),
        ("fixed", ["--target-len", "10"]),
        ("sentence", ["--target-len", "10"]),
    ],
)
def test_empty_documents(tmp_path, capsys, tiny, method, extra):
    texts = ["", EN, "   \n\t \n", ZH, "\u3000\n", ""]
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "o.jsonl"
    argv = [src, "-o", out, "--model", tiny, "--method", method, *extra]
    rc, err = run(capsys, *argv, "--emit-sentences", "--plot", tmp_path / "p")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["00001_2.png", "00003_4.png"]
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["1", "2", "3", "4", "5", "6"]
    for r, text in zip(records, texts):
        if text.strip():
            assert r["chunks"]
        elif text:  # whitespace only: kept, as one sentence and one chunk (nothing is dropped)
            assert [(x["start"], x["end"]) for x in r["sentences"]] == [(0, len(text))]
            assert [c["text"] for c in r["chunks"]] == [text]
        else:
            assert r["chunks"] == [] and r["sentences"] == []
    if "--overlap" not in extra:
        for r, text in zip(records, texts):
            assert_tiles(r, text)

    # a file of nothing but empty documents, and an empty file
    for content in (['{"text": ""}\n', '{"text": "  "}\n'], []):
        write_jsonl(src, content)
        rc, err = run(capsys, *argv)
        assert rc == 0, err
        assert [[c["text"] for c in r["chunks"]] for r in read_jsonl(out)] == [[], ["  "]][: len(content)]
        manifest = json.loads((tmp_path / "o.meta.json").read_text(encoding="utf-8"))
        assert manifest["summary"]["documents"] == len(content)
        assert manifest["summary"]["chunks"] == len(content) // 2


# --------------------------------------------------------------------------------------------
# YAML recipes and option validation
# --------------------------------------------------------------------------------------------


def test_recipe_applied_and_overridden(tmp_path, capsys, tiny):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": EN}, {"text": ZH}])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"method: sentence\ntarget_len: 40\nlen_unit: char\nemit_sentences: true\nmodel: {tiny}\nthreshold: 1\n",
        encoding="utf-8",
    )
    out = tmp_path / "o.jsonl"
    rc, err = run(capsys, src, "-o", out, "--config", recipe)
    assert rc == 0, err
    manifest = json.loads((tmp_path / "o.meta.json").read_text(encoding="utf-8"))
    cfg = manifest["config"]
    assert (cfg["method"], cfg["target_len"], cfg["len_unit"], cfg["emit_sentences"]) == (
        "sentence",
        40,
        "char",
        True,
    )
    assert cfg["threshold"] == 1.0 and isinstance(cfg["threshold"], float)
    records = read_jsonl(out)
    assert all("sentences" in r for r in records)
    n_40 = sum(len(r["chunks"]) for r in records)

    # flags override the recipe, including a bool switched off
    rc, err = run(
        capsys,
        src,
        "-o",
        out,
        "--config",
        recipe,
        "--target-len",
        "20",
        "--no-emit-sentences",
        "--method",
        "fixed",
    )
    assert rc == 0, err
    cfg = json.loads((tmp_path / "o.meta.json").read_text(encoding="utf-8"))["config"]
    assert (cfg["method"], cfg["target_len"], cfg["len_unit"], cfg["emit_sentences"]) == (
        "fixed",
        20,
        "char",
        False,
    )
    records = read_jsonl(out)
    assert all("sentences" not in r and r["method"] == "fixed" for r in records)
    assert all(len(c["text"]) <= 20 for r in records for c in r["chunks"])
    assert sum(len(r["chunks"]) for r in records) > n_40
    for r, text in zip(records, [EN, ZH]):
        assert_tiles(r, text)


def test_recipe_may_name_input_and_output(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": EN}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"input: {src}\noutput: {tmp_path / 'x.jsonl'}\nmethod: fixed\ntarget_len: 3\n", encoding="utf-8"
    )
    rc, err = run(capsys, "--config", recipe)
    assert rc == 0, err
    assert_tiles(read_jsonl(tmp_path / "x.jsonl")[0], EN)


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("method: fixed\ntarget_len: 10\nchunk_size: 5\n", ["'chunk_size'", "unknown field"]),
        ("target_len: big\n", ["'target_len'", "int", "str"]),
        ("method: fixed\ntarget_len: 10\nlen_unit: chars\n", ["'len_unit'", "chars"]),
        ("method: msp\nmsp_prompt: table8\n", ["'msp_prompt'", "table8"]),
        ("lang: fr\n", ["'lang'", "fr"]),
        ("method: [ppl\n", ["recipe.yaml:2: invalid YAML", "expected ',' or ']'"]),
        ("- method\n- ppl\n", ["mapping"]),
        ("method: fixed\n", ["--target-len"]),
    ],
)
def test_recipe_errors(tmp_path, capsys, tiny, yaml_text, expected):
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}])
    recipe = tmp_path / "in" / "recipe.yaml"
    recipe.write_text(yaml_text, encoding="utf-8")
    out, before = _prepare_output(tmp_path)
    rc, err = run(capsys, src, "-o", out, "--model", tiny, "--config", recipe)
    _assert_clean_failure(rc, err, out, before, [str(recipe), *expected])
    assert err.count(str(recipe)) == 1  # named once, not prefixed twice


def test_missing_recipe(tmp_path, capsys, tiny):
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}])
    out, before = _prepare_output(tmp_path)
    rc, err = run(capsys, src, "-o", out, "--config", tmp_path / "none.yaml")
    _assert_clean_failure(rc, err, out, before, [str(tmp_path / "none.yaml"), "not found"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--method", "fixed"], "--method fixed needs --target-len"),
        (["--method", "sentence"], "--method sentence needs --target-len"),
        (["--method", "fixed", "--target-len", "10", "--overlap"], "--overlap"),
        (["--method", "sentence", "--target-len", "10", "--overlap"], "--overlap"),
        (["--method", "fixed", "--target-len", "10", "--len-unit", "token"], "tokens"),
        (["--target-len", "0"], "--target-len must be >= 1"),
        (["--method", "fixed", "--target-len", "0"], "--target-len must be >= 1, got 0"),
        (["--method", "semantic", "--threshold", "150"], "--threshold is a percentile for --method semantic"),
        (["--method", "ppl", "--device", "tpux"], "device 'tpux' is not a torch device"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--max-context", "8"], "--max-context must be >= 16"),
        (
            ["--method", "msp", "--dynamic-threshold", "--threshold-window", "0"],
            "--threshold-window must be >= 1",
        ),
    ],
)
def test_invalid_option_combinations(tmp_path, capsys, tiny, flags, expected):
    src = write_jsonl(tmp_path / "in" / "d.jsonl", [{"text": EN}])
    out, before = _prepare_output(tmp_path)
    rc, err = run(capsys, src, "-o", out, "--model", tiny, *flags)
    _assert_clean_failure(rc, err, out, before, [expected])


def test_missing_output_and_argparse_errors(tmp_path, capsys, tiny):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": EN}])
    for argv in ([src, "--model", tiny], ["-o", tmp_path / "o.jsonl", "--model", tiny]):
        rc, err = run(capsys, *argv)
        assert rc == 2 and "usage: metachunk chunk INPUT -o OUTPUT.jsonl" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    for bad in (["--method", "bogus"], ["--target-len", "ten"], ["--no-such-flag"]):
        with pytest.raises(SystemExit) as exc:
            run(capsys, src, "-o", tmp_path / "o.jsonl", *bad)
        assert exc.value.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_data_push_without_a_token_fails_cleanly(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    (tmp_path / "ds" / "data").mkdir(parents=True)
    (tmp_path / "ds" / "README.md").write_text("---\nlicense: other\n---\n")
    (tmp_path / "ds" / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    assert main(["data", "push", str(tmp_path / "ds"), "--repo-id", "org/name"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err


def test_data_build_sft_names_a_missing_file(tmp_path, capsys):
    code = main(
        [
            "data",
            "build-sft",
            "rewrite",
            "--distilled",
            str(tmp_path / "nope.jsonl"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err


def test_data_build_sft_names_a_truncated_meta_file_beside_the_records(tmp_path, capsys):
    """The run's ``.meta.json`` beside the distilled records, cut short by a crash or a copy: one line naming it."""
    (tmp_path / "rewrite.jsonl").write_text("")
    (tmp_path / "rewrite.meta.json").write_text('{"config": {"documents": ')
    argv = [
        "data",
        "build-sft",
        "rewrite",
        "--distilled",
        str(tmp_path / "rewrite.jsonl"),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'rewrite.meta.json'}:1: invalid JSON" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# Equal-length runs: --mean-chunk-chars searches --target-len
# --------------------------------------------------------------------------------------------


def emma_texts(n: int = 12) -> list[str]:
    """Real text: the first ``n`` paragraphs of Emma (the named dataset gutenqa-emma)."""
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line, _ in zip(f, range(n))]


@pytest.mark.parametrize("method", ["ppl", "fixed", "sentence"])
def test_mean_chunk_chars_reaches_the_goal_of_another_run(tmp_path, capsys, tiny, method):
    texts = emma_texts()
    src = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    ppl = tmp_path / "ppl.jsonl"
    rc, err = run(capsys, src, "-o", ppl, "--model", tiny, "--target-len", "300", "--len-unit", "char")
    assert rc == 0, err
    goal = json.loads((tmp_path / "ppl.meta.json").read_text())["summary"]["mean_chunk_chars"]
    out = tmp_path / "o.jsonl"
    rc, err = run(capsys, src, "-o", out, "--model", tiny, "--method", method, "--len-unit", "word",
                  "--mean-chunk-chars-of", ppl, "--mean-chunk-chars-tolerance", "0.05")  # fmt: skip
    assert rc == 0, err
    meta = json.loads((tmp_path / "o.meta.json").read_text())
    fit = meta["length_fit"]
    assert fit["goal"] == round(goal, 1) and fit["within_tolerance"], fit
    assert abs(meta["summary"]["mean_chunk_chars"] - goal) <= 0.05 * goal
    assert meta["summary"]["mean_chunk_chars"] == fit["mean_chunk_chars"]
    assert meta["config"]["target_len"] == fit["target_len"]  # the length it found is the one recorded
    for r, text in zip(read_jsonl(out), texts):
        assert_tiles(r, text)
    # the same run, with the found length given: byte-identical chunks
    again = tmp_path / "again.jsonl"
    rc, err = run(capsys, src, "-o", again, "--model", tiny, "--method", method, "--len-unit", "word",
                  "--target-len", fit["target_len"])  # fmt: skip
    assert rc == 0, err
    assert again.read_text() == out.read_text()


def test_mean_chunk_chars_into_a_folder_writes_the_files_chunks(tmp_path, capsys):
    """A folder is the same run as a file, shard by shard: --mean-chunk-chars fits one target_len
    for the whole input, then writes its shards."""
    src = write_jsonl(tmp_path / "d.jsonl", [{"id": f"d{k}", "text": EN * (k + 1)} for k in range(5)])
    args = ["--method", "sentence", "--lang", "en", "--len-unit", "char", "--mean-chunk-chars", "120"]
    rc, err = run(capsys, src, "-o", tmp_path / "one.jsonl", *args)
    assert rc == 0, err
    rc, err = run(capsys, src, "-o", tmp_path / "dir", "--shards", "2", *args)
    assert rc == 0, err
    shards = sorted((tmp_path / "dir").glob("train-*.jsonl"))
    assert len(shards) == 2
    assert b"".join(p.read_bytes() for p in shards) == (tmp_path / "one.jsonl").read_bytes()
    manifest = json.loads((tmp_path / "dir" / "manifest.json").read_text())
    file_meta = json.loads((tmp_path / "one.meta.json").read_text())
    assert manifest["length_fit"] == file_meta["length_fit"]
    assert manifest["summary"]["mean_chunk_chars"] == file_meta["summary"]["mean_chunk_chars"]


def test_mean_chunk_chars_refusals(tmp_path, capsys, tiny):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": EN}])
    rc, err = run(capsys, src, "-o", tmp_path / "o.jsonl", "--method", "fixed", "--mean-chunk-chars-of",
                  tmp_path / "nothing.jsonl")  # fmt: skip
    assert rc == 2 and "nothing.meta.json" in err and "Traceback" not in err
    rc, err = run(capsys, src, "-o", tmp_path / "o.jsonl", "--method", "fixed", "--mean-chunk-chars", "100",
                  "--mean-chunk-chars-of", tmp_path / "x.jsonl")  # fmt: skip
    assert rc == 2 and "not both" in err


def test_a_mistyped_flag_is_answered_by_its_commands_parser_with_the_nearest_flag(capsys):
    """It got the top-level usage and 'unrecognized arguments', nothing about the flag meant."""
    with pytest.raises(SystemExit) as e:
        main(["chunk", "docs.jsonl", "-o", "out.jsonl", "--target-length", "80"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "metachunk chunk: error: unrecognized arguments: --target-length 80" in err
    assert "did you mean --target-len?" in err and "usage: metachunk chunk" in err


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`metachunk ... | head -1`: "metachunk: error: Broken pipe" and exit 1 had followed; a pipe's reader
    that has gone wants no message. The status is a SIGPIPE's, as a shell gives `yes | head`."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "metachunk", "models", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # the reader goes before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_only_a_stdout_whose_reader_has_gone_counts_as_one(monkeypatch, tmp_path):
    """A broken pipe of another kind (a socket's, a child's) is an error to say, not a quiet exit."""
    import io
    import os

    from metachunk.cli import stdout_reader_gone

    monkeypatch.setattr("sys.stdout", io.StringIO())  # no file descriptor
    assert stdout_reader_gone() is False
    with open(tmp_path / "out.txt", "w") as f:
        monkeypatch.setattr("sys.stdout", f)
        assert stdout_reader_gone() is False
    read, write = os.pipe()
    with os.fdopen(write, "w") as f:
        monkeypatch.setattr("sys.stdout", f)
        assert stdout_reader_gone() is False  # its reader is still there
        os.close(read)
        assert stdout_reader_gone() is True
