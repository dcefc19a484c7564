"""End to end against the real local teacher: SmolLM2-135M-Instruct under ``transformers serve``.

Both pipelines run through the CLI on a handful of Emma chunks. A 135M model answers badly
(unparseable refinements, rambling summaries); the test asserts that every chunk ends in a
recorded outcome, that the HTTP path really ran, and that a rerun pays for nothing.
"""

import json

import pytest
import yaml
from support.data import data_file
from support.fixtures import write_emma_chunks

from metachunk.artifacts import read_run_log
from metachunk.cli import main as metachunk

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_teacher():
    from metachunk.local_teacher import LocalTeacher
    from metachunk.models import ModelNotFoundError

    try:
        teacher = LocalTeacher("smollm2", threads=1)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with teacher:
        yield teacher


def test_both_pipelines_against_smollm2(local_teacher, tmp_path):
    write_emma_chunks(tmp_path, n_chunks=2)
    block = {
        "model": "smollm2",
        "serve_preset": True,
        "base_url": local_teacher.base_url,
        "temperature": 0.7,
        "max_tokens": 64,
        "max_tokens_limit": 128,  # a small model rambles: one retry at twice the length
        "concurrency": 2,
        "timeout": 300,
        "max_retries": 1,
    }
    stages = ["reflection", "refinement", "completion", "summary_global", "summary_local", "summary_fuse"]
    recipe = {
        "chunks": str(tmp_path / "chunks.jsonl"),
        "documents": str(tmp_path / "docs.jsonl"),
        "out": str(tmp_path / "run"),
        "max_context_chars": 1500,
        "parse_retries": 1,
        "progress": False,
        "teachers": dict.fromkeys(stages, block),
    }
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(recipe), encoding="utf-8")

    # The 135M teacher may fail every chunk (status 4: failures); the records are written either way.
    for task in ("rewrite", "summary"):
        assert metachunk(["distill", task, "--config", str(config)]) in (0, 4)
        records = [json.loads(line) for line in (tmp_path / "run" / f"{task}.jsonl").open(encoding="utf-8")]
        assert len(records) == 2
        for r in records:
            assert r["status"] in {"ok", "complete_as_is", "failed"}, r
            first = r["stages"][stages[0] if task == "rewrite" else "summary_local"]
            assert first["usage"]["completion_tokens"] > 0
            if r["status"] == "ok":
                assert r["output"].strip()
        assert read_run_log(tmp_path / "run")[-1]["requests_sent"] >= 2

    # A rerun sends nothing: every answer comes from the store.
    assert metachunk(["distill", "summary", "--config", str(config)]) in (0, 4)
    run = read_run_log(tmp_path / "run")[-1]
    assert run["command"] == "distill summary"
    assert run["requests_sent"] == 0 and run["answers_from_store"] >= 2


def test_eval_qa_with_the_local_teacher_as_generator(local_teacher, tmp_path):
    """`metachunk eval qa` end to end: real MiniLM retrieval from an embedded Milvus index, the
    local teacher answering through the teacher client, every metric scored; a rerun pays nothing."""
    write_emma_chunks(tmp_path, n_chunks=6)
    questions = tmp_path / "questions.jsonl"
    with data_file("gutenqa-emma/questions.jsonl").open(encoding="utf-8") as f:
        questions.write_text(
            f.readline(), encoding="utf-8"
        )  # a chapter I question; retrieval may miss it here
    out = tmp_path / "qa"
    argv = ["eval", "qa", "--chunks", str(tmp_path / "chunks.jsonl"), "--qa", str(questions), "--out", str(out),
            "--top-k", "2", "--generator", f"{local_teacher.base_url}:smollm2", "--serve-preset",
            "--max-new-tokens", "32", "--no-progress"]  # fmt: skip
    assert metachunk(argv) == 0
    doc = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    metrics = doc["metrics"]
    for name in ("hits@2", "mrr@2", "bleu_avg", "rouge_l", "bertscore_f1", "embedding_similarity", "f1"):
        assert name in metrics, name
    assert read_run_log(out)[-1]["generation"]["requests_sent"] == 1 and metrics["answers_failed"] == 0
    answers = [json.loads(line) for line in (out / "answers.jsonl").open(encoding="utf-8")]
    assert len(answers) == 1 and answers[0]["prediction"].strip()
    assert metachunk(argv) == 0  # the rerun: the answer comes from answers.sqlite
    again = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert read_run_log(out)[-1]["generation"]["answers_from_store"] == 1
    assert again["metrics"]["bleu_avg"] == metrics["bleu_avg"]


def test_a_streamed_rewrite_against_transformers_serve(local_teacher, tmp_path, monkeypatch):
    """``transformers serve`` streams too: the rewrite's answers arrive as SSE chunks, assembled
    into chat completions, with no stream cut or error."""
    from metachunk.streaming import ChatStream

    streams = []  # every answer assembled from a stream's chunks, not read as one body
    body = ChatStream.body

    def counted(self):
        streams.append(1)
        return body(self)

    monkeypatch.setattr(ChatStream, "body", counted)
    write_emma_chunks(tmp_path, n_chunks=1)
    block = {"model": "smollm2", "serve_preset": True, "base_url": local_teacher.base_url, "stream": True,
             "temperature": 0.0, "max_tokens": 48, "concurrency": 1, "timeout": 300, "max_retries": 1}  # fmt: skip
    recipe = {"chunks": str(tmp_path / "chunks.jsonl"), "documents": str(tmp_path / "docs.jsonl"),
              "out": str(tmp_path / "run"), "max_context_chars": 800, "parse_retries": 0, "progress": False,
              "teachers": dict.fromkeys(["reflection", "refinement", "completion"], block)}  # fmt: skip
    config = tmp_path / "streamed.yaml"
    config.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert metachunk(["distill", "rewrite", "--config", str(config)]) in (0, 4)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "rewrite.jsonl").open(encoding="utf-8")]
    reflection = record["stages"]["reflection"]
    # answered (a 135M model often runs to max_tokens: finish_reason "length", a paid answer)
    assert reflection["finish_reason"] in ("stop", "length"), reflection
    assert reflection["reason"] in ("", "length") and reflection["raw"]  # the streamed content, assembled
    assert not reflection.get("usage_estimated")  # transformers serve honours include_usage
    assert len(streams) >= 1  # the reflection at least was streamed (later stages may not be reached)
