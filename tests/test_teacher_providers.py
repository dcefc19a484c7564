"""Teachers as the providers really behave.

Each recipe under ``recipes/distill/providers/`` runs, as shipped but for its base URL, against the
wire-level fake of its provider (``tests/support/providers.py``: refused parameters, stream-only
models, where the reasoning arrives, usage only in a stream's last chunk). Around them: a generic
teacher against the same fakes (the refusal that repeats stops the run within 8 requests, with the
provider's words), the content filter, ``extra_body``, the dry run's request bodies and each
profile's batch path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from metachunk.distill.pipelines import STAGES
from support.distill_jobs import KEY_ENV, cli_env, make_job
from support.fixtures import EMMA_SENTENCES
from support.loopback_server import THINK_TEXT, serve_in_subprocess

from metachunk.providers import PROVIDERS
from metachunk.teacher import Teacher, TeacherConfig

REPO = Path(__file__).resolve().parents[1]
RECIPES = {p.stem: p for p in sorted((REPO / "recipes" / "distill" / "providers").glob("*.yaml"))}
ITEMS = '{"items": [{"missing": "who she is", "supplement": "Emma Woodhouse, the heroine", "score": 9}]}'
REPLIES = {'"score"': ITEMS}  # only the refinement prompt (and its schema) says "score"
SECRET = "sk-provider-SECRET-0987654321"

# recipe -> (its provider, whether the provider returns the model's reasoning, the response_format
# type the refinement is asked with)
EXPECTED = {
    "dashscope_qwq": ("dashscope", True, "json_object"),
    "vllm_qwq": ("vllm", True, "json_schema"),
    "qianfan_ernie": ("qianfan", False, "json_object"),
    "openai_o4mini": ("openai", False, "json_schema"),
    "deepseek_reasoner": ("deepseek", True, "json_object"),
    "sglang_qwen": ("sglang", True, "json_schema"),
}


def chunks(n: int, marker: str = "") -> dict[str, list[str]]:
    return {
        f"c{i}": [f"Passage {i}. {EMMA_SENTENCES[i % len(EMMA_SENTENCES)]} {marker}".strip()]
        for i in range(n)
    }


def shipped_teachers(recipe: Path, base_url: str) -> dict:
    """The recipe's teacher blocks as shipped, pointed at ``base_url``, the key from KEY_ENV."""
    teachers = yaml.safe_load(recipe.read_text(encoding="utf-8"))["teachers"]
    for block in teachers.values():
        block.pop("base_url_env", None)
        block.update(base_url=base_url, api_key_env=KEY_ENV, timeout=10, max_retries=1)
    return teachers


def with_teachers(job, teachers: dict) -> None:
    recipe = yaml.safe_load(job.recipe.read_text(encoding="utf-8"))
    recipe["teachers"] = teachers
    job.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")


def test_there_is_a_recipe_for_each_provider_the_issue_names():
    assert set(RECIPES) == set(EXPECTED)
    for name, path in RECIPES.items():
        for block in yaml.safe_load(path.read_text(encoding="utf-8"))["teachers"].values():
            assert block["provider"] == EXPECTED[name][0]
            # the profile does the rest: no structured_output, no stream, no token-limit field
            assert not {"structured_output", "stream", "max_tokens_field", "refused_params"} & set(block)
    for shipped in ("rewrite.yaml", "summary.yaml"):
        blocks = yaml.safe_load((REPO / "recipes" / "distill" / shipped).read_text(encoding="utf-8"))[
            "teachers"
        ]
        assert all(block.get("provider") in PROVIDERS for block in blocks.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_provider_recipe_works_against_its_provider(tmp_path, monkeypatch, name):
    provider, thinks, fmt = EXPECTED[name]
    monkeypatch.setenv(KEY_ENV, SECRET)
    with serve_in_subprocess(provider=provider, replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, chunks(3))
        with_teachers(job, shipped_teachers(RECIPES[name], server.base_url))
        code = job.main("rewrite")
        stats = server.stats()
        again = job.main("rewrite")
        resent = server.stats()["requests"] - stats["requests"]
    assert code == 0 and again == 0
    assert "400" not in stats["by_outcome"], stats["by_outcome"]  # no request refused for a parameter
    records = job.records()
    assert len(records) == 3 and all(r["status"] == "ok" and r["output"] for r in records)
    entries = [e for r in records for e in r["stages"].values()]
    assert all(e["status"] == "ok" and not e.get("usage_estimated") for e in entries)  # the provider's usage
    assert all(e["reasoning"] == (THINK_TEXT if thinks else "") for e in entries)
    refinement_keys = {r["stages"]["refinement"]["request_key"] for r in records}
    assert {stats["response_format"][k]["type"] for k in refinement_keys} == {fmt}
    streamed = PROVIDERS[provider].settings(job.config().teachers["reflection"].model)["stream"]
    assert stats.get("streams", 0) == (stats["requests"] if streamed else 0)
    assert resent == 0  # a rerun pays nothing
    assert SECRET not in job.records_path.read_text(encoding="utf-8")


# The same models with no provider named: what each fake refuses, and why the run stops.
REFUSED = {
    # DashScope's QwQ without stream: a permanent code, the run stops at the first refusal.
    "dashscope": ({"model": "qwq-32b"}, "This model only support stream mode"),
    # o4-mini with max_tokens: OpenAI's unsupported_parameter, permanent too.
    "openai": ({"model": "o4-mini"}, "Use 'max_completion_tokens' instead"),
    # DeepSeek asked for json_schema: a code that is not permanent, the same refusal 3 times in a row.
    "deepseek": ({"model": "deepseek-chat", "structured_output": "json_schema"}, "This response_format type is unavailable now"),
}  # fmt: skip


@pytest.mark.parametrize("provider", sorted(REFUSED))
def test_a_refusal_that_repeats_stops_the_run_within_8_requests(tmp_path, provider):
    block, message = REFUSED[provider]
    with serve_in_subprocess(provider=provider, replies=REPLIES) as server:
        teacher = {**block, "concurrency": 2, "max_retries": 1}
        # deepseek-chat answers the reflection; the refinement asks for json_schema and is refused
        job = make_job(tmp_path, server.base_url, chunks(20), teacher=teacher)
        done = job.cli("rewrite", env=cli_env())
        stats = server.stats()
    assert done.returncode == 4, done.stderr
    assert message in done.stderr and "refuses the request" in done.stderr and "Traceback" not in done.stderr
    refused = stats["by_outcome"].get("400", 0)
    assert 1 <= refused and refused + 2 <= stats["requests"] + 2 and refused <= 8  # at most 8 refused
    if provider != "deepseek":
        assert stats["requests"] <= 8  # every request of the run, not only the refused ones
    records = job.records()  # written: every chunk, each failed, pending or done
    assert len(records) == 20
    assert {r["status"] for r in records} <= {"ok", "failed", "pending"}
    assert any(r["reason"] == "http_400" for r in records)
    assert job.last_run()["stopped"] == "refused"

    # Named, the provider's profile sends what it takes; the rerun retries the refused requests.
    recipe = yaml.safe_load(job.recipe.read_text(encoding="utf-8"))
    with serve_in_subprocess(provider=provider, replies=REPLIES) as server:
        for stage_block in recipe["teachers"].values():
            stage_block.pop("structured_output", None)
            stage_block.update(provider=provider, base_url=server.base_url)
        job.recipe.write_text(yaml.safe_dump(recipe), encoding="utf-8")
        rerun = job.cli("rewrite", env=cli_env())
        assert rerun.returncode == 0, rerun.stderr
        assert "400" not in server.stats()["by_outcome"]
    assert all(r["status"] == "ok" for r in job.records())


def test_content_filter_is_a_failure_never_an_answer(tmp_path):
    docs = {**chunks(4), "filtered": ["Passage 9. Something the filter cuts. [[fault:filter]]"]}
    with serve_in_subprocess(provider="qianfan", replies=REPLIES) as server:
        job = make_job(
            tmp_path, server.base_url, docs, teacher={"provider": "qianfan", "model": "ernie-3.5-128k"}
        )
        code = job.main("rewrite")
        sent = server.stats()["requests"]
        assert job.main("rewrite") == 0
        assert server.stats()["requests"] == sent  # paid once: the rerun reads it from the store
    assert code == 0  # one of five failed: under --max-failure-rate
    record = job.records_by_doc()["filtered"]
    entry = record["stages"]["reflection"]
    assert record["status"] == "failed" and record["reason"] == "content_filter"
    assert entry["finish_reason"] == "content_filter" and entry["text"] == "" and entry["raw"]
    assert record.get("output") in (None, "")
    assert job.meta()["summary"]["failed_by_stage_reason"] == {"reflection:content_filter": 1}


def test_extra_body_is_sent_and_keyed(tmp_path):
    base = {"model": "m", "max_tokens": 64}
    plain = Teacher(TeacherConfig(**base), None, None, None, None)
    extra = Teacher(
        TeacherConfig(**base, extra_body={"enable_thinking": False, "top_k": 20}), None, None, None, None
    )
    messages = [{"role": "user", "content": "Hello"}]
    body, key = extra.request(messages, "ab" * 32, 0, 64)
    assert body["enable_thinking"] is False and body["top_k"] == 20
    assert key != plain.request(messages, "ab" * 32, 0, 64)[1]
    with pytest.raises(ValueError, match="extra_body"):
        TeacherConfig(**base, extra_body={"max_tokens": 10})

    with serve_in_subprocess(replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, chunks(2), teacher={"extra_body": {"top_k": 20}})
        assert job.main("rewrite") == 0
        first = server.stats()["requests"]
        assert job.main("rewrite") == 0 and server.stats()["requests"] == first  # unchanged: pays nothing
        with_teachers(job, {s: {"model": "loopback", "base_url": server.base_url, "extra_body": {"top_k": 40}}
                            for s in STAGES["rewrite"]})  # fmt: skip
        assert job.main("rewrite") == 0 and server.stats()["requests"] == 2 * first  # changed: pays again


def test_streamed_and_plain_answers_make_the_same_records(tmp_path):
    records = {}
    with serve_in_subprocess(replies=REPLIES, hang_seconds=30) as server:
        for stream in (False, True):
            job = make_job(tmp_path / str(stream), server.base_url, chunks(4), teacher={"stream": stream})
            assert job.main("rewrite") == 0
            records[stream] = job.records()
            # the first run asked for no stream, the second for one a request
            assert server.stats().get("streams", 0) == (server.stats()["requests"] // 2 if stream else 0)
        # A stream that stalls past stream_idle_timeout is abandoned and asked again.
        stalled = make_job(tmp_path / "stall", server.base_url, {"s": ["A stalled one. [[fault:stall*1]]"]},
                           teacher={"stream": True, "stream_idle_timeout": 0.5, "max_retries": 1})  # fmt: skip
        before = server.stats()["requests"]
        started = time.monotonic()
        assert stalled.main("rewrite") == 0
        assert time.monotonic() - started < 10  # each stage stalls once: far less than 30 s
        asked = server.stats()["requests"] - before
        assert asked == 2 * len(STAGES["rewrite"])  # each stage's stalled stream, then its answer
    for plain, streamed in zip(records[False], records[True]):
        for stage in STAGES["rewrite"]:
            a, b = plain["stages"][stage], streamed["stages"][stage]
            # (the loopback bills a token per 4 bytes of the body, stream fields included: prompts differ)
            same = ("text", "reasoning", "finish_reason", "request_key", "status")
            assert [a[k] for k in same] == [b[k] for k in same]
            assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
            assert not a.get("usage_estimated") and not b.get("usage_estimated")


def test_dry_run_prints_each_teachers_provider_and_request_body(tmp_path, capsys):
    with serve_in_subprocess() as server:
        job = make_job(tmp_path, server.base_url, chunks(2))
    for name in ("openai_o4mini", "dashscope_qwq"):
        with_teachers(job, shipped_teachers(RECIPES[name], "http://127.0.0.1:9/v1"))
        assert job.main("rewrite", "--dry-run") == 0
        out = capsys.readouterr().out
        provider = EXPECTED[name][0]
        assert f"reflection: provider {provider}" in out
        if provider == "openai":
            assert '"max_completion_tokens": 4096' in out and '"temperature"' not in out
            assert '"reasoning_effort": "medium"' in out
            # refinement waits on the reflection's answer: its body is shown around a placeholder
            assert "refinement: provider openai" in out and '"type": "json_schema"' in out
        else:
            assert '"stream": true' in out and '"include_usage": true' in out and "streamed" in out


def test_profiles_fill_what_the_recipe_leaves_unset():
    ernie = TeacherConfig(provider="qianfan", model="ernie-3.5-128k", mode="batch")
    assert (ernie.batch_endpoint, ernie.batch_max_requests, ernie.structured_output) == (
        "/v2/chat/completions", 5000, "json_object")  # fmt: skip
    assert TeacherConfig(provider="qianfan", model="e", batch_max_requests=100).batch_max_requests == 100
    o4 = TeacherConfig(provider="openai", model="o4-mini", temperature=0.3, top_p=0.9, seed=1)
    assert o4.max_tokens_field == "max_completion_tokens" and o4.generation_params() == {"seed": 1}
    assert TeacherConfig(provider="openai", model="gpt-4.1", temperature=0.3).generation_params() == {
        "temperature": 0.3
    }
    assert TeacherConfig(provider="dashscope", model="qwq-plus").stream is True
    assert TeacherConfig(provider="dashscope", model="qwen-plus").stream is False
    assert TeacherConfig(provider="dashscope", model="qwq-32b", stream=False).stream is False  # explicit wins
    generic = TeacherConfig(model="m")
    assert (generic.structured_output, generic.stream, generic.max_tokens_field) == (
        "none",
        False,
        "max_tokens",
    )
    with pytest.raises(ValueError, match="no Batch API"):
        TeacherConfig(provider="deepseek", model="deepseek-chat", mode="batch")
    with pytest.raises(ValueError, match="provider"):
        TeacherConfig(provider="anthropic", model="m")


def test_batch_lines_take_the_profiles_path_and_never_stream(tmp_path):
    with serve_in_subprocess(replies=REPLIES) as server:
        job = make_job(tmp_path, server.base_url, chunks(2))
    lines = {}
    for provider, model in (("qianfan", "ernie-3.5-128k"), ("dashscope", "qwq-plus")):
        teachers = {s: {"provider": provider, "model": model, "base_url": "http://127.0.0.1:9/v1", "mode": "batch"}
                    for s in STAGES["rewrite"]}  # fmt: skip
        with_teachers(job, teachers)
        out = tmp_path / f"{provider}.jsonl"
        assert job.main("rewrite", "--export-batch", str(out)) == 0
        lines[provider] = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert {x["url"] for x in lines["qianfan"]} == {"/v2/chat/completions"}
    assert {x["url"] for x in lines["dashscope"]} == {"/v1/chat/completions"}
    assert not any("stream" in x["body"] for x in lines["dashscope"])  # QwQ streams online, not in a batch
