"""QA answer metrics as local Hugging Face ``evaluate`` modules (no Hub script downloads).

Each folder here is one metric script, loadable anywhere with ``evaluate.load(metric_path(name))``
(or ``evaluate.load("/abs/path/eval/metrics/NAME")``); its description says exactly which
reference it reproduces:

* ``crud_bleu``: CRUD-RAG BLEU-1..4 / BLEU-avg (NMT ``compute_bleu``, jieba tokens for zh, 13a for en).
* ``rouge_l``: ROUGE-L F via ``rouge-score``, jieba tokens for zh.
* ``bertscore``: BERTScore via ``bert-score`` with a local encoder, no baseline download.
* ``embedding_similarity``: sentence-embedding cosine, what CRUD-RAG's code calls "bertScore".
* ``longbench_f1``: LongBench ``qa_f1_score`` / ``qa_f1_zh_score``.

`qa_scores` runs them all and returns the flat means ``eval qa`` reports.
"""

from __future__ import annotations

from pathlib import Path

METRICS = ("crud_bleu", "rouge_l", "bertscore", "embedding_similarity", "longbench_f1")
_HERE = Path(__file__).resolve().parent
_LOADED: dict[str, object] = {}


def metric_path(name: str) -> str:
    """Absolute path of the folder holding metric ``name`` (what ``evaluate.load`` takes)."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
    return str(_HERE / name)


def load(name: str):
    """``evaluate.load(metric_path(name), keep_in_memory=True)``, once per process.

    In memory: no Arrow cache file and no file lock under ``~/.cache/huggingface/metrics``, so
    parallel runs never wait on each other (and a failed call leaves no lock behind).
    """
    if name not in _LOADED:
        import evaluate

        _LOADED[name] = evaluate.load(metric_path(name), keep_in_memory=True)
    return _LOADED[name]


def qa_scores(
    predictions: list[str],
    references: list[str],
    lang: str,
    bertscore_model: str | None = "minilm",
    embedder: str | None = "minilm",
    per_item: bool = False,
) -> dict[str, float] | tuple[dict[str, float], list[dict[str, float]]]:
    """Mean answer scores over the examples, as one flat dict; with ``per_item``, also each
    example's scores under the same keys (every mean here is the mean of those), as
    ``(means, items)``, for bootstrap intervals over the questions.

    Keys: ``bleu_1``..``bleu_4``, ``bleu_avg`` (CRUD-RAG BLEU, brevity penalty divided out as CRUD
    does), ``rouge_l``, ``bertscore_precision``, ``bertscore_recall``, ``bertscore_f1`` (unless
    ``bertscore_model`` is None), ``embedding_similarity`` (unless ``embedder`` is None) and ``f1``
    (LongBench QA F1). ``bertscore_model`` / ``embedder``: a preset name or a local model folder.
    """
    if lang not in ("zh", "en"):
        raise ValueError(f"lang must be 'zh' or 'en', not {lang!r}")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    data = {"predictions": list(predictions), "references": list(references), "lang": lang}
    out: dict[str, float] = {}
    items: dict[str, list] = {}  # metric -> one score per example
    bleu = load("crud_bleu").compute(**data)
    out.update({f"bleu_{n}": float(bleu[f"bleu_{n}"]) for n in range(1, 5)})
    out["bleu_avg"] = float(bleu["bleu_avg"])
    items.update({f"bleu_{n}": [p[n - 1] for p in bleu["precisions"]] for n in range(1, 5)})
    items["bleu_avg"] = bleu["scores"]
    rouge = load("rouge_l").compute(**data)
    out["rouge_l"], items["rouge_l"] = float(rouge["rouge_l"]), rouge["scores"]
    if bertscore_model is not None:
        bs = load("bertscore").compute(**data, model=bertscore_model)
        out.update(
            bertscore_precision=float(bs["precision"]),
            bertscore_recall=float(bs["recall"]),
            bertscore_f1=float(bs["f1"]),
        )
        items.update(
            bertscore_precision=bs["precisions"], bertscore_recall=bs["recalls"], bertscore_f1=bs["scores"]
        )
    if embedder is not None:
        sim = load("embedding_similarity").compute(**data, model=embedder)
        out["embedding_similarity"] = float(sim["embedding_similarity"])
        items["embedding_similarity"] = sim["scores"]
    f1 = load("longbench_f1").compute(**data)
    out["f1"], items["f1"] = float(f1["f1"]), f1["scores"]
    if not per_item:
        return out
    return out, [{k: float(v[i]) for k, v in items.items()} for i in range(len(predictions))]
