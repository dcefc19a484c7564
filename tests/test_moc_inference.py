"""Tests for metachunk.chunking.moc and moc_answers: prompts, router labels, recovery of head[MASK]tail rules, windows with
the chunk buffer, retries and the PPL fallback, and `metachunk chunk --method moc`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from metachunk.chunking.moc import (
    ROUTER_LABELS,
    MocChunker,
    MocOptions,
    expert_messages,
    granularity_label,
    label_token_ids,
    parse_experts,
    router_label,
    router_messages,
    stand_in_models,
)
from metachunk.chunking.moc_answers import (
    PLACEHOLDERS,
    format_elements,
    parse_expert_answer,
    recover_chunks,
    recover_spans,
    split_element,
    tile,
)
from metachunk.chunking.sentences import split_sentences

from metachunk.artifacts import read_run_log
from metachunk.cli import main
from metachunk.engine.generation import Generation

EN = (
    "The committee met on Tuesday (in the old hall) to discuss the budget. It lasted three hours. "
    "Members asked: what costs *more* than last year? Nobody knew at first. "
    "After a long debate, the committee approved the plan. The vote was 7 to 2.\n\n"
    "Reporter: the river rose again on Friday. Roads were closed near the bridge. "
    "Reporter: the river fell on Sunday. Roads reopened by noon."
)
ZH = (
    "今天上午，市政府召开新闻发布会。会议介绍了今年的城市建设计划，包括三条新地铁线。"
    "记者：计划何时完成？发言人表示，预计2026年底全部建成。"
    "此外，市里还将新建十个公园（含两个湿地公园）。市民对此反应积极。"
)


def chunk_of(text: str, first: str, last: str) -> tuple[int, int]:
    start = text.index(first)
    end = text.index(last, start) + len(last)
    return start, end


def element(text: str, span: tuple[int, int], n: int = 12, placeholder: str = "[MASK]") -> str:
    s, e = span
    piece = text[s:e].strip()
    return piece[:n] + placeholder + piece[-n:]


def assert_tiles(spans, length):
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(e > s for s, e in spans)


# ------------------------------------------------------------------------------------- prompts


def test_messages_use_the_versioned_templates():
    for lang in ("en", "zh"):
        m = router_messages("SOME TEXT", lang)
        assert [x["role"] for x in m] == ["system", "user"] and m[1]["content"].endswith("SOME TEXT")
        for p in PLACEHOLDERS:
            e = expert_messages("DOC", lang, p)
            assert [x["role"] for x in e] == ["system", "user"]
            assert e[1]["content"].endswith("DOC") and p in e[1]["content"]
    assert expert_messages("x", "en") == expert_messages("x", "en", "[MASK]")
    with pytest.raises(ValueError):
        expert_messages("x", "en", "<gap>")
    with pytest.raises(ValueError):
        router_messages("x", "fr")
    assert PLACEHOLDERS[0] == "[MASK]" and len(PLACEHOLDERS) == 8


def test_granularity_labels_and_answer_format():
    means = (1, 120, 120.5, 150, 151, 180, 181, 999)
    assert [granularity_label(x) for x in means] == [0, 0, 1, 1, 2, 2, 3, 3]
    answer = format_elements([("今天上午，", "发布会。"), ("He said", "end.")], "<.*>")
    assert parse_expert_answer(answer) == ["今天上午，<.*>发布会。", "He said<.*>end."]


def test_parse_expert_answer():
    assert parse_expert_answer('["a[MASK]b", "c[MASK]d"]') == ["a[MASK]b", "c[MASK]d"]
    assert parse_expert_answer('```json\n["a[MASK]b"]\n```') == ["a[MASK]b"]
    bad_answers = ["", "no list", "[1, 2]", "[]", '["a", 3]', '["unterminated]', '{"a": 1}', "] [", "[MASK]"]
    for bad in bad_answers:
        assert parse_expert_answer(bad) is None, bad


def test_split_element():
    assert split_element("The quick [MASK] lazy dog.") == ("The quick", "lazy dog.")
    assert split_element("whole chunk") == ("whole chunk", "")
    assert split_element("[MASK]tail") == ("", "tail")
    assert split_element("a.*?b.*?c", ".*?") == ("a", "c")


def test_parse_experts():
    assert parse_experts("a, b,c,d") == ("a", "b", "c", "d")
    for bad in ("a,b,c", "a,b,c,d,e", "a,,c,d"):
        with pytest.raises(ValueError):
            parse_experts(bad)


def test_stand_ins_fill_the_roles_without_a_trained_model(tmp_path):
    trained = tmp_path / "e1"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes(b"")
    untrained = [str(tmp_path / f"e{k}") for k in range(4)]  # only e1 holds weights
    experts = [untrained[0], str(trained), untrained[2], untrained[3]]
    router, out, stand_ins = stand_in_models(str(tmp_path / "router"), experts, "smollm2")
    assert out == (str(trained),) * 4  # the nearest trained expert for each other granularity
    assert router == "smollm2" and stand_ins == {
        "expert 0": str(trained), "expert 2": str(trained), "expert 3": str(trained), "router": "smollm2"
    }  # fmt: skip
    none = [str(tmp_path / f"n{k}") for k in range(4)]
    router, out, stand_ins = stand_in_models("smollm2", none, "smollm2")  # none trained
    assert out == ("smollm2",) * 4 and "router" not in stand_ins
    # without a stand-in nothing is replaced: the missing dir is the usual error later
    assert stand_in_models("r", experts, None) == ("r", tuple(experts), {})


def test_a_trained_model_named_from_home_is_no_stand_ins_business(tmp_path, monkeypatch, tiny_model_dir):
    """``--experts ~/m/e0,~/m/e1``: bash leaves the ``~`` after a comma as it is, and loading expands it,
    but the check for trained models had not, and put the stand-in in every role."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_model_dir, tmp_path / "m" / "e0")
    router, out, stand_ins = stand_in_models("~/m/e0", ["~/m/e0"] * 4, "smollm2")
    assert router == "~/m/e0" and out == ("~/m/e0",) * 4 and stand_ins == {}


def test_experts_decode_without_the_base_models_penalties(tiny_model_dir, tmp_path, monkeypatch):
    """An export keeps its base model's generation_config; a repetition penalty there would penalise the
    placeholder and ", " every rule repeats, and the manifest records temperature and top_p only."""
    import shutil

    from metachunk.chunking import moc
    from metachunk.chunking.api import MoCChunker

    model = tmp_path / "expert"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.3,
                                                              "no_repeat_ngram_size": 3}))  # fmt: skip
    seen = []
    real = moc.generate_batched

    def spy(model_, tokenizer, ids, generation_config, *args, **kwargs):
        seen.append(generation_config)
        return real(model_, tokenizer, ids, generation_config, *args, **kwargs)

    monkeypatch.setattr(moc, "generate_batched", spy)
    chunker = MoCChunker(str(model), [str(model)] * 4, lang="en", max_new_tokens=8, retries=0)
    chunker("Emma was clever. She was rich. Her home was Hartfield. She had few troubles.")
    assert seen and all(c.repetition_penalty == 1.0 and c.no_repeat_ngram_size == 0 for c in seen)


# ------------------------------------------------------------------------------------- router


def test_router_label_from_planted_logits():
    label_ids = [15, 16, 17, 18]
    logits = torch.zeros(3, 40)
    logits[0, 17] = 5.0  # label 2
    logits[1, 15] = 1.0  # label 0 ...
    logits[1, 3] = 9.0  # ... a non-label token scoring higher does not count
    logits[2, 18], logits[2, 16] = 2.0, 1.9  # label 3
    assert router_label(logits, label_ids) == [2, 0, 3]
    assert router_label(logits[0], label_ids) == 2


def test_route_reads_the_last_prompt_position(tiny_model_dir):
    """route(): batched, left-padded prompts; the label comes from the last position's logits."""
    d = str(tiny_model_dir)
    moc = MocChunker(MocOptions(router=d, experts=",".join([d] * 4)), batch_size=2)
    ids = label_token_ids(moc.router.tokenizer)
    assert len(set(ids)) == 4
    texts = ["short", "a much longer text " * 8, "mid length text here", "x"]
    want = {len(moc.router.encode(router_messages(t, "en"))): k % 4 for k, t in enumerate(texts)}
    seen = []

    def fake_forward(input_ids, attention_mask, position_ids, logits_to_keep):
        assert logits_to_keep == 1
        assert (position_ids[attention_mask.bool()] >= 0).all()
        logits = torch.zeros(input_ids.shape[0], 1, 2048)
        for row in range(input_ids.shape[0]):
            n = int(attention_mask[row].sum())
            assert attention_mask[row, -1] == 1  # padded on the left
            assert int(position_ids[row, -1]) == n - 1
            logits[row, 0, ids[want[n]]] = 3.0
            seen.append(n)
        return SimpleNamespace(logits=logits)

    fake = {"device": torch.device("cpu"), "__call__": staticmethod(fake_forward)}
    moc.router.model = type("FakeRouter", (), fake)()
    assert moc.route(texts, ["en"] * 4) == [0, 1, 2, 3]
    assert sorted(seen) == sorted(want)


# ------------------------------------------------------------------------------------- recovery


def test_recovery_exact():
    spans = [
        chunk_of(EN, "The committee met", "three hours. "),
        chunk_of(EN, "Members asked", "7 to 2.\n\n"),
        chunk_of(EN, "Reporter: the river rose", "noon."),
    ]
    elements = [element(EN, s) for s in spans]
    found, stats = recover_spans(EN, elements)
    assert stats.exact == 3 and stats.skipped == 0 and stats.fuzzy == 0
    assert [s for s, _ in found] == [s for s, _ in spans]
    chunks, _ = recover_chunks(EN, elements)
    assert [s for s, _ in chunks] == [s for s, _ in spans]
    assert_tiles(chunks, len(EN))


def test_recovery_regex_metacharacters():
    elements = [
        "The committee met on Tuesday (in the[MASK]the budget.",
        "It lasted three[MASK]*more* than last year?",
        "Nobody knew[MASK]7 to 2.",
    ]
    found, stats = recover_spans(EN, elements)
    assert stats.exact == 3
    second = EN[found[1][0] : found[1][1]]
    assert second == "It lasted three hours. Members asked: what costs *more* than last year?"
    for p in PLACEHOLDERS:  # every placeholder, including the regex-looking ones
        found, stats = recover_spans(EN, [x.replace("[MASK]", p) for x in elements], placeholder=p)
        assert stats.exact == 3, p


def test_recovery_with_typos_in_head_or_tail():
    want = [chunk_of(EN, "The committee met", "three hours."), chunk_of(EN, "Members asked", "at first.")]
    elements = [
        "The comittee met on Tuesday[MASK]lasted three hours.",  # typo in the head
        "Members asked: what costs[MASK]Nobody knew at frist.",  # typo in the tail
    ]
    found, stats = recover_spans(EN, elements)
    assert stats.fuzzy == 2 and stats.skipped == 0
    assert found == want
    zh_elements = ["今天上午，市政府召开[MASK]三条新地铁线。", "记者：计划合时完成？[MASK]全部建成。"]
    found, stats = recover_spans(ZH, zh_elements, max_ratio=0.2)
    assert stats.exact == 1 and stats.fuzzy == 1
    assert ZH[found[1][0] : found[1][1]] == "记者：计划何时完成？发言人表示，预计2026年底全部建成。"


def test_short_chunks_head_and_tail_overlap():
    text = "Yes. No way. Maybe tomorrow."
    found, stats = recover_spans(text, ["Yes. No[MASK]No way.", "Maybe tomo[MASK]tomorrow."])
    assert stats.exact == 2 and [text[s:e] for s, e in found] == ["Yes. No way.", "Maybe tomorrow."]


def test_one_typo_allowed_in_short_anchors():
    # 10% of a 9-character anchor is no edit at all; anchors of 8+ characters may have one
    text = "Intro here. The city council voted on Monday. Later news."
    found, stats = recover_spans(text, ["Intro[MASK]here.", "The city[MASK]on Mondy."])
    assert stats.fuzzy == 1 and text[found[1][0] : found[1][1]] == "The city council voted on Monday."
    found, stats = recover_spans(text, ["Intro[MASK]here.", "The city[MASK]on Mndy."])  # 2 edits in 8
    assert stats.skipped == 1


def test_a_typod_tail_found_verbatim_further_on_does_not_swallow_the_next_chunks():
    """The exact pattern ran from the head to a later exact copy of the typo'd tail, over three chunks;
    the edit-distance match one edit away ends before the next element's head, and is taken."""
    text = ("Emma was handsome, clever and rich. She lived with her father. Her father was kind. "
            "Later Emma, clever and rich! The end came.")  # fmt: skip
    elements = ["Emma was handsome[MASK]clever and rich!", "She lived[MASK]father.", "Her father[MASK]kind.",
                "Later Emma[MASK]rich!"]  # fmt: skip
    found, stats = recover_spans(text, elements)
    assert [text[s:e] for s, e in found] == [
        "Emma was handsome, clever and rich.", "She lived with her father.", "Her father was kind.",
        "Later Emma, clever and rich!",
    ]  # fmt: skip
    assert (stats.exact, stats.fuzzy, stats.skipped) == (3, 1, 0)
    # both rules right, the next head also inside this chunk after a one-edit copy of its tail, and again
    # where the next chunk starts: the exact match loses nothing, and is kept
    first = "Setup the router. Then restart the device! See Section two below. Then restart the device."
    text = first + " Section two covers the firmware update procedure in detail."
    for ratio in (0.0, 0.1):
        found, stats = recover_spans(
            text, ["Setup the router[MASK]restart the device.", "Section two[MASK]procedure in detail."],
            max_ratio=ratio,
        )  # fmt: skip
        assert [s for s, _ in found] == [0, len(first) + 1] and stats.exact == 2


def test_recovery_with_repeated_heads():
    doc = "".join(f"Reporter: item {k} is here. More about item {k}.\n" for k in range(5))
    starts = [i for i in range(len(doc)) if doc.startswith("Reporter:", i)]
    elements = [f"Reporter:[MASK]item {k}." for k in range(5)]
    found, stats = recover_spans(doc, elements)
    assert stats.exact == 5 and [s for s, _ in found] == starts
    # same heads with a typo and the tail cut short: each still lands on its own occurrence
    elements = [f"Reportr: item {k}[MASK]about item {k}." for k in range(5)]
    found, stats = recover_spans(doc, elements)
    assert stats.skipped == 0 and [s for s, _ in found] == starts


def test_hallucinated_elements_are_skipped_and_counted():
    elements = [
        element(EN, chunk_of(EN, "The committee met", "three hours.")),
        "The mayor resigned[MASK]nobody expected it.",
        element(EN, chunk_of(EN, "Reporter: the river rose", "noon.")),
        "[MASK]",
    ]
    found, stats = recover_spans(EN, elements)
    assert stats.elements == 4 and stats.skipped == 2 and stats.exact == 2
    chunks, _ = recover_chunks(EN, elements)
    assert len(chunks) == 2 and chunks[1][0] == EN.index("Reporter: the river rose")
    assert_tiles(chunks, len(EN))


def test_tile():
    assert tile(10, []) == [(0, 10)]
    assert tile(10, [3, 3, 0, 12, 7]) == [(0, 3), (3, 7), (7, 10)]
    assert tile(0, [0]) == []


@settings(max_examples=150, deadline=None)
@given(
    cuts=st.lists(st.integers(1, len(EN) - 1), max_size=8, unique=True),
    n=st.integers(1, 15),
    noise=st.lists(st.tuples(st.integers(0, 400), st.sampled_from("xq(*?. ")), max_size=4),
    junk=st.lists(st.text(min_size=0, max_size=12), max_size=3),
)
def test_recovered_chunks_always_tile(cuts, n, noise, junk):
    edges = [0, *sorted(cuts), len(EN)]
    elements = []
    for k, (s, e) in enumerate(zip(edges, edges[1:])):
        text = list(EN[s:e])
        for pos, ch in noise:
            if k == pos % (len(edges) - 1) and text:
                text[pos % len(text)] = ch
        piece = "".join(text)
        elements.append(piece[:n] + "[MASK]" + piece[-n:])
    elements[1:1] = [j + "[MASK]" + j[::-1] for j in junk]
    spans, stats = recover_spans(EN, elements)
    assert stats.exact + stats.fuzzy + stats.skipped == stats.elements == len(elements)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    chunks, _ = recover_chunks(EN, elements)
    assert_tiles(chunks, len(EN))
    assert "".join(EN[s:e] for s, e in chunks) == EN


# ------------------------------------------------------------------------------------- chunker


@pytest.fixture(scope="module")
def moc(tiny_model_dir):
    """Free decoding (--no-moc-constrained); the grammar's tests are in test_moc_constrained.py."""
    d = str(tiny_model_dir)
    options = MocOptions(
        router=d, experts=",".join([d] * 4), max_new_tokens=8, window_chars=200, retries=1, constrained=False
    )
    return MocChunker(options)


def reset(moc):
    moc.reset_stats()
    return moc


def long_doc(k: int = 12) -> str:
    return " ".join(f"Sentence number {i} talks about topic {i // 3} in some detail." for i in range(k))


def test_gibberish_expert_falls_back_to_ppl(moc):
    """Decoding freely, the tiny model writes no JSON: every window is retried, then PPL-chunked,
    and counted by cause (its 8-token answers never end: truncated)."""
    texts = [long_doc(), ZH, "One sentence only."]
    langs = ["en", "zh", "en"]
    out = moc.chunk_documents(texts, langs, [split_sentences(t, lang) for t, lang in zip(texts, langs)])
    for spans, text in zip(out, texts):
        assert_tiles(spans, len(text))
    m = moc.manifest()
    assert m["windows"] > 3  # the long document takes several windows
    assert m["fallback"]["windows"] == m["windows"]
    assert m["expert_attempts"] == 2 * m["windows"] and m["retried"] == m["windows"]
    assert m["invalid_json"] + m["truncated_answers"] + m["unrecovered_answers"] == 2 * m["windows"]
    assert m["truncated_answers"] > 0
    assert sum(m["fallback"]["causes"].values()) == m["windows"]
    assert m["constrained"] == {"enabled": False, "library": None, "version": None, "anchored": False}
    assert sum(m["routes"].values()) == m["windows"]
    assert set(m["prompt_sha256"]) == {"moc_router.en", "moc_router.zh", "moc_expert.en", "moc_expert.zh"}
    assert m["generation"]["temperature"] == 0.1 and m["generation"]["top_p"] == 0.1
    assert m["generation"]["retry_sampling"] == [(0.5, 0.5)]


def fake_expert(pairs_per_chunk: int = 2, bad_attempts: int = 0, typo: bool = False):
    """generate(), with MocChunker.generate's signature: an expert answering head[MASK]tail for every
    `pairs_per_chunk` sentences of the window (invalid JSON on the first `bad_attempts` attempts)."""
    calls = []

    def generate(lm, prompts, attempt, max_items=None, grammars=None):
        assert grammars is None  # free decoding: no window grammars
        calls.append((len(prompts), attempt))
        answers = []
        for p in prompts:
            text = p[1]["content"].split("Document content: ", 1)[1]
            if attempt < bad_attempts:
                answers.append("[not json")
                continue
            sents = split_sentences(text, "en")
            groups = [sents[i : i + pairs_per_chunk] for i in range(0, len(sents), pairs_per_chunk)]
            items = []
            for g in groups:
                piece = text[g[0].start : g[-1].end].strip()
                head = piece[:10].replace("e", "3", 1) if typo else piece[:10]
                items.append(head + "[MASK]" + piece[-8:])
            answers.append(json.dumps(items))
        return [Generation(a, len(a), stopped=True) for a in answers]

    return generate, calls


def test_windows_carry_the_last_chunk_over(moc, monkeypatch):
    moc = reset(moc)
    generate, calls = fake_expert(pairs_per_chunk=1, typo=True)
    monkeypatch.setattr(moc, "generate", generate)
    text = long_doc(20)
    sentences = split_sentences(text, "en")
    [spans] = moc.chunk_documents([text], ["en"], [sentences])
    assert_tiles(spans, len(text))
    m = moc.manifest()
    assert m["windows"] >= 4 and m["carried_over"] >= 2 and m["fallback"]["windows"] == 0
    assert m["recovery"]["skipped"] == 0 and m["recovery"]["fuzzy"] > 0
    # chunks begin at sentence starts: the expert's heads were recovered despite the typo
    sentence_starts = {s.start for s in sentences}
    assert all(s in sentence_starts for s, _ in spans)
    assert max(e - s for s, e in spans) <= 2 * max(s.end - s.start for s in sentences)


def test_invalid_json_is_retried_with_more_randomness(moc, monkeypatch):
    moc = reset(moc)
    generate, calls = fake_expert(bad_attempts=1)
    monkeypatch.setattr(moc, "generate", generate)
    text = "First point here. Second point here. Third point here."
    [spans] = moc.chunk_documents([text], ["en"], [split_sentences(text, "en")])
    m = moc.manifest()
    assert [a for _, a in calls] == [0, 1]
    assert m["retried"] == 1 and m["invalid_json"] == 1 and m["fallback"]["windows"] == 0
    assert [text[s:e] for s, e in spans] == ["First point here. Second point here. ", "Third point here."]
    assert moc.sampling(0) == (0.1, 0.1) and moc.sampling(2) == (pytest.approx(0.9), pytest.approx(0.9))


def test_blank_documents(moc):
    texts = ["", "   \n", "Just one."]
    out = reset(moc).chunk_documents(texts, ["en"] * 3, [split_sentences(t, "en") for t in texts])
    assert out[0] == [] and out[1] == [(0, 4)] and out[2] == [(0, 9)]  # whitespace is kept, as one chunk
    assert moc.manifest()["windows"] == 1  # only the real document was sent to the models


# ------------------------------------------------------------------------------------- CLI


def test_cli_chunk_method_moc(tmp_path, tiny_model_dir, capsys):
    d = str(tiny_model_dir)
    texts = [EN, ZH, long_doc(8)]
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)]
    src.write_text("".join(lines), encoding="utf-8")
    out = tmp_path / "moc.jsonl"
    experts = ",".join([d] * 4)
    argv = ["chunk", str(src), "-o", str(out), "--method", "moc", "--router", d, "--experts", experts]
    rc = main([*argv, "--moc-max-new-tokens", "8", "--moc-retries", "1", "--moc-window-chars", "300"])
    err = capsys.readouterr().err
    assert rc == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(texts)
    for r, text in zip(records, texts):
        assert r["method"] == "moc"
        assert "".join(c["text"] for c in r["chunks"]) == text
        assert all(c["text"] == text[c["start"] : c["end"]] for c in r["chunks"])
    meta = json.loads(Path(str(out).replace(".jsonl", ".meta.json")).read_text())
    moc = read_run_log(out)[-1]["workers_report"][0]["moc"]  # how the run went: its run log
    assert moc["fallback"]["windows"] == moc["windows"] >= 3
    assert "moc_expert.zh" in meta["prompt_sha256"] and moc["placeholder"] == "[MASK]"
    assert "PPL fallbacks" in err


def test_the_python_mocchunker_cuts_as_the_cli_does(tmp_path, tiny_model_dir):
    import metachunk

    d = str(tiny_model_dir)
    texts = [EN, ZH, long_doc(4)]
    chunker = metachunk.MoCChunker(d, [d] * 4, max_new_tokens=8, retries=0, window_chars=300)
    chunks = chunker.chunk_batch(texts)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n"
                           for i, t in enumerate(texts)), encoding="utf-8")  # fmt: skip
    out = tmp_path / "moc.jsonl"
    argv = ["chunk", str(src), "-o", str(out), "--method", "moc", "--router", d, "--experts", ",".join([d] * 4),
            "--moc-max-new-tokens", "8", "--moc-retries", "0", "--moc-window-chars", "300"]  # fmt: skip
    assert main(argv) == 0
    cli = [r["chunks"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())]
    assert cli == [[c.to_json() for c in cs] for cs in chunks]
    assert all("".join(c.text for c in cs) == t for cs, t in zip(chunks, texts))


def test_moc_into_a_folder_of_shards_resumes(tmp_path, tiny_model_dir, capsys):
    """`chunk -o DIR --method moc`: the one-shard folder holds the file run's bytes; a two-shard
    folder whose shard was lost (a kill) redoes only that shard, to the same bytes."""
    d = str(tiny_model_dir)
    texts = [EN, ZH, long_doc(4)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n"
                           for i, t in enumerate(texts)), encoding="utf-8")  # fmt: skip
    argv = ["chunk", str(src), "--method", "moc", "--router", d, "--experts", ",".join([d] * 4),
            "--moc-max-new-tokens", "8", "--moc-retries", "0", "--moc-window-chars", "300"]  # fmt: skip
    assert main([*argv, "-o", str(tmp_path / "one.jsonl")]) == 0
    assert main([*argv, "-o", str(tmp_path / "one"), "--shards", "1"]) == 0
    assert (tmp_path / "one" / "train-00000-of-00001.jsonl").read_bytes() == (
        tmp_path / "one.jsonl"
    ).read_bytes()

    folder = tmp_path / "two"
    assert main([*argv, "-o", str(folder), "--shards", "2"]) == 0
    shards = sorted(folder.glob("train-*.jsonl"))
    first = {p.name: p.read_bytes() for p in shards}
    records = [json.loads(line) for p in shards for line in p.read_text().splitlines()]
    assert [r["id"] for r in records] == ["0", "1", "2"]
    for r, text in zip(records, texts):
        assert r["method"] == "moc" and "".join(c["text"] for c in r["chunks"]) == text
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] and read_run_log(folder)[-1]["workers_report"][0]["moc"]["windows"] >= 3
    assert "chunking/prompts/moc_expert.schema.json" in manifest["prompt_sha256"]

    shards[1].unlink()  # what a kill -9 before the second shard landed leaves
    capsys.readouterr()
    assert main([*argv, "-o", str(folder), "--shards", "2"]) == 0
    assert "resuming: 1 of 2 shards done" in capsys.readouterr().err
    run = read_run_log(folder)[-1]
    assert run["documents_chunked"] == 2 and run["shards_skipped"] == 1
    assert {p.name: p.read_bytes() for p in sorted(folder.glob("train-*.jsonl"))} == first


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "--router"),
        (["--router", "R"], "--router"),
        (["--router", "R", "--experts", "a,b,c"], "4 model dirs"),
        (["--router", "R", "--experts", "a,b,c,d", "--moc-top-p", "0"], "--moc-top-p"),
        (["--router", "R", "--experts", "a,b,c,d", "--moc-placeholder", "<gap>"], "<gap>"),
    ],
)
def test_cli_moc_option_errors(tmp_path, capsys, flags, expected):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "a b c."}\n')
    with pytest.raises(SystemExit) if "--moc-placeholder" in flags else _returns_2():
        rc = main(["chunk", str(src), "-o", str(tmp_path / "o.jsonl"), "--method", "moc", *flags])
        assert rc == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


class _returns_2:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_label_tokens_are_single_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = label_token_ids(tok)
    assert [tok.decode([i]) for i in ids] == list(ROUTER_LABELS)


def test_a_placeholder_that_is_a_special_token_of_the_expert_is_refused(tiny_model_dir, tmp_path):
    """Gemma's tokenizer has <pad> as a special token, and decoding skips special tokens: every rule came
    back without its placeholder, so no answer was ever recoverable."""
    import shutil

    from metachunk.chunking.api import MoCChunker
    from transformers import AutoTokenizer

    from metachunk.artifacts import InputError

    model = tmp_path / "expert"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<pad>"]})
    tokenizer.save_pretrained(model)
    chunker = MoCChunker(str(model), [str(model)] * 4, lang="en", placeholder="<pad>", max_new_tokens=8)
    with pytest.raises(InputError, match="--moc-placeholder <pad> is a special token of expert"):
        chunker("Emma was clever. She was rich. Her home was Hartfield. She had few troubles.")
