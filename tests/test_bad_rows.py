"""``--on-bad-row skip``: a corpus with broken rows mixed into good ones (``metachunk/sources.py``).

The good rows' output is byte-identical to the run on the good rows alone (one file, or a folder
of shards); the rejects file names each bad row once, with its ``file:line`` and reason; the
manifest counts them; the exit status is 6. The default (``error``) stops at the first bad row with
its ``file:line``, and ``--max-bad-rows`` stops a mostly broken input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert manifest["run"]["rejects"]["rows"] == 5 and manifest["complete"]


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


def test_data_sample_skips_bad_pool_rows(tmp_path, capsys, corpora, tiny_model_dir):
    good, mixed = corpora
    args = ["--n-docs", 6, "--min-doc-chars", 10, "--model", tiny_model_dir, "--lang", "en", "--target-len", 60,
            "--len-unit", "char", "--no-progress", "--max-row-bytes", 1000]  # fmt: skip

    def sample(pool, out, *extra):
        capsys.readouterr()
        rc = main(["data", "sample", "--pool", str(pool), "--out", str(out), *map(str, args), *extra])
        return rc, capsys.readouterr().err

    assert sample(good, tmp_path / "good")[0] == 0
    rc, err = sample(mixed, tmp_path / "mixed", "--on-bad-row", "skip")
    assert rc == 6 and "5 bad pool rows left out" in err, err
    for name in ("documents.jsonl", "chunks.jsonl"):
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "good" / name).read_bytes()
    assert len((tmp_path / "mixed.rejects.jsonl").read_text().splitlines()) == 5
    assert json.loads((tmp_path / "mixed" / "sample.json").read_text())["rejects"]["rows"] == 5
    assert sample(mixed, tmp_path / "strict")[0] == 2
