"""``metachunk eval chunk-quality``: BC and CS on hand-made perplexities, batched = pair-by-pair
scoring on the tiny model, and a small end-to-end run through the CLI parser."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from metachunk.eval import chunk_quality as cq

from metachunk import config

NAN = float("nan")

# ppl of each chunk read alone, and C[i, j] = ppl(chunk j | chunk i) (row: context d, column: q)
ALONE = [10.0, 10.0, 20.0]
COND = [
    [NAN, 2.0, 4.0],  # Edge: 0.8, 0.8
    [3.0, NAN, 6.0],  # Edge: 0.7, 0.7
    [9.0, 6.0, NAN],  # Edge: 0.1, 0.4
]


def test_edge_weights_sign_and_direction():
    w = cq.edge_weights(ALONE, COND)
    # W[i, j] = (ppl(c_j) - ppl(c_j | c_i)) / ppl(c_j): positive when the context helps
    assert w[0, 1] == pytest.approx(0.8) and w[1, 2] == pytest.approx(0.7) and w[2, 0] == pytest.approx(0.1)
    assert np.isnan(np.diag(w)).all()


def test_boundary_clarity_hand_computed():
    bc = cq.boundary_clarity(ALONE, COND, "paper")
    # boundaries 0->1 and 1->2: ppl(next | previous) / ppl(next)
    assert bc.tolist() == pytest.approx([2.0 / 10.0, 6.0 / 20.0])
    released = cq.boundary_clarity(ALONE, COND, "released")  # ratio of mean NLLs = of log ppl
    assert released.tolist() == pytest.approx([math.log(2) / math.log(10), math.log(6) / math.log(20)])
    assert cq.boundary_clarity([5.0], [[NAN]]).size == 0  # one chunk: no boundary


def test_chunk_stickiness_hand_computed():
    # paper, K = 0.5: kept (d -> q) = (0,1) 0.8, (0,2) 0.8, (1,0) 0.7, (1,2) 0.7
    assert cq.kept_edges(ALONE, COND, 0.5, "paper", "complete") == [(0, 1), (0, 2), (1, 0), (1, 2)]
    # degrees 3, 3, 2 over 2m = 8
    expected = -(2 * (3 / 8) * math.log2(3 / 8) + (2 / 8) * math.log2(2 / 8))
    assert cq.chunk_stickiness(ALONE, COND, 0.5, "paper", "complete") == (pytest.approx(expected), 4)
    # incomplete graph: only j > i, (0,1), (0,2), (1,2): degrees 2, 2, 2 -> log2 3
    assert cq.chunk_stickiness(ALONE, COND, 0.5, "paper", "incomplete") == (pytest.approx(math.log2(3)), 3)
    # K = 0.75 keeps (0,1), (0,2) only: degrees 2, 1, 1 over 4
    assert cq.chunk_stickiness(ALONE, COND, 0.75, "paper", "complete")[0] == pytest.approx(1.5)
    # no edge survives K = 0.9: m = 0 -> CS = 0
    assert cq.chunk_stickiness(ALONE, COND, 0.9, "paper", "complete") == (0.0, 0)


def test_released_convention_keeps_the_weak_pairs():
    # ppl(q|d) / ppl(q) > K: 1 - Edge > 0.5 -> (2,0) 0.9 and (2,1) 0.6
    assert cq.kept_edges(ALONE, COND, 0.5, "released", "complete") == [(2, 0), (2, 1)]
    assert cq.chunk_stickiness(ALONE, COND, 0.5, "released", "complete") == (pytest.approx(1.5), 2)
    assert cq.chunk_stickiness(ALONE, COND, 0.5, "released", "incomplete") == (0.0, 0)  # both go backward


def test_uncomputed_pairs_are_no_edges():
    cond = np.array(COND)
    cond[0, 2] = NAN
    assert (0, 2) not in cq.kept_edges(ALONE, cond, 0.5, "paper", "complete")
    assert (0, 2) not in cq.kept_edges(ALONE, cond, 0.5, "released", "complete")


def test_structural_entropy():
    assert cq.structural_entropy([], 4) == 0.0
    assert cq.structural_entropy([(0, 1)], 3) == pytest.approx(1.0)
    assert cq.structural_entropy([(0, 1), (1, 2), (2, 3), (3, 0)], 4) == pytest.approx(2.0)


def test_pair_selection_nearest_first():
    assert cq.select_pairs(3) == [(0, 1), (1, 2), (1, 0), (2, 1), (0, 2), (2, 0)]
    assert cq.select_pairs(4, 3) == [(0, 1), (1, 2), (2, 3)]  # adjacent pairs (BC) come first
    assert cq.select_pairs(4, 4) == [(0, 1), (1, 2), (2, 3), (1, 0)]  # then the nearest others
    # A cap below the boundaries still scores every boundary: the first few would be the opening ones only.
    assert cq.select_pairs(30, 8) == [(i, i + 1) for i in range(29)]
    assert len(cq.select_pairs(5, 0)) == 20


TEXTS = [
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years. ",
    "She was the youngest of the two daughters of a most affectionate father. ",
    "Sixteen years had Miss Taylor been in Mr. Woodhouse's family. ",
    "The wedding was very much like other weddings. ",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from metachunk.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), device="cpu")


def test_batched_conditional_nll_equals_pair_by_pair(tiny):
    model, tokenizer = tiny
    pairs = cq.select_pairs(len(TEXTS))
    fast = cq.mean_nll_matrix(model, tokenizer, TEXTS, pairs, batched=True, batch_size=3)
    slow = cq.mean_nll_matrix(model, tokenizer, TEXTS, pairs, batched=False)
    # float32 sums in another order once rows are padded into a batch: a few parts in 1e5
    np.testing.assert_allclose(fast[0], slow[0], atol=1e-4, rtol=5e-5)
    np.testing.assert_allclose(fast[1], slow[1], atol=1e-4, rtol=5e-5)  # NaN on the diagonal in both
    assert np.isnan(np.diag(fast[1])).all() and not np.isnan(fast[1][~np.eye(4, dtype=bool)]).any()
    # and in ppl, which the metrics use (exp turns the NLL's absolute tolerance into a relative one)
    np.testing.assert_allclose(np.exp(fast[1]), np.exp(slow[1]), rtol=2e-4)


def test_continuation_nll_per_token_matches_one_pass(tiny):
    from metachunk.engine.scoring import continuation_nll, token_nll

    model, tokenizer = tiny
    prefix = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    conts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[1:]] + [[]]
    got = continuation_nll(model, prefix, conts, max_batch_size=2)
    for cont, values in zip(conts, got):
        assert len(values) == len(cont)
        if cont:
            (ref,) = token_nll(model, [prefix + cont])
            np.testing.assert_allclose(values, ref[len(prefix) :], atol=1e-4)


def _chunks_file(path, docs):
    with path.open("w", encoding="utf-8") as f:
        for doc_id, texts in docs.items():
            start, chunks = 0, []
            for t in texts:
                chunks.append({"text": t, "start": start, "end": start + len(t)})
                start += len(t)
            f.write(json.dumps({"schema_version": 1, "id": doc_id, "method": "ppl", "chunks": chunks}) + "\n")
    return path


def _parse(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, cq.CONFIG)
    return config.from_namespace(cq.CONFIG, parser.parse_args(argv))


def test_a_cap_below_the_boundaries_still_scores_every_boundary(tmp_path, tiny_model_dir):
    chunks = _chunks_file(tmp_path / "chunks.jsonl", {"a": TEXTS, "b": TEXTS[:3]})
    cfg = _parse(["--chunks", str(chunks), "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"),
                  "--max-pairs", "1", "--no-progress"])  # fmt: skip
    assert cq.run(cfg).exit == 0
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    # a: 4 chunks, 3 boundaries; b: 3 chunks, 2; a cap of 1 pair per document scores all 5, and no other pair
    assert (m["boundaries"], m["pairs_computed"], m["docs_capped"]) == (5, 5, 2)
    assert m["cs_complete"] == m["cs_incomplete"]  # the same path graph: CS restates BC


def test_end_to_end_through_the_parser(tmp_path, tiny_model_dir, capsys):
    chunks = _chunks_file(tmp_path / "chunks.jsonl", {"a": TEXTS, "b": TEXTS[:3], "single": TEXTS[:1]})
    out = tmp_path / "run"
    cfg = _parse(["--chunks", str(chunks), "--model", str(tiny_model_dir), "--out", str(out),
                  "--max-pairs", "4", "--k", "0.05", "--no-progress"])  # fmt: skip
    assert cfg.max_pairs == 4 and cfg.k == 0.05 and cfg.convention == "paper"
    assert cq.run(cfg).exit == 0
    doc = json.loads((out / "metrics.json").read_text())
    m = doc["metrics"]
    assert doc["command"] == "chunk-quality" and doc["config"]["max_pairs"] == 4
    # a: 4 chunks, 12 pairs capped to 4 (3 adjacent + 1); b: 3 chunks, 6 pairs capped to 4; single skipped
    assert (m["pairs_computed"], m["pairs_total"], m["docs_capped"]) == (8, 18, 2)
    assert (m["docs"], m["docs_skipped"], m["boundaries"], m["max_pairs"], m["k"]) == (2, 1, 5, 4, 0.05)
    docs = {d["id"]: d for d in doc["details"]["documents"]}
    assert docs["single"]["skipped"] and docs["a"]["pairs_computed"] == 4
    # the stored matrices give back every metric
    bcs, cs = [], []
    for d in (docs["a"], docs["b"]):
        alone = np.exp(np.array(d["nll_alone"], dtype=float))
        cond = np.exp(np.array([[NAN if x is None else x for x in r] for r in d["nll_cond"]], dtype=float))
        assert np.isfinite(cond).sum() == 4
        bcs += cq.boundary_clarity(alone, cond).tolist()
        cs.append(cq.chunk_stickiness(alone, cond, 0.05, "paper", "complete")[0])
        assert d["cs_incomplete"] == pytest.approx(
            cq.chunk_stickiness(alone, cond, 0.05, "paper", "incomplete")[0]
        )
    assert m["bc_mean"] == pytest.approx(np.mean(bcs), abs=1e-5)
    assert m["cs_complete"] == pytest.approx(np.mean(cs), abs=1e-9)
    assert (out / "chunk_quality.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "| bc_mean |" in report and "![chunk quality](chunk_quality.png)" in report
    assert "BC " in capsys.readouterr().err


def test_bad_input_exits_2(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "chunks": [{"start": 0}]}\n')
    cfg = cq.ChunkQualityConfig(chunks=bad, model=str(tiny_model_dir), out=tmp_path / "o", progress=False)
    assert cq.run(cfg).exit == 2
    assert "bad.jsonl:1:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'k' must be in"):
        cq.ChunkQualityConfig(chunks=bad, out=tmp_path, k=1.2)
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a", "chunks": [{"text": "One."}, {"text": "Two."}]}\n')
    cfg = cq.ChunkQualityConfig(chunks=good, model="no-such-model", out=tmp_path / "o", plot_doc="b")
    assert cq.run(cfg).exit == 2  # named before the model loads (this one does not exist)
    assert "good.jsonl: --plot-doc: no document 'b' among those read" in capsys.readouterr().err


def test_matrices_can_be_left_out(tmp_path, tiny_model_dir):
    chunks = _chunks_file(tmp_path / "chunks.jsonl", {"a": TEXTS[:3]})
    cfg = _parse(["--chunks", str(chunks), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r"),
                  "--no-save-matrices", "--convention", "released", "--no-progress"])  # fmt: skip
    assert cq.run(cfg).exit == 0
    doc = json.loads((tmp_path / "r" / "metrics.json").read_text())
    (d,) = doc["details"]["documents"]
    assert "nll_cond" not in d and d["pairs_computed"] == 6 and doc["details"]["convention"] == "released"
