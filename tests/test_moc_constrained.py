"""Constrained decoding of the MoC experts (chunking/moc_grammar.py, --moc-constrained): the answer schema
file, xgrammar's logits processor on a random tiny model (every answer that ends parses, an answer
the budget cuts is truncated, never invalid JSON), the free-decoding path of --no-moc-constrained,
and what the run's meta (its config) and run log (the `moc` block) record."""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path

import metachunk.chunking.moc as moc_module
import pytest
from metachunk.chunking.moc import FAILURES, MocChunker, MocOptions, expert_messages
from metachunk.chunking.moc_answers import parse_expert_answer
from metachunk.chunking.moc_grammar import expert_schema, load_moc_schema
from metachunk.chunking.sentences import split_sentences

from metachunk.artifacts import read_run_log
from metachunk.cli import main
from metachunk.models import ModelNotFoundError
from metachunk.prompts import parse_schema

ZH = "今天上午，市政府召开新闻发布会。会议介绍了今年的城市建设计划。市民对此反应积极。"


def long_doc(k: int = 12) -> str:
    return " ".join(f"Sentence number {i} talks about topic {i // 3} in some detail." for i in range(k))


TEXTS = [long_doc(), ZH, "One sentence only."]
LANGS = ["en", "zh", "en"]


def chunker(model_dir, seed: int = 0, batch_size: int = 8, **kw) -> MocChunker:
    """A MoC chunker whose router and experts are all ``model_dir``; ``kw``: its MocOptions."""
    d = str(model_dir)
    kw = {"max_new_tokens": 64, "window_chars": 200, "retries": 0, **kw}
    return MocChunker(MocOptions(router=d, experts=",".join([d] * 4), **kw), seed=seed, batch_size=batch_size)


def run(moc: MocChunker, texts=TEXTS, langs=LANGS) -> dict:
    sentences = [split_sentences(t, lang) for t, lang in zip(texts, langs)]
    out = moc.chunk_documents(texts, langs, sentences)
    for spans, text in zip(out, texts):
        assert "".join(text[a:b] for a, b in spans) == text
    return moc.manifest()


def test_schema_file_is_versioned_beside_the_prompts():
    schema = load_moc_schema()
    raw = (files("metachunk.chunking") / "prompts" / "moc_expert.schema.json").read_bytes()
    assert schema.sha256 == hashlib.sha256(raw).hexdigest()
    assert schema.data["type"] == "array" and schema.data["items"] == {"type": "string"}
    assert schema.data["minItems"] == 1
    bounded = expert_schema(3)
    assert bounded["maxItems"] == 3 and "maxItems" not in load_moc_schema().data
    assert expert_schema(0)["maxItems"] == 1  # never below minItems
    with pytest.raises(ValueError, match="object at its root"):  # a teacher's schema still must be an object
        parse_schema("moc_expert", raw, "moc_expert.schema.json")


def test_constrained_answers_always_parse(tiny_model_dir):
    """A random tiny model, held to the schema: every answer ends with the array's `]` and then a
    stop token, parses as a JSON list of strings written as json.dumps writes it, and has at most
    one item per sentence of its window. Its items quote nothing of the text: every failure is a
    recovery failure, none is invalid JSON or truncated."""
    moc = chunker(tiny_model_dir)
    m = run(moc)
    assert m["windows"] >= 5
    assert m["invalid_json"] == 0 and m["truncated_answers"] == 0
    assert m["unrecovered_answers"] == m["windows"] == m["expert_attempts"]
    assert m["fallback"]["windows"] == m["windows"]
    assert m["fallback"]["causes"] == {"invalid_json": 0, "truncated": 0, "unrecovered": m["windows"]}
    c = m["constrained"]
    assert c["enabled"] and c["library"] == "xgrammar" and c["version"] == version("xgrammar")
    assert c["mask_steps"] > 0 and c["mask_rows"] >= c["mask_steps"] and c["mask_seconds"] > 0
    assert m["schema_sha256"] == {"moc_expert": load_moc_schema().sha256}

    lm = moc.lm(moc.expert_paths[0])
    bounds = [3, 2, 1]
    answers = moc.generate(lm, [expert_messages(t, lang) for t, lang in zip(TEXTS, LANGS)], 0, bounds)
    for answer, bound in zip(answers, bounds):
        assert answer.stopped and answer.new_tokens < 64  # the stop token came right after `]`
        value = json.loads(answer.text)
        assert isinstance(value, list) and 1 <= len(value) <= bound
        assert all(isinstance(x, str) for x in value)
        assert answer.text == json.dumps(value, ensure_ascii=False)  # the form the experts are trained on
        assert parse_expert_answer(answer.text) == value


@pytest.mark.parametrize("temperature", [0.1, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_invalid_json_at_any_temperature(tiny_model_dir, temperature, seed):
    """Sampling hotter, the random model writes long strings the budget cuts: those are truncated
    (length failures); an answer that stops always parses."""
    moc = chunker(tiny_model_dir, max_new_tokens=24, temperature=temperature, top_p=1.0, seed=seed)
    lm = moc.lm(moc.expert_paths[0])
    answers = moc.generate(lm, [expert_messages(t, lang) for t, lang in zip(TEXTS, LANGS)], 0, [4, 3, 1])
    for answer in answers:
        assert answer.text.startswith("[")
        if answer.stopped:
            assert parse_expert_answer(answer.text) is not None
        else:
            assert answer.new_tokens == 24
    m = run(moc)
    assert m["invalid_json"] == 0
    assert m["truncated_answers"] + m["unrecovered_answers"] == m["expert_attempts"]


def test_budget_cut_is_truncated_not_invalid_json(tiny_model_dir):
    """Three tokens are too few to close any array: every answer is truncated, retried, and the
    fallbacks say why."""
    moc = chunker(tiny_model_dir, max_new_tokens=3, retries=1)
    m = run(moc)
    assert m["truncated_answers"] == m["expert_attempts"] == 2 * m["windows"]
    assert m["invalid_json"] == 0 and m["unrecovered_answers"] == 0 and m["retried"] == m["windows"]
    assert m["fallback"]["causes"] == {"invalid_json": 0, "truncated": m["windows"], "unrecovered": 0}
    assert set(m["fallback"]["causes"]) == set(FAILURES)
    assert "truncated" in moc.summary_line() and "constrained by xgrammar" in moc.summary_line()


def test_no_moc_constrained_decodes_freely(tiny_model_dir, monkeypatch):
    """--no-moc-constrained: no logits processor, no xgrammar needed; the old lenient parse."""
    seen = []
    real = moc_module.generate_batched

    def spy(*args, **kw):
        seen.append(kw.get("logits_processor"))
        return real(*args, **kw)

    monkeypatch.setattr(moc_module, "generate_batched", spy)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` fails
    moc = chunker(tiny_model_dir, constrained=False, max_new_tokens=8)
    m = run(moc)
    assert seen and all(p is None for p in seen)
    assert m["constrained"] == {"enabled": False, "library": None, "version": None, "anchored": False}
    assert m["truncated_answers"] + m["invalid_json"] + m["unrecovered_answers"] == m["expert_attempts"]
    assert "unconstrained" in moc.summary_line()
    with pytest.raises(ModelNotFoundError, match="--no-moc-constrained"):
        chunker(tiny_model_dir)


def test_constrained_generate_gets_one_processor_per_batch(tiny_model_dir, monkeypatch):
    seen = []
    real = moc_module.generate_batched

    def spy(*args, **kw):
        make = kw["logits_processor"]

        def record(batch):
            processors = make(batch)
            seen.append((list(batch), processors))
            return processors

        return real(*args, **{**kw, "logits_processor": record})

    monkeypatch.setattr(moc_module, "generate_batched", spy)
    moc = chunker(tiny_model_dir, batch_size=2)
    lm = moc.lm(moc.expert_paths[0])
    moc.generate(lm, [expert_messages(t, lang) for t, lang in zip(TEXTS, LANGS)], 0, [4, 3, 1])
    assert sorted(i for batch, _ in seen for i in batch) == [0, 1, 2]
    assert len(seen) == 2 and all(len(p) == 1 for _, p in seen)
    processors = [p[0] for _, p in seen]
    assert len({id(p) for p in processors}) == 2  # a fresh processor (fresh matchers) per generate call
    for batch, (p,) in seen:
        assert len(p.compiled_grammars) == len(batch)


def _moc_argv(tmp_path, tiny_model_dir) -> tuple[str, Path, list[str]]:
    """(model dir, output path, `metachunk chunk --method moc` argv) over TEXTS, written to tmp_path."""
    d = str(tiny_model_dir)
    src = tmp_path / "docs.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(TEXTS)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "moc.jsonl"
    return (
        d,
        out,
        ["chunk", str(src), "-o", str(out), "--method", "moc", "--router", d, "--experts", ",".join([d] * 4)],
    )


@pytest.mark.parametrize("flag", [None, "--moc-constrained", "--no-moc-constrained"])
def test_cli_records_the_flag(tmp_path, tiny_model_dir, capsys, flag):
    d, out, argv = _moc_argv(tmp_path, tiny_model_dir)
    argv += ["--moc-max-new-tokens", "32", "--moc-retries", "0", "--moc-window-chars", "200"]
    rc = main([*argv, *([flag] if flag else [])])
    err = capsys.readouterr().err
    assert rc == 0, err
    on = flag != "--no-moc-constrained"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert ["".join(c["text"] for c in r["chunks"]) for r in records] == TEXTS
    meta = json.loads(Path(str(out).replace(".jsonl", ".meta.json")).read_text())
    assert meta["config"]["moc_constrained"] is on
    moc = read_run_log(out)[-1]["workers_report"][0]["moc"]
    c = moc["constrained"]
    assert c["enabled"] is on
    assert (c["library"], c["version"]) == (("xgrammar", version("xgrammar")) if on else (None, None))
    assert moc["schema_sha256"]["moc_expert"] == load_moc_schema().sha256
    if on:
        assert moc["invalid_json"] == 0
    assert ("constrained by xgrammar" if on else "unconstrained") in err


def accepts(grammar, answer: str) -> bool:
    """Whether ``grammar`` accepts ``answer`` whole, through xgrammar's public API: a matcher compiled
    with an empty vocabulary reads strings only (``GrammarMatcher.accept_string``, then
    ``is_terminated``, as xgrammar's python/xgrammar/matcher.py documents them)."""
    import xgrammar

    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        grammar
    )
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(answer) and matcher.is_terminated()


# ------------------------------------------------------------------------------------- anchored


def test_anchored_grammar_accepts_the_training_form_and_nothing_else():
    """The anchored grammar of a window is the set of its sentence-level partitions, each chunk
    written as metachunk.chunking.moc_answers.expert_element writes the experts' targets; every such answer recovers exactly
    at its chunks' starts. Escaping: quotes, backslashes, newlines and non-ASCII text."""
    from metachunk.chunking.moc_answers import expert_element as element
    from metachunk.chunking.moc_answers import recover_spans
    from metachunk.chunking.moc_grammar import anchored_grammar, window_segments

    text = (
        'He said "stop\\here" now, twice over.\nThen a second sentence follows it closely. '
        "Short one. 今天上午，市政府召开新闻发布会。Another sentence number four comes last here."
    )
    sents = split_sentences(text, "en")
    segments = window_segments(text, [s.end for s in sents])
    assert len(segments) >= 4 and "".join(text[a:b] for a, b in segments) == text
    grammar = anchored_grammar(text, segments)
    n = len(segments)
    for cuts in ([0], [0, 1], [0, 2], list(range(n)), [0, n - 1]):
        chunks = [(segments[c][0], segments[d - 1][1]) for c, d in zip(cuts, [*cuts[1:], n])]
        elements = [element(text[a:b], 10, 10, "[MASK]") for a, b in chunks]
        answer = json.dumps(elements, ensure_ascii=False)
        assert accepts(grammar, answer), answer
        spans, stats = recover_spans(text, elements)
        assert stats.exact == len(elements) and stats.fuzzy == stats.skipped == 0
        assert [a for a, _ in spans] == [a + len(text[a:b]) - len(text[a:b].lstrip()) for a, b in chunks]
    full = json.dumps([element(text, 10, 10, "[MASK]")], ensure_ascii=False)
    assert accepts(grammar, full)
    assert not accepts(grammar, full.replace("[MASK]", " [MASK]"))
    assert not accepts(grammar, json.dumps([text], ensure_ascii=False))  # a verbatim copy: refused
    assert not accepts(grammar, '["He said[MASK]closely."]')  # does not cover the window


def test_anchored_heads_grow_until_recovery_is_unambiguous():
    """Every sentence of long_doc starts "Sentence number" and ends "in some detail.": a chunk's
    shortest match ends at its first sentence's end, so the next element is searched from there.
    The heads are doubled until the first occurrence of each is its own sentence, so recovery
    never lands on an earlier sentence; with the 10-character heads it would."""
    from metachunk.chunking.moc_answers import ANCHOR_SCALES, anchor_head, anchor_tail, recover_spans
    from metachunk.chunking.moc_grammar import anchored_grammar, window_segments

    text = long_doc(6)
    segments = window_segments(text, [s.end for s in split_sentences(text, "en")])
    grammar = anchored_grammar(text, segments)
    starts = [a + len(text[a:b]) - len(text[a:b].lstrip()) for a, b in segments]
    ends = [b - (len(text[a:b]) - len(text[a:b].rstrip())) for a, b in segments]
    short = [anchor_head(text[a:], 10) for a in starts]
    grown = [
        next(
            h
            for h in (anchor_head(text[a:], 10 * k) for k in ANCHOR_SCALES)
            if i == 0 or text.find(h, 1) == a
        )
        for i, a in enumerate(starts)
    ]
    assert all(len(g) > len(h) for g, h in zip(grown[2:], short[2:]))  # sentence 1 is the first match anyway

    def answer(heads):  # chunks of two sentences: 0-1, 2-3, 4-5
        return [f"{heads[i]}[MASK]{anchor_tail(text[: ends[i + 1]], 10)}" for i in (0, 2, 4)]

    assert accepts(grammar, json.dumps(answer(grown), ensure_ascii=False))
    assert not accepts(grammar, json.dumps(answer(short), ensure_ascii=False))
    spans, stats = recover_spans(text, answer(grown))
    assert stats.exact == 3 and [a for a, _ in spans] == [starts[0], starts[2], starts[4]]
    spans, _ = recover_spans(text, answer(short))
    assert [a for a, _ in spans][1] == starts[1]  # what the growing prevents: an earlier sentence


@pytest.mark.parametrize("seed", [0, 1])
def test_anchored_answers_recover_exactly(tiny_model_dir, seed):
    """--moc-anchored on a random tiny model: every answer is made of the windows' own anchors, so
    none is invalid JSON or unrecovered, every element recovers exactly, and the windows take the
    expert path; chunks tile the documents."""
    texts = [long_doc(), ZH, "One sentence only.", long_doc(5) + ' "Quoted \\ text," she said.']
    langs = ["en", "zh", "en", "en"]
    moc = chunker(tiny_model_dir, anchored=True, max_new_tokens=256, seed=seed, temperature=1.0, top_p=1.0)
    sentences = [split_sentences(t, lang) for t, lang in zip(texts, langs)]
    out = moc.chunk_documents(texts, langs, sentences)
    for spans, text in zip(out, texts):
        assert "".join(text[a:b] for a, b in spans) == text
        assert all(b > a for a, b in spans)
    m = moc.manifest()
    assert m["windows"] >= 6
    assert m["invalid_json"] == 0 and m["unrecovered_answers"] == 0 and m["truncated_answers"] == 0
    assert m["fallback"]["windows"] == 0 < m["windows"]
    r = m["recovery"]
    assert r["elements"] > 0 and r["exact"] == r["elements"] and r["fuzzy"] == r["skipped"] == 0
    c = m["constrained"]
    assert c["enabled"] and c["anchored"] is True and c["anchor_chars"] == 10
    assert 0 < c["grammars_compiled"] <= m["expert_attempts"]
    assert c["anchored_compile_seconds"] > 0 and c["compile_seconds"] >= c["anchored_compile_seconds"]
    assert "anchored" in moc.summary_line()


def test_anchored_tiny_budget_is_truncated_only(tiny_model_dir):
    moc = chunker(tiny_model_dir, anchored=True, max_new_tokens=3)
    m = run(moc)
    assert m["truncated_answers"] == m["expert_attempts"] == m["fallback"]["windows"] == m["windows"]
    assert m["invalid_json"] == m["unrecovered_answers"] == 0


def test_anchored_needs_constrained(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--moc-constrained"):
        chunker(tiny_model_dir, anchored=True, constrained=False)
    d = str(tiny_model_dir)
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "0", "text": TEXTS[0]}) + "\n", encoding="utf-8")
    argv = ["chunk", str(src), "-o", str(tmp_path / "o.jsonl"), "--method", "moc", "--router", d]
    rc = main([*argv, "--experts", ",".join([d] * 4), "--moc-anchored", "--no-moc-constrained"])
    assert rc != 0 and "--moc-constrained" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_records_anchored(tmp_path, tiny_model_dir, capsys):
    d, out, argv = _moc_argv(tmp_path, tiny_model_dir)
    argv += [
        "--moc-max-new-tokens",
        "128",
        "--moc-retries",
        "0",
        "--moc-window-chars",
        "200",
        "--moc-anchored",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r, text in zip(records, TEXTS):
        assert all(c["text"] == text[c["start"] : c["end"]] for c in r["chunks"])
        assert "".join(c["text"] for c in r["chunks"]) == text
    meta = json.loads(Path(str(out).replace(".jsonl", ".meta.json")).read_text())
    assert meta["config"]["moc_anchored"] is True
    moc = read_run_log(out)[-1]["workers_report"][0]["moc"]
    c = moc["constrained"]
    assert c["anchored"] is True and c["grammars_compiled"] > 0 and "anchored_compile_seconds" in c
    assert moc["fallback"]["windows"] < moc["windows"]
    assert moc["unrecovered_answers"] == moc["invalid_json"] == 0
