# A local `evaluate` metric: load it with evaluate.load("/abs/path/to/eval/metrics/embedding_similarity").
"""Sentence-embedding cosine similarity: what CRUD-RAG's code calls "bertScore" (it is not BERTScore)."""

import os

import datasets
import evaluate

_CITATION = """\
@inproceedings{reimers-gurevych-2019-sentence,
    title = "Sentence-{BERT}: Sentence Embeddings using {S}iamese {BERT}-Networks",
    author = "Reimers, Nils and Gurevych, Iryna",
    booktitle = "Proceedings of the 2019 Conference on Empirical Methods in Natural Language Processing",
    year = "2019",
    url = "https://arxiv.org/abs/1908.10084",
}
"""

_DESCRIPTION = """\
Cosine similarity between the sentence embeddings of each prediction and its reference, with a
LOCAL sentence-transformers model; per-example scores and their mean.

The naming trap: CRUD-RAG (``src/metric/common.py``) reports a metric called ``bertScore``, but its
``bert_score`` function is ``text2vec.Similarity(model_name_or_path="text2vec-base-chinese")
.get_score(prediction, reference)``: the cosine of two mean-pooled sentence embeddings, one number
per pair. That is NOT BERTScore (Zhang et al., 2020: greedy token-level matching, precision /
recall / F1), which is the separate ``bertscore`` metric next to this one. Numbers reported as
CRUD "bertScore" compare with this metric run with the same encoder (text2vec-base-chinese as a
local sentence-transformers folder), never with ``bertscore``.

As text2vec's ``get_score``: both texts are stripped, and a pair where either is empty scores 0.
``model`` is a local sentence-transformers folder or a metachunk preset name (loaded with
``metachunk.models.load_sentence_embedder``); the default ``"minilm"`` (all-MiniLM-L6-v2, English,
inputs truncated at 256 word pieces) is a stand-in, not CRUD's Chinese encoder. The folder's own
pooling is used (text2vec forces mean pooling; MiniLM and text2vec-base-chinese are mean-pooled
anyway). Embeddings are L2-normalised and dotted. With several references per prediction the most
similar one counts.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str, or list of list of str): the reference answer(s) for each prediction.
    lang (str, required): "zh" or "en" (recorded; the encoder decides how each language is read).
    model (str): local sentence-transformers folder or metachunk preset name (default "minilm").
    batch_size (int): default 64.
    device (str): default "cuda" when available, else "cpu".
Returns:
    embedding_similarity: mean cosine; scores: per-example cosine; model: the model name.
Examples:
    >>> sim = evaluate.load("eval/metrics/embedding_similarity")
    >>> round(sim.compute(predictions=["a cat"], references=["a cat"], lang="en")["embedding_similarity"], 4)
    1.0
"""

_MODELS = {}


def load_model(model, device):
    key = (model, device)
    if key not in _MODELS:
        try:
            from metachunk.models import load_sentence_embedder
        except ImportError:
            if not os.path.isdir(os.path.expanduser(model)):
                raise ValueError(
                    f"model {model!r} is not a local folder (and metachunk, which knows presets, is not installed)"
                ) from None
            from sentence_transformers import SentenceTransformer

            _MODELS[key] = SentenceTransformer(os.path.expanduser(model), device=device)
        else:
            _MODELS[key] = load_sentence_embedder(model, device=device)
    return _MODELS[key]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class EmbeddingSimilarity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence")),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
            codebase_urls=[
                "https://github.com/IAAR-Shanghai/CRUD_RAG/blob/main/src/metric/common.py",
                "https://github.com/shibing624/text2vec",
            ],
            reference_urls=["https://www.sbert.net/"],
        )

    def _compute(self, predictions, references, lang=None, model="minilm", batch_size=64, device=None):
        if lang not in ("zh", "en"):
            raise ValueError(f"lang must be 'zh' or 'en' (required), not {lang!r}")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        encoder = load_model(model, device)
        preds = [p.strip() for p in predictions]
        groups = [[ref.strip()] if isinstance(ref, str) else [r.strip() for r in ref] for ref in references]
        texts = [t for t in dict.fromkeys([*preds, *(r for g in groups for r in g)]) if t]
        row = {t: i for i, t in enumerate(texts)}
        emb = None
        if texts:
            emb = encoder.encode(
                texts,
                batch_size=batch_size,
                convert_to_tensor=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        scores = []
        for pred, group in zip(preds, groups):
            sims = [float((emb[row[pred]] * emb[row[r]]).sum()) if pred and r else 0.0 for r in group]
            scores.append(max(sims, default=0.0))
        n = len(scores)
        name = model
        if os.path.isdir(os.path.expanduser(model)):
            name = os.path.basename(os.path.normpath(model))
        return {"embedding_similarity": sum(scores) / n if n else 0.0, "scores": scores, "model": name}
