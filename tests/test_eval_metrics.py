"""The QA metrics under eval/metrics/: local `evaluate` modules, checked against hand-computed values
and against the reference implementations where their definitions coincide."""

from __future__ import annotations

import math
import socket

import pytest

evaluate = pytest.importorskip("evaluate")
jieba = pytest.importorskip("jieba")

from metachunk.eval.metrics import METRICS, load, metric_path, qa_scores  # noqa: E402


def lcut(text: str) -> list[str]:
    return list(jieba.cut(text))


def test_every_metric_loads_offline_with_evaluate_load(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("evaluate.load tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in METRICS:
        metric = evaluate.load(metric_path(name))
        assert isinstance(metric, evaluate.Metric)
        info = metric.info
        assert info.description.strip() and info.citation.strip() and info.inputs_description.strip()
        assert {"predictions", "references"} <= set(
            info.features[0] if isinstance(info.features, list) else info.features
        )
    with pytest.raises(ValueError, match="unknown metric"):
        metric_path("rouge")


@pytest.mark.parametrize("name", ["crud_bleu", "rouge_l", "longbench_f1"])
def test_lang_is_required(name):
    for lang in (None, "fr"):
        with pytest.raises(ValueError, match="lang must be 'zh' or 'en'"):
            load(name).compute(predictions=["a"], references=["a"], lang=lang)


# ----------------------------------------------------------------------------------------- BLEU


def test_bleu_by_hand_on_whitespace_tokens():
    # pred a b c d e / ref a b c d f g: p1..p4 = 4/5, 3/4, 2/3, 1/2; c = 5, r = 6
    bleu = load("crud_bleu")
    args = {
        "predictions": ["a b c d e"],
        "references": ["a b c d f g"],
        "lang": "en",
        "tokenizer": "whitespace",
    }
    geo = (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    bp = math.exp(1 - 6 / 5)
    crud = bleu.compute(**args)  # CRUD default: the brevity penalty is divided out
    assert [crud[f"bleu_{n}"] for n in range(1, 5)] == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1 / 2], abs=1e-15)
    assert crud["bleu_avg"] == pytest.approx(geo, abs=1e-15)
    assert crud["brevity_penalty"] == pytest.approx(bp, abs=1e-15)
    standard = bleu.compute(**args, with_penalty=True)
    assert standard["bleu_avg"] == pytest.approx(geo * bp, abs=1e-15)
    assert standard["bleu_1"] == crud["bleu_1"]  # BLEU-n are precisions in both modes
    # a longer prediction has no penalty: both modes agree
    longer = {**args, "predictions": ["a b c d e h i"]}
    assert bleu.compute(**longer)["bleu_avg"] == bleu.compute(**longer, with_penalty=True)["bleu_avg"]
    # no 4-gram match -> geometric mean 0, BLEU-1..3 still reported
    none4 = bleu.compute(predictions=["a b c x d"], references=["a b c d"], lang="en", tokenizer="whitespace")
    assert none4["bleu_avg"] == 0.0 and none4["bleu_1"] == pytest.approx(4 / 5) and none4["bleu_4"] == 0.0


def test_bleu_chinese_jieba_tokens_by_hand():
    pred, ref = "我来到了网易杭研大厦", "他昨天来到了网易杭研大厦"
    assert lcut(pred) == ["我", "来到", "了", "网易", "杭研", "大厦"]
    assert lcut(ref) == ["他", "昨天", "来到", "了", "网易", "杭研", "大厦"]
    # p1 = 5/6, p2 = 4/5, p3 = 3/4, p4 = 2/3 -> geo = (1/3)^(1/4); c = 6, r = 7 -> BP = exp(-1/6)
    bleu = load("crud_bleu")
    crud = bleu.compute(predictions=[pred], references=[ref], lang="zh")
    assert [crud[f"bleu_{n}"] for n in range(1, 5)] == pytest.approx([5 / 6, 4 / 5, 3 / 4, 2 / 3], abs=1e-15)
    assert crud["bleu_avg"] == pytest.approx((1 / 3) ** 0.25, abs=1e-15)
    standard = bleu.compute(predictions=[pred], references=[ref], lang="zh", with_penalty=True)
    assert standard["bleu_avg"] == pytest.approx((1 / 3) ** 0.25 * math.exp(-1 / 6), abs=1e-15)
    # the mean over examples is CRUD's compute_overall: per-example scores averaged
    two = bleu.compute(predictions=[pred, "我爱北京天安门"], references=[ref, "我爱北京"], lang="zh")
    assert lcut("我爱北京天安门") == ["我", "爱", "北京", "天安门"]
    assert two["scores"] == pytest.approx([(1 / 3) ** 0.25, 0.0])  # no 4-gram in a 3-token reference
    assert two["bleu_1"] == pytest.approx((5 / 6 + 3 / 4) / 2)
    assert two["bleu_avg"] == pytest.approx((1 / 3) ** 0.25 / 2)
    # jieba keeps spaces and punctuation as tokens, as CRUD's list(jieba.cut(text)) does
    spaced = bleu.compute(predictions=["北京 天安门"], references=["北京天安门"], lang="zh")
    assert lcut("北京 天安门") == ["北京", " ", "天安门"]
    assert spaced["bleu_1"] == pytest.approx(2 / 3)


def test_bleu_matches_nltk_where_definitions_coincide():
    from nltk.translate.bleu_score import corpus_bleu

    bleu = load("crud_bleu")
    pairs = [
        ("the quick brown fox jumps over the lazy dog", "the quick brown fox jumped over the lazy dog"),
        ("a cat sat on the mat and the cat slept", "the cat sat on the mat"),
        ("it is a guide to action which ensures that the military always obeys",
         "it is a guide to action that ensures that the military will forever heed party commands"),
        ("one two three four five", "one two three four five six seven eight"),
    ]  # fmt: skip
    preds, refs = [p for p, _ in pairs], [r for _, r in pairs]
    ours = bleu.compute(predictions=preds, references=refs, lang="en", with_penalty=True)
    crud = bleu.compute(predictions=preds, references=refs, lang="en")
    for (pred, ref), score, score_no_bp, bp in zip(
        pairs, ours["scores"], crud["scores"], ours["brevity_penalties"]
    ):
        # one segment, one reference: NMT (shortest ref) and nltk (closest ref) brevity penalties agree;
        # no punctuation, so 13a tokens are the whitespace tokens
        expected = corpus_bleu([[ref.split()]], [pred.split()])
        assert score == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert score_no_bp == pytest.approx(expected / bp, rel=1e-12, abs=1e-12)


def test_bleu_13a_tokens_multi_reference_and_empty():
    bleu = load("crud_bleu")
    # 13a splits punctuation off: "mat." == "mat ."
    r = bleu.compute(
        predictions=["the cat sat on the mat."], references=["the cat sat on the mat ."], lang="en"
    )
    assert r["bleu_avg"] == pytest.approx(1.0)
    # several references: counts clipped by the max over references, BP from the shortest (NMT)
    multi = bleu.compute(
        predictions=["a b c d e"],
        references=[["a b c d f g", "x"]],
        lang="en",
        tokenizer="whitespace",
        with_penalty=True,
    )
    assert multi["brevity_penalty"] == 1.0 and multi["bleu_avg"] == pytest.approx(
        (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    )
    empty = bleu.compute(predictions=["", "a"], references=["a b", ""], lang="zh")
    assert empty["scores"] == [0.0, 0.0] and empty["bleu_1"] == 0.0


# --------------------------------------------------------------------------------------- ROUGE-L


def test_rouge_l_chinese_lcs_by_hand():
    pred, ref = "我爱北京天安门", "我在北京看天安门"
    assert lcut(ref) == ["我", "在", "北京", "看", "天安门"]
    # LCS(我 爱 北京 天安门, 我 在 北京 看 天安门) = 我 北京 天安门 = 3; P = 3/4, R = 3/5
    r = load("rouge_l").compute(predictions=[pred], references=[ref], lang="zh")
    assert r["rouge_l_precision"] == pytest.approx(3 / 4) and r["rouge_l_recall"] == pytest.approx(3 / 5)
    assert r["rouge_l"] == pytest.approx(2 * 0.75 * 0.6 / 1.35)
    # rouge-score's own tokenizer keeps [a-z0-9] only: Chinese scores 0, the trap jieba avoids
    default = load("rouge_l").compute(predictions=[pred], references=[ref], lang="zh", tokenizer="default")
    assert default["rouge_l"] == 0.0


def test_rouge_l_english_and_multi_reference():
    rouge = load("rouge_l")
    # rouge-score default tokens: lowercase, punctuation dropped; LCS 3 of 3 vs 4
    r = rouge.compute(predictions=["The cat, sat!"], references=["the cat sat down"], lang="en")
    assert r["rouge_l"] == pytest.approx(2 * 1 * 0.75 / 1.75)
    for refs in (["a dog", "the cat sat"], ["the cat sat", "a dog"]):  # the best, wherever it is
        multi = rouge.compute(predictions=["the cat sat"], references=[refs], lang="en")
        assert multi["rouge_l"] == pytest.approx(1.0)
    mean = rouge.compute(predictions=["the cat sat", "x"], references=["the cat sat", "y"], lang="en")
    assert mean["scores"] == [1.0, 0.0] and mean["rouge_l"] == 0.5


# ------------------------------------------------------------------------------------ LongBench F1


def test_longbench_f1_english_normalisation():
    f1 = load("longbench_f1")

    def score(pred, ref):
        return f1.compute(predictions=[pred], references=[ref], lang="en")["f1"]

    assert score("The Eiffel Tower!", "eiffel tower") == 1.0  # case, article, punctuation
    assert score("a cat and the dog", "cat dog") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))  # 0.8
    assert score("U.S.A.", "usa") == 1.0  # punctuation removed inside words
    assert score("an banana", "banana") == 1.0  # articles only as whole words ("an" inside stays)
    assert score("the the", "a") == 0.0  # nothing left -> no overlap -> 0
    # Counter overlap clips repeats: 1 of 3 prediction tokens, 1 of 1 reference token
    assert score("paris paris london", "paris") == pytest.approx(0.5)
    for refs in (["red", "blue sky"], ["blue sky", "red"]):  # max over references (LongBench eval.py)
        best = f1.compute(predictions=["blue"], references=[refs], lang="en")
        assert best["f1"] == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_longbench_f1_chinese_normalisation():
    f1 = load("longbench_f1")
    assert lcut("北京，天安门。") == ["北京", "，", "天安门", "。"]
    # punctuation tokens normalise to "" and are dropped: [北京, 天安门] vs [天安门]
    r = f1.compute(predictions=["北京，天安门。", "答案是“北京”！"], references=["天安门", "北京"], lang="zh")
    assert lcut("答案是“北京”！") == ["答案", "是", "“", "北京", "”", "！"]
    assert r["scores"] == pytest.approx([2 / 3, 2 * (1 / 3) * 1 / (1 / 3 + 1)])
    assert r["f1"] == pytest.approx((2 / 3 + 0.5) / 2)
    # lowercase, ASCII and Chinese punctuation dropped, white space tokens dropped
    assert lcut("ABC，北京。") == ["ABC", "，", "北京", "。"] and lcut("abc 北京") == ["abc", " ", "北京"]
    assert f1.compute(predictions=["ABC，北京。"], references=["abc 北京"], lang="zh")["f1"] == 1.0
    assert f1.compute(predictions=["。！"], references=["北京"], lang="zh")["f1"] == 0.0


# ------------------------------------------------------------------------------------ qa_scores


def test_qa_scores_without_models():
    out = qa_scores(
        ["我来到了网易杭研大厦"], ["他昨天来到了网易杭研大厦"], "zh", bertscore_model=None, embedder=None
    )
    assert set(out) == {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "bleu_avg", "rouge_l", "f1"}
    assert out["bleu_avg"] == pytest.approx((1 / 3) ** 0.25)
    assert out["rouge_l"] == pytest.approx(2 * (5 / 6) * (5 / 7) / (5 / 6 + 5 / 7))  # LCS 5 of 6 vs 7
    assert out["f1"] == pytest.approx(out["rouge_l"])  # no punctuation, each token once: same counts
    assert all(isinstance(v, float) for v in out.values())
    with pytest.raises(ValueError):
        qa_scores(["a"], ["a", "b"], "en", None, None)


def test_qa_scores_per_item_average_to_the_means():
    preds, refs = (
        ["the cat sat on the mat", "Paris", "no idea"],
        ["the cat sat on a mat", "paris, France", "42"],
    )
    means, items = qa_scores(preds, refs, "en", bertscore_model=None, embedder=None, per_item=True)
    assert len(items) == 3 and all(set(i) == set(means) for i in items)
    for name, mean in means.items():  # what eval compare resamples is what the table reports
        assert sum(i[name] for i in items) / 3 == pytest.approx(mean)


# ----------------------------------------------------------------------- model-based (integration)


@pytest.mark.integration
def test_bertscore_local_minilm():
    pytest.importorskip("bert_score")
    from metachunk.models import ModelNotFoundError, resolve

    try:
        path = str(resolve("minilm"))
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    bs = load("bertscore")
    preds = ["the cat sat on the mat", "the cat sat on the mat", "the cat sat on the mat", ""]
    refs = ["the cat sat on the mat", "a cat was sitting on the mat", "stock prices fell sharply today", "x"]
    r = bs.compute(predictions=preds, references=refs, lang="en", device="cpu")
    assert r["num_layers"] == 6 and r["model"] == "minilm" and not r["rescaled"]
    assert r["scores"][0] == pytest.approx(1.0, abs=1e-5)
    assert r["precisions"][0] == pytest.approx(1.0, abs=1e-5) and r["recalls"][0] == pytest.approx(
        1.0, abs=1e-5
    )
    assert r["scores"][1] > r["scores"][2]  # a paraphrase beats an unrelated sentence
    assert r["scores"][3] == 0.0  # empty prediction
    assert r["f1"] == pytest.approx(sum(r["scores"]) / 4)
    # the same numbers as bert-score's own entry point with that folder and layer
    import bert_score

    _, _, f = bert_score.score(preds[:3], refs[:3], model_type=path, num_layers=6, device="cpu")
    assert r["scores"][:3] == pytest.approx(f.tolist(), abs=1e-6)


@pytest.mark.integration
def test_embedding_similarity_and_full_qa_scores():
    from metachunk.models import ModelNotFoundError, load_sentence_embedder

    try:
        model = load_sentence_embedder("minilm", device="cpu")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    sim = load("embedding_similarity")
    preds = ["the cat sat on the mat", "the cat sat on the mat", "  ", "Paris is the capital of France"]
    refs = [
        ["the cat sat on the mat"],
        ["stock prices fell sharply today"],
        ["x"],
        ["Berlin", "The capital of France is Paris"],
    ]
    r = sim.compute(predictions=preds, references=refs, lang="en", device="cpu")
    assert r["scores"][0] == pytest.approx(1.0, abs=1e-5)
    assert r["scores"][1] < 0.5 and r["scores"][2] == 0.0  # empty after strip -> 0, as text2vec
    from sentence_transformers.util import cos_sim

    e = model.encode([preds[3], refs[3][1]], convert_to_tensor=True)
    assert r["scores"][3] == pytest.approx(float(cos_sim(e[0], e[1])), abs=1e-5)  # best reference counts
    first = sim.compute(predictions=preds[3:], references=[refs[3][::-1]], lang="en", device="cpu")
    assert first["scores"][0] == pytest.approx(r["scores"][3], abs=1e-5)  # first or last

    out = qa_scores(["the cat sat on the mat", "Paris"], ["the cat sat on the mat", "paris, France"], "en")
    assert set(out) == {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "bleu_avg", "rouge_l", "bertscore_precision",
                        "bertscore_recall", "bertscore_f1", "embedding_similarity", "f1"}  # fmt: skip
    assert 0.5 < out["bertscore_f1"] <= 1.0 + 1e-6 and 0.5 < out["embedding_similarity"] <= 1.0 + 1e-6
    assert out["f1"] == pytest.approx((1.0 + 2 * 1 * 0.5 / 1.5) / 2)
