"""LumberChunker (``chunk --method lumber``) against the loopback OpenAI-compatible server.

The server's scripted replies pick the answer by the window's first numbered unit (the line after
``Document:`` / ``文档：``), so each test knows where every cut must land. Checked: cuts where the
answers say, exact offsets that tile the document (en and zh), fallbacks for unusable answers (no
ID, an ID not after the window's first, an ID past the window, a failed request) counted by
reason, retries, the budget stop, a rerun that sends nothing, and the CLI path with its manifest.
"""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path

import pytest
import yaml
from metachunk.chunking.lumber import (
    LumberOptions,
    judge,
    last_unit_in_window,
    load_lumber_prompt,
    lumber_token_estimate,
    make_units,
    parse_answer,
    resolve_teacher,
    unit_line,
)
from metachunk.chunking.pipeline import ChunkConfig, Chunker
from metachunk.chunking.sentences import split_sentences
from support.data import data_file
from support.loopback_server import serve_in_subprocess

from metachunk.artifacts import read_run_log
from metachunk.cli import main as metachunk
from metachunk.config import load_yaml

# English paragraphs (blank lines, one of them CRLF, odd whitespace) -> paragraph units.
EN_PARAS = [
    "Amber light fell on the orchard. The apples were ripe.",
    "Beryl walked along the river bank. She counted the boats.",
    "Coral reefs lay far away from here. Nobody had seen one.",
    "Dune grass covered the northern hills. Wind shaped it daily.",
    "Ember glowed in the blacksmith's forge. He hammered all night.",
    "Fjord water was cold and very deep. Ships moved slowly there.",
    "Grove owls called out after sunset. The village slept.",
    "Heath fires were rare in that wet county.",
]
EN_DOC = (
    "  "
    + "\n\n".join(EN_PARAS[:3])
    + "\r\n\r\n"
    + "\n \n".join(EN_PARAS[3:6])
    + "\n\n\n"
    + "\n\n".join(EN_PARAS[6:])
    + "\n"
)
# Chinese without blank lines -> sentence units.
ZH_SENTENCES = [
    "春天来了，花园里开满了鲜花。",
    "孩子们在草地上放风筝。",
    "夏天的雨水很多，河水上涨。",
    "农民们忙着修补堤坝。",
    "秋天的稻田一片金黄。",
    "冬天终于下起了大雪！",
]
ZH_DOC = "".join(ZH_SENTENCES)
# English sentences of 6 words: each unit line is 8 words -> 10 estimated tokens; a budget of 30
# makes windows of exactly 3 units.
FALLBACK_SENTENCES = [
    "Quartz stones sit on the shelf.",
    "Ruby glasses shine in the cupboard.",
    "Slate roofs cover the old houses.",
    "Topaz rings lie in a box.",
    "Umber paint dries on the wall.",
    "Violet flowers grow by the gate.",
    "Wheat fields wave in the breeze.",
    "Xenon lamps light the long hall.",
    "Yarrow herbs hang in the kitchen.",
]
FALLBACK_DOC = " ".join(FALLBACK_SENTENCES)
# Structured answers ({"id": n}), 6-word sentences again: windows of 3 units at a budget of 30.
STRUCTURED_SENTENCES = [
    "Agate beads lie on the table.",
    "Basalt cliffs rise above the sea.",
    "Chalk lines mark the school yard.",
    "Dolomite hills stand to the east.",
    "Emerald moss grows on the stones.",
    "Flint tools rest in the museum.",
    "Garnet seeds fill the red fruit.",
]
STRUCTURED_DOC = " ".join(STRUCTURED_SENTENCES)
FAILING_DOC = "Zinc plates rust in the rain. Zinc roofs are noisy [[fault:500]]."

REPLIES = {
    # en: window 0 -> cut at 3; window 3 -> cut at 5 (bare "ID: n"); window 5 -> no ID: fallback
    r"Document:\nID 0: Amber": "Answer: ID 3",
    r"Document:\nID 3: Dune": "ID: 5",
    r"Document:\nID 5: Fjord": "The passage does not change.",
    # zh: cuts at 2, 4, 5; the last unit is left alone (no window)
    "文档：\nID 0: 春天": "答案：ID 2",
    "文档：\nID 2: 夏天": "ID 4",
    "文档：\nID 4: 秋天": "<think>看一下。</think>答案：ID 5",
    # fallbacks: an ID at the window's first, an ID past the window, no ID
    r"Document:\nID 0: Quartz": "Answer: ID 0",
    r"Document:\nID 3: Topaz": "Answer: ID 42",
    r"Document:\nID 6: Wheat": "I am not sure.",
    # structured: valid, valid but past the window (fallback), text from a server that ignored the schema
    r"Document:\nID 0: Agate": '{"id": 2}',
    r"Document:\nID 2: Chalk": '{"id": 9}',
    r"Document:\nID 5: Flint": "Answer: ID 6",
}


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def server():
    with serve_in_subprocess(replies=REPLIES) as handle:
        yield handle


def teacher_block(server) -> dict:
    return {
        "model": "loopback-teacher",
        "base_url": server.base_url,
        "temperature": 0.1,
        "max_tokens": 16,
        "max_retries": 0,
        "timeout": 10,
        "concurrency": 4,
    }


PRICES = {"loopback-teacher": {"input": 1.0, "output": 2.0}}


def make_cfg(server, tmp_path: Path, **lumber) -> ChunkConfig:
    return ChunkConfig(
        input=tmp_path / "docs.jsonl",
        output=tmp_path / "chunks.jsonl",
        method="lumber",
        lumber=LumberOptions(teachers={"lumber": teacher_block(server)}, prices=PRICES, **lumber),
    )


def run_lumber(cfg: ChunkConfig, docs: dict[str, str]):
    chunker = Chunker(cfg, progress=False)
    assert chunker.own_progress
    try:
        out = chunker.chunk(list(docs), list(docs.values()))
    finally:
        chunker.close()
    return out, chunker.manifest()["lumber"]


def assert_tiles(text: str, chunks) -> None:
    spans = [
        (c["start"], c["end"], c["text"]) if isinstance(c, dict) else (c.start, c.end, c.text) for c in chunks
    ]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert end == start
    for start, end, chunk_text in spans:
        assert chunk_text == text[start:end] and chunk_text.strip()


def unit_starts(text: str, budget: int = 550) -> list[int]:
    units, _ = make_units(text, split_sentences(text), budget)
    return [u.start for u in units]


# ------------------------------------------------------------------------------------ pure parts


def test_units_paragraphs_sentences_and_oversized_paragraphs():
    units, kind = make_units(EN_DOC, split_sentences(EN_DOC), 550)
    assert kind == "paragraph" and len(units) == len(EN_PARAS)
    assert [EN_DOC[u.start : u.end].strip() for u in units] == EN_PARAS
    assert units[0].start == 0 and units[-1].end == len(EN_DOC)
    assert all(a.end == b.start for a, b in zip(units, units[1:]))
    # A paragraph over the budget is replaced by its sentences.
    units, kind = make_units(EN_DOC, split_sentences(EN_DOC), 5)
    assert kind == "paragraph" and len(units) == 2 * len(EN_PARAS) - 1  # the last paragraph is one sentence
    units, kind = make_units(ZH_DOC, split_sentences(ZH_DOC), 550)
    assert kind == "sentence" and [ZH_DOC[u.start : u.end] for u in units] == ZH_SENTENCES
    assert make_units("", [], 550) == ([], "sentence")


def test_token_estimate_window_and_answer_parsing():
    assert lumber_token_estimate("ID 0: Quartz stones sit on the shelf.") == 10  # 8 words x 1.2
    assert lumber_token_estimate("ID 1: 春天来了。") == 4 + round(
        1.2 * 3
    )  # 4 CJK characters; "ID", "1:", "。"
    assert last_unit_in_window([10] * 9, 0, 30) == 2 and last_unit_in_window([10] * 9, 6, 30) == 8
    assert last_unit_in_window([10] * 9, 7, 1000) == 8
    assert last_unit_in_window([900, 900, 900], 0, 550) == 1  # at least two units, even over the budget
    assert unit_line("a\n b  c", make_units("a\n b  c", split_sentences("a\n b  c"), 9)[0][0], 7).startswith(
        "ID 7: a"
    )
    for answer, expected in [
        ("Answer: ID 5", 5),
        ("ID: 5", 5),
        ("答案：ID 12", 12),
        ("**Answer:** ID 7", 7),
        ("The answer is ID 9.", 9),
        ("Answer: 3", 3),
        ("4", 4),
        ("no shift here", None),
        ("", None),
    ]:
        assert parse_answer(answer) == expected, answer
    assert [judge(x, 3, 6) for x in (None, 2, 3, 4, 6, 7)] == [
        "no_id", "not_after_first", "not_after_first", "ok", "ok", "out_of_window",
    ]  # fmt: skip
    for lang in ("en", "zh"):
        prompt = load_lumber_prompt(lang)
        assert "{document}" in prompt.user and len(prompt.sha256) == 64


@pytest.mark.parametrize(
    "recipe",
    sorted((Path(__file__).resolve().parents[1] / "recipes" / "chunk").glob("lumber_*.yaml")),
    ids=lambda p: p.name,
)
def test_lumber_recipes_name_a_valid_teacher(recipe):
    cfg = ChunkConfig(**load_yaml(ChunkConfig, recipe))
    assert cfg.method == "lumber"
    _, teacher, prices = resolve_teacher(cfg.lumber)
    assert teacher.model and (teacher.api_key_env is None or teacher.api_key_env.isupper())
    assert all(teacher.model == name for name in prices)


# --------------------------------------------------------------------------- against the server


def test_cuts_land_where_the_answers_say_en_and_zh(server, tmp_path):
    cfg = make_cfg(server, tmp_path)
    out, meta = run_lumber(cfg, {"en": EN_DOC, "zh": ZH_DOC})
    en, zh = out
    starts = unit_starts(EN_DOC)
    assert [c.start for c in en.chunks] == [starts[0], starts[3], starts[5]]
    assert_tiles(EN_DOC, en.chunks)
    assert [c.text for c in zh.chunks] == [
        "".join(ZH_SENTENCES[0:2]), "".join(ZH_SENTENCES[2:4]), ZH_SENTENCES[4], ZH_SENTENCES[5],
    ]  # fmt: skip
    assert_tiles(ZH_DOC, zh.chunks)
    assert (en.lang, zh.lang) == ("en", "zh")
    # en: 3 windows (the last falls back: no ID), zh: 3 windows
    assert meta["windows"] == 6 and meta["requests"] == 6 and meta["requests_sent"] == 6
    assert meta["answers_from_store"] == 0
    assert meta["fallbacks"] == {"total": 1, "no_id": 1}
    assert meta["documents_by_unit"] == {"paragraph": 1, "sentence": 1}
    assert meta["prompt_tokens"] > 0 and meta["cost"] > 0 and meta["cost_paid"] == meta["cost"]


def test_unusable_answers_fall_back_at_the_window_end_and_are_counted(server, tmp_path):
    cfg = make_cfg(server, tmp_path, tokens=30)
    (doc,), meta = run_lumber(cfg, {"f": FALLBACK_DOC})
    starts = unit_starts(FALLBACK_DOC, 30)
    assert len(starts) == 9
    assert [c.start for c in doc.chunks] == [starts[0], starts[3], starts[6]]
    assert_tiles(FALLBACK_DOC, doc.chunks)
    assert meta["fallbacks"] == {"total": 3, "no_id": 1, "not_after_first": 1, "out_of_window": 1}
    assert meta["windows"] == 3 and meta["retries"] == 0

    # --lumber-retries 1: each window is asked once more (a new request), then falls back the same way.
    cfg = make_cfg(server, tmp_path, tokens=30, retries=1)
    (again,), meta = run_lumber(cfg, {"f": FALLBACK_DOC})
    assert again.chunks == doc.chunks
    assert meta["requests"] == 6 and meta["retries"] == 3 and meta["requests_sent"] == 3
    assert meta["answers_from_store"] == 3 and meta["fallbacks"]["total"] == 3


def test_structured_output_asks_each_window_for_an_id_it_holds(server, tmp_path):
    cfg = make_cfg(server, tmp_path, tokens=30)
    cfg.lumber.teachers["lumber"]["structured_output"] = "json_schema"
    (doc,), meta = run_lumber(cfg, {"s": STRUCTURED_DOC})
    starts = unit_starts(STRUCTURED_DOC, 30)
    assert [c.start for c in doc.chunks] == [starts[0], starts[2], starts[5], starts[6]]
    assert_tiles(STRUCTURED_DOC, doc.chunks)
    assert meta["structured_output"] == "json_schema" and len(meta["schema_sha256"]) == 64
    assert meta["answers"] == {"valid": 2, "repaired": 1, "unparseable": 0}
    assert meta["fallbacks"] == {"total": 1, "out_of_window": 1}
    # Each request carried OpenAI's json_schema form, its id narrowed to the window's later IDs.
    formats = [f for f in server.stats()["response_format"].values() if f["json_schema"]["name"] == "lumber"]
    enums = sorted(f["json_schema"]["schema"]["properties"]["id"]["enum"] for f in formats)
    assert enums == [[1, 2], [3, 4], [6]]
    assert all(f["type"] == "json_schema" and f["json_schema"]["strict"] for f in formats)

    # With a target length the teacher's chunks are merged up to it, from the stored answers.
    cfg.target_len, cfg.len_unit = 70, "char"
    (merged,), meta = run_lumber(cfg, {"s": STRUCTURED_DOC})
    assert meta["requests_sent"] == 0 and meta["answers_from_store"] == 3
    assert_tiles(STRUCTURED_DOC, merged.chunks)
    assert len(merged.chunks) < len(doc.chunks)
    assert {c.start for c in merged.chunks} <= {c.start for c in doc.chunks}


def test_a_failed_request_falls_back(server, tmp_path):
    cfg = make_cfg(server, tmp_path)
    (doc,), meta = run_lumber(cfg, {"z": FAILING_DOC})
    assert [c.text for c in doc.chunks] == [FAILING_DOC]
    assert meta["fallbacks"] == {"total": 1, "teacher_http_500": 1}


def test_budget_stop_is_an_error_and_keeps_the_output(server, tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": "en", "text": EN_DOC}) + "\n", encoding="utf-8")
    out = tmp_path / "chunks.jsonl"
    out.write_text("previous\n", encoding="utf-8")
    recipe = tmp_path / "lumber.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"teachers": {"lumber": teacher_block(server)}, "prices": {"loopback-teacher": {"input": 1e6}}}
        ),
        encoding="utf-8",
    )
    code = metachunk(["chunk", str(tmp_path / "docs.jsonl"), "-o", str(out), "--method", "lumber",
                      "--config", str(recipe), "--lumber-max-cost", "0.5"])  # fmt: skip
    assert code == 2
    assert "passes --lumber-max-cost 0.5" in capsys.readouterr().err  # the budget's stop, not another error
    assert out.read_text(encoding="utf-8") == "previous\n"


def test_cli_chunk_method_lumber_and_a_rerun_sends_nothing(server, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n"
            for i, t in [("en", EN_DOC), ("zh", ZH_DOC)]
        ),
        encoding="utf-8",
    )
    out = tmp_path / "out" / "lumber.jsonl"
    recipe = tmp_path / "lumber.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"teachers": {"lumber": teacher_block(server)}, "prices": PRICES, "emit_sentences": True}
        ),
        encoding="utf-8",
    )
    argv = ["chunk", str(docs), "-o", str(out), "--method", "lumber", "--config", str(recipe)]
    before = server.stats()["requests"]
    assert metachunk(argv) == 0
    assert server.stats()["requests"] - before == 6
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["method"] for r in records] == ["lumber", "lumber"]
    for record, text in zip(records, (EN_DOC, ZH_DOC)):
        assert_tiles(text, record["chunks"])
        assert record["sentences"][-1]["end"] == len(text)
    assert len(records[0]["chunks"]) == 3 and len(records[1]["chunks"]) == 4
    meta = json.loads(out.with_suffix(".meta.json").read_text(encoding="utf-8"))
    assert meta["prompt_sha256"] == {
        "lumber.en": load_lumber_prompt("en").sha256,
        "lumber.zh": load_lumber_prompt("zh").sha256,
    }
    lumber = read_run_log(out)[-1]["workers_report"][0]["lumber"]  # how the run went
    assert "lumber" not in meta and "seconds" not in meta["summary"]  # a rerun writes the same meta
    assert lumber["answer_store"] == str(out.parent / "answers.sqlite")
    assert (lumber["windows"], lumber["requests_sent"], lumber["answers_from_store"]) == (6, 6, 0)
    assert lumber["fallbacks"]["total"] == 1 and lumber["cost_paid"] > 0
    assert lumber["teacher"]["model"] == "loopback-teacher" and lumber["token_budget"] == 550
    assert "lumber (loopback-teacher): 6 windows, 6 requests sent" in capsys.readouterr().err

    # The rerun reads every answer from the store: nothing reaches the server, same chunks.
    first_output = out.read_text(encoding="utf-8")
    assert metachunk(argv) == 0
    assert server.stats()["requests"] - before == 6
    assert out.read_text(encoding="utf-8") == first_output
    assert json.loads(out.with_suffix(".meta.json").read_text(encoding="utf-8")) == meta
    lumber = read_run_log(out)[-1]["workers_report"][0]["lumber"]
    assert (lumber["requests_sent"], lumber["answers_from_store"], lumber["cost_paid"]) == (0, 6, 0)
    assert lumber["cost"] > 0  # what the chunking cost, read from the store


def test_lumber_into_a_folder_of_shards_resumes_and_pays_nothing_twice(server, tmp_path, capsys):
    """`chunk -o DIR --method lumber`: shard by shard, with the file run's records; a lost shard is
    redone from the answer store, sending nothing."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n"
                            for i, t in [("en", EN_DOC), ("zh", ZH_DOC)]), encoding="utf-8")  # fmt: skip
    recipe = tmp_path / "lumber.yaml"
    recipe.write_text(yaml.safe_dump({"teachers": {"lumber": teacher_block(server)}, "prices": PRICES}),
                      encoding="utf-8")  # fmt: skip
    argv = ["chunk", str(docs), "--method", "lumber", "--config", str(recipe), "--lumber-cache",
            str(tmp_path / "answers.sqlite")]  # fmt: skip
    before = server.stats()["requests"]
    assert metachunk([*argv, "-o", str(tmp_path / "one.jsonl")]) == 0
    sent = server.stats()["requests"] - before
    assert sent == 6

    folder = tmp_path / "dir"
    assert metachunk([*argv, "-o", str(folder), "--shards", "2"]) == 0
    shards = sorted(folder.glob("train-*.jsonl"))
    assert b"".join(p.read_bytes() for p in shards) == (tmp_path / "one.jsonl").read_bytes()
    assert server.stats()["requests"] - before == sent  # the same requests: answered by the store
    manifest = json.loads((folder / "manifest.json").read_text())
    lumber = read_run_log(folder)[-1]["workers_report"][0]["lumber"]
    assert (lumber["requests_sent"], lumber["answers_from_store"]) == (0, 6)
    assert set(manifest["prompt_sha256"]) == {"chunking/prompts/lumber.en.txt", "chunking/prompts/lumber.zh.txt",
                                              "chunking/prompts/lumber.schema.json"}  # fmt: skip

    first = {p.name: p.read_bytes() for p in shards}
    shards[0].unlink()
    capsys.readouterr()
    assert metachunk([*argv, "-o", str(folder), "--shards", "2"]) == 0
    assert "resuming: 1 of 2 shards done" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in sorted(folder.glob("train-*.jsonl"))} == first
    assert server.stats()["requests"] - before == sent


def test_the_python_lumberchunker_cuts_as_the_cli_does(server, tmp_path):
    """`metachunk.LumberChunker(teacher_block)`: the same cuts as `chunk --method lumber`; with the
    same answer store, the second of them sends nothing."""
    from metachunk import LumberChunker

    store = tmp_path / "answers.sqlite"
    before = server.stats()["requests"]
    with LumberChunker(teacher_block(server), prices=PRICES, cache=store) as chunker:
        chunks = chunker.chunk_batch([EN_DOC, ZH_DOC])
    sent = server.stats()["requests"] - before
    assert sent == 6
    for text, cs in zip((EN_DOC, ZH_DOC), chunks):
        assert_tiles(text, [c.to_json() for c in cs])
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n"
                            for i, t in [("en", EN_DOC), ("zh", ZH_DOC)]), encoding="utf-8")  # fmt: skip
    recipe = tmp_path / "lumber.yaml"
    recipe.write_text(yaml.safe_dump({"teachers": {"lumber": teacher_block(server)}, "prices": PRICES}))
    out = tmp_path / "cli.jsonl"
    argv = [
        "chunk",
        str(docs),
        "-o",
        str(out),
        "--method",
        "lumber",
        "--config",
        str(recipe),
        "--lumber-cache",
        str(store),
    ]
    assert metachunk(argv) == 0
    assert server.stats()["requests"] - before == sent
    cli = [r["chunks"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())]
    assert cli == [[c.to_json() for c in cs] for cs in chunks]

    # A TeacherConfig, or a Teacher (its config and its answer store): the same answers, none sent.
    from metachunk.store import AnswerStore
    from metachunk.teacher import TeacherConfig, TeacherPool

    cfg = TeacherConfig(**teacher_block(server))
    pool = TeacherPool({"lumber": cfg}, {}, AnswerStore(store), None, offline=True)
    for teacher in (cfg, pool.stages["lumber"]):
        extra = {"cache": store} if teacher is cfg else {}
        with LumberChunker(teacher, prices=PRICES, **extra) as again:
            assert again.chunk_batch([EN_DOC, ZH_DOC]) == chunks
    assert server.stats()["requests"] - before == sent


def test_teacher_from_a_distill_recipe_and_config_errors(server, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "zh", "text": ZH_DOC}, ensure_ascii=False) + "\n", encoding="utf-8")
    distill_recipe = tmp_path / "distill.yaml"
    distill_recipe.write_text(
        yaml.safe_dump(
            {
                "chunks": "c.jsonl",
                "documents": "d.jsonl",
                "out": "run",
                "lang": "zh",
                "teachers": {"summary_local": teacher_block(server)},
            }
        ),
        encoding="utf-8",
    )
    out = tmp_path / "zh.jsonl"
    base = ["chunk", str(docs), "-o", str(out), "--method", "lumber", "--teacher-config", str(distill_recipe)]
    assert metachunk([*base, "--lumber-teacher", "summary_local"]) == 0
    assert len(json.loads(out.read_text(encoding="utf-8"))["chunks"]) == 4

    capsys.readouterr()
    assert metachunk(base) == 2  # no block named 'lumber'
    assert "no teacher block 'lumber'" in capsys.readouterr().err
    assert metachunk(["chunk", str(docs), "-o", str(out), "--method", "lumber"]) == 2
    assert "needs a teacher" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"teachers": {"lumber": {"base_url": server.base_url}}}), encoding="utf-8")
    assert metachunk(["chunk", str(docs), "-o", str(out), "--method", "lumber", "--config", str(bad)]) == 2
    assert "'model' is required" in capsys.readouterr().err


# -------------------------------------------------------------------------- the real local teacher


@pytest.mark.integration
def test_against_the_local_smollm2_teacher(tmp_path):
    from metachunk.local_teacher import LocalTeacher
    from metachunk.models import ModelNotFoundError

    try:
        teacher = LocalTeacher("smollm2", threads=1)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    paragraphs = []
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        for line, _ in zip(f, range(8)):
            paragraphs.append(json.loads(line)["text"])
    text = "\n\n".join(paragraphs)
    docs = tmp_path / "emma.jsonl"
    docs.write_text(json.dumps({"id": "emma", "text": text}) + "\n", encoding="utf-8")
    out = tmp_path / "emma_lumber.jsonl"
    with teacher:
        block = {"model": "smollm2", "serve_preset": True, "base_url": teacher.base_url, "max_tokens": 24,
                 "stop": ["\n\n"], "concurrency": 1, "timeout": 300, "max_retries": 1}  # fmt: skip
        recipe = tmp_path / "lumber.yaml"
        recipe.write_text(
            yaml.safe_dump({"teachers": {"lumber": block}, "lumber_tokens": 300}), encoding="utf-8"
        )
        argv = ["chunk", str(docs), "-o", str(out), "--method", "lumber", "--config", str(recipe)]
        assert metachunk(argv) == 0
        lumber = read_run_log(out)[-1]["workers_report"][0]["lumber"]
        assert lumber["requests_sent"] >= 1 and lumber["completion_tokens"] > 0
        assert_tiles(text, json.loads(out.read_text(encoding="utf-8"))["chunks"])
        assert metachunk(argv) == 0  # the rerun pays nothing
        lumber = read_run_log(out)[-1]["workers_report"][0]["lumber"]
        assert lumber["requests_sent"] == 0 and lumber["answers_from_store"] >= 1
