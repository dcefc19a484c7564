# A local `evaluate` metric: load it with evaluate.load("/abs/path/to/eval/metrics/longbench_f1").
"""LongBench QA F1 (``qa_f1_score`` / ``qa_f1_zh_score``), with LongBench's exact normalisation."""

import re
import string
from collections import Counter

import datasets
import evaluate

_CITATION = """\
@inproceedings{bai-etal-2024-longbench,
    title = "{L}ong{B}ench: A Bilingual, Multitask Benchmark for Long Context Understanding",
    author = "Bai, Yushi and Lv, Xin and Zhang, Jiajie and Lyu, Hongchang and Tang, Jiankai and Huang, Zhidian and Du, Zhengxiao and Liu, Xiao and Zeng, Aohan and Hou, Lei and Dong, Yuxiao and Tang, Jie and Li, Juanzi",
    booktitle = "Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics",
    year = "2024",
    pages = "3119--3137",
}
"""

_DESCRIPTION = """\
Token-level QA F1 exactly as LongBench (THUDM/LongBench ``metrics.py``) computes it; the numbers
are fractions in [0, 1] (LongBench's ``eval.py`` prints 100x the mean, rounded to 2 decimals).

* ``lang="en"`` (``qa_f1_score``): ``normalize_answer`` = lowercase, drop ASCII punctuation
  (``string.punctuation``), replace the articles a/an/the (whole words) by spaces, collapse white
  space; then split on white space.
* ``lang="zh"`` (``qa_f1_zh_score``): ``jieba.cut(text, cut_all=False)`` tokens, each passed through
  ``normalize_zh_answer`` (lowercase, drop ASCII and Chinese punctuation, drop all white space),
  empty tokens dropped.
* ``f1_score``: overlap = sum of the ``Counter`` intersection of the two token lists;
  0 if no overlap, else P = overlap / prediction tokens, R = overlap / reference tokens,
  F1 = 2PR / (P + R).

With several references per prediction the best F1 counts (LongBench's ``eval.py`` takes the max
over an example's ``answers``). LongBench only truncates predictions at the first newline for
trec/triviaqa/samsum/lsht, never for QA, so predictions are used as given.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str, or list of list of str): the reference answer(s) for each prediction.
    lang (str, required): "en" (normalize_answer + split) or "zh" (jieba + normalize_zh_answer).
Returns:
    f1: mean F1 over the examples; scores: per-example F1.
Examples:
    >>> f1 = evaluate.load("eval/metrics/longbench_f1")
    >>> f1.compute(predictions=["The Eiffel Tower!"], references=["eiffel tower"], lang="en")["f1"]
    1.0
"""

# Verbatim from LongBench metrics.py (normalize_zh_answer).
CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_PUNCTUATION = set(string.punctuation)
_ALL_PUNCTUATION = set(string.punctuation + CN_PUNCTUATION)


def normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _EN_PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s):
    """Lower text and remove punctuation, extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _ALL_PUNCTUATION)
    return "".join(s.split())


def f1_score(prediction, ground_truth):
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction)
    recall = 1.0 * num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction, ground_truth):
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _zh_tokens(text):
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    tokens = [normalize_zh_answer(token) for token in jieba.cut(text, cut_all=False)]
    return [token for token in tokens if len(token) > 0]


def qa_f1_zh_score(prediction, ground_truth):
    return f1_score(_zh_tokens(prediction), _zh_tokens(ground_truth))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class LongbenchF1(evaluate.Metric):
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
            codebase_urls=["https://github.com/THUDM/LongBench/blob/main/LongBench/metrics.py"],
            reference_urls=["https://arxiv.org/abs/2308.14508"],
        )

    def _compute(self, predictions, references, lang=None):
        if lang not in ("zh", "en"):
            raise ValueError(f"lang must be 'zh' or 'en' (required), not {lang!r}")
        score = qa_f1_zh_score if lang == "zh" else qa_f1_score
        scores = []
        for pred, refs in zip(predictions, references):
            refs = [refs] if isinstance(refs, str) else list(refs)
            scores.append(float(max((score(pred, ref) for ref in refs), default=0.0)))
        return {"f1": sum(scores) / len(scores) if scores else 0.0, "scores": scores}
