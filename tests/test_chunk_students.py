"""``metachunk chunk --rewrite MODEL --summarize MODEL``: trained students applied to every chunk.

The tiny random Qwen2 stands in for a trained student (its answers are gibberish); what is checked
is the plumbing: the fields, the offsets, the manifest, greedy and batch-independent decoding,
clean errors, and above all that the prompt at inference is the SFT row's prompt for that chunk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from metachunk.chunking.students import FIELDS, ContextSpec, chunk_prompts, load_student_prompt

from metachunk.artifacts import read_run_log
from metachunk.cli import main

SENTENCES_EN = [
    "Emma Woodhouse lived with her father at Hartfield, a large house in the village of Highbury.",
    "Her governess, Miss Taylor, had just married Mr. Weston and moved to Randalls.",
    "The wedding left father and daughter alone for the first long evening in sixteen years.",
    "Mr. Woodhouse could not understand why anyone would wish to leave home and marry.",
    "Mr. Knightley, an old friend of the family, walked over from Donwell Abbey after dinner.",
    "He teased Emma about her boast that she had made the match herself.",
    "She resolved, against his advice, to find a husband for the young vicar, Mr. Elton.",
]
EN = " ".join(SENTENCES_EN)
ZH = (
    "近日，西安市发放了第二批体育消费券，市民可以在指定的体育场馆使用。"
    "据市体育局介绍，这批消费券共计五百万元，分三轮发放。"
    "活动期间，游泳馆和羽毛球馆的预约人数明显增加。"
    "该局表示，下一步将把更多社区健身场所纳入使用范围。"
)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def chunk(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["chunk", *map(str, argv)])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def student(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model as a 'trained' student whose generation_config asks for sampling (which the
    chunker must override with greedy) and suppresses whitespace-only tokens (else the random model
    emits newlines only, which strip to nothing)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("student") / "tiny-student"
    shutil.copytree(tiny_model_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    config_path = path / "generation_config.json"
    generation = json.loads(config_path.read_text())
    generation.update(
        do_sample=True,
        temperature=0.7,
        top_k=5,
        suppress_tokens=[i for i in range(len(tok)) if not tok.decode([i]).strip()],
    )
    config_path.write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    return write_jsonl(folder / "docs.jsonl", [{"id": "en", "text": EN}, {"id": "zh", "text": ZH},
                                               {"id": "empty", "text": ""}])  # fmt: skip


BASELINE = ("--method", "sentence", "--target-len", "120", "--len-unit", "char")  # no chunking model


def test_rewrite_and_summarize_add_fields_and_keep_offsets(tmp_path, capsys, student, docs_file):
    out = tmp_path / "chunks.jsonl"
    rc, err = chunk(capsys, docs_file, "-o", out, *BASELINE, "--rewrite", student, "--summarize", student)
    assert rc == 0, err
    records = read_jsonl(out)
    texts = {"en": EN, "zh": ZH, "empty": ""}
    assert [r["id"] for r in records] == ["en", "zh", "empty"]
    for r in records:
        text = texts[r["id"]]
        assert set(r) == {"schema_version", "id", "method", "chunks"}
        assert "".join(c["text"] for c in r["chunks"]) == text  # still tiles the document
        for c in r["chunks"]:
            assert set(c) == {"text", "start", "end", "rewritten", "summary"}
            assert c["text"] == text[c["start"] : c["end"]]
            assert isinstance(c["rewritten"], str) and c["rewritten"]
            assert isinstance(c["summary"], str) and c["summary"]
            for written in (c["rewritten"], c["summary"]):  # a character cut in half at the end is not kept
                assert not written.endswith("\ufffd") or set(written) == {"\ufffd"}
    assert len(records[0]["chunks"]) > 2 and records[2]["chunks"] == []

    meta = json.loads(out.with_suffix(".meta.json").read_text(encoding="utf-8"))
    assert meta["config"]["rewrite"] == meta["config"]["summarize"] == str(student)
    n_chunks = sum(len(r["chunks"]) for r in records)
    students = read_run_log(out)[-1]["workers_report"][0]["students"]  # how the run went: its run log
    for task, run in students.items():
        assert run["model"] == str(student) and run["path"] == str(student.resolve())
        assert run["field"] == FIELDS[task] and run["chunks"] == n_chunks
        assert run["prompt_sha256"] == {
            f"student_{task}.{lang}": load_student_prompt(task, lang).sha256 for lang in ("en", "zh")
        }
        assert run["context"] == {"mode": "document", "max_chars": 8000}
        gen = run["generation"]
        # The model's generation_config is respected (suppress_tokens) but decoding is greedy.
        assert gen["do_sample"] is False and gen["forced_greedy"] is True and gen["num_beams"] == 1
        assert "temperature" not in gen and "top_k" not in gen and gen["suppress_tokens"]
        assert (
            0 < run["new_tokens"] and 0 <= run["cut_at_budget"] <= run["chunks"]
        )  # said, where a budget ended one
    assert students["summary"]["generation"]["max_new_tokens"] == 256
    assert students["summary"]["new_tokens"] <= 256 * n_chunks
    assert "1.5" in students["rewrite"]["generation"]["max_new_tokens"]
    assert "rewrite (" in err and "summary (" in err

    # One flag alone; batches of one give the same (greedy) answers as batches of eight.
    alone = tmp_path / "summaries.jsonl"
    rc, err = chunk(capsys, docs_file, "-o", alone, *BASELINE, "--summarize", student, "--batch-size", "1")
    assert rc == 0, err
    for r, again in zip(records, read_jsonl(alone)):
        assert [c["summary"] for c in again["chunks"]] == [c["summary"] for c in r["chunks"]]
        assert all("rewritten" not in c for c in again["chunks"])
    assert set(read_run_log(alone)[-1]["workers_report"][0]["students"]) == {"summary"}

    # A parquet folder keeps the students' fields too (pyarrow had dropped what its schema did not name).
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    rc, err = chunk(capsys, docs_file, "-o", folder, *BASELINE, "--rewrite", student, "--summarize", student,
                    "--output-format", "parquet")  # fmt: skip
    assert rc == 0, err
    rows = [r for shard in sorted(folder.glob("train-*.parquet")) for r in pq.read_table(shard).to_pylist()]
    assert [[(c["text"], c["rewritten"], c["summary"]) for c in r["chunks"]] for r in rows] == [
        [(c["text"], c["rewritten"], c["summary"]) for c in r["chunks"]] for r in records
    ]


def test_a_blank_chunk_is_kept_and_not_sent_to_the_students(tmp_path, capsys, student):
    blank = " \n\t \n"
    src = write_jsonl(tmp_path / "d.jsonl", [{"id": "blank", "text": blank}, {"id": "en", "text": EN}])
    out = tmp_path / "chunks.jsonl"
    rc, err = chunk(capsys, src, "-o", out, *BASELINE, "--rewrite", student, "--summarize", student)
    assert rc == 0, err
    first, second = read_jsonl(out)
    # The whitespace is a chunk (nothing dropped); there is nothing to rewrite or summarise in it.
    assert first["chunks"] == [{"text": blank, "start": 0, "end": len(blank), "rewritten": "", "summary": ""}]
    assert all(c["rewritten"] and c["summary"] for c in second["chunks"])


def test_rewrite_budget_flag(tmp_path, capsys, student, docs_file):
    out = tmp_path / "chunks.jsonl"
    rc, err = chunk(
        capsys, docs_file, "-o", out, *BASELINE, "--rewrite", student, "--rewrite-max-new-tokens", "3"
    )
    assert rc == 0, err
    run = read_run_log(out)[-1]["workers_report"][0]["students"]["rewrite"]
    assert run["generation"]["max_new_tokens"] == 3
    assert 0 < run["new_tokens"] <= 3 * run["chunks"]


# --------------------------------------------------------------------------- prompt = SFT prompt


@pytest.mark.parametrize(
    "task, doc_id, context, top_k",
    [("rewrite", "en", "document", 4), ("summary", "zh", "document", 4), ("summary", "en", "related", 2)],
)
def test_inference_prompt_is_the_sft_rows_prompt(tmp_path, capsys, monkeypatch, student, docs_file,
                                                 task, doc_id, context, top_k):  # fmt: skip
    """Chunk, distil (records with the context spans the teacher saw), build-sft; then chunk again
    with the student: every prompt the student is sent equals the SFT row of that chunk."""
    if context == "related":
        pytest.importorskip("sentence_transformers")
    from datasets import load_dataset
    from metachunk.chunking.students import Student
    from metachunk.distill.pipelines import STAGES, new_record, read_jobs
    from metachunk.distill.run import DistillConfig
    from metachunk.distill.sft import BuildSftConfig, build_sft

    from metachunk.teacher import TeacherConfig

    limit = 150  # shorter than the documents: the context is a window around each chunk
    docs = write_jsonl(tmp_path / "docs.jsonl", [r for r in read_jsonl(docs_file) if r["id"] == doc_id])
    chunks = tmp_path / "chunks.jsonl"
    rc, err = chunk(
        capsys, docs, "-o", chunks, "--method", "sentence", "--target-len", "40", "--len-unit", "char"
    )
    assert rc == 0, err

    run_dir = tmp_path / "distill"
    cfg = DistillConfig(task=task, chunks=chunks, documents=docs, out=run_dir, context=context,
                        context_top_k=top_k, max_context_chars=limit,
                        teachers=dict.fromkeys(STAGES[task], TeacherConfig("teacher")))  # fmt: skip
    jobs = read_jobs(cfg)
    assert len(jobs) >= 4
    run_dir.mkdir()
    records = []
    for job in jobs:
        record = new_record(task, job)
        output = f"{job.text} Restated." if task == "rewrite" else f"Summary {job.index}."
        record.update(status="ok", output=output, stages={s: {"status": "ok"} for s in STAGES[task]})
        records.append(record)
    write_jsonl(run_dir / f"{task}.jsonl", records)
    (run_dir / f"{task}.meta.json").write_text(
        json.dumps({"config": {"documents": str(docs), "max_context_chars": limit}})
    )
    build_sft(BuildSftConfig(task=task, distilled=run_dir / f"{task}.jsonl", out=tmp_path / "sft",
                             cards_dir=tmp_path / "cards", tokenizer=str(student)), progress=False)  # fmt: skip
    rows = load_dataset(str(tmp_path / "sft"), split="train")
    by_chunk = {row["chunk_index"]: row["prompt"] for row in rows}
    assert len(by_chunk) == len(jobs)  # no row was filtered away
    for job in jobs:
        assert job.context in by_chunk[job.index][1]["content"]  # the teacher's context, too

    sent = []
    real = Student.generate

    def spy(self, prompts, budgets, on_batch=None):
        sent.extend(prompts)
        return real(self, prompts, budgets, on_batch)

    monkeypatch.setattr(Student, "generate", spy)
    flag = "--rewrite" if task == "rewrite" else "--summarize"
    out = tmp_path / "students.jsonl"
    rc, err = chunk(capsys, docs, "-o", out, "--method", "sentence", "--target-len", "40", "--len-unit", "char",
                    flag, student, "--student-context", context, "--student-top-k", top_k,
                    "--student-context-chars", limit)  # fmt: skip
    assert rc == 0, err
    assert sent == [by_chunk[i] for i in range(len(jobs))]

    # The public helper builds the same prompts from the chunk spans alone (document context).
    if context == "document":
        text = read_jsonl(docs)[0]["text"]
        spans = [(c["start"], c["end"]) for c in read_jsonl(out)[0]["chunks"]]
        lang = "zh" if doc_id == "zh" else "en"
        assert chunk_prompts(task, lang, text, spans, ContextSpec("document", limit)) == sent


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", ["no-such-model", "empty-dir", "absent/dir", "bin-only", "no-template"])
def test_bad_student_is_a_clean_error(tmp_path, capsys, tiny_model_dir, docs_file, case):
    model = {"no-such-model": "no-such-model"}.get(case, str(tmp_path / case))
    if case == "empty-dir":
        (tmp_path / case).mkdir()
    elif case in ("bin-only", "no-template"):
        shutil.copytree(tiny_model_dir, tmp_path / case)
        if case == "bin-only":
            (tmp_path / case / "model.safetensors").rename(tmp_path / case / "pytorch_model.bin")
        else:
            (tmp_path / case / "chat_template.jinja").unlink()
    out = tmp_path / "out" / "chunks.jsonl"
    for flag in ("--rewrite", "--summarize"):
        rc, err = chunk(capsys, docs_file, "-o", out, *BASELINE, flag, model)
        assert rc == 2 and "Traceback" not in err
        assert err.startswith("metachunk: error: ") and repr(model) in err
        expected = {"bin-only": "safetensors", "no-template": "chat template"}.get(case, "")
        assert expected in err
        assert not out.exists() and not out.with_suffix(".meta.json").exists()


def test_student_options_are_checked(tmp_path, capsys, student, docs_file):
    out = tmp_path / "chunks.jsonl"
    rc, err = chunk(
        capsys, docs_file, "-o", out, *BASELINE, "--rewrite", student, "--summary-max-new-tokens", "0"
    )
    assert rc == 2 and "--summary-max-new-tokens must be >= 1" in err and not out.exists()


def test_a_student_batches_by_the_device_unless_told(student):
    from metachunk.chunking.students import GPU_STUDENT_ROWS, Student

    assert Student("rewrite", str(student), device="cpu").batch_size == 8  # every CPU figure's plan
    assert Student("rewrite", str(student), device="cpu", batch_size=3).batch_size == 3
    assert GPU_STUDENT_ROWS == 64  # on a GPU (bench/rewrite_speed.py measures it against plain generate)


def test_a_one_chunk_document_in_related_mode_gets_no_context_as_its_teacher_did():
    """In related mode a chunk's context is its document's other chunks: a document of one chunk has none,
    and its teacher was asked with an empty context. The SFT row and the chunker had given the student
    the whole document instead (an empty span list read as "whole document", the legacy meaning)."""
    from metachunk.chunking.students import chunk_context_spans, student_messages

    text = "Emma was clever and rich."
    import numpy as np

    unit = lambda texts: np.ones((len(texts), 2)) / np.sqrt(2)  # noqa: E731
    spans = chunk_context_spans(text, [(0, len(text))], ContextSpec(mode="related"), embed=unit)
    assert spans == [()]
    empty = student_messages("rewrite", "en", text, text, spans[0], 8000)
    whole = student_messages("rewrite", "en", text, text, None, 8000)  # a record from before context spans
    assert empty[1]["content"] != whole[1]["content"] and whole[1]["content"].count(text) == 2
    assert empty[1]["content"].count(text) == 1


def test_a_narrower_build_sft_context_is_centred_on_the_chunk_as_the_chunker_centres_it(tmp_path):
    """build-sft --max-context-chars under the distill run's: the rows had cut the distill window from its
    left edge, prompts inference never sends (with the chunk outside the context, here); the window is
    centred on the chunk again, as `chunk --student-context-chars` centres it."""
    from metachunk.chunking.students import chunk_prompts, window_span
    from metachunk.distill.sft import BuildSftConfig
    from metachunk.distill.sft_rows import ROW_MAKERS

    text = " ".join(f"Sentence number {k} is here." for k in range(1000))  # about 27K characters
    start = text.index("Sentence number 900 ")
    end = start + len("Sentence number 900 is here.")
    record = {"start": start, "end": end, "context_spans": [list(window_span(len(text), start, end, 8000))]}
    maker = ROW_MAKERS["rewrite"](BuildSftConfig(task="rewrite", distilled=tmp_path / "r.jsonl", out=tmp_path / "o",
                                                 max_context_chars=4000))  # fmt: skip
    maker.start({"config": {"max_context_chars": 8000, "context": "document"}})
    spans = maker.context_spans(record, text)
    assert spans == [window_span(len(text), start, end, 4000)]
    from metachunk.chunking.students import student_messages

    row = student_messages("rewrite", "en", text, text[start:end], spans, 4000)
    (student_prompt,) = chunk_prompts("rewrite", "en", text, [(start, end)], ContextSpec(max_chars=4000))
    assert row == student_prompt and text[start:end] in row[1]["content"].split("Text chunk:")[0]
