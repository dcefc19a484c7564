# A local `evaluate` metric: load it with evaluate.load("/abs/path/to/eval/metrics/rouge_l").
"""ROUGE-L F-measure (rouge-score's LCS), with jieba tokens for Chinese, as CRUD-RAG scores it."""

import datasets
import evaluate
from rouge_score import rouge_scorer

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
    address = "Barcelona, Spain",
    publisher = "Association for Computational Linguistics",
    url = "https://aclanthology.org/W04-1013",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-L: the longest common subsequence (LCS) of prediction and reference tokens;
precision = LCS / prediction tokens, recall = LCS / reference tokens, F = 2PR / (P + R).
Computed with Google's ``rouge-score`` package (``rouge_scorer.RougeScorer(["rougeL"])``, no
stemming), one score per example; the reported numbers are means over the examples (CRUD-RAG's
``rougeL_score`` scores each answer alone and ``compute_overall`` averages them).

Tokens: ``lang="zh"`` passes a tokenizer object whose ``tokenize`` is ``list(jieba.cut(text))``
(jieba's default dictionary, HMM on; spaces and punctuation are tokens), exactly as CRUD-RAG does
through the Hugging Face ``rouge`` metric. rouge-score's default tokenizer lowercases and keeps only
``[a-z0-9]`` runs, so it scores any Chinese text 0; it is used for ``lang="en"`` (the Hugging Face
``rouge`` default). ``tokenizer="jieba"`` or ``"default"`` overrides the choice.

With several references per prediction the best-scoring one counts (``RougeScorer.score_multi``).
An empty prediction or reference scores 0.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str, or list of list of str): the reference answer(s) for each prediction.
    lang (str, required): "zh" (jieba tokens) or "en" (rouge-score's default tokenizer).
    tokenizer (str): "auto" (by lang), "jieba" or "default".
Returns:
    rouge_l: mean ROUGE-L F-measure; rouge_l_precision, rouge_l_recall: means;
    scores: per-example F-measure; precisions, recalls: per example.
Examples:
    >>> rouge = evaluate.load("eval/metrics/rouge_l")
    >>> rouge.compute(predictions=["the cat sat"], references=["the cat sat down"], lang="en")["rouge_l"]
    0.857142...
"""


class JiebaTokenizer:
    """rouge-score tokenizer interface: ``tokenize(text) -> list[str]``."""

    def tokenize(self, text):
        import logging

        import jieba

        jieba.setLogLevel(logging.WARNING)
        return list(jieba.cut(text))


_SCORERS = {}


def scorer(tokenizer):
    if tokenizer not in _SCORERS:
        custom = JiebaTokenizer() if tokenizer == "jieba" else None
        _SCORERS[tokenizer] = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=custom)
    return _SCORERS[tokenizer]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RougeL(evaluate.Metric):
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
                "https://github.com/google-research/google-research/tree/master/rouge",
                "https://github.com/IAAR-Shanghai/CRUD_RAG/blob/main/src/metric/common.py",
            ],
            reference_urls=["https://aclanthology.org/W04-1013"],
        )

    def _compute(self, predictions, references, lang=None, tokenizer="auto"):
        if lang not in ("zh", "en"):
            raise ValueError(f"lang must be 'zh' or 'en' (required), not {lang!r}")
        if tokenizer == "auto":
            tokenizer = "jieba" if lang == "zh" else "default"
        if tokenizer not in ("jieba", "default"):
            raise ValueError(f"tokenizer must be auto, jieba or default, not {tokenizer!r}")
        rouge = scorer(tokenizer)
        f, p, r = [], [], []
        for pred, refs in zip(predictions, references):
            if isinstance(refs, str):
                score = rouge.score(refs, pred)["rougeL"]
            elif refs:
                score = rouge.score_multi(list(refs), pred)["rougeL"]
            else:
                score = rouge_scorer.scoring.Score(precision=0.0, recall=0.0, fmeasure=0.0)
            f.append(float(score.fmeasure))
            p.append(float(score.precision))
            r.append(float(score.recall))
        n = len(f)

        def mean(values):
            return sum(values) / n if n else 0.0

        return {
            "rouge_l": mean(f),
            "rouge_l_precision": mean(p),
            "rouge_l_recall": mean(r),
            "scores": f,
            "precisions": p,
            "recalls": r,
        }
