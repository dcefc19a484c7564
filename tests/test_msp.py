"""Margin sampling chunking (Meta-Chunking §3.1.2): margin sign, fixed and dynamic θ, prompt files,
KV-prefix reuse against the one-pass reference, and one end-to-end run with a real model."""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from metachunk.chunking import msp
from metachunk.chunking.msp import PROMPT_VARIANTS, MarginScorer, Threshold, load_msp_prompt, msp_decisions
from metachunk.chunking.sentences import split_sentences
from metachunk.chunking.types import Sentence
from support.data import data_file

# --------------------------------------------------------------------------------------------
# Decisions with a stub scorer
# --------------------------------------------------------------------------------------------


class StubScorer:
    """``margins`` looks each pair's margin up by its sentence2 and records every call."""

    def __init__(self, table: dict[str, float]):
        self.table = table
        self.calls: list[list[tuple[str, str]]] = []
        self.batch_sizes: list[int] = []

    def margins(self, pairs, batch_size=8):
        self.calls.append(list(pairs))
        self.batch_sizes.append(batch_size)
        return np.array([self.table[b] for _, b in pairs], dtype=np.float64)


def make_doc(texts: list[str], seps: list[str] | None = None) -> tuple[str, list[Sentence]]:
    """A document of the given sentences; each sentence owns the whitespace after it."""
    seps = seps or [" "] * len(texts)
    doc, sents = "", []
    for text, sep in zip(texts, seps):
        sents.append(Sentence(len(doc), len(doc) + len(text) + len(sep)))
        doc += text + sep
    return doc, sents


SENTS_A = [f"A{i} says something." for i in range(6)]


def _expected_dynamic(margins: list[float], window: int | None) -> tuple[list[int], list[float]]:
    """Independent restatement: θ starts at 0, then the mean of the (last ``window``) past margins."""
    boundaries, thetas = [], []
    for i, m in enumerate(margins, start=1):
        past = margins[: i - 1]
        if window:
            past = past[-window:]
        theta = sum(past) / len(past) if past else 0.0
        thetas.append(theta)
        if not m > theta:
            boundaries.append(i - 1)
    return boundaries, thetas


def test_fixed_threshold_decisions():
    doc, sents = make_doc(SENTS_A)
    margins = [0.5, -0.2, 0.1, 0.3, 0.2]
    stub = StubScorer(dict(zip(SENTS_A[1:], margins)))
    (res,) = msp_decisions(stub, [doc], [sents], mode="pair", threshold=0.2, batch_size=5)
    # keep when margin > θ; a margin equal to θ splits. A split before sentence i ends sentence i-1.
    assert res.boundaries == [1, 2, 4]
    assert res.margins == [None, *margins]
    assert res.thresholds == [None, 0.2, 0.2, 0.2, 0.2, 0.2]
    # pair mode: sentence1 is the previous sentence, stripped; all pairs in one call
    assert stub.calls == [list(zip(SENTS_A[:-1], SENTS_A[1:]))]
    assert stub.batch_sizes == [5]

    (res,) = msp_decisions(stub, [doc], [sents], threshold=0.0)
    assert res.boundaries == [1]
    (res,) = msp_decisions(stub, [doc], [sents], threshold=-1.0)
    assert res.boundaries == []
    (res,) = msp_decisions(stub, [doc], [sents], threshold=1.0)
    assert res.boundaries == [0, 1, 2, 3, 4]


def test_dynamic_threshold_hand_computed():
    doc, sents = make_doc(SENTS_A)
    margins = [0.4, -0.2, 0.3, 0.1, 0.5]
    stub = StubScorer(dict(zip(SENTS_A[1:], margins)))

    (res,) = msp_decisions(stub, [doc], [sents], dynamic=True, threshold=0.9)  # fixed θ is ignored
    assert res.boundaries == [1, 3]
    assert res.thresholds == pytest.approx([None, 0.0, 0.4, 0.1, 0.2 / 1.2, 0.15])

    (res,) = msp_decisions(stub, [doc], [sents], dynamic=True, window=2)
    assert res.boundaries == [1]  # i=4: θ = mean(-0.2, 0.3) = 0.05 < 0.1 keeps
    assert res.thresholds == pytest.approx([None, 0.0, 0.4, 0.1, 0.05, 0.2])

    (res,) = msp_decisions(stub, [doc], [sents], dynamic=True, window=1)
    assert res.thresholds == pytest.approx([None, 0.0, 0.4, -0.2, 0.3, 0.1])


@pytest.mark.parametrize("window", [None, 1, 3, 50])
def test_dynamic_threshold_random(window):
    rng = np.random.default_rng(window or 0)
    texts = [f"Sentence number {i}." for i in range(40)]
    doc, sents = make_doc(texts, [" ", "\n", "  ", "\n\n"] * 10)
    margins = rng.uniform(-1, 1, size=39).round(3).tolist()
    stub = StubScorer(dict(zip(texts[1:], margins)))
    (res,) = msp_decisions(stub, [doc], [sents], dynamic=True, window=window)
    boundaries, thetas = _expected_dynamic(margins, window)
    assert res.boundaries == boundaries
    assert res.thresholds[1:] == pytest.approx(thetas)
    assert res.margins[1:] == margins


def test_dynamic_threshold_is_per_document():
    doc_a, sents_a = make_doc(SENTS_A[:4])
    texts_b = ["B0 starts.", "B1 goes on.", "B2 ends."]
    doc_b, sents_b = make_doc(texts_b)
    stub = StubScorer(
        {
            "A1 says something.": 0.9,
            "A2 says something.": 0.8,
            "A3 says something.": 0.7,
            "B1 goes on.": 0.1,
            "B2 ends.": 0.05,
        }
    )
    res_a, res_b = msp_decisions(stub, [doc_a, doc_b], [sents_a, sents_b], dynamic=True)
    assert res_a.thresholds == pytest.approx([None, 0.0, 0.9, 0.85])
    assert res_a.boundaries == [1, 2]
    assert res_b.thresholds == pytest.approx([None, 0.0, 0.1])  # B does not inherit A's history
    assert res_b.boundaries == [1]
    assert len(stub.calls) == 1 and len(stub.calls[0]) == 5  # pair mode: one batched call


def test_accumulated_mode_passes_growing_chunk():
    texts_a = ["A0 opens.", "A1 continues.", "A2 changes topic.", "A3 continues it.", "A4 too."]
    doc_a, sents_a = make_doc(texts_a, ["\n", " ", "  ", "\n\n", " "])
    texts_b = ["B0 one.", "B1 two.", "B2 three."]
    doc_b, sents_b = make_doc(texts_b)
    table = {"A1 continues.": 0.9, "A2 changes topic.": -0.9, "A3 continues it.": 0.9, "A4 too.": 0.9}
    table |= {"B1 two.": -0.5, "B2 three.": 0.5}
    stub = StubScorer(table)
    steps = []
    res_a, res_b = msp_decisions(
        stub, [doc_a, doc_b], [sents_a, sents_b], mode="accumulated", batch_size=4, on_step=steps.append
    )
    assert stub.calls == [
        [("A0 opens.", "A1 continues."), ("B0 one.", "B1 two.")],
        [("A0 opens.\nA1 continues.", "A2 changes topic."), ("B1 two.", "B2 three.")],
        [("A2 changes topic.", "A3 continues it.")],  # a split starts a new chunk
        [("A2 changes topic.  A3 continues it.", "A4 too.")],  # inner whitespace kept verbatim
    ]
    assert steps == [2, 2, 1, 1]  # documents advance in lock step
    assert set(stub.batch_sizes) == {4}
    assert res_a.boundaries == [1] and res_b.boundaries == [0]
    assert res_a.margins == [None, 0.9, -0.9, 0.9, 0.9]


def test_accumulated_sentence1_is_capped(monkeypatch):
    monkeypatch.setattr(msp, "ACCUMULATED_MAX_CHARS", 12)
    texts = ["First sentence here.", "Second sentence here.", "Third one."]
    doc, sents = make_doc(texts)
    stub = StubScorer({"Second sentence here.": 0.5, "Third one.": 0.5})
    msp_decisions(stub, [doc], [sents], mode="accumulated")
    assert stub.calls[1] == [("sentence here."[-12:], "Third one.")]
    assert stub.calls[1][0][0] == "First sentence here. Second sentence here."[-12:]


def test_decisions_edge_cases():
    stub = StubScorer({})
    assert msp_decisions(stub, [], []) == []
    doc, sents = make_doc(["Only one."])
    for mode in ("pair", "accumulated"):
        (res,) = msp_decisions(stub, [doc, ""], [sents, []], mode=mode)[:1]
        assert res.boundaries == [] and res.margins == [None] and res.thresholds == [None]
    with pytest.raises(ValueError, match="msp mode"):
        msp_decisions(stub, [doc], [sents], mode="chained")


def test_threshold_object():
    t = Threshold(0.3)
    assert t.value == 0.3 and t.decide(0.31) and not t.decide(0.3) and t.value == 0.3
    t = Threshold(0.3, dynamic=True, window=2)
    assert t.value == 0.0
    for m in (1.0, 0.0, -0.5):
        t.decide(m)
    assert t.value == pytest.approx(-0.25)


# --------------------------------------------------------------------------------------------
# Prompt files
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["table6", "table7", "released"])
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_load_prompt(variant, lang):
    prompt = load_msp_prompt(variant, lang)
    raw = files("metachunk.chunking").joinpath("prompts", f"msp_{variant}.{lang}.txt").read_bytes()
    text = raw.decode("utf-8")
    assert prompt.variant == variant and prompt.lang == lang
    assert prompt.name == f"msp_{variant}.{lang}"
    assert prompt.instruction + prompt.pair_template == text.rstrip("\n")
    assert prompt.instruction.endswith("\n") and prompt.instruction.strip()
    assert "{sentence1}" not in prompt.instruction and "{sentence2}" not in prompt.instruction
    assert prompt.pair_template.index("{sentence1}") < prompt.pair_template.index("{sentence2}")
    filled = prompt.pair_template.format(sentence1="<<S1>>", sentence2="<<S2>>")
    assert filled.index("<<S1>>") < filled.index("<<S2>>") and "{" not in filled
    assert "1" in text and "2" in text  # the two answers are described
    assert prompt.sha256 == hashlib.sha256(raw).hexdigest()
    assert load_msp_prompt(variant, lang) == prompt  # stable


def test_load_prompt_variants_differ_and_errors():
    shas = {load_msp_prompt(v, lang).sha256 for v in PROMPT_VARIANTS for lang in ("en", "zh")}
    assert len(shas) == 6
    assert load_msp_prompt() == load_msp_prompt("table6", "en")
    with pytest.raises(ValueError, match="table8"):
        load_msp_prompt("table8", "en")
    with pytest.raises(ValueError, match="fr"):
        load_msp_prompt("table6", "fr")


# --------------------------------------------------------------------------------------------
# The scorer on the tiny model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir: Path):
    from metachunk.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def scorers(tiny_lm):
    model, tok = tiny_lm
    scorers = {lang: MarginScorer(model, tok, load_msp_prompt("table6", lang)) for lang in ("en", "zh")}
    # the sentences inside the options: the shared prefix is one line, each sentence is sent twice
    scorers["released"] = MarginScorer(model, tok, load_msp_prompt("released", "en"))
    return scorers


def test_the_released_prompt_writes_the_sentences_into_the_options():
    en, zh = load_msp_prompt("released", "en"), load_msp_prompt("released", "zh")
    assert "{" not in en.instruction and en.instruction.count("\n") == 1
    assert en.pair_template.format(sentence1="A.", sentence2="B.") == (
        '1. Split "A. B." into "A." and "B." two parts;\n2. Keep "A. B." unsplit in its original form;\n'
        "Please answer 1 or 2."
    )
    assert zh.pair_template.format(sentence1="甲。", sentence2="乙。").startswith(
        "1. 将“甲。乙。”分割成“甲。”与“乙。”两部分；"
    )


def test_a_base_models_prompt_is_read_after_its_bos(tiny_lm, monkeypatch):
    """Gemma-3-270m has no chat template: its plain prompt went in without the <bos> its tokenizer starts
    every text with. A template that writes the <bos> itself gets no second one."""
    import copy

    model, tok = tiny_lm
    base = copy.deepcopy(tok)
    base.chat_template = None
    bos = base.convert_tokens_to_ids("<|endoftext|>")
    plain = MarginScorer(model, base, load_msp_prompt("table6", "en")).prefix_ids
    real_call = type(base).__call__

    def with_bos(self, text, add_special_tokens=True, **kwargs):
        out = real_call(self, text, add_special_tokens=False, **kwargs)
        if add_special_tokens:
            out["input_ids"] = [bos, *out["input_ids"]]
        return out

    monkeypatch.setattr(type(base), "__call__", with_bos)
    assert MarginScorer(model, base, load_msp_prompt("table6", "en")).prefix_ids == [bos, *plain]
    base.chat_template = "<|endoftext|>{{ messages[0].content }}"  # the template writes the <bos>
    templated = MarginScorer(model, base, load_msp_prompt("table6", "en")).prefix_ids
    assert templated[0] == bos and templated[1] != bos


def test_scorer_answer_tokens_and_prefix(scorers, tiny_lm):
    _, tok = tiny_lm
    for scorer in scorers.values():
        assert tok.decode([scorer.keep_id]).strip() == "2"
        assert tok.decode([scorer.split_id]).strip() == "1"
        assert scorer.keep_id != scorer.split_id
        assert scorer.head.startswith("<|im_start|>system")
        assert scorer.prompt.instruction in scorer.head
        assert scorer.tail.endswith("<|im_start|>assistant\n")
        full = tok.decode(scorer.prefix_ids + scorer.pair_ids("  One.  ", "Two.\n"))
        assert full.endswith(
            scorer.prompt.pair_template.format(sentence1="One.", sentence2="Two.") + scorer.tail
        )


def test_margin_sign_from_logits(scorers):
    import torch

    scorer = scorers["en"]
    vocab = 1 + max(scorer.keep_id, scorer.split_id, 100)
    logits = torch.zeros(4, vocab)
    logits[0, scorer.keep_id] = 30.0  # model says "2" = keep together
    logits[1, scorer.split_id] = 30.0  # model says "1" = split
    logits[3, scorer.keep_id] = logits[3, scorer.split_id] = 5.0
    logits[3, 0] = 6.0
    out = scorer.margins_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == np.float64 and out.shape == (4,)
    assert out[0] == pytest.approx(1.0, abs=1e-6) and out[0] > 0
    assert out[1] == pytest.approx(-1.0, abs=1e-6) and out[1] < 0
    assert out[2] == 0.0 and out[3] == 0.0
    probs = torch.softmax(torch.tensor([[2.0, 0.0, 1.0]]), dim=-1)[0]
    scorer_like = type("S", (), {"keep_id": 2, "split_id": 0})()
    got = MarginScorer.margins_from_logits(scorer_like, torch.tensor([[2.0, 0.0, 1.0]]))
    assert got[0] == pytest.approx(float(probs[2] - probs[0]))


PAIRS = [
    (
        "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world.",
        "She was the youngest.",
    ),
    ("Hi.", "Yes?"),
    ("今天天气很好，我们去公园散步。", "北京是中国的首都，上海是最大的城市。"),
    (
        "近日，抖音直播发布第二十期“不良直播PK内容”治理公示。",
        "公示显示，2023年7月1日以来，平台已对110991个账号进行处罚，并无限期回收1059个账号直播权限。",
    ),
    ("The answer is 1.", "The answer is 2.\n\nNew paragraph here."),
    (
        "Mixed 中英文 text: RAG 系统 uses chunking 分块 to work well。",
        "Retrieval-augmented generation (RAG) needs good text chunking…",
    ),
    (
        "Mr. Knightley was a sensible man about seven or eight and thirty, " * 3,
        "He said, “It's fine,” and she replied, “We'll see.”",
    ),
]


@pytest.mark.parametrize("lang", ["en", "zh", "released"])
def test_prefix_cache_matches_single_pass(scorers, lang, monkeypatch):
    scorer = scorers[lang]
    single = np.array([scorer.margin_single(a, b) for a, b in PAIRS])
    batched = scorer.margins(PAIRS, batch_size=3)
    assert batched.shape == (len(PAIRS),)
    np.testing.assert_allclose(batched, single, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scorer.margins(PAIRS, batch_size=1), single, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scorer.margins(PAIRS[::-1], batch_size=8), single[::-1], atol=1e-5, rtol=0)
    assert np.all(np.abs(single) <= 1)
    assert scorer.margins([], batch_size=3).shape == (0,)

    # Probabilities of a random 1.5K-vocab model are ~1e-3, so margins alone are a weak check:
    # capture the full next-token logits of every pair and compare those.
    rows = []

    def capture(logits):
        rows.extend(logits.float().cpu())
        return np.arange(len(rows) - len(logits), len(rows), dtype=np.float64)

    monkeypatch.setattr(scorer, "margins_from_logits", capture)
    single_rows = [rows[int(scorer.margin_single(a, b))] for a, b in PAIRS]
    batched_rows = [rows[int(k)] for k in scorer.margins(PAIRS, batch_size=3)]
    for got, want in zip(batched_rows, single_rows):
        assert float((got - want).abs().max()) < 1e-4
    # the pairs are distinguishable, so a mix-up of rows would show
    assert min(float((a - b).abs().max()) for a, b in zip(single_rows, single_rows[1:])) > 1e-2


def test_chunker_msp_tiny_tiles(tiny_model_dir: Path):
    from metachunk.chunking.pipeline import ChunkConfig, Chunker

    docs = [
        "Emma was clever. She was rich!\n\nMr. Knightley came. He was sensible? Yes. " * 2,
        "今天天气很好，我们去公园散步。北京是中国的首都。上海是最大的城市！\n\n模型训练完成后，我们评估了它。",
        "",
    ]
    for mode in ("pair", "accumulated"):
        cfg = ChunkConfig(
            method="msp", model=str(tiny_model_dir), msp_mode=mode, dynamic_threshold=True, device="cpu"
        )
        chunker = Chunker(cfg)
        out = chunker.chunk(["en", "zh", "empty"], docs)
        assert [d.lang for d in out[:2]] == ["en", "zh"]
        assert set(chunker.prompt_sha256) == {"msp_table6.en", "msp_table6.zh"}
        for d in out:
            assert "".join(c.text for c in d.chunks) == d.text
            assert all(c.text == d.text[c.start : c.end] and c.text for c in d.chunks)
            if d.sentences:
                assert d.sentences[0].score is None
                assert all(-1 <= s.score <= 1 for s in d.sentences[1:])
                assert d.thresholds[0] is None and d.thresholds[1] == 0.0


# --------------------------------------------------------------------------------------------
# Real model (integration)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emma_15() -> str:
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        paragraphs = [json.loads(line)["text"] for line in f][21:40]
    doc = "\n\n".join(paragraphs)
    sents = split_sentences(doc, "en")
    assert len(sents) >= 15
    return doc[: sents[14].end]


@pytest.mark.integration
def test_chunker_msp_smollm2(smollm2, emma_15, monkeypatch):
    from metachunk.chunking.pipeline import ChunkConfig, Chunker

    import metachunk.models

    model, tok = smollm2
    monkeypatch.setattr(metachunk.models, "load_causal_lm_model", lambda *a, **k: model)
    sents = split_sentences(emma_15, "en")
    assert len(sents) == 15
    reference = MarginScorer(model, tok, load_msp_prompt("table6", "en"))
    texts = [emma_15[s.start : s.end].strip() for s in sents]
    single = [reference.margin_single(a, b) for a, b in zip(texts, texts[1:])]
    theta = float(np.median(single))  # a θ with decisions both ways

    for mode in ("pair", "accumulated"):
        cfg = ChunkConfig(
            method="msp", model="smollm2", msp_mode=mode, threshold=theta, device="cpu", batch_size=4
        )
        chunker = Chunker(cfg)
        (d,) = chunker.chunk(["emma"], [emma_15])
        assert chunker.prompt_sha256 == {"msp_table6.en": load_msp_prompt("table6", "en").sha256}
        assert d.lang == "en" and len(d.sentences) == 15
        assert "".join(c.text for c in d.chunks) == emma_15
        assert all(c.text == emma_15[c.start : c.end] and c.text for c in d.chunks)
        margins = [s.score for s in d.sentences]
        assert margins[0] is None and all(-1 <= m <= 1 for m in margins[1:])
        assert d.thresholds == [None] + [theta] * 14
        if mode == "pair":
            np.testing.assert_allclose(margins[1:], single, atol=1e-4, rtol=0)
            expected = [i - 1 for i, m in enumerate(single, start=1) if not m > theta]
            ambiguous = {i - 1 for i, m in enumerate(single, start=1) if abs(m - theta) < 1e-4}
            assert set(d.boundaries) ^ set(expected) <= ambiguous
            assert 0 < len(expected) < 14


@given(
    lengths=st.lists(st.integers(min_value=1, max_value=400), max_size=60),
    batch_size=st.integers(min_value=1, max_value=16),
    pass_tokens=st.sampled_from([0, 1024]),
)
def test_length_batches_cover_every_pair_once_within_limits(lengths, batch_size, pass_tokens):
    from metachunk.chunking.msp import MAX_PADDING, length_batches

    batches = length_batches(lengths, batch_size, pass_tokens=pass_tokens)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert 1 <= len(b) <= batch_size
        if len(b) > 1:
            real = sum(lengths[i] for i in b)
            padding = len(b) * max(lengths[i] for i in b) - real
            assert padding <= max(MAX_PADDING * real + 1e-9, pass_tokens)
    # a GPU's allowance only ever merges passes
    assert len(batches) <= len(length_batches(lengths, batch_size))


def test_gpu_plan_pads_to_save_passes_and_reads_free_memory_once(scorers, monkeypatch):
    """On a GPU a pass may pad by GPU_PASS_TOKENS (fewer, wider passes); its rows are read from
    free memory once per scorer, so the allocator's cache after a first batch changes no later
    batch's shape (a fake device and free-memory figure: no GPU needed)."""
    import torch
    from metachunk.chunking import msp

    scorer = scorers["en"]
    lengths = [40 + 7 * k for k in range(64)]  # 40..481 tokens
    cpu = scorer.plan(lengths, 64)
    assert cpu == msp.length_batches(lengths, 64) and len(cpu) > 10

    gpu = msp.MarginScorer(scorer.model, scorer.tokenizer, scorer.prompt)
    monkeypatch.setattr(gpu, "device", torch.device("cuda"))
    free = iter([80 * 2**30, 20 * 2**30])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (next(free), 80 * 2**30))
    wide = gpu.plan(lengths, 64)
    assert wide == msp.length_batches(lengths, 64, pass_tokens=msp.GPU_PASS_TOKENS)
    assert len(wide) < len(cpu) // 2
    rows = gpu.rows
    assert rows > 64 and gpu.plan(lengths) == gpu.plan(lengths) and gpu.rows == rows


def test_pairs_per_batch_follow_the_device(scorers, monkeypatch):
    """8 pairs a batch on CPU (every CPU figure's plan); on a GPU what the engine's budget for its
    free memory holds, each row counted as the prefix plus GPU_PAIR_TOKENS (a fake free-memory
    figure: no GPU needed)."""
    import torch
    from metachunk.chunking import msp

    from metachunk.engine.scoring import batch_budget

    scorer = scorers["en"]
    assert scorer.default_rows() == msp.CPU_PAIR_ROWS == 8
    monkeypatch.setattr(scorer, "device", torch.device("cuda"))
    row = len(scorer.prefix_ids) + msp.GPU_PAIR_TOKENS
    for free in (10 * 2**30, 80 * 2**30):
        tokens, _ = batch_budget(scorer.model, row, torch.device("cuda"), free)
        assert scorer.default_rows(free_bytes=free) == max(8, tokens // row) > 8
