"""The experiment recipes cannot rot: a smoke version of recipes/experiments/emma.yaml (its own
stage blocks, three chapters, two chunkers, the bootstrap on), with emma_generation.yaml's answer
stages when llama.cpp is installed, runs end to end through ``metachunk run``, and its report
carries intervals and paired differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from metachunk.cli import main

ROOT = Path(__file__).resolve().parents[1]


def load_recipe(name: str, tmp_path: Path) -> dict:
    text = (ROOT / "recipes" / "experiments" / name).read_text(encoding="utf-8")
    text = text.replace("runs/experiments/emma", str(tmp_path / "emma"))
    return yaml.safe_load(text)


def smoke_recipe(tmp_path: Path, tiny: str, generate: bool) -> Path:
    """emma.yaml with its paths under ``tmp_path``, chapters I-III, fixed and sentence chunking at
    its length goal, retrieval over the answerable questions, BC/CS under the tiny model, and (with
    ``generate``) emma_generation.yaml's answers from the local teacher, llama.cpp on SmolLM2, short
    ones from 2 chunks, compared in the same report."""
    recipe = load_recipe("emma.yaml", tmp_path)
    keep = {"docs", "chunk_fixed", "chunk_sentence", "qa_fixed", "qa_sentence", "quality_fixed",
            "quality_sentence", "qa_fixed_whole", "qa_sentence_whole", "compare_whole", "compare"}  # fmt: skip
    recipe["stages"] = [s for s in recipe["stages"] if s["name"] in keep]
    if generate:
        generation = load_recipe("emma_generation.yaml", tmp_path)
        recipe["local_teacher"] = {**generation["local_teacher"], "backend": "llama.cpp"}
        answers = [s for s in generation["stages"] if s["name"] in ("gen_fixed", "gen_sentence")]
        at = next(i for i, s in enumerate(recipe["stages"]) if s["name"] == "compare")
        recipe["stages"][at:at] = answers  # before the compare stage, which reads them too
        compare = next(s for s in recipe["stages"] if s["name"] == "compare")["config"]
        compare["runs"] += [s["config"]["out"] for s in answers]
        compare["labels"] += ["fixed", "sentence"]
        compare["metrics"] += ["f1", "rouge_l", "bleu_avg", "bertscore_f1"]
    recipe = {k: v for k, v in recipe.items() if not k.startswith("x-")}
    for stage in recipe["stages"]:
        cfg = stage["config"]
        if stage["name"] == "docs":
            cfg["groups"] = "0:3"
        if stage["run"] == "eval qa":
            cfg.update(questions="answerable", progress=False)
        if stage["name"].startswith("gen_"):
            cfg.update(top_k=2, max_new_tokens=12, cutoffs=[1, 2])  # none deeper than the retrieval
        if stage["run"] == "eval chunk-quality":
            cfg.update(model=tiny, limit=2, max_pairs=2, progress=False)
        if stage["run"] == "eval compare":
            keep_runs = [
                (r, label) for r, label in zip(cfg["runs"], cfg["labels"]) if label in ("fixed", "sentence")
            ]
            cfg["runs"], cfg["labels"] = [r for r, _ in keep_runs], [label for _, label in keep_runs]
            cfg["n_resamples"] = 500
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.integration
def test_the_emma_experiment_in_small_runs_and_reports_intervals(tmp_path, tiny_model_dir, capsys):
    pytest.importorskip("pymilvus")
    from metachunk.local_teacher import llama_cpp_available

    generate = llama_cpp_available()  # make install builds it; without it the answers are left out
    path = smoke_recipe(tmp_path, str(tiny_model_dir), generate)
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "emma" / "compare.json").read_text())
    lengths = result["metrics"]["avg_chunk_chars"]
    assert all(abs(v - 600) <= 0.05 * 600 for v in lengths.values()), lengths  # the recipe's length goal
    stats = result["statistics"]
    assert stats["baseline"] == "fixed" and stats["confidence"] == 0.95
    lo, hi = stats["intervals"]["hits@8"]["sentence"]
    assert 0.0 <= lo <= result["metrics"]["hits@8"]["sentence"] <= hi <= 1.0
    assert set(stats["differences"]["hits@8"]) == {"sentence"}  # paired with fixed, question by question
    assert "bc_doc_mean" in stats["intervals"]  # per chapter
    assert {"bc_mean@paper", "cs_complete@released", "cs_incomplete@paper"} <= set(stats["intervals"])
    if generate:  # every answer scored, each question's scores resampled like its retrieval ones
        answers = (tmp_path / "emma" / "sentence" / "gen" / "answers.jsonl").read_text().splitlines()
        assert answers and all(json.loads(a)["status"] == "ok" for a in answers)
        assert {"f1", "rouge_l", "bleu_avg", "bertscore_f1"} <= set(stats["intervals"])
        assert set(stats["differences"]["f1"]) == {"sentence"}
    whole = json.loads((tmp_path / "emma" / "compare_whole.json").read_text())  # GutenQA's relevance rule
    assert set(whole["metrics"]["dcg@8"]) == {"fixed", "sentence"}
    report = (tmp_path / "emma" / "compare.md").read_text()
    assert "bootstrap intervals" in report and "Paired differences from `fixed`" in report
    # a rerun skips every stage: each says so, and none runs its command
    capsys.readouterr()
    assert main(["run", str(path)]) == 0
    err = capsys.readouterr().err
    names = [stage["name"] for stage in yaml.safe_load(path.read_text())["stages"]]
    assert all(f"== run: {name} (" in err for name in names), err
    assert err.count("cached, skipped") == len(names) and ": metachunk " not in err, err
