"""Sampling for distillation and the SFT set builder: filters, splits, features, chat rendering."""

import json
import random
from pathlib import Path

import pytest
from metachunk.distill.sample import SampleConfig, choose_chunks, sample
from metachunk.distill.sft import BuildSftConfig, build_sft, in_validation
from metachunk.distill.sft_rows import FILTERS, content_kept, features, off_format
from support.data import data_file
from support.fixtures import sentence  # the planted records' sentences (the `planted` fixture)

# ------------------------------------------------------------------------------------- sampling


def test_choose_chunks_takes_the_wanted_bucket_else_the_nearest():
    edges = [100, 200, 400]
    lengths = [50, 150, 150, 900, 20]
    rng = random.Random(0)
    assert choose_chunks(lengths, [1], edges, rng) in ([1], [2])
    assert choose_chunks(lengths, [3], edges, rng) == [3]
    assert choose_chunks(lengths, [2], edges, rng) in ([1], [2], [3])  # no 200-400 chunk: a neighbour
    picked = choose_chunks(lengths, [1, 1, 1], edges, rng)
    assert len(picked) == len(set(picked)) == 3  # never the same chunk twice
    assert 4 not in choose_chunks(lengths, [0, 0], edges, rng, min_chars=30)  # too short to rewrite


def test_sample_is_deterministic_and_feeds_distill(tiny_model_dir, tmp_path):
    pool = tmp_path / "pool.jsonl"
    with data_file("crud-news/news.jsonl").open(encoding="utf-8") as f:
        pool.write_text("".join(line for line, _ in zip(f, range(30))), encoding="utf-8")

    def run(out, seed):
        cfg = SampleConfig(pool=pool, out=out, n_docs=5, chunks_per_doc=2, seed=seed, model=str(tiny_model_dir),
                           lang="zh", progress=False)  # fmt: skip
        return sample(cfg)

    first, again = run(tmp_path / "a", 0), run(tmp_path / "b", 0)
    assert (tmp_path / "a" / "chunks.jsonl").read_bytes() == (tmp_path / "b" / "chunks.jsonl").read_bytes()
    assert first["documents"] == again["documents"] == 5 and first["selected_chunks"] == 10
    assert sum(first["selected_by_length"].values()) == 10
    run(tmp_path / "c", 1)
    assert (tmp_path / "a" / "chunks.jsonl").read_bytes() != (tmp_path / "c" / "chunks.jsonl").read_bytes()

    # The output is distill's input: offsets check out against documents.jsonl.
    from metachunk.distill.pipelines import STAGES, read_jobs
    from metachunk.distill.run import DistillConfig

    from metachunk.teacher import TeacherConfig

    jobs = read_jobs(DistillConfig(task="rewrite", chunks=tmp_path / "a" / "chunks.jsonl",
                                   documents=tmp_path / "a" / "documents.jsonl", out=tmp_path / "d",
                                   teachers=dict.fromkeys(STAGES["rewrite"], TeacherConfig("m"))))  # fmt: skip
    assert len(jobs) == 10 and all(j.lang == "zh" for j in jobs)


# ------------------------------------------------------------------------------------- filters


@pytest.mark.parametrize(
    "task, output, bad",
    [
        ("rewrite", "Emma Woodhouse, the heroine, was handsome.", False),
        ("rewrite", "I'm sorry, but I cannot help with that.", True),
        ("rewrite", "Here is the rewritten chunk: Emma was handsome.", True),
        ("rewrite", "1. missing: who / supplement: Emma", True),
        ("rewrite", "以下是改写后的文本：艾玛很漂亮。", True),
        ("summary", "Emma, a rich young woman of Highbury, is introduced.", False),
        ("summary", "One. Two. Three. Four. Five.", True),
    ],
)
def test_off_format(task, output, bad):
    assert off_format(task, output, "She was handsome, clever, and rich.") is bad


def test_content_kept_per_language():
    assert content_kept("She was rich.", "Emma Woodhouse was rich, she said.", "en") == 1.0
    assert content_kept("She was rich and clever.", "Emma.", "en") == 0.0
    assert content_kept("西安发放消费券", "陕西西安市发放了体育消费券", "zh") > 0.6


def test_validation_split_is_by_document_and_seeded():
    ids = [f"doc{i}" for i in range(2000)]
    share = sum(in_validation(i, 0, 0.1) for i in ids) / len(ids)
    assert 0.07 < share < 0.13
    assert [in_validation(i, 0, 0.1) for i in ids] == [in_validation(i, 0, 0.1) for i in ids]
    assert [in_validation(i, 0, 0.1) for i in ids] != [in_validation(i, 1, 0.1) for i in ids]


# ------------------------------------------------------------------------------------- builder


def test_every_filter_catches_its_planted_record(planted, tiny_model_dir):
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=planted / "ds",
                         documents=planted / "docs.jsonl", test_documents=planted / "test_docs.jsonl",
                         cards_dir=planted / "cards", tokenizer=str(tiny_model_dir), max_length=2048,
                         validation_fraction=0.25)  # fmt: skip
    stats = build_sft(cfg, progress=False)
    assert stats["filters"] == dict.fromkeys(FILTERS, 1)
    assert stats["input_records"] == 19
    assert sum(stats["rows"].values()) == 12
    assert stats["leakage"]["contaminated"] == 1 and stats["leakage"]["test_documents"] == 1
    assert stats["teacher_usage"]["prompt_tokens"] == 19 * 3 * 10

    from datasets import load_dataset

    ds = load_dataset(str(planted / "ds"))
    assert set(ds) == {"train", "validation"}
    assert ds["train"].features == features()
    assert ds["train"].num_rows + ds["validation"].num_rows == 12
    assert not set(ds["train"]["doc_id"]) & set(ds["validation"]["doc_id"])  # split by document
    card = (planted / "ds" / "README.md").read_text(encoding="utf-8")
    assert card == (planted / "cards" / f"{cfg.name}.md").read_text(encoding="utf-8")
    assert (planted / "ds" / "token_lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_a_rebuild_of_the_same_records_writes_the_same_bytes(planted, tiny_model_dir):
    """The card and build_report.json carried the build's seconds and rows/s: every rebuild changed
    them, so a regeneration retrained on an unchanged set and a push of it made a new commit."""
    import time

    def build():
        cfg = BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=planted / "ds",
                             documents=planted / "docs.jsonl", cards_dir=planted / "cards",
                             tokenizer=str(tiny_model_dir), max_length=2048)  # fmt: skip
        stats = build_sft(cfg, progress=False)
        assert stats["timing"]["seconds"] > 0  # the caller still gets the time
        return {p.relative_to(planted / "ds").as_posix(): p.read_bytes() for p in (planted / "ds").rglob("*")
                if p.is_file()}  # fmt: skip

    first = build()
    time.sleep(0.05)
    assert build() == first and "build_report.json" in first


def test_a_published_set_names_no_local_folder(planted, tiny_model_dir, tmp_path, monkeypatch):
    """The card and build_report.json are pushed: an absolute path (the documents, the distilled records,
    a tokenizer folder) shows only its last part, one under the working directory only relative to it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    teacher = str(tmp_path / "models" / "acme-qwen-7b")  # a local server's model is its folder
    records = [json.loads(line) for line in (planted / "rewrite.jsonl").read_text().splitlines()]
    for record in records:
        for entry in record["stages"].values():
            entry["teacher"] = teacher
    (planted / "rewrite.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=planted / "ds",
                         documents=planted / "docs.jsonl", cards_dir=planted / "cards",
                         tokenizer=str(tiny_model_dir), max_length=2048)  # fmt: skip
    build_sft(cfg, progress=False)
    for name in ("README.md", "build_report.json"):
        text = (planted / "ds" / name).read_text(encoding="utf-8")
        assert (
            str(planted) not in text and str(tiny_model_dir) not in text and str(Path.home()) not in text
        ), name
        assert "…/rewrite.jsonl" in text and f"…/{tiny_model_dir.name}" in text, name
    import pyarrow.parquet as pq  # the rows too: the dataset viewer shows every column

    shards = sorted((planted / "ds" / "data").glob("*.parquet"))
    teachers = {t for shard in shards for t in pq.read_table(shard).column("teachers").to_pylist()}
    assert teachers and all(str(tmp_path) not in t and "…/acme-qwen-7b" in t for t in teachers), teachers

    monkeypatch.chdir(planted)  # under the working directory: relative, as a user would type it
    build_sft(cfg, progress=False)
    assert "--distilled rewrite.jsonl --out ds" in (planted / "ds" / "README.md").read_text(encoding="utf-8")


def test_a_card_shows_no_home_from_a_working_directory_above_it(tmp_path, monkeypatch):
    """Run from `/` (a container, cron) every path lies under the working directory: a path under the
    home folder is then shown by its last part, not relative to `/`."""
    from metachunk.markdown import shown_argument, shown_keys, shown_path

    home = tmp_path / "home" / "alice"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    cache = home / ".cache" / "Qwen2.5-3B"
    for cwd in ("/", tmp_path / "home", home):
        monkeypatch.chdir(cwd)
        assert (
            shown_path(cache) == "…/Qwen2.5-3B"
            and shown_argument(f"--model={cache}") == "--model=…/Qwen2.5-3B"
        )
    monkeypatch.chdir(home / "project")
    assert shown_path(home / "project" / "runs" / "ds") == "runs/ds"  # under a project folder: as typed there
    assert shown_path(home / "project" / "runs" / "ds", relative_to_cwd=False) == "…/ds"  # recorded elsewhere
    both = {"/d/train/documents.jsonl": 1, "/d/test/documents.jsonl": 2, "runs/x.jsonl": 3}
    assert shown_keys(both) == {"…/documents.jsonl": 1, "…/test/documents.jsonl": 2, "runs/x.jsonl": 3}


def test_rows_render_with_the_qwen_chat_template(planted, tiny_model_dir):
    from datasets import load_dataset
    from transformers import AutoTokenizer

    cfg = BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=planted / "ds",
                         documents=planted / "docs.jsonl", cards_dir=planted / "cards",
                         tokenizer=str(tiny_model_dir), max_length=100_000)  # fmt: skip
    build_sft(cfg, progress=False)
    row = load_dataset(str(planted / "ds"), split="train")[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["completion"][0]["role"] == "assistant"
    assert row["prompt"][1]["content"].endswith("Text chunk:\n" + sentence(3 * int(row["doc_id"][1:]) + 1))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    assert rendered.startswith("<|im_start|>system\n" + row["prompt"][0]["content"] + "<|im_end|>\n")
    assert ("<|im_start|>assistant\n" + row["completion"][0]["content"] + "<|im_end|>") in rendered
    # TRL masks the loss to the completion via the template's {% generation %} markers.
    masked = tokenizer.apply_chat_template(
        row["prompt"] + row["completion"], return_dict=True, return_assistant_tokens_mask=True
    )
    kept = [t for t, m in zip(masked["input_ids"], masked["assistant_masks"]) if m]
    # exactly the completion and its end token: no prompt token is trained on
    assert tokenizer.decode(kept).strip() == row["completion"][0]["content"] + "<|im_end|>"


def test_bad_record_names_file_and_line(planted, tiny_model_dir):
    from metachunk.artifacts import InputError

    (planted / "bad.jsonl").write_text((planted / "rewrite.jsonl").read_text().splitlines()[0] + "\n{oops\n")
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "bad.jsonl", out=planted / "ds2",
                         documents=planted / "docs.jsonl", cards_dir=planted / "cards", tokenizer=str(tiny_model_dir))  # fmt: skip
    with pytest.raises(InputError, match=r"bad\.jsonl:2: invalid JSON"):
        build_sft(cfg, progress=False)
    assert not (planted / "ds2").exists()  # nothing half-written


@pytest.mark.parametrize(
    "change, said",
    [
        ({"text": [1]}, "field 'text' must be a string, got [1]"),
        ({"output": ["a"]}, "field 'output' must be a string"),
        ({"stages": None}, "field 'stages' must be an object"),
        ({"chunk_index": "x"}, "field 'chunk_index' must be an int"),
        ({"context_spans": "oops"}, "field 'context_spans' must be a list of [start, end] offsets"),
        ({"context_spans": [[5]]}, "field 'context_spans' must be a list of [start, end] offsets"),
        ({"start": 500, "end": 50}, "field 'end' (50) is before field 'start' (500)"),
        ({"status": None}, "field 'status' must be a string"),
        # offsets that do not fit the documents given: prompts cut from the wrong text
        ({"end": 10**9}, "fields 'start':'end' "),
        ({"context_spans": [[0, 10**9]]}, "field 'context_spans' 0:1000000000 is outside document"),
    ],
)
def test_a_record_field_of_the_wrong_type_is_named(planted, tiny_model_dir, change, said):
    """A list for ``text`` said "AttributeError: 'list' object has no attribute 'lower'", a string
    ``chunk_index`` a pyarrow traceback after the build, and ``end`` before ``start`` went in."""
    from metachunk.artifacts import InputError

    record = json.loads((planted / "rewrite.jsonl").read_text().splitlines()[0])
    (planted / "bad.jsonl").write_text(json.dumps({**record, **change}) + "\n")
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "bad.jsonl", out=planted / "ds3",
                         documents=planted / "docs.jsonl", cards_dir=planted / "cards", tokenizer=str(tiny_model_dir))  # fmt: skip
    with pytest.raises(InputError) as e:
        build_sft(cfg, progress=False)
    assert "bad.jsonl:1: " in str(e.value) and said in str(e.value), str(e.value)
    missing = {k: v for k, v in record.items() if k != "status"}
    (planted / "bad.jsonl").write_text(json.dumps(missing) + "\n")
    with pytest.raises(InputError, match="field 'status' is missing"):
        build_sft(cfg, progress=False)


@pytest.mark.parametrize("key, value", [("teacher", ["gpt-4o"]), ("prompt_sha256", {"a": 1})])
def test_a_stage_entry_of_the_wrong_type_is_named(planted, tiny_model_dir, key, value):
    """A list for a stage's ``teacher`` had raised "TypeError: unhashable type: 'list'" with a traceback."""
    from metachunk.artifacts import InputError

    record = json.loads((planted / "rewrite.jsonl").read_text().splitlines()[0])
    record["stages"]["reflection"][key] = value
    (planted / "bad.jsonl").write_text(json.dumps(record) + "\n")
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "bad.jsonl", out=planted / "ds5",
                         documents=planted / "docs.jsonl", cards_dir=planted / "cards", tokenizer=str(tiny_model_dir))  # fmt: skip
    with pytest.raises(InputError, match=rf"bad\.jsonl:1: .*stage 'reflection': {key} is not a string"):
        build_sft(cfg, progress=False)


def test_a_row_dropped_as_too_long_makes_no_later_row_a_duplicate(planted, tiny_model_dir):
    """The same chunk and answer from a long document (too long) and then a short one: the short one's row
    is kept. It had been dropped as a duplicate of the long one's, which nothing kept."""
    record = json.loads((planted / "rewrite.jsonl").read_text().splitlines()[0])
    chunk = record["text"]
    docs = {"long": chunk + " " + " ".join(sentence(500 + i) for i in range(200)), "short": chunk}
    records = []
    for doc_id, text in docs.items():
        records.append(
            {**record, "doc_id": doc_id, "start": 0, "end": len(chunk), "context_spans": [[0, len(text)]]}
        )
    (planted / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (planted / "two-docs.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items())
    )
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "two.jsonl", out=planted / "ds6",
                         documents=planted / "two-docs.jsonl", cards_dir=planted / "cards",
                         tokenizer=str(tiny_model_dir), max_length=1024, validation_fraction=0.0)  # fmt: skip
    stats = build_sft(cfg, progress=False)
    assert stats["filters"]["too_long"] == 1 and stats["filters"]["exact_duplicate"] == 0, stats["filters"]
    assert sum(stats["rows"].values()) == 1


def test_a_record_from_other_documents_is_named(planted, tiny_model_dir):
    """A chunk's text is its document's ``[start:end]`` (chonkie's and semchunk's property), so a
    documents file edited since the distill run is named, not trained on."""
    from metachunk.artifacts import InputError

    docs = [json.loads(line) for line in (planted / "docs.jsonl").read_text().splitlines()]
    record = json.loads((planted / "rewrite.jsonl").read_text().splitlines()[0])
    for doc in docs:
        if doc["id"] == record["doc_id"]:
            doc["text"] = "An edited first line. " + doc["text"]
    (planted / "edited.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (planted / "one.jsonl").write_text(json.dumps(record) + "\n")
    cfg = BuildSftConfig(task="rewrite", distilled=planted / "one.jsonl", out=planted / "ds4",
                         documents=planted / "edited.jsonl", cards_dir=planted / "cards", tokenizer=str(tiny_model_dir))  # fmt: skip
    with pytest.raises(InputError, match=r"one\.jsonl:1: .*field 'text' differs from document"):
        build_sft(cfg, progress=False)
    assert not (planted / "ds4").exists()


def test_bad_records_are_skipped_on_request(planted, tiny_model_dir, capsys):
    """``--on-bad-row skip`` (tests/test_bad_rows.py has the other commands): the bad records go to
    OUT.rejects.jsonl, the dataset is the one the good records alone make, the exit status is 6."""
    from metachunk.cli import main

    good = (planted / "rewrite.jsonl").read_text().splitlines(keepends=True)
    record = json.loads(good[0])
    bad = ["{oops\n", json.dumps({**record, "doc_id": "nowhere"}) + "\n",
           json.dumps({**record, "task": "summary"}) + "\n"]  # fmt: skip
    # Appended, so that the good records keep their line numbers (each row names its source line).
    for name, lines in (("good", good), ("mixed", [*good, *bad])):
        (planted / name).mkdir()
        (planted / name / "rewrite.jsonl").write_text("".join(lines))
    args = ["--documents", planted / "docs.jsonl", "--cards-dir", planted / "cards", "--tokenizer", tiny_model_dir,
            "--max-length", 2048, "--name", "same"]  # fmt: skip

    def build(name, *extra):
        capsys.readouterr()
        rc = main(["data", "build-sft", "rewrite", "--distilled", str(planted / name / "rewrite.jsonl"),
                   "--out", str(planted / f"ds-{name}"), *map(str, args), *extra])  # fmt: skip
        return rc, capsys.readouterr().err

    assert build("good")[0] == 0
    rc, err = build("mixed", "--on-bad-row", "skip")
    assert rc == 6 and "data build-sft: 3 bad rows left out" in err, err
    shards = sorted(
        p.relative_to(planted / "ds-good") for p in (planted / "ds-good" / "data").glob("*.parquet")
    )
    assert shards  # the same shards, no more, with the same bytes
    assert (
        sorted(p.relative_to(planted / "ds-mixed") for p in (planted / "ds-mixed" / "data").glob("*.parquet"))
        == shards
    )
    for shard in shards:
        assert (planted / "ds-mixed" / shard).read_bytes() == (planted / "ds-good" / shard).read_bytes()
    rejects = [json.loads(x) for x in (planted / "ds-mixed.rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [len(good) + 1, len(good) + 2, len(good) + 3]
    assert "not in" in rejects[1]["reason"] and "'task'" in rejects[2]["reason"]
    assert json.loads((planted / "ds-mixed" / "build_report.json").read_text())["rejects"]["rows"] == 3
    rc, err = build("mixed")
    assert rc == 2 and f"rewrite.jsonl:{len(good) + 1}: invalid JSON" in err


def test_documents_are_read_as_the_records_ask_holding_a_window(tmp_path):
    """build-sft's documents: asked in the file's order, at most ``window`` texts are held; asked out of
    order, every text is loaded once and the answers stay right; an id the file lacks is None."""
    from metachunk.sources import DocumentTexts, Rejects

    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": f"d{i}", "text": f"text {i}"}) for i in range(50)]
    lines.insert(30, "{not json")  # a bad row no one asks past: `finish` still reads it
    path.write_text("\n".join(lines) + "\n")
    rejects = Rejects(None)
    docs = DocumentTexts(path, rejects=rejects, window=4)
    for i in (0, 0, 1, 3, 3, 7, 20, 21):  # the records of distill: in order, a document asked many times
        assert docs.get(f"d{i}") == f"text {i}"
        assert docs.held <= 4 and docs.all is None
    assert docs.get("d10") == "text 10"  # passed and out of the window: the rest is loaded once
    assert docs.all is not None and docs.get("d2") == "text 2" and docs.get("nope") is None
    docs.finish()
    assert list(rejects.rows.values()) == [31]

    ordered = DocumentTexts(path, rejects=Rejects(None), window=4)
    assert ordered.get("nope") is None and ordered.all is None  # read to the end, held nothing
    ordered.finish()


def test_a_documents_file_that_cannot_be_read_on_is_its_error_not_the_asking_records(tmp_path):
    """A cut gzip under --on-bad-row skip: the read cannot go on, and that is the documents file's
    error (exit 2), raised again on every later ask, never a bad record to skip."""
    import gzip

    from metachunk.sources import DocumentsFileError, DocumentTexts, Rejects

    body = "".join(json.dumps({"id": f"d{i}", "text": "x" * 200 + str(i)}) + "\n" for i in range(2000))
    whole = gzip.compress(body.encode())
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    docs = DocumentTexts(path, rejects=Rejects(None))
    assert docs.get("d0").endswith("0")
    with pytest.raises(DocumentsFileError):
        docs.get("d1999")
    with pytest.raises(DocumentsFileError):
        docs.get("d1")
    with pytest.raises(DocumentsFileError):
        docs.finish()


def test_documents_in_another_order_build_the_same_dataset(planted, tiny_model_dir):
    """The bounded read needs the records in the documents' order only to stay small: reversed
    documents give the same rows (the card and report name the documents file)."""

    def build(documents):
        cfg = BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=planted / "ds",
                             documents=documents, cards_dir=planted / "cards", tokenizer=str(tiny_model_dir),
                             max_length=2048)  # fmt: skip
        build_sft(cfg, progress=False)
        return {p.relative_to(planted / "ds").as_posix(): p.read_bytes() for p in (planted / "ds").rglob("*")
                if p.is_file() and p.parent.name == "data"}  # fmt: skip

    first = build(planted / "docs.jsonl")
    lines = (planted / "docs.jsonl").read_text().splitlines()
    (planted / "reversed.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    assert first and build(planted / "reversed.jsonl") == first
