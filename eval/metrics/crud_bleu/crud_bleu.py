# A local `evaluate` metric: load it with evaluate.load("/abs/path/to/eval/metrics/crud_bleu").
"""CRUD-RAG compatible BLEU-1..4 and BLEU-avg (Google NMT ``compute_bleu``, jieba tokens)."""

import collections
import math
import re

import datasets
import evaluate

_CITATION = """\
@inproceedings{papineni-etal-2002-bleu,
    title = "{B}leu: a Method for Automatic Evaluation of Machine Translation",
    author = "Papineni, Kishore and Roukos, Salim and Ward, Todd and Zhu, Wei-Jing",
    booktitle = "Proceedings of the 40th Annual Meeting of the Association for Computational Linguistics",
    year = "2002",
    pages = "311--318",
}
@article{lyu2024crud,
    title = {CRUD-RAG: A Comprehensive Chinese Benchmark for Retrieval-Augmented Generation of Large Language Models},
    author = {Lyu, Yuanjie and Li, Zhiyu and Niu, Simin and Xiong, Feiyu and Tang, Bo and Wang, Wenjin and Wu, Hao and Liu, Huanyong and Xu, Tong and Chen, Enhong},
    journal = {arXiv preprint arXiv:2401.17043},
    year = {2024},
}
"""

_DESCRIPTION = """\
BLEU-1..4 and BLEU-avg exactly as CRUD-RAG scores generated answers (``src/metric/common.py``
``bleu_score`` in IAAR-Shanghai/CRUD_RAG).

Each prediction is scored on its own (sentence-level BLEU) with Google's NMT ``compute_bleu``
(tensorflow/nmt ``nmt/scripts/bleu.py``, the code behind the Hugging Face ``bleu`` metric):
max order 4, no smoothing, clipped n-gram counts, brevity penalty from the shortest reference.
The reported numbers are the means over examples, as CRUD's ``compute_overall`` does.

* ``bleu_1`` .. ``bleu_4``: the modified n-gram precisions p1..p4 (never multiplied by the
  brevity penalty, in either mode).
* ``bleu_avg``: the geometric mean of p1..p4 (0 when any of them is 0).
  - ``with_penalty=False`` (the default, CRUD's default): the brevity penalty is divided out,
    ``bleu / BP`` (0 when BP is 0), as CRUD does. Short answers are therefore not penalised.
  - ``with_penalty=True``: standard BLEU, ``geo_mean * BP`` with ``BP = exp(1 - r/c)`` when the
    prediction (c tokens) is shorter than the reference (r tokens), else 1.

Tokens: ``lang="zh"`` uses ``list(jieba.cut(text))`` (jieba's default dictionary, HMM on; spaces
and punctuation are tokens too), exactly as CRUD. ``lang="en"`` uses the 13a tokenizer (mteval-v13a,
the Hugging Face ``bleu`` default: punctuation split off, case kept). ``tokenizer`` overrides this:
``"jieba"``, ``"13a"``, ``"whitespace"`` (``str.split``) or any callable ``str -> list[str]``.

Edge cases: an empty prediction or reference (no tokens) scores 0 everywhere (CRUD's code raises
ZeroDivisionError there and drops the example's BLEU).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str, or list of list of str): the reference answer(s) for each prediction.
    lang (str, required): "zh" (jieba tokens) or "en" (13a tokens).
    with_penalty (bool): keep the brevity penalty in bleu_avg (default False: divided out, as CRUD).
    tokenizer (str or callable): "auto" (by lang), "jieba", "13a", "whitespace" or a function.
    max_order (int): highest n-gram order (4).
Returns:
    bleu_avg, bleu_1, bleu_2, bleu_3, bleu_4, brevity_penalty: means over the examples;
    scores: per-example bleu_avg; precisions: per-example [p1..p4];
    brevity_penalties: per-example BP.
Examples:
    >>> bleu = evaluate.load("eval/metrics/crud_bleu")
    >>> r = bleu.compute(predictions=["a b c d e"], references=["a b c d f g"], lang="en", tokenizer="whitespace")
    >>> round(r["bleu_avg"], 4), round(r["bleu_1"], 4)
    (0.6687, 0.8)
"""


# ----------------------------------------------------------------------------- Google NMT BLEU


def _get_ngrams(segment, max_order):
    counts = collections.Counter()
    for order in range(1, max_order + 1):
        for i in range(0, len(segment) - order + 1):
            counts[tuple(segment[i : i + order])] += 1
    return counts


def compute_bleu(reference_corpus, translation_corpus, max_order=4, smooth=False):
    """tensorflow/nmt ``compute_bleu``: (bleu, precisions, bp, ratio, translation_length, reference_length)."""
    matches_by_order = [0] * max_order
    possible_matches_by_order = [0] * max_order
    reference_length = 0
    translation_length = 0
    for references, translation in zip(reference_corpus, translation_corpus):
        reference_length += min(len(r) for r in references)
        translation_length += len(translation)
        merged_ref_ngram_counts = collections.Counter()
        for reference in references:
            merged_ref_ngram_counts |= _get_ngrams(reference, max_order)
        overlap = _get_ngrams(translation, max_order) & merged_ref_ngram_counts
        for ngram in overlap:
            matches_by_order[len(ngram) - 1] += overlap[ngram]
        for order in range(1, max_order + 1):
            possible_matches = len(translation) - order + 1
            if possible_matches > 0:
                possible_matches_by_order[order - 1] += possible_matches

    precisions = [0] * max_order
    for i in range(0, max_order):
        if smooth and i > 0:
            precisions[i] = (matches_by_order[i] + 1.0) / (possible_matches_by_order[i] + 1.0)
        elif possible_matches_by_order[i] > 0:
            precisions[i] = float(matches_by_order[i]) / possible_matches_by_order[i]
        else:
            precisions[i] = 0.0

    if min(precisions) > 0:
        geo_mean = math.exp(sum((1.0 / max_order) * math.log(p) for p in precisions))
    else:
        geo_mean = 0
    ratio = float(translation_length) / reference_length
    bp = 1.0 if ratio > 1.0 else math.exp(1 - 1.0 / ratio)
    return geo_mean * bp, precisions, bp, ratio, translation_length, reference_length


# ----------------------------------------------------------------------------- tokenizers

_RE_13A = [
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),  # punctuation and symbols
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),  # period/comma unless preceded by a digit
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),  # period/comma unless followed by a digit
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),  # dash after a digit
]


def tokenize_13a(line):
    """sacrebleu's mteval-v13a tokenizer, returning a token list (as the HF ``bleu`` metric does)."""
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    line = f" {line} "
    for pattern, repl in _RE_13A:
        line = pattern.sub(repl, line)
    return line.split()


def tokenize_jieba(text):
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text))


def _tokenizer(tokenizer, lang):
    if callable(tokenizer):
        return tokenizer
    if tokenizer == "auto":
        tokenizer = "jieba" if lang == "zh" else "13a"
    table = {"jieba": tokenize_jieba, "13a": tokenize_13a, "whitespace": str.split}
    if tokenizer not in table:
        raise ValueError(
            f"tokenizer must be one of auto, {', '.join(table)} or a callable, not {tokenizer!r}"
        )
    return table[tokenizer]


# ----------------------------------------------------------------------------- the metric


def sentence_scores(prediction_tokens, reference_tokens_list, with_penalty=False, max_order=4):
    """CRUD's per-example numbers: (bleu_avg, [p1..pN], bp)."""
    if not prediction_tokens or not reference_tokens_list or min(len(r) for r in reference_tokens_list) == 0:
        return 0.0, [0.0] * max_order, 0.0
    bleu, precisions, bp, *_ = compute_bleu([reference_tokens_list], [prediction_tokens], max_order=max_order)
    if not with_penalty:
        bleu = 0.0 if bp == 0 else bleu / bp
    return float(bleu), [float(p) for p in precisions], float(bp)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CrudBleu(evaluate.Metric):
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
                        "references": datasets.Sequence(
                            datasets.Value("string", id="sequence"), id="references"
                        ),
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
                "https://github.com/tensorflow/nmt/blob/master/nmt/scripts/bleu.py",
            ],
            reference_urls=["https://arxiv.org/abs/2401.17043"],
        )

    def _compute(self, predictions, references, lang=None, with_penalty=False, tokenizer="auto", max_order=4):
        if lang not in ("zh", "en"):
            raise ValueError(f"lang must be 'zh' or 'en' (required), not {lang!r}")
        tok = _tokenizer(tokenizer, lang)
        scores, precisions, bps = [], [], []
        for pred, refs in zip(predictions, references):
            refs = [refs] if isinstance(refs, str) else list(refs)
            bleu, prec, bp = sentence_scores(tok(pred), [tok(r) for r in refs], with_penalty, max_order)
            scores.append(bleu)
            precisions.append(prec)
            bps.append(bp)
        n = len(scores)

        def mean(values):
            return sum(values) / n if n else 0.0

        out = {"bleu_avg": mean(scores)}
        for i in range(max_order):
            out[f"bleu_{i + 1}"] = mean([p[i] for p in precisions])
        out.update(brevity_penalty=mean(bps), scores=scores, precisions=precisions, brevity_penalties=bps)
        return out
