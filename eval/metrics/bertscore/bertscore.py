# A local `evaluate` metric: load it with evaluate.load("/abs/path/to/eval/metrics/bertscore").
"""BERTScore (the ``bert-score`` package) with a local encoder: no Hub access, no baseline download."""

import json
import os

import datasets
import evaluate

_CITATION = """\
@inproceedings{bert-score,
    title = {BERTScore: Evaluating Text Generation with BERT},
    author = {Tianyi Zhang* and Varsha Kishore* and Felix Wu* and Kilian Q. Weinberger and Yoav Artzi},
    booktitle = {International Conference on Learning Representations},
    year = {2020},
    url = {https://openreview.net/forum?id=SkeHuCVFDr}
}
"""

_DESCRIPTION = """\
BERTScore (Zhang et al., 2020) through the ``bert-score`` package (``bert_score.BERTScorer``):
greedy matching of contextual token embeddings; precision, recall and F1 per example, and their
means. Token weights are uniform ([CLS]/[SEP] weigh 0) unless ``idf=True`` (idf from the batch's
references, as ``bert_score.score(idf=True)`` does; it needs many references: a word found in every
reference weighs 0, and a batch of identical references gives NaN precision / recall).

The encoder is LOCAL: ``model`` is a local Hugging Face model folder (``AutoModel`` +
``AutoTokenizer``, which ``bert-score`` loads from ``model_type``), or a metachunk preset name,
resolved with ``metachunk.models.resolve``. The default, ``"minilm"``, is all-MiniLM-L6-v2 (the
transformer inside the sentence-transformers folder): an English model; for Chinese pass a
Chinese encoder folder (e.g. a local bert-base-chinese). ``num_layers`` is the layer whose output
is used: by default ``bert-score``'s tuned layer when ``model`` is one of its known model names,
else the model's last layer (``num_hidden_layers`` from ``config.json``; 6 for MiniLM-L6). Scores
from different encoders or layers are not comparable; the output records both.

Baseline rescaling is off: ``bert-score`` would download its baseline file. Pass
``baseline_path`` (a local baseline .tsv in ``bert-score``'s format) to rescale; ``lang`` then
selects nothing but is still required by ``bert-score``.

``bert-score`` 0.3.13 cannot encode an empty string with transformers 5; an empty prediction (or
a prediction whose references are all empty) scores 0 (``bert-score``'s own rule for empty
candidates), also when rescaling. Inputs longer than the encoder's positions are truncated.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated answers.
    references (list of str, or list of list of str): the reference answer(s); with several, the
        best precision / recall / F1 of each example counts (bert-score's rule).
    lang (str, required): "zh" or "en".
    model (str): local model folder or metachunk preset name (default "minilm").
    num_layers (int): representation layer (default: see the description).
    idf (bool): idf weighting from the references (default False).
    baseline_path (str): local baseline file; rescaling happens only when given.
    batch_size (int): default 64.
    device (str): default "cuda" when available, else "cpu".
Returns:
    precision, recall, f1: means over the examples; scores: per-example F1;
    precisions, recalls: per example; model (the folder's name), num_layers, rescaled (bool).
Examples:
    >>> bertscore = evaluate.load("eval/metrics/bertscore")
    >>> r = bertscore.compute(predictions=["the cat sat"], references=["the cat sat"], lang="en")
    >>> round(r["f1"], 4)
    1.0
"""


def resolve_model(model):
    """A local model folder, or a metachunk preset name (resolved by metachunk.models.resolve)."""
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.abspath(os.path.expanduser(model))
    try:
        from metachunk.models import resolve
    except ImportError as e:
        raise ValueError(
            f"model {model!r} is not a local folder (and metachunk, which knows presets, is not installed)"
        ) from e
    return str(resolve(model))


def default_num_layers(model_type):
    from bert_score.utils import model2layers

    if model_type in model2layers:
        return model2layers[model_type]
    with open(os.path.join(model_type, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    layers = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    if not layers:
        raise ValueError(f"cannot tell how many layers {model_type} has; pass num_layers")
    return int(layers)


_SCORERS = {}


def get_scorer(model_type, num_layers, lang, baseline_path, idf, device, batch_size):
    key = (model_type, num_layers, lang, baseline_path, idf, device)
    if key not in _SCORERS:
        from bert_score import BERTScorer

        class Scorer(BERTScorer):
            """bert-score truncates at the tokenizer's ``model_max_length``, which some model folders leave
            at 1e30: a long text then overflows the position embeddings. The subclass sets it to the
            model's positions (the tokenizer and model are the scorer's own attributes)."""

            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                positions = getattr(self._model.config, "max_position_embeddings", None)
                if positions and self._tokenizer.model_max_length > positions:
                    self._tokenizer.model_max_length = positions

        _SCORERS[key] = Scorer(
            model_type=model_type,
            num_layers=num_layers,
            lang=lang,
            idf=idf,
            rescale_with_baseline=baseline_path is not None,
            baseline_path=baseline_path,
            device=device,
            batch_size=batch_size,
        )
    return _SCORERS[key]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Bertscore(evaluate.Metric):
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
            codebase_urls=["https://github.com/Tiiiger/bert_score"],
            reference_urls=["https://arxiv.org/abs/1904.09675"],
        )

    def _compute(
        self,
        predictions,
        references,
        lang=None,
        model="minilm",
        num_layers=None,
        idf=False,
        baseline_path=None,
        batch_size=64,
        device=None,
    ):
        if lang not in ("zh", "en"):
            raise ValueError(f"lang must be 'zh' or 'en' (required), not {lang!r}")
        model_type = resolve_model(model)
        if num_layers is None:
            num_layers = default_num_layers(model_type)
        if baseline_path is not None and not os.path.isfile(baseline_path):
            raise ValueError(f"baseline_path {baseline_path!r} is not a file")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        scorer = get_scorer(model_type, num_layers, lang, baseline_path, bool(idf), device, batch_size)

        # bert-score cannot encode "" (transformers 5): score only the non-empty pairs
        keep, cands, refs = [], [], []
        for i, (pred, ref) in enumerate(zip(predictions, references)):
            group = [r for r in ([ref] if isinstance(ref, str) else ref) if r.strip()]
            if pred.strip() and group:
                keep.append(i)
                cands.append(pred)
                refs.append(group)
        n = len(predictions)
        empty = [0.0, 0.0, 0.0]
        if baseline_path is not None:
            b = scorer.baseline_vals
            empty = [float(-b[k] / (1 - b[k])) for k in range(3)]
        rows = [list(empty) for _ in range(n)]
        if cands:
            if idf:
                scorer.compute_idf([r for group in refs for r in group])
            single = all(len(g) == 1 for g in refs)
            p, r, f = scorer.score(cands, [g[0] for g in refs] if single else refs, batch_size=batch_size)
            for j, i in enumerate(keep):
                rows[i] = [float(p[j]), float(r[j]), float(f[j])]

        def mean(k):
            return sum(row[k] for row in rows) / n if n else 0.0

        return {
            "precision": mean(0),
            "recall": mean(1),
            "f1": mean(2),
            "scores": [row[2] for row in rows],
            "precisions": [row[0] for row in rows],
            "recalls": [row[1] for row in rows],
            "model": os.path.basename(os.path.normpath(model_type))
            if os.path.isdir(os.path.expanduser(model))
            else model,
            "num_layers": int(num_layers),
            "rescaled": baseline_path is not None,
        }
