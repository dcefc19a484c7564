"""Structured teacher outputs: the request each ``structured_output`` mode sends, the cache-key
rule, and the outcome of every JSON answer (valid by its schema, repaired, unparseable), against
the loopback server, which records each request's ``response_format`` and refuses malformed ones.

The key rule: a request without a ``response_format`` (a stage answering text, or ``none``) is
keyed exactly as before structured outputs (a key pinned from the code before them), so old
stores are found again; the schema's sha256 joins the key only when the request sends the schema.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
from metachunk.distill.pipelines import parse_items
from metachunk.distill.prompts import load_prompt, load_schema
from metachunk.distill.run import run_task as run
from metachunk.distill.run import write_records
from support.loopback_server import serve_in_subprocess
from test_distill_reliability import REWRITE, chunk_text, make_job, one_chunk_per_doc, table

from metachunk.prompts import Schema
from metachunk.structured import json_in_text, read_answer
from metachunk.teacher import Teacher, TeacherConfig, response_format, with_json_instruction

REFINEMENT = load_schema("refinement")
ITEM = {"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}
VALID = json.dumps({"items": [ITEM]})
# Refinement answers by a marker in the chunk (only the refinement prompt holds '"score"').
ANSWERS = {
    "@valid": VALID,
    "@fenced": "```json\n" + VALID + "\n```",  # a code fence around valid JSON
    "@cut": VALID[:-2],  # the closing brackets missing: json-repair closes them
    "@prose": "I could not find anything to add.",  # no JSON at all
}
REPLIES = {rf'(?s)"score".*{marker}': answer for marker, answer in ANSWERS.items()}


def teacher(mode: str = "none") -> Teacher:
    """A stage's teacher, for building requests (no endpoint, store or budget needed)."""
    cfg = TeacherConfig(model="m", temperature=0.0, max_tokens=64, structured_output=mode)
    return Teacher(cfg, None, None, None, None)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, 世界"}]
# Teacher.request(MESSAGES, "ab" * 32, 1, 64) as the code before structured outputs keyed it.
OLD_KEY = "e49b99f34acba9c9a978aea935405e2365b2513df425d8502f474c43baff6d0c"


def test_each_mode_sends_its_response_format_and_the_key_changes_only_when_it_must():
    plain, key = teacher("none").request(MESSAGES, "ab" * 32, 1, 64, REFINEMENT)
    assert key == OLD_KEY and "response_format" not in plain
    for mode in ("json_schema", "json_object_schema", "json_object"):  # a stage answering text
        payload, text_key = teacher(mode).request(MESSAGES, "ab" * 32, 1, 64, None)
        assert (payload, text_key) == (plain, OLD_KEY)

    sent = {}
    for mode in ("json_schema", "json_object_schema", "json_object"):
        payload, sent[mode] = teacher(mode).request(MESSAGES, "ab" * 32, 1, 64, REFINEMENT)
        assert payload["response_format"] == response_format(mode, REFINEMENT)
        expected = dict(plain)
        if mode == "json_object":  # not sent the schema: the system message says JSON and shows it
            expected["messages"] = with_json_instruction(MESSAGES, REFINEMENT)
            system = payload["messages"][0]["content"]
            assert system.startswith("Be brief.") and "json" in system and '"supplement"' in system
        assert {k: v for k, v in payload.items() if k != "response_format"} == expected
    assert len({OLD_KEY, *sent.values()}) == 4
    assert response_format("json_schema", REFINEMENT) == {
        "type": "json_schema",
        "json_schema": {"name": "refinement", "schema": REFINEMENT.data, "strict": True},
    }
    assert response_format("json_object_schema", REFINEMENT) == {
        "type": "json_object",
        "schema": REFINEMENT.data,
    }
    assert response_format("json_object", REFINEMENT) == {"type": "json_object"}

    # The schema's hash is in the key when the schema is sent, and only then.
    renamed = Schema("refinement", REFINEMENT.data, "cd" * 32)  # same schema, another version
    for mode in ("json_schema", "json_object_schema"):
        assert teacher(mode).request(MESSAGES, "ab" * 32, 1, 64, renamed)[1] != sent[mode]
    # json_object sends the schema's shape in the prompt, not its version: the same shape, the same key.
    assert teacher("json_object").request(MESSAGES, "ab" * 32, 1, 64, renamed)[1] == sent["json_object"]

    with pytest.raises(ValueError, match="structured_output"):
        TeacherConfig(model="m", structured_output="grammar")


def test_an_answer_is_valid_repaired_or_unparseable():
    def read(text, repair):
        items, outcome = read_answer(text, REFINEMENT, parse_items, repair)
        return outcome, None if items is None else [x.to_json() for x in items]

    for repair in (True, False):
        assert read(VALID, repair) == ("valid", [ITEM])
        assert read(ANSWERS["@fenced"], repair) == ("repaired", [ITEM])  # the lenient reader strips the fence
        assert read(json.dumps([ITEM]), repair) == ("repaired", [ITEM])  # the prompt's old shape
        over = json.dumps({"items": [{**ITEM, "score": 11}]})  # over the schema's maximum: kept by the reader
        assert read(over, repair) == ("repaired", [{**ITEM, "score": 11}])
        assert read(ANSWERS["@prose"], repair) == ("unparseable", None)
    assert read(ANSWERS["@cut"], repair=True) == ("repaired", [ITEM])  # json-repair closes it
    assert read(ANSWERS["@cut"], repair=False) == ("unparseable", None)  # asked for JSON: no repair
    # the prompt's old shape, a bare list, with a raw newline in a string: still repaired
    broken = json.dumps([ITEM]).replace("the heroine", "the heroine\nof Highbury", 1)
    assert read(broken, repair=True)[0] == "repaired"
    assert read('{"items": []}', repair=False) == ("valid", [])


def rewrite_job(tmp_path, base_url, mode: str, **fields):
    chunks = {marker[1:]: chunk_text(i, marker) for i, marker in enumerate(ANSWERS)}
    return make_job(
        tmp_path, base_url, one_chunk_per_doc(chunks), teacher={"structured_output": mode}, **fields
    )


# mode -> refinement answers by outcome: @prose is asked 3 times (parse_retries 2); @cut is
# repaired only when the endpoint was asked for nothing
OUTCOMES = {
    "none": {"valid": 1, "repaired": 2, "unparseable": 3},
    "json_object": {"valid": 1, "repaired": 1, "unparseable": 6},
    "json_object_schema": {"valid": 1, "repaired": 1, "unparseable": 6},
    "json_schema": {"valid": 1, "repaired": 1, "unparseable": 6},
}


def test_the_json_in_an_answer_is_found_inside_a_fence_or_prose():
    # Every stage's lenient reader (MoC's expert list, the refinement items, the MoC chunk list)
    # starts from this one reader.
    assert json_in_text('{"chunks": ["a"]}') == {"chunks": ["a"]}
    assert json_in_text('```json\n["a", "b"]\n```') == ["a", "b"]
    assert json_in_text('Here they are: {"items": []} Hope this helps.') == {"items": []}
    assert json_in_text('Sure: [{"id": 1}] done') == [{"id": 1}]
    # openers="[" reads the outermost list even when an object opens first
    assert json_in_text('{"elements": ["x"]}', openers="[") == ["x"]
    assert json_in_text("no JSON here") is None
    assert json_in_text("42") is None
    assert json_in_text('{"cut": ') is None


@pytest.mark.parametrize("mode", list(OUTCOMES))
def test_each_mode_against_the_loopback_server(tmp_path, capsys, mode):
    with serve_in_subprocess(replies=REPLIES) as server:
        job = rewrite_job(tmp_path, server.base_url, mode, parse_retries=2, max_failure_rate=1.0)
        cfg = job.config()
        summary = write_records(cfg, run(cfg))
        stats = server.stats()
        assert job.main("status") == 0
    assert stats["by_outcome"] == {"ok": stats["requests"]}  # the server took every request
    sent = stats.get("response_format", {})
    records = job.records_by_doc()
    for record in records.values():
        for stage in REWRITE:
            entry = record["stages"].get(stage)
            if entry is None:
                continue
            carried = sent.get(entry["request_key"])
            if stage == "refinement" and mode != "none":
                assert carried == response_format(mode, REFINEMENT)
                assert entry["params"]["structured_output"] == mode
            else:  # stages answering text never carry one, nor does any request under none
                assert carried is None and "structured_output" not in entry["params"]
        refinement = record["stages"]["refinement"]
        assert refinement["schema_sha256"] == REFINEMENT.sha256
        assert "json_outcomes" not in record["stages"]["reflection"]
    refinement_requests = sum(r["stages"]["refinement"]["attempts"] for r in records.values())
    assert len(sent) == (0 if mode == "none" else refinement_requests)

    assert summary["json_answers"] == {"refinement": OUTCOMES[mode]}
    repaired_ok = "ok" if mode == "none" else "failed"
    assert {name: r["status"] for name, r in records.items()} == {
        "valid": "ok", "fenced": "ok", "cut": repaired_ok, "prose": "failed"
    }  # fmt: skip
    meta = job.meta()
    assert meta["schema_sha256"] == {"refinement": REFINEMENT.sha256}
    assert meta["summary"]["json_answers"] == summary["json_answers"]
    assert meta["config"]["teachers"]["refinement"]["structured_output"] == mode

    rows = table(capsys.readouterr().out, REWRITE)
    valid, repaired, unparsed = rows["refinement"][6:9]
    assert [int(valid), int(repaired), int(unparsed)] == list(OUTCOMES[mode].values())
    assert rows["reflection"][6:9] == ["-", "-", "-"]


def test_asking_for_a_schema_resends_only_the_json_stage_and_reruns_send_nothing(tmp_path):
    with serve_in_subprocess(replies=REPLIES) as server:
        job = rewrite_job(tmp_path, server.base_url, "none", max_failure_rate=1.0)
        plain = job.config()
        first, again = run(plain), run(plain)
        assert "response_format" not in server.stats()
        # The same store, its teachers now asked for the schema: only refinement's requests are new.
        asked = {
            s: dataclasses.replace(t, structured_output="json_schema") for s, t in plain.teachers.items()
        }
        schema_run, schema_again = run(job.config(teachers=asked)), run(job.config(teachers=asked))
        stats = server.stats()
    assert first.sent > 0 and again.sent == 0 and schema_again.sent == 0
    refinement_requests = sum(r["stages"]["refinement"]["attempts"] for r in schema_run.records)
    assert len(stats["response_format"]) == refinement_requests
    completions = 0
    for old, new in zip(first.records, schema_run.records, strict=True):
        assert new["stages"]["reflection"]["request_key"] == old["stages"]["reflection"]["request_key"]
        assert stats["by_key"][old["stages"]["reflection"]["request_key"]] == 1  # sent once: from the store
        assert new["stages"]["refinement"]["request_key"] in stats["response_format"]
        if "completion" in new["stages"]:  # the same items as before: the same request, from the store
            assert new["stages"]["completion"]["request_key"] == old["stages"]["completion"]["request_key"]
            assert stats["by_key"][old["stages"]["completion"]["request_key"]] == 1
            completions += 1
    assert completions == 2 and schema_run.sent == refinement_requests


def test_the_loopback_server_refuses_a_malformed_response_format():
    def post(fmt) -> int:
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        )
        request = urllib.request.Request(
            server.base_url + "/chat/completions", body.encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    with serve_in_subprocess() as server:
        codes = [
            post(response_format("json_schema", REFINEMENT)),
            post(response_format("json_object_schema", REFINEMENT)),
            post({"type": "json_object"}),
            post({"type": "json_schema", "json_schema": {"name": "refinement"}}),  # no schema
            post({"type": "grammar"}),
        ]
        stats = server.stats()
    assert codes == [200, 200, 200, 400, 400]
    assert stats["by_outcome"] == {"ok": 3, "400": 2} and len(stats["response_format"]) == 5


def test_schema_files_are_checked_and_versioned():
    assert load_schema("reflection") is None and load_schema("summary_fuse") is None
    moc = load_schema("moc_chunk")
    assert moc.data["required"] == ["chunks"] and len(moc.sha256) == 64
    for schema in (REFINEMENT, moc):  # what OpenAI's strict mode asks of an object
        objects = [
            schema.data,
            *([schema.data["properties"]["items"]["items"]] if schema is REFINEMENT else []),
        ]
        for node in objects:
            assert node["additionalProperties"] is False and set(node["required"]) == set(node["properties"])
    assert '"items"' in load_prompt("refinement", "en").user
    # MoC keeps the paper's Table 6 prompt (separators), so stores and the 135M demo teacher keep
    # working; under a schema-honouring endpoint the grammar makes the answer a {"chunks": [...]}.
    assert '"chunks"' not in load_prompt("moc_chunk", "zh").user


@pytest.mark.parametrize(("mode", "answer", "outcome"), [
    ("json_schema", "json", "valid"),
    ("none", "separators", "repaired"),  # Table 6's own form: read by the fallback
])  # fmt: skip
def test_moc_asks_for_its_chunk_list_under_the_schema(
    tmp_path, capsys, tiny_model_dir, mode, answer, outcome
):
    pieces = [chunk_text(0) + " " + chunk_text(1), chunk_text(2) + " " + chunk_text(3)]
    text = " ".join(pieces)
    reply = json.dumps({"chunks": pieces}) if answer == "json" else "\n—\n".join(pieces)
    documents = tmp_path / "documents.jsonl"
    documents.write_text(json.dumps({"id": "d", "text": text}) + "\n")
    recipe = tmp_path / "moc.yaml"
    block = {
        "model": "loopback",
        "max_tokens": 512,
        "timeout": 5.0,
        "max_retries": 1,
        "structured_output": mode,
    }
    with serve_in_subprocess(replies={"segment": reply}) as server:
        recipe.write_text(json.dumps({
            "task": "moc", "documents": str(documents), "out": str(tmp_path / "run"), "lang": "en",
            "moc_tokenizer": str(tiny_model_dir), "progress": False,
            "teachers": {"moc_chunk": {**block, "base_url": server.base_url}},
        }))  # fmt: skip
        from metachunk.cli import main

        assert main(["distill", "moc", "--config", str(recipe)]) == 0
        stats = server.stats()
        assert main(["distill", "status", "--config", str(recipe)]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "moc.jsonl").read_text().splitlines()]
    (window,) = record["windows"]
    assert [text[c["start"] : c["end"]] for c in record["chunks"]] == pieces
    assert window["answer"]["json_outcomes"] == [outcome]
    carried = stats.get("response_format", {}).get(window["answer"]["request_key"])
    assert carried == (response_format(mode, load_schema("moc_chunk")) if mode != "none" else None)
    meta = json.loads((tmp_path / "run" / "moc.meta.json").read_text())
    assert meta["schema_sha256"] == {"moc_chunk": load_schema("moc_chunk").sha256}
    expected = {"valid": 0, "repaired": 0, "unparseable": 0, outcome: 1}
    assert meta["summary"]["json_answers"] == {"moc_chunk": expected}
    assert (
        f"answers: moc_chunk JSON: valid {expected['valid']}, repaired {expected['repaired']}"
        in capsys.readouterr().out
    )
