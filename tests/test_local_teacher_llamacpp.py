"""Structured outputs against a real server: SmolLM2-135M's GGUF under llama-cpp-python's server.

The llama.cpp backend of ``metachunk teacher serve`` decodes a request's JSON schema as a
grammar. These tests send the toolkit's own requests (the rewrite pipeline's refinement, MoC's
chunk list) through the CLI, so the request format is one a real server accepts, and check
that every JSON answer parses. They need ``pip install 'metachunk[llamacpp]'`` (``make install``
builds it); without it they are skipped, with the reason.
"""

import json

import pytest
import yaml
from support.data import data_file
from support.fixtures import write_emma_chunks

from metachunk.artifacts import read_run_log
from metachunk.cli import main as metachunk
from metachunk.local_teacher import LocalTeacher, llama_cpp_available, pick_backend

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python[server] is not installed"),
]


@pytest.fixture(scope="module")
def llama_teacher():
    from metachunk.models import ModelNotFoundError

    try:
        teacher = LocalTeacher("smollm2", backend="llama.cpp", threads=1)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with teacher:
        yield teacher


def test_the_backend_serves_the_gguf_as_it_ships(llama_teacher):
    assert pick_backend("auto") == "llama.cpp"
    assert llama_teacher.source.suffix == ".gguf" and llama_teacher.source.name.startswith("SmolLM2")
    assert llama_teacher.model == "smollm2" and not llama_teacher.serve_preset
    assert llama_teacher.structured_output == "json_object_schema"


def test_refinement_under_the_schema_always_parses(llama_teacher, tmp_path):
    """distill rewrite with the refinement schema sent as llama.cpp takes it: every refinement
    answer is JSON with an ``items`` list (none unparseable, none repaired from prose), and the
    rewrite reaches the completion stage for the chunks whose items pass the threshold."""
    write_emma_chunks(tmp_path, n_chunks=3, min_chars=150, n_paragraphs=4)
    block = {"model": "smollm2", "base_url": llama_teacher.base_url, "temperature": 0.0, "max_tokens": 96,
             "max_tokens_limit": 192, "concurrency": 1, "timeout": 300, "max_retries": 1, "stop": ["\n\n"]}  # fmt: skip
    teachers = {
        "reflection": block,
        # a forced non-NONE reflection would not be the pipeline; refinement is reached whenever
        # the reflection lists something, which SmolLM2 nearly always does
        "refinement": {**block, "stop": None, "structured_output": "json_object_schema", "max_tokens": 192,
                       "max_tokens_limit": 384},
        "completion": {**block, "stop": None},
    }  # fmt: skip
    recipe = {"chunks": str(tmp_path / "chunks.jsonl"), "documents": str(tmp_path / "docs.jsonl"),
              "out": str(tmp_path / "run"), "max_context_chars": 1200, "parse_retries": 0, "progress": False,
              "teachers": teachers}  # fmt: skip
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert metachunk(["distill", "rewrite", "--config", str(config)]) in (0, 4)
    records = [json.loads(line) for line in (tmp_path / "run" / "rewrite.jsonl").open(encoding="utf-8")]
    refined = [r["stages"]["refinement"] for r in records if "refinement" in r["stages"]]
    assert refined, "SmolLM2 answered NONE to every reflection: no refinement request was made"
    for entry in refined:
        assert entry["status"] == "ok", entry  # the server took the request (no 4xx / 5xx)
        assert entry["params"]["structured_output"] == "json_object_schema"
        assert entry["finish_reason"] == "stop", entry  # the grammar closed the object
        assert isinstance(json.loads(entry["text"])["items"], list)
        assert entry["json_outcomes"] and set(entry["json_outcomes"]) <= {"valid", "repaired"}
    meta = json.loads((tmp_path / "run" / "rewrite.meta.json").read_text(encoding="utf-8"))
    counts = meta["summary"]["json_answers"]["refinement"]
    assert counts["unparseable"] == 0 and counts["valid"] + counts["repaired"] == len(refined)
    # A rerun sends nothing: the schema's hash is part of each stored request's key.
    assert metachunk(["distill", "rewrite", "--config", str(config)]) in (0, 4)
    again = json.loads((tmp_path / "run" / "rewrite.meta.json").read_text(encoding="utf-8"))
    assert again == meta  # answered from the store: the same records and the same meta file
    assert read_run_log(tmp_path / "run")[-1]["requests_sent"] == 0


def test_moc_chunk_list_under_the_schema(llama_teacher, tmp_path):
    """distill moc with the chunk-list schema: each window's answer is {"chunks": [strings]}."""
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        text = "\n\n".join(json.loads(line)["text"] for line, _ in zip(f, range(4)))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "emma", "text": text[:700]}) + "\n", encoding="utf-8")
    recipe = {"documents": str(docs), "out": str(tmp_path / "moc"), "lang": "en", "moc_tokenizer": "smollm2",
              "moc_window_tokens": 256, "progress": False,
              "teachers": {"moc_chunk": {"model": "smollm2", "base_url": llama_teacher.base_url, "temperature": 0.0,
                                         "max_tokens": 256, "concurrency": 1, "timeout": 300, "max_retries": 1,
                                         "structured_output": "json_object_schema"}}}  # fmt: skip
    config = tmp_path / "moc.yaml"
    config.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert metachunk(["distill", "moc", "--config", str(config)]) in (0, 4)
    meta = json.loads((tmp_path / "moc" / "moc.meta.json").read_text(encoding="utf-8"))
    counts = meta["summary"]["json_answers"]["moc_chunk"]
    assert counts["unparseable"] == 0 and counts["valid"] >= 1, counts


def test_metachunk_run_starts_the_local_teacher_only_for_a_stage_that_runs(tmp_path, capsys):
    """A regeneration recipe's ``local_teacher:``: started for the stage that asks for it, its
    blocks pointed at it; on a rerun the stage is cached and no teacher is started."""
    write_emma_chunks(tmp_path, n_chunks=2, min_chars=150, n_paragraphs=3)
    block = {"model": "smollm2", "temperature": 0.0, "max_tokens": 64, "concurrency": 1, "timeout": 300,
             "max_retries": 1, "stop": ["\n\n"]}  # fmt: skip
    recipe = {
        "name": "local-regen",
        "state": str(tmp_path / "state"),
        "local_teacher": {"model": "smollm2", "backend": "llama.cpp", "threads": 1},
        "stages": [{"name": "rewrite", "run": "distill rewrite", "local_teacher": True, "allow_exit": [0, 4],
                    "config": {"chunks": str(tmp_path / "chunks.jsonl"), "documents": str(tmp_path / "docs.jsonl"),
                               "out": str(tmp_path / "run"), "max_context_chars": 800, "parse_retries": 0,
                               "progress": False, "lang": "en",
                               "teachers": {"reflection": block,
                                            "refinement": {**block, "stop": None,
                                                           "structured_output": "json_object_schema"},
                                            "completion": {**block, "stop": None}}}}],
    }  # fmt: skip
    path = tmp_path / "regen.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert metachunk(["run", str(path)]) == 0
    err = capsys.readouterr().err
    assert "local teacher: llama.cpp server" in err
    records = [json.loads(x) for x in (tmp_path / "run" / "rewrite.jsonl").read_text().splitlines()]
    # The teacher answered every reflection (a 64-token cap may cut SmolLM2's answer: 'length').
    reflections = [r["stages"]["reflection"] for r in records]
    assert len(records) == 2 and all(e["raw"] and e["reason"] in ("", "length") for e in reflections)
    manifest = json.loads((tmp_path / "state" / "regen_manifest.json").read_text())
    assert manifest["stages"][0]["teachers"] == {"reflection": "smollm2", "refinement": "smollm2",
                                                 "completion": "smollm2"}  # fmt: skip
    assert metachunk(["run", str(path)]) == 0
    err = capsys.readouterr().err
    assert "rewrite (distill rewrite): cached, skipped" in err and "local teacher:" not in err


def test_a_streamed_rewrite_matches_the_plain_one(llama_teacher, tmp_path):
    """The same rewrite against the real server, streamed and not, each into its own store: at
    temperature 0 the assembled streams give the same answers, reasoning and finish reasons as the
    plain bodies. llama-cpp-python's server sends no usage in a stream (it has no stream_options),
    so a streamed answer's tokens are the client's estimate, marked ``usage_estimated``."""
    write_emma_chunks(tmp_path, n_chunks=2, min_chars=150, n_paragraphs=3)
    records = {}
    for stream in (False, True):
        block = {"provider": "llamacpp", "model": "smollm2", "base_url": llama_teacher.base_url, "stream": stream,
                 "temperature": 0.0, "max_tokens": 64, "concurrency": 1, "timeout": 300, "max_retries": 1}  # fmt: skip
        recipe = {"chunks": str(tmp_path / "chunks.jsonl"), "documents": str(tmp_path / "docs.jsonl"),
                  "out": str(tmp_path / f"run-{stream}"), "max_context_chars": 1000, "parse_retries": 0,
                  "progress": False, "teachers": dict.fromkeys(["reflection", "refinement", "completion"], block)}  # fmt: skip
        config = tmp_path / f"recipe-{stream}.yaml"
        config.write_text(yaml.safe_dump(recipe), encoding="utf-8")
        assert metachunk(["distill", "rewrite", "--config", str(config)]) in (0, 4)
        lines = (tmp_path / f"run-{stream}" / "rewrite.jsonl").open(encoding="utf-8")
        records[stream] = [json.loads(line) for line in lines]
    compared = 0
    assert len(records[False]) == len(records[True]) == 2
    for plain, streamed in zip(records[False], records[True]):
        assert plain["stages"].keys() == streamed["stages"].keys()
        for stage, a in plain["stages"].items():
            b = streamed["stages"][stage]
            assert b["status"] in ("ok", "failed") and b["reason"] not in ("stream_cut", "stream_error"), b
            same = ("text", "reasoning", "finish_reason", "request_key")
            assert [a.get(k) for k in same] == [b.get(k) for k in same]
            assert b["status"] != "ok" or b.get("usage_estimated") is True
            compared += 1
    assert compared >= 2
