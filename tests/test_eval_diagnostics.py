"""``metachunk eval diagnostics``: PPL of rewrites, AVGSim@k and CP on planted retrieval files.

The embedder is a planted bag-of-words over four words, so every cosine is known by hand; CP and
PPL use the tiny random Qwen2 and are checked against a plain forward pass of the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from metachunk.eval import diagnostics as dg

from metachunk import config

VOCAB = ["apple", "banana", "cherry", "delta"]


class PlantedEmbedder:
    """Bag-of-words unit vectors, with the SentenceTransformer calls ``metachunk.eval.index.embed`` makes."""

    def __init__(self):
        self.embedded: list[str] = []

    @staticmethod
    def vector(text: str) -> np.ndarray:
        words = re.findall(r"[a-z]+", text.lower())
        v = np.array([words.count(w) for w in VOCAB], dtype=np.float32)
        return v / max(float(np.linalg.norm(v)), 1e-9)

    def encode(self, texts, **kwargs):
        self.embedded += list(texts)
        return np.stack([self.vector(t) for t in texts])

    def get_embedding_dimension(self) -> int:
        return len(VOCAB)


@pytest.fixture
def planted_embedder(monkeypatch):
    import metachunk.models

    embedder = PlantedEmbedder()
    monkeypatch.setattr(metachunk.models, "load_sentence_embedder", lambda name, device=None: embedder)
    return embedder


def hit(rank, text, indexed=None, score=0.5):
    return {"rank": rank, "doc_id": "d", "chunk_index": rank - 1, "start": 0, "end": len(text), "text": text,
            "indexed_text": indexed or text, "score": score, "relevant": False}  # fmt: skip


def write_retrieval(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            base = {"qid": i, "lang": "en", "relevant_any": False, "reranked": None}
            f.write(json.dumps({**base, **row}) + "\n")
    return path


# "same": three identical chunks; "mixed": the query is "apple banana", chunks "apple" and "banana"
SAME = [
    {
        "question": "apple",
        "answer": "the apple",
        "hits": [hit(r, "apple apple", score=0.9) for r in (1, 2, 3)],
    }
]
MIXED = [
    {"question": "apple banana", "answer": "an apple and a banana",
     "hits": [hit(1, "apple", score=0.7), hit(2, "banana", score=0.6), hit(3, "cherry", score=0.1)]},
    {"question": "delta?", "answer": None, "hits": [hit(1, "delta", score=1.0)]},
]  # fmt: skip


def test_avgsim_by_hand(tmp_path, planted_embedder):
    same = write_retrieval(tmp_path / "same" / "retrieval.jsonl", SAME)
    mixed = write_retrieval(tmp_path / "mixed.jsonl", MIXED)
    cfg = dg.DiagnosticsConfig(out=tmp_path / "o", retrieval=[str(same.parent), f"mix={mixed}"], models=[], k=2,
                               progress=False)  # fmt: skip
    m = dg.evaluate(cfg)["metrics"]
    # identical chunks, query = the chunk's words: every cosine is 1
    assert m["avgsim@2_same"] == pytest.approx(1.0) and m["pairsim@2_same"] == pytest.approx(1.0)
    assert m["retriever_avgsim@2_same"] == pytest.approx(0.9)
    # q1: cos(apple banana, apple) = cos(., banana) = 1/sqrt 2, chunks orthogonal; q2: one hit, cos 1, no pair
    assert m["avgsim@2_mix"] == pytest.approx((1 / math.sqrt(2) + 1.0) / 2)
    assert m["pairsim@2_mix"] == pytest.approx(0.0)
    assert m["retriever_avgsim@2_mix"] == pytest.approx((0.65 + 1.0) / 2)  # the stored scores, top 2
    assert "cherry" not in planted_embedder.embedded  # rank 3 is beyond k


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from metachunk.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), device="cpu", dtype="float32")


def forward_nll(model, ids: list[int], first: int) -> float:
    """-mean log P(ids[t] | ids[:t]) over t >= first, from one plain forward pass."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return float(-np.mean([logp[t - 1, ids[t]].item() for t in range(first, len(ids))]))


def test_cp_equals_hand_computed_log_prob(tiny):
    model, tokenizer = tiny
    rows = [
        {"question": "Who is rich?", "answer": " Emma is rich.",
         "hits": [{"text": "Emma Woodhouse was rich."}, {"text": "She lived at Hartfield."}, {"text": "ignored"}]},
        {"question": "No answer", "answer": None, "hits": [{"text": "x"}]},
    ]  # fmt: skip
    got = dg.cp_scores(model, tokenizer, rows, k=2)
    ids = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = ids("Emma Woodhouse was rich.\n\nShe lived at Hartfield.") + ids("\n\n")
    expected = forward_nll(model, head + ids("Emma is rich."), len(head))
    assert got[0] == pytest.approx(expected, abs=1e-4) and got[1] is None
    # with the question block
    got_q = dg.cp_scores(model, tokenizer, rows[:1], k=2, cp_prompt="question")[0]
    head_q = ids("Emma Woodhouse was rich.\n\nShe lived at Hartfield.") + ids(
        "\n\nQuestion: Who is rich?\nAnswer: "
    )
    assert got_q == pytest.approx(forward_nll(model, head_q + ids("Emma is rich."), len(head_q)), abs=1e-4)
    # a context too long for max_context keeps its first tokens and every answer token
    cut, first = dg.cp_ids(tokenizer, ["word " * 200], "the answer", max_context=40)
    assert len(cut) == 40 and cut[first:] == ids("the answer")


def write_rewrites(path: Path) -> Path:
    chunks = [
        {"text": "It was hot. ", "start": 0, "end": 12, "rewritten": "The summer in Highbury was hot."},
        {"text": "She left. ", "start": 12, "end": 22, "rewritten": "Emma left the party early."},
        {"text": "No rewrite here.", "start": 22, "end": 38},
    ]
    path.write_text(json.dumps({"schema_version": 1, "id": "d", "method": "ppl", "chunks": chunks}) + "\n")
    return path


def _parse(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, dg.CONFIG)
    return config.from_namespace(dg.CONFIG, parser.parse_args(argv))


def test_end_to_end_through_the_parser(tmp_path, tiny, tiny_model_dir, planted_embedder, capsys):
    model, tokenizer = tiny
    chunks = write_rewrites(tmp_path / "rag.jsonl")
    a = write_retrieval(tmp_path / "original" / "retrieval.jsonl", MIXED)
    b = write_retrieval(tmp_path / "rewritten.jsonl", SAME)
    out = tmp_path / "diag"
    cfg = _parse(["--out", str(out), "--chunks", str(chunks), "--retrieval", str(a.parent), f"rewritten={b}",
                  "--models", str(tiny_model_dir), "--k", "2", "--no-progress", "--dtype", "float32"])  # fmt: skip
    assert cfg.retrieval == [str(a.parent), f"rewritten={b}"] and cfg.k == 2
    assert dg.run(cfg).exit == 0
    doc = json.loads((out / "metrics.json").read_text())
    m, name = doc["metrics"], dg.model_label(str(tiny_model_dir))
    assert doc["command"] == "diagnostics"
    assert (m["rewritten_chunks"], m["chunks_without_rewrite"]) == (2, 1)
    # PPL: exp(mean NLL) of each text after the lead tokens (a single space for this tokenizer)
    lead = tokenizer(" ", add_special_tokens=False)["input_ids"]
    ppl = {t: math.exp(forward_nll(model, lead + tokenizer(t)["input_ids"], len(lead)))
           for t in ["It was hot. ", "She left. ", "The summer in Highbury was hot.", "Emma left the party early."]}  # fmt: skip
    assert m[f"ppl_original_{name}"] == pytest.approx((ppl["It was hot. "] + ppl["She left. "]) / 2, rel=1e-4)
    rewritten = [ppl["The summer in Highbury was hot."], ppl["Emma left the party early."]]
    assert m[f"ppl_rewritten_{name}"] == pytest.approx(np.mean(rewritten), rel=1e-4)
    assert 0 <= m[f"ppl_rewritten_lower_share_{name}"] <= 1
    # AVGSim per label, CP per model and label (the question without an answer is skipped)
    assert m["avgsim@2_rewritten"] == pytest.approx(1.0) and m["pairsim@2_original"] == pytest.approx(0.0)
    assert m[f"cp_{name}_original"] > 0 and m[f"cp_{name}_rewritten"] > 0
    assert doc["details"]["cp"][name]["original"]["skipped_no_answer"] == 1
    for png in ("ppl_rewrite.png", "avgsim.png", "cp.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "## Retrieved chunks" in report and "| rewritten |" in report and "![cp](cp.png)" in report
    assert "avgsim@2_original" in capsys.readouterr().err


def test_input_errors(tmp_path, tiny_model_dir, capsys):
    no_rewrite = tmp_path / "c.jsonl"
    no_rewrite.write_text(json.dumps({"id": "d", "chunks": [{"text": "a", "start": 0, "end": 1}]}) + "\n")
    assert (
        dg.run(dg.DiagnosticsConfig(out=tmp_path / "o", chunks=no_rewrite, models=[str(tiny_model_dir)])).exit
        == 2
    )
    assert "no chunk carries a 'rewritten'" in capsys.readouterr().err
    assert (
        dg.run(dg.DiagnosticsConfig(out=tmp_path / "o", retrieval=[str(tmp_path / "missing.jsonl")])).exit
        == 2
    )
    assert "no such retrieval file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    assert dg.run(dg.DiagnosticsConfig(out=tmp_path / "o", retrieval=[str(bad)])).exit == 2
    assert "bad.jsonl:1:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give --chunks"):
        dg.DiagnosticsConfig(out=tmp_path)


def test_items_and_intervals(tmp_path, planted_embedder):
    """Every metric is the mean of its items.jsonl lines; each mean and each paired difference
    gets a bootstrap interval that holds the mean, and the same seed gives the same interval."""
    rows = [{"question": "apple banana", "answer": None,
             "hits": [hit(1, "apple " * (1 + i % 3) + "banana" * (i % 2)), hit(2, "cherry")]} for i in range(12)]  # fmt: skip
    rows_b = [
        {"question": "apple banana", "answer": None, "hits": [hit(1, "apple banana"), hit(2, "banana")]}
    ] * 12
    a = write_retrieval(tmp_path / "chunk.jsonl", rows)
    b = write_retrieval(tmp_path / "summary.jsonl", rows_b)
    out = tmp_path / "diag"
    cfg = dg.DiagnosticsConfig(
        out=out, retrieval=[f"chunk={a}", f"summary={b}"], models=[], k=2, progress=False
    )
    assert dg.run(cfg).exit == 0
    doc = json.loads((out / "metrics.json").read_text())
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert sorted(row["id"] for row in items) == sorted(f"q:{i}" for i in range(12))
    for name in ("avgsim@2_chunk", "avgsim@2_summary", "pairsim@2_chunk"):
        assert doc["metrics"][name] == pytest.approx(np.mean([row[name] for row in items]))
        lo, hi = doc["details"]["statistics"]["intervals"][name]["interval"]
        assert lo <= doc["metrics"][name] <= hi
    diff = {d["metric"]: d for d in doc["details"]["statistics"]["differences"]}["avgsim@2_summary"]
    assert diff["baseline"] == "avgsim@2_chunk" and diff["paired_items"] == 12
    assert diff["difference"] == pytest.approx(
        doc["metrics"]["avgsim@2_summary"] - doc["metrics"]["avgsim@2_chunk"]
    )
    # "apple banana" matches its question better than every chunk of the first file
    assert diff["resolved"] and diff["interval"][0] > 0
    report = (out / "report.md").read_text()
    assert "## 95% bootstrap intervals" in report and "avgsim@2_summary − avgsim@2_chunk" in report
    again = dg.evaluate(cfg)["details"]["statistics"]
    assert again == doc["details"]["statistics"]


def test_bad_retrieval_rows_are_skipped_on_request(tmp_path, planted_embedder):
    """``--on-bad-row skip`` (tests/test_bad_rows.py has the other commands)."""
    good = write_retrieval(tmp_path / "good.jsonl", MIXED)
    lines = good.read_text().splitlines(keepends=True)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join([lines[0], '{"question": "no hits"}\n', lines[1], "{oops\n"]))
    run = lambda path, out, **kw: dg.run(  # noqa: E731
        dg.DiagnosticsConfig(
            out=tmp_path / out, retrieval=[f"a={path}"], models=[], k=2, progress=False, **kw
        )
    )
    assert run(good, "good").exit == 0
    result = run(mixed, "mixed", bad_rows=dg.BadRows(on_bad_row="skip"))
    assert result.exit == 6 and result.rejects["rows"] == 2
    assert (tmp_path / "mixed" / "items.jsonl").read_bytes() == (
        tmp_path / "good" / "items.jsonl"
    ).read_bytes()
    rejects = [json.loads(x) for x in (tmp_path / "mixed.rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [2, 4]
    assert run(mixed, "strict").exit == 2
