"""``--on-bad-row skip``: inputs with broken rows mixed into good ones (``metachunk/sources.py``).

For every command that reads a corpus or records (``chunk``, ``data sample``, ``data passages``,
``data prepare-crud``, ``distill``, ``data build-sft`` in tests/test_sft.py, ``eval qa`` in
tests/test_eval_qa.py, ``eval chunk-quality``) and for ``metachunk run``'s stages: the good rows'
output is byte-identical to the run on the good rows alone (one file, or a folder of shards); the
rejects file names each bad row once, with its ``file:line`` and reason; the manifest counts them;
the exit status is 6. The default (``error``) stops at the first bad row with its ``file:line``,
and ``--max-bad-rows`` stops a mostly broken input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.data import data_file
from support.loopback_server import serve_in_subprocess

from metachunk.cli import main

GOOD = [{"id": f"g{k}", "text": f"Emma walked to Highbury on day {k}. She met Harriet there. They talked."}
        for k in range(12)]  # fmt: skip
BAD = {  # line (1-based) in the mixed file -> (raw bytes, the reason's words)
    3: (b'{"id": "x1", "text": "unterminated\n', "invalid JSON"),
    6: (b'{"id": "x2", "text": "caf\xe9 au lait"}\n', "invalid UTF-8"),
    9: (b'{"id": "x3", "body": "no text field"}\n', "missing field 'text'"),
    12: (json.dumps({"id": "g1", "text": "A second g1."}).encode() + b"\n", "duplicate id 'g1'"),
    15: (json.dumps({"id": "x5", "text": "Long. " * 400}).encode() + b"\n", "over 1,000"),
}
ARGS = [
    "--method",
    "sentence",
    "--target-len",
    "60",
    "--len-unit",
    "char",
    "--lang",
    "en",
    "--max-row-bytes",
    "1000",
]


def write(path: Path, rows: list[bytes]) -> Path:
    path.write_bytes(b"".join(rows))
    return path


@pytest.fixture
def corpora(tmp_path):
    good = [json.dumps(r).encode() + b"\n" for r in GOOD]
    mixed, it = [], iter(good)
    for line in range(1, len(GOOD) + len(BAD) + 1):
        mixed.append(BAD[line][0] if line in BAD else next(it))
    return write(tmp_path / "good.jsonl", good), write(tmp_path / "mixed.jsonl", mixed)


def chunk(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["chunk", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_skipped_rows_leave_the_good_rows_output_unchanged(tmp_path, capsys, corpora):
    good, mixed = corpora
    rc, err = chunk(capsys, good, "-o", tmp_path / "good_out.jsonl", *ARGS)
    assert rc == 0, err
    rc, err = chunk(capsys, mixed, "-o", tmp_path / "mixed_out.jsonl", *ARGS, "--on-bad-row", "skip")
    assert rc == 6, err
    assert "5 bad rows left out" in err
    assert (tmp_path / "mixed_out.jsonl").read_bytes() == (tmp_path / "good_out.jsonl").read_bytes()

    rejects = [json.loads(line) for line in (tmp_path / "mixed_out.rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == sorted(BAD) and all(r["file"] == str(mixed) for r in rejects)
    for r in rejects:
        assert BAD[r["line"]][1] in r["reason"]
    meta = json.loads((tmp_path / "mixed_out.meta.json").read_text())
    assert meta["rejects"]["rows"] == 5 and meta["rejects"]["file"] == str(
        tmp_path / "mixed_out.rejects.jsonl"
    )
    assert meta["summary"]["documents"] == len(GOOD)


def test_a_folder_skips_the_same_rows_in_every_shard(tmp_path, capsys, corpora):
    good, mixed = corpora
    assert chunk(capsys, good, "-o", tmp_path / "good_dir", "--shards", 3, *ARGS)[0] == 0
    rc, err = chunk(capsys, mixed, "-o", tmp_path / "mixed_dir", "--shards", 3, *ARGS, "--on-bad-row", "skip")
    assert rc == 6, err
    shards = sorted(p.name for p in (tmp_path / "good_dir").glob("train-*"))
    assert len(shards) == 3
    for name in shards:
        assert (tmp_path / "mixed_dir" / name).read_bytes() == (tmp_path / "good_dir" / name).read_bytes()
    lines = (tmp_path / "mixed_dir.rejects.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["line"] for line in lines) == sorted(BAD)  # each once
    manifest = json.loads((tmp_path / "mixed_dir" / "manifest.json").read_text())
    assert manifest["rejects"]["rows"] == 5 and manifest["complete"]


def test_by_default_a_bad_row_is_an_error_and_a_broken_input_stops(tmp_path, capsys, corpora):
    _, mixed = corpora
    rc, err = chunk(capsys, mixed, "-o", tmp_path / "out.jsonl", *ARGS)
    assert rc == 2 and f"{mixed}:3: invalid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
    rc, err = chunk(
        capsys, mixed, "-o", tmp_path / "out.jsonl", *ARGS, "--on-bad-row", "skip", "--max-bad-rows", 2
    )
    assert rc == 2 and "more than --max-bad-rows 2 bad rows" in err and f"{mixed}:9" in err
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.rejects.jsonl").exists()


def test_data_sample_skips_bad_pool_rows(tmp_path, capsys, corpora, tiny_model_dir, monkeypatch):
    good, mixed = corpora
    args = ["--n-docs", 6, "--min-doc-chars", 10, "--model", tiny_model_dir, "--lang", "en", "--target-len", 60,
            "--len-unit", "char", "--no-progress", "--max-row-bytes", 1000]  # fmt: skip

    def sample(pool, out, *extra):
        capsys.readouterr()
        rc = main(["data", "sample", "--pool", str(pool), "--out", str(out), *map(str, args), *extra])
        return rc, capsys.readouterr().err

    assert sample(good, tmp_path / "good")[0] == 0
    rc, err = sample(mixed, tmp_path / "mixed", "--on-bad-row", "skip")
    assert rc == 6 and "data sample: 5 bad rows left out" in err, err
    for name in ("documents.jsonl", "chunks.jsonl"):
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "good" / name).read_bytes()
    assert len((tmp_path / "mixed.rejects.jsonl").read_text().splitlines()) == 5
    assert json.loads((tmp_path / "mixed" / "sample.json").read_text())["rejects"]["rows"] == 5
    assert sample(mixed, tmp_path / "strict")[0] == 2

    # A new draw whose chunking fails leaves the last sample whole: documents.jsonl was replaced first,
    # beside chunks whose offsets pointed into the old documents.
    def outputs():  # the staged draw (hidden, the chunker's input) is the next run's to replace
        return {
            p.name: p.read_bytes() for p in (tmp_path / "good").iterdir() if p.is_file() and p.name[0] != "."
        }

    before = outputs()
    import metachunk.chunking.run

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metachunk.chunking.run, "run_sharded", fails)
    rc, err = sample(good, tmp_path / "good", "--seed", "7")
    assert rc == 1 and "No space left" in err, err
    assert outputs() == before and set(before) == {
        "documents.jsonl",
        "chunks.jsonl",
        "sample.json",
        "runs.jsonl",
    }


def run_cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([*map(str, argv)])
    return rc, capsys.readouterr().err


def rejected_lines(path: Path) -> list[int | None]:
    return [json.loads(line)["line"] for line in path.read_text(encoding="utf-8").splitlines()]


def mix(good: list[bytes], bad: dict[int, bytes]) -> list[bytes]:
    """``good`` with ``bad[line]`` put at each 1-based ``line``."""
    it, rows = iter(good), []
    for line in range(1, len(good) + len(bad) + 1):
        rows.append(bad[line] if line in bad else next(it))
    return rows


def test_data_passages_skips_bad_paragraph_lines(tmp_path, capsys):
    paragraphs = [{"chapter": f"CHAPTER {k // 3}", "text": f"Paragraph {k} of Emma."} for k in range(9)]
    good = [json.dumps(p).encode() + b"\n" for p in paragraphs]
    bad = {2: b'{"chapter": "CHAPTER 0", "text": \n', 5: b'{"chapter": "CHAPTER 1", "text": "caf\xe9"}\n',
           7: b'{"chapter": "CHAPTER 1"}\n', 9: b'{"chapter": "CHAPTER 2", "text": "\\ud800"}\n',
           11: json.dumps({"chapter": "CHAPTER 2", "text": "x" * 2000}).encode() + b"\n"}  # fmt: skip
    write(tmp_path / "good.jsonl", good)
    write(tmp_path / "mixed.jsonl", mix(good, bad))
    args = ["--group-field", "chapter", "--max-row-bytes", 1000]
    assert run_cli(capsys, "data", "passages", "--input", tmp_path / "good.jsonl", "--out", tmp_path / "good_out.jsonl", *args)[0] == 0  # fmt: skip
    rc, err = run_cli(capsys, "data", "passages", "--input", tmp_path / "mixed.jsonl", "--out",
                      tmp_path / "mixed_out.jsonl", *args, "--on-bad-row", "skip")  # fmt: skip
    assert rc == 6 and "data passages: 5 bad rows left out" in err, err
    assert (tmp_path / "mixed_out.jsonl").read_bytes() == (tmp_path / "good_out.jsonl").read_bytes()
    assert rejected_lines(tmp_path / "mixed_out.rejects.jsonl") == sorted(bad)
    rc, err = run_cli(capsys, "data", "passages", "--input", tmp_path / "mixed.jsonl", "--out",
                      tmp_path / "strict.jsonl", *args)  # fmt: skip
    assert rc == 2 and "mixed.jsonl:2: invalid JSON" in err and not (tmp_path / "strict.jsonl").exists()


def test_data_prepare_crud_skips_bad_articles_and_qa_entries(tmp_path, capsys):
    news = data_file("crud-news/news.jsonl").read_bytes().splitlines(keepends=True)[:40]
    qa_all = json.loads(data_file("crud-news/questanswer_1doc.json").read_text(encoding="utf-8"))
    qa = dict(list(qa_all.items())[:60])
    write(tmp_path / "news_good.jsonl", news)
    first = json.loads(news[0])
    second = json.loads(news[1])
    # Line 2 is a lone surrogate under the id of a good row that comes after it: left out, it must
    # not lend that row its source either.
    bad = {2: b'{"id": "' + second["id"].encode() + b'", "text": "\\ud800", "source": "BAD"}\n',
           4: b"{not json\n", 9: news[1][:-1] + b"\xff\n", 14: json.dumps({"id": "no-text"}).encode() + b"\n",
           20: json.dumps({"id": first["id"], "text": "A copy of the first id."}).encode() + b"\n"}  # fmt: skip
    write(tmp_path / "news_mixed.jsonl", mix(news, bad))
    (tmp_path / "qa_good.json").write_text(json.dumps(qa, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "qa_mixed.json").write_text(json.dumps({**qa, "broken-entry": {"question": "no lists"}},
                                                       ensure_ascii=False), encoding="utf-8")  # fmt: skip

    def prepare(news_file, qa_file, out, *extra):
        return run_cli(
            capsys, "data", "prepare-crud", "--news", news_file, "--qa", qa_file, "--out", out, *extra
        )

    assert prepare(tmp_path / "news_good.jsonl", tmp_path / "qa_good.json", tmp_path / "good")[0] == 0
    rc, err = prepare(tmp_path / "news_mixed.jsonl", tmp_path / "qa_mixed.json", tmp_path / "mixed",
                      "--on-bad-row", "skip")  # fmt: skip
    assert rc == 6 and "data prepare-crud: 6 bad rows left out" in err, err
    for name in ("test_documents.jsonl", "train_pool.jsonl", "qa_matches.jsonl"):
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "good" / name).read_bytes(), name
    rejects = [
        json.loads(x) for x in (tmp_path / "mixed.rejects.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert [r["line"] for r in rejects] == [*sorted(bad), None]
    assert "broken-entry" in rejects[-1]["reason"] and "duplicate id" in rejects[4]["reason"]
    assert json.loads((tmp_path / "mixed" / "report.json").read_text())["rejects"]["rows"] == 6
    rc, err = prepare(tmp_path / "news_mixed.jsonl", tmp_path / "qa_good.json", tmp_path / "strict")
    assert rc == 2 and "news_mixed.jsonl:2: field 'text' holds a lone surrogate" in err


ITEMS = '[{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]'


def distill_job(root: Path, base_url: str, chunks_rows: list[bytes], docs: list[dict]) -> Path:
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    (root / "documents.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    write(root / "chunks.jsonl", chunks_rows)
    block = {"model": "loopback", "base_url": base_url, "max_tokens": 64, "timeout": 10.0, "max_retries": 1}
    recipe = {"task": "rewrite", "documents": str(root / "documents.jsonl"), "chunks": str(root / "chunks.jsonl"),
              "out": str(root / "run"), "lang": "en", "progress": False,
              "teachers": {s: dict(block) for s in ("reflection", "refinement", "completion")}}  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root / "recipe.yaml"


def test_distill_skips_bad_chunk_records_before_anything_is_sent(tmp_path, capsys):
    docs = [
        {"id": f"d{i}", "text": f"Passage {i}. Emma Woodhouse had lived {i} years in Highbury."}
        for i in range(5)
    ]
    good = [json.dumps({"id": d["id"], "chunks": [{"text": d["text"], "start": 0, "end": len(d["text"])}]}).encode()
            + b"\n" for d in docs]  # fmt: skip
    bad = {2: b'{"id": "d0", "chunks": [\n', 4: json.dumps({"id": "nowhere", "chunks": []}).encode() + b"\n",
           6: json.dumps({"id": "d1", "chunks": [{"text": "not in d1", "start": 0, "end": 9}]}).encode() + b"\n"}  # fmt: skip
    with serve_in_subprocess(replies={'"score"': ITEMS}) as server:
        good_recipe = distill_job(tmp_path / "good", server.base_url, good, docs)
        mixed_recipe = distill_job(tmp_path / "mixed", server.base_url, mix(good, bad), docs)
        assert run_cli(capsys, "distill", "rewrite", "--config", good_recipe)[0] == 0
        sent = server.stats()["requests"]
        rc, err = run_cli(capsys, "distill", "rewrite", "--config", mixed_recipe, "--on-bad-row", "skip")
        assert rc == 6 and "distill rewrite: 3 bad rows left out" in err, err
        assert server.stats()["requests"] == 2 * sent  # the good chunks only, as many as alone
        rc, err = run_cli(
            capsys, "distill", "rewrite", "--config", mixed_recipe, "--out", tmp_path / "strict"
        )
        assert rc == 2 and "chunks.jsonl:2: invalid JSON" in err
        assert server.stats()["requests"] == 2 * sent  # refused before any request
    good_records = (tmp_path / "good" / "run" / "rewrite.jsonl").read_bytes()
    assert (tmp_path / "mixed" / "run" / "rewrite.jsonl").read_bytes() == good_records
    assert rejected_lines(tmp_path / "mixed" / "run" / "rewrite.rejects.jsonl") == sorted(bad)
    meta = json.loads((tmp_path / "mixed" / "run" / "rewrite.meta.json").read_text())
    assert meta["summary"]["rejects"]["rows"] == 3


def test_eval_chunk_quality_skips_bad_chunk_records(tmp_path, capsys, tiny_model_dir):
    texts = ["Emma walked to Highbury. ", "She met Harriet there. ", "They talked of Mr. Elton. "]
    good = []
    for k in range(3):
        chunks, start = [], 0
        for t in texts:
            chunks.append({"text": t, "start": start, "end": start + len(t)})
            start += len(t)
        good.append(json.dumps({"id": f"d{k}", "chunks": chunks}).encode() + b"\n")
    bad = {2: b"[1, 2]\n", 4: json.dumps({"id": "x", "chunks": [{"start": 0}]}).encode() + b"\n"}
    write(tmp_path / "good.jsonl", good)
    write(tmp_path / "mixed.jsonl", mix(good, bad))
    args = [
        "--model",
        tiny_model_dir,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-progress",
        "--no-save-matrices",
    ]
    assert run_cli(capsys, "eval", "chunk-quality", "--chunks", tmp_path / "good.jsonl", "--out", tmp_path / "good", *args)[0] == 0  # fmt: skip
    rc, err = run_cli(capsys, "eval", "chunk-quality", "--chunks", tmp_path / "mixed.jsonl", "--out", tmp_path / "mixed",
                      *args, "--on-bad-row", "skip")  # fmt: skip
    assert rc == 6 and "eval chunk-quality: 2 bad rows left out" in err, err
    assert (tmp_path / "mixed" / "items.jsonl").read_bytes() == (
        tmp_path / "good" / "items.jsonl"
    ).read_bytes()
    assert rejected_lines(tmp_path / "mixed.rejects.jsonl") == sorted(bad)
    assert json.loads((tmp_path / "mixed" / "metrics.json").read_text())["details"]["rejects"]["rows"] == 2


def test_a_regeneration_stage_may_skip_bad_rows_and_its_manifest_carries_them(tmp_path, capsys, corpora):
    import yaml

    _, mixed = corpora
    recipe = {"name": "bad-rows", "state": str(tmp_path / "state"), "stages": [
        {"name": "chunk", "run": "chunk", "config": {
            "input": str(mixed), "output": str(tmp_path / "chunks.jsonl"), "method": "sentence", "target_len": 60,
            "len_unit": "char", "lang": "en", "max_row_bytes": 1000, "on_bad_row": "skip"}},
        {"name": "passages", "run": "data passages", "config": {
            "input": str(tmp_path / "chunks.jsonl"), "out": str(tmp_path / "docs.jsonl"), "text_field": "id"}},
    ]}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rc, err = run_cli(capsys, "run", tmp_path / "recipe.yaml")
    assert rc == 6, err
    manifest = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
    chunk_stage, passages_stage = manifest["stages"]
    rejects = tmp_path / "chunks.rejects.jsonl"
    # the manifest is pushed with the dataset: the file by its name, not its folder (markdown.shown_path)
    assert chunk_stage["rejects"]["rows"] == 5 and chunk_stage["rejects"]["file"] == "…/chunks.rejects.jsonl"
    import hashlib

    assert chunk_stage["rejects"]["sha256"] == hashlib.sha256(rejects.read_bytes()).hexdigest()
    assert "rejects" not in passages_stage
    rc, err = run_cli(capsys, "run", tmp_path / "recipe.yaml")  # cached: still says rows were left out
    assert rc == 6 and "chunk (chunk): cached, skipped" in err


def test_parquet_rows_are_skipped_too_and_a_clean_rerun_removes_old_rejects(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [{"id": r["id"], "text": r["text"]} for r in GOOD]
    mixed = [
        *good[:3],
        {"id": "n1", "text": None},
        *good[3:7],
        {"id": "g2", "text": "A second g2."},
        *good[7:],
    ]
    pq.write_table(pa.Table.from_pylist(good), tmp_path / "good.parquet")
    pq.write_table(pa.Table.from_pylist(mixed), tmp_path / "mixed.parquet")
    assert chunk(capsys, tmp_path / "good.parquet", "-o", tmp_path / "good.jsonl", *ARGS)[0] == 0
    rc, err = chunk(
        capsys, tmp_path / "mixed.parquet", "-o", tmp_path / "out.jsonl", *ARGS, "--on-bad-row", "skip"
    )
    assert rc == 6, err
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "good.jsonl").read_bytes()
    assert rejected_lines(tmp_path / "out.rejects.jsonl") == [4, 9]
    # the same output made again from clean input: the old rejects file would describe another run
    rc, err = chunk(
        capsys, tmp_path / "good.parquet", "-o", tmp_path / "out.jsonl", *ARGS, "--on-bad-row", "skip"
    )
    assert rc == 0, err
    assert not (tmp_path / "out.rejects.jsonl").exists()


def test_a_line_over_the_limit_is_read_through_not_held(tmp_path):
    """A 300 MB line peaked at 832 MB before it was refused: the whole line was read first. Now no
    more than the limit is held; the line is measured, refused by its size, and the next one read."""
    import gzip
    import io

    from metachunk.artifacts import InputError
    from metachunk.sources import DocumentSource, Rejects, bounded_lines, read_records

    long = b'{"id": "big", "text": "' + b"x" * 3_000_000 + b'"}\n'
    data = b'{"id": "a", "text": "first"}\n' + long + b'{"id": "b", "text": "last"}'
    got = list(bounded_lines(io.BytesIO(data), 1000))
    assert [size for _, size in got] == [29, len(long), 27] and len(got[1][0]) == 1001
    assert got[2][0] == b'{"id": "b", "text": "last"}'
    path = tmp_path / "c.jsonl"
    path.write_bytes(data)
    with pytest.raises(InputError, match=rf"c\.jsonl:2: a row of {len(long):,} bytes, over 1,000"):
        list(read_records(path, max_row_bytes=1000))
    for name, payload in (("d.jsonl", data), ("d.jsonl.gz", gzip.compress(data))):
        (tmp_path / name).write_bytes(payload)
        source = DocumentSource(
            tmp_path / name, rejects=Rejects(tmp_path / f"{name}.rejects"), max_row_bytes=1000
        )
        assert [d.id for d in source] == ["a", "b"], name
