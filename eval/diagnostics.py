"""``metachunk eval diagnostics``: why semantic completion helps (Meta-Chunking §5.4, MoC A.4).

```
metachunk eval diagnostics --out DIR [--chunks REWRITTEN.jsonl] \\
  [--retrieval original=RUN_A/retrieval.jsonl summary=RUN_B rewritten=RUN_C/retrieval.jsonl] \\
  [--models smollm2 gemma3-270m] [--k 8] [--embedder minilm]
```

Three diagnostics, each optional (give ``--chunks``, ``--retrieval`` or both):

* **PPL of rewritten vs original chunks** (Meta-Chunking Figure 5), from ``--chunks``: a
  ``metachunk chunk --rewrite MODEL`` output, whose chunks carry ``rewritten``. Under every
  ``--models`` LM, each chunk that has a non-empty rewrite is read alone, as text and as rewrite:
  ``ppl = exp(mean token NLL)`` over its tokens (`metachunk.engine.scoring.token_nll`; read after
  the tokenizer's lead tokens, or a single space where it has none, as in ``eval chunk-quality``;
  texts longer than ``--max-context`` tokens go by sliding windows). Reported per model: the mean
  and median ppl of originals and of rewrites over the same chunks, and the share of chunks whose
  rewrite reads with lower ppl; a box plot per model (``ppl_rewrite.png``).
* **AVGSim@k** (Table 5), from each ``--retrieval`` file (``retrieval.jsonl`` of ``metachunk eval
  qa``, one row per question with its ranked ``hits``; ``reranked`` instead with
  ``--ranking reranked``). The paper's definition, "the average similarity scores for the Top-8
  retrieved chunks in response to queries", is the query-chunk cosine averaged over the top k:
  ``avgsim@k`` embeds each question and each retrieved chunk's ``indexed_text`` (what was indexed:
  the chunk, its rewrite, or summary + chunk) with ``--embedder`` (MiniLM by default, unit
  vectors), averages the k cosines per question, then over questions. Two companions:
  ``pairsim@k``, the mean cosine over all pairs of the top-k chunks (how alike the retrieved set
  is; identical chunks give 1; questions with one hit are left out), and ``retriever_avgsim@k``,
  the same average of the ``score`` the qa run's own retriever stored. A question with fewer than
  k hits averages the ones it has.
* **CP**, the information support of the retrieved chunks for the reference answer (MoC
  Appendix A.4, Eq. 7): ``CP = -(1/M) Σ_i log P(a_i | c_1..c_n)`` in nats, under each ``--models``
  LM. The sequence read is: the tokenizer's lead tokens, the top-k ``indexed_text``s in rank order
  joined by blank lines, a blank line (with ``--cp-prompt question``: then ``Question: ...`` and
  ``Answer: ``, not in Eq. 7), then the answer. Normalisation: the mean over the M answer tokens
  of one question, then the mean over questions (each question weighs the same, however long
  its answer); lower is better. The context keeps its first tokens (the best-ranked chunks) when
  context + answer would pass ``--max-context``. Questions without an answer are skipped.

Metric names carry the label of the retrieval file (``avgsim@8_rewritten``) and the model
(``cp_smollm2_rewritten``, ``ppl_original_smollm2``). A retrieval file is given as
``LABEL=PATH`` or ``PATH`` (label: the run dir's name); PATH may be the run dir itself.

**Intervals.** Every metric is a mean over items, chunks for PPL (``chunk:N``) and questions for
AVGSim and CP (``q:QID``), and ``items.jsonl`` holds them one line per item. Each mean gets a
bootstrap interval (``--confidence``, as in ``eval compare``: ``scipy.stats.bootstrap``, percentile,
fixed ``--seed``), and so does each paired difference: a rewrite's PPL minus its chunk's, and every
retrieval label's AVGSim, pairsim and CP minus the first label's, over the questions both have.
A difference whose interval excludes 0 is *resolved*, the others are inside the noise.

Writes ``OUT/metrics.json`` + ``report.md`` (`metachunk.eval.report.write_run`, with a table per
diagnostic added), ``items.jsonl``, and ``ppl_rewrite.png``, ``avgsim.png``, ``cp.png`` for what
was computed.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from metachunk.eval.report import known, mean_of_known

from metachunk import config
from metachunk.artifacts import AtomicWriter, InputError, write_figure
from metachunk.command import Reads, Result
from metachunk.config import option
from metachunk.sources import (
    MAX_ROW_BYTES,
    BadRows,
    Rejects,
    finish_rejects,
    read_records,
    refuse_or_skip,
)


@dataclass
class DiagnosticsConfig:
    out: Path = option(None, "run dir: metrics.json, report.md, PNGs")
    chunks: Path | None = option(
        None,
        "chunks JSONL whose chunks carry 'rewritten' (`metachunk chunk --rewrite`): PPL original vs rewrite",
    )
    retrieval: list[str] | None = option(
        None, "retrieval.jsonl files of `metachunk eval qa` (or their run dirs), each LABEL=PATH or PATH"
    )
    models: list[str] | None = option(
        None, "causal LMs for PPL and CP: presets or local HF dirs (default: smollm2)"
    )
    k: int = option(8, "top k retrieved chunks per question (paper: 8)")
    ranking: str = option("dense", "which ranking of retrieval.jsonl to read", choices=["dense", "reranked"])
    embedder: str = option("minilm", "AVGSim embedder: preset or local sentence-transformers dir")
    query_prefix: str = option("", "text put before each question when embedding it (e.g. a BGE instruction)")
    cp_prompt: str = option(
        "chunks",
        "CP context: the chunks only (Eq. 7), or chunks then 'Question: ... Answer: '",
        choices=["chunks", "question"],
    )
    max_context: int = option(2048, "tokens per scored sequence (CP: context is cut; PPL: sliding windows)")
    limit: int | None = option(None, "only the first N questions of each retrieval file")
    batch_tokens: int = option(8192, "padded tokens per forward pass")
    embed_batch_size: int = option(64, "texts per embedding batch")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda when available)", runtime=True)
    dtype: str = option(
        "auto",
        "model dtype, as `chunk --dtype`: auto = bfloat16 on a GPU or a CPU with native bfloat16 (AMX, "
        "AVX-512 BF16), else float32 (exact)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    confidence: float = option(0.95, "bootstrap confidence level of the intervals (0: none)")
    n_resamples: int = option(2000, "bootstrap resamples per interval")
    seed: int = option(0, "the bootstrap's random seed: the same items give the same intervals")
    progress: bool = option(True, "progress bars", runtime=True)
    bad_rows: BadRows = config.block(BadRows, "what a bad retrieval row or chunks record does", prefix="")

    def __post_init__(self):
        config.check_choices(self)
        if self.out is None:
            raise ValueError("field 'out' is required")
        if self.chunks is None and not self.retrieval:
            raise ValueError("give --chunks (PPL of rewrites), --retrieval (AVGSim, CP), or both")
        if self.k < 1:
            raise ValueError("field 'k' must be >= 1")
        if self.models is None:
            self.models = ["smollm2"]
        if self.max_context < 8:
            raise ValueError("field 'max_context' must be >= 8")
        if not 0 <= self.confidence < 1:
            raise ValueError("field 'confidence' must be in [0, 1)")
        if self.n_resamples < 100:
            raise ValueError("field 'n_resamples' must be >= 100")


CONFIG = DiagnosticsConfig


# ------------------------------------------------------------------------------------ inputs


def parse_retrieval(specs: list[str]) -> dict[str, Path]:
    """``LABEL=PATH`` or ``PATH`` (a retrieval.jsonl or an eval qa run dir) -> ``{label: file}``."""
    out: dict[str, Path] = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        path = Path(rest if sep and label and "/" not in label else spec)
        if path.is_dir():
            path = path / "retrieval.jsonl"
        if not (sep and label and "/" not in label):
            label = path.parent.name or path.stem
        if not path.is_file():
            raise InputError(path, "no such retrieval file (give LABEL=PATH to an eval qa retrieval.jsonl)")
        if label in out:
            raise InputError(path, f"label {label!r} given twice; name them with LABEL=PATH")
        out[label] = path
    return out


def read_retrieval(path: Path, ranking: str = "dense", limit: int | None = None,
                   rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> list[dict]:  # fmt: skip
    """Rows of a retrieval.jsonl: ``{"qid", "question", "answer", "hits": [{"text", "indexed_text",
    "score"}...]}`` in rank order (``hits``, or ``reranked`` when asked and present). A bad row is
    an error or, with ``rejects`` (``--on-bad-row skip``), left out."""
    rows = []
    for number, raw, row in read_records(path, rejects, max_row_bytes):
        try:
            question = row["question"]
            hits = row["hits"]
            if ranking == "reranked" and row.get("reranked") is not None:
                hits = row["reranked"]
            if not isinstance(question, str) or not isinstance(hits, list):
                raise TypeError("'question' must be a string and 'hits' a list")
            hits = sorted(hits, key=lambda h: h.get("rank", 0))
            parsed = [{"text": h.get("indexed_text") or h["text"], "score": h.get("score")} for h in hits]
        except (KeyError, TypeError, AttributeError) as e:
            error = InputError(path, f"expected an eval qa retrieval row ({type(e).__name__}: {e})", number)
            refuse_or_skip(rejects, error, raw)
            continue
        answer = row.get("answer")
        rows.append({
            "qid": row.get("qid", number), "question": question,
            "answer": answer if isinstance(answer, str) else None, "hits": parsed,
        })  # fmt: skip
        if limit is not None and len(rows) >= limit:  # stop before reading (and judging) a row not used
            break
    if not rows:
        raise InputError(path, "no questions in the file")
    return rows


def read_rewrites(path: Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES
                  ) -> tuple[list[tuple[str, str]], int]:  # fmt: skip
    """``([(original, rewritten)], n_without)``: every chunk with a non-empty ``rewritten``; a bad
    record is an error or, with ``rejects``, left out whole."""
    pairs, without = [], 0
    for number, raw, record in read_records(path, rejects, max_row_bytes):
        try:
            mine, lacking = [], 0
            for c in record["chunks"]:
                text, rewritten = c["text"], c.get("rewritten")
                if isinstance(rewritten, str) and rewritten.strip():
                    mine.append((text, rewritten))
                else:
                    lacking += 1
        except (KeyError, TypeError, AttributeError) as e:
            refuse_or_skip(rejects, InputError(path, f"expected a chunks record ({type(e).__name__}: {e})", number),
                           raw)  # fmt: skip
            continue
        pairs += mine
        without += lacking
    if not pairs:
        raise InputError(
            path, "no chunk carries a 'rewritten' text (chunk with `metachunk chunk --rewrite MODEL`)"
        )
    return pairs, without


def model_label(name: str) -> str:
    """A metric-name-safe label: the preset name, or the model dir's name."""
    base = Path(name).name or name
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base)


# ------------------------------------------------------------------------------ computations


def _progress(total: int, desc: str, enabled: bool):
    from metachunk.progress import bar as progress_bar

    return progress_bar(total=total, unit="tok", unit_scale=True, desc=desc, enabled=enabled)


def text_nll(model, tokenizer, texts, max_context: int = 2048, batch_tokens: int = 8192, progress: bool = False,
             desc: str = "ppl") -> list[float]:  # fmt: skip
    """Mean token NLL (nats) of each text read alone (after the lead tokens, see ``eval chunk-quality``)."""
    from metachunk.eval.chunk_quality import lead_ids

    from metachunk.engine.scoring import token_nll

    _, lead = lead_ids(tokenizer)
    ids = [lead + list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    with _progress(sum(len(x) - 1 for x in ids), desc, progress) as bar:
        nll = token_nll(
            model,
            ids,
            max_context=max_context,
            batch_tokens=max(batch_tokens, max_context),
            on_batch=bar.update,
        )
    return [
        float(np.mean(v[len(lead) :], dtype=np.float64)) if len(v) > len(lead) else float("nan") for v in nll
    ]


def cp_ids(tokenizer, chunks, answer: str, question: str | None = None, max_context: int = 2048):
    """``(ids, first answer position)`` of one CP sequence: lead tokens, the chunks joined by blank
    lines (first tokens kept when too long), a blank line (or the question block), the answer."""
    start = list(tokenizer("", add_special_tokens=True)["input_ids"])
    context = list(tokenizer("\n\n".join(chunks), add_special_tokens=False)["input_ids"]) if chunks else []
    tail = "\n\n" if question is None else f"\n\nQuestion: {question.strip()}\nAnswer: "
    sep = list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    ans = list(tokenizer(answer.strip(), add_special_tokens=False)["input_ids"])[: max_context // 2]
    context = context[: max(0, max_context - len(start) - len(sep) - len(ans))]
    head = start + context + sep
    return head + ans, len(head)


def cp_scores(model, tokenizer, rows, k: int, cp_prompt: str = "chunks", max_context: int = 2048,
              batch_tokens: int = 8192, progress: bool = False, desc: str = "cp") -> list[float | None]:  # fmt: skip
    """Per question: mean NLL (nats) of the answer's tokens given its top-k chunks; None without an answer."""
    from metachunk.engine.scoring import token_nll

    seqs, owners = [], []
    for q, row in enumerate(rows):
        if not row["answer"] or not row["answer"].strip():
            continue
        question = row["question"] if cp_prompt == "question" else None
        seqs.append(
            cp_ids(tokenizer, [h["text"] for h in row["hits"][:k]], row["answer"], question, max_context)
        )
        owners.append(q)
    out: list[float | None] = [None] * len(rows)
    if not seqs:
        return out
    longest = max(len(ids) for ids, _ in seqs)
    with _progress(sum(len(ids) - 1 for ids, _ in seqs), desc, progress) as bar:
        nll = token_nll(
            model, [ids for ids, _ in seqs], max_context=max(longest, 2), batch_tokens=max(batch_tokens, longest),
            on_batch=bar.update,
        )  # fmt: skip
    for q, (_, first), v in zip(owners, seqs, nll):
        out[q] = float(np.mean(v[max(first, 1) :], dtype=np.float64))
    return out


def similarity_scores(rows, k: int, vectors: dict[str, np.ndarray], query_vectors: list[np.ndarray]):
    """Per question: ``(mean query-chunk cosine over the top k, mean pairwise cosine among them or None)``."""
    out = []
    for row, qv in zip(rows, query_vectors):
        hits = [vectors[h["text"]] for h in row["hits"][:k]]
        if not hits:
            out.append((None, None))
            continue
        m = np.stack(hits)
        avg = float((m @ qv).mean())
        if len(hits) < 2:
            out.append((avg, None))
            continue
        sims = m @ m.T
        iu = np.triu_indices(len(hits), k=1)
        out.append((avg, float(sims[iu].mean())))
    return out


def paired_names(labels: list[str], model_labels: list[str], k: int) -> list[tuple[str, str]]:
    """``(metric, its baseline)`` pairs whose item-by-item difference gets an interval: each
    model's rewrite PPL against the originals', and each retrieval label against the first."""
    pairs = [(f"ppl_rewritten_{m}", f"ppl_original_{m}") for m in model_labels]
    kinds = [f"avgsim@{k}", f"pairsim@{k}", f"retriever_avgsim@{k}", *[f"cp_{m}" for m in model_labels]]
    return pairs + [(f"{kind}_{label}", f"{kind}_{labels[0]}") for kind in kinds for label in labels[1:]]


def intervals(items: list[dict], pairs: list[tuple[str, str]], confidence: float, n_resamples: int,
              seed: int) -> dict:  # fmt: skip
    """Bootstrap intervals of every metric's mean over its items, and of the paired differences."""
    from metachunk.eval.compare import bootstrap_interval

    by_metric: dict[str, dict[str, float]] = {}
    for row in items:
        for name, value in row.items():
            if name != "id":
                by_metric.setdefault(name, {})[row["id"]] = value

    def interval(samples):
        return bootstrap_interval(samples, confidence, n_resamples, seed)

    out = {"confidence": confidence, "n_resamples": n_resamples, "seed": seed, "method": "percentile",
           "intervals": {}, "differences": []}  # fmt: skip
    for name, values in by_metric.items():
        out["intervals"][name] = {"n": len(values), "interval": interval([list(values.values())])}
    for name, base in pairs:
        a, b = by_metric.get(name), by_metric.get(base)
        common = [i for i in a if i in b] if a and b else []
        if not common:
            continue
        x, y = [a[i] for i in common], [b[i] for i in common]
        ci = interval([x, y])
        out["differences"].append({
            "metric": name, "baseline": base, "difference": float(np.mean(np.subtract(x, y))), "interval": ci,
            "paired_items": len(common), "resolved": ci is not None and (ci[0] > 0 or ci[1] < 0),
        })  # fmt: skip
    return out


# ------------------------------------------------------------------------------------ the run


def _avgsim(cfg: DiagnosticsConfig, rows: dict[str, list[dict]], metrics: dict, put) -> dict:
    """AVGSim and pair similarity of each retrieval run's top k (one embedder, every distinct text
    embedded once) into ``metrics`` and each question's item (``put``); returns the per-question details."""
    from metachunk.eval.index import embed

    from metachunk import models

    embedder = models.load_sentence_embedder(cfg.embedder, device=cfg.device)
    texts = list(dict.fromkeys(h["text"] for rs in rows.values() for r in rs for h in r["hits"][: cfg.k]))
    questions = list(dict.fromkeys(r["question"] for rs in rows.values() for r in rs))
    chunk_vecs = dict(zip(texts, embed(embedder, texts, cfg.embed_batch_size, cfg.progress, "embed chunks")))
    query_vecs = dict(zip(questions, embed(embedder, questions, cfg.embed_batch_size, cfg.progress,
                                           "embed questions", prefix=cfg.query_prefix)))  # fmt: skip
    per_label: dict = {}
    for label, rs in rows.items():
        sims = similarity_scores(rs, cfg.k, chunk_vecs, [query_vecs[r["question"]] for r in rs])
        stored = [mean_of_known([h["score"] for h in r["hits"][: cfg.k]]) for r in rs]
        metrics[f"avgsim@{cfg.k}_{label}"] = mean_of_known([s for s, _ in sims])
        metrics[f"pairsim@{cfg.k}_{label}"] = mean_of_known([p for _, p in sims])
        metrics[f"retriever_avgsim@{cfg.k}_{label}"] = mean_of_known(stored)
        metrics[f"questions_{label}"] = len(rs)
        for r, (s, p), st in zip(rs, sims, stored):
            put(f"q:{r['qid']}", f"avgsim@{cfg.k}_{label}", s)
            put(f"q:{r['qid']}", f"pairsim@{cfg.k}_{label}", p)
            put(f"q:{r['qid']}", f"retriever_avgsim@{cfg.k}_{label}", st)
        per_label[label] = [
            {"qid": r["qid"], "avgsim": s, "pairsim": p, "retriever_avgsim": st, "hits": len(r["hits"][: cfg.k])}
            for r, (s, p), st in zip(rs, sims, stored)
        ]  # fmt: skip
    return per_label


def evaluate(cfg: DiagnosticsConfig) -> dict:
    """AVGSim of retrieval runs, then PPL of rewrites and CP of the retrieved chunks under each model;
    returns the metrics, details, per-item values and how the run went."""
    from metachunk import models

    retrieval = parse_retrieval(cfg.retrieval) if cfg.retrieval else {}
    rejects = cfg.bad_rows.rejects(cfg.out)
    limit = cfg.bad_rows.max_row_bytes
    rows = {
        label: read_retrieval(path, cfg.ranking, cfg.limit, rejects, limit)
        for label, path in retrieval.items()
    }
    rewrites, without = read_rewrites(cfg.chunks, rejects, limit) if cfg.chunks else ([], 0)
    rejected = finish_rejects(rejects, "eval diagnostics")
    labels = [model_label(m) for m in cfg.models]
    if len(set(labels)) != len(labels):
        raise InputError("--models", f"two models share a label: {labels}")
    metrics: dict[str, float] = {}
    items: dict[str, dict[str, float]] = {}  # item id (chunk:N, q:QID) -> its value of each metric

    def put(item: str, name: str, value) -> None:
        if known(value):
            items.setdefault(item, {})[name] = float(value)

    details: dict = {
        "retrieval": {label: str(p) for label, p in retrieval.items()},
        "models": dict(zip(labels, cfg.models)),
    }
    t0 = time.perf_counter()

    if rows:  # AVGSim: one embedder, every distinct text once
        details["avgsim"] = _avgsim(cfg, rows, metrics, put)

    # PPL and CP: one causal LM at a time
    details["ppl"], details["cp"] = {}, {}
    for name, mlabel in zip(cfg.models, labels):
        model, tokenizer = models.load_causal_lm(name, device=cfg.device, dtype=cfg.dtype)
        details.setdefault("dtype", {})[mlabel] = getattr(model, "metachunk_dtype", {})  # picked, and why
        if rewrites:
            texts = [t for pair in rewrites for t in pair]
            nll = text_nll(
                model, tokenizer, texts, cfg.max_context, cfg.batch_tokens, cfg.progress, f"ppl {mlabel}"
            )
            original, rewritten = np.exp(nll[0::2]), np.exp(nll[1::2])
            ok = ~(np.isnan(original) | np.isnan(rewritten))
            for i in np.flatnonzero(ok):
                put(f"chunk:{i}", f"ppl_original_{mlabel}", original[i])
                put(f"chunk:{i}", f"ppl_rewritten_{mlabel}", rewritten[i])
                put(f"chunk:{i}", f"ppl_rewritten_lower_share_{mlabel}", float(rewritten[i] < original[i]))
            original, rewritten = original[ok], rewritten[ok]
            metrics[f"ppl_original_{mlabel}"] = float(original.mean())
            metrics[f"ppl_rewritten_{mlabel}"] = float(rewritten.mean())
            metrics[f"ppl_rewritten_lower_share_{mlabel}"] = float((rewritten < original).mean())
            details["ppl"][mlabel] = {
                "chunks": int(ok.sum()), "median_original": float(np.median(original)),
                "median_rewritten": float(np.median(rewritten)),
                "original": [round(float(x), 4) for x in original], "rewritten": [round(float(x), 4) for x in rewritten],
            }  # fmt: skip
        for label, rs in rows.items():
            scores = cp_scores(model, tokenizer, rs, cfg.k, cfg.cp_prompt, cfg.max_context, cfg.batch_tokens,
                               cfg.progress, f"cp {mlabel} {label}")  # fmt: skip
            cp = mean_of_known(scores)
            for r, score in zip(rs, scores):
                put(f"q:{r['qid']}", f"cp_{mlabel}_{label}", score)
            if cp is not None:
                metrics[f"cp_{mlabel}_{label}"] = cp
            details["cp"].setdefault(mlabel, {})[label] = {
                "questions": sum(s is not None for s in scores),
                "skipped_no_answer": sum(s is None for s in scores),
                "per_question": [{"qid": r["qid"], "cp": s} for r, s in zip(rs, scores)],
            }
        del model
    if rewrites:
        metrics["rewritten_chunks"] = len(rewrites)
        metrics["chunks_without_rewrite"] = without
    item_rows = [{"id": item, **values} for item, values in items.items()]
    if cfg.confidence:
        details["statistics"] = intervals(item_rows, paired_names(list(rows), labels, cfg.k), cfg.confidence,
                                          cfg.n_resamples, cfg.seed)  # fmt: skip
    if rejected is not None:
        details["rejects"] = rejected
    return {
        "metrics": {k: v for k, v in metrics.items() if v is not None},
        "details": details,
        "items": item_rows,
        "run": {"seconds": round(time.perf_counter() - t0, 2)},
    }


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    return write_figure(fig, path)


def _error_bars(details: dict, names: list[str], values: list[float]):
    """matplotlib's ``yerr`` from the bootstrap intervals of ``names`` (None when there are none)."""
    cis = [details.get("statistics", {}).get("intervals", {}).get(n, {}).get("interval") for n in names]
    if not any(cis):
        return None
    return [[max(0.0, v - ci[0]) if ci else 0.0 for v, ci in zip(values, cis)],
            [max(0.0, ci[1] - v) if ci else 0.0 for v, ci in zip(values, cis)]]  # fmt: skip


def plot(out: Path, result: dict, k: int) -> list[Path]:
    from metachunk.artifacts import new_figure

    out, metrics, details, paths = Path(out), result["metrics"], result["details"], []
    if details.get("ppl"):
        names = list(details["ppl"])
        fig, ax = new_figure(figsize=(max(4.5, 1.5 + 2.2 * len(names)), 4))
        data, positions, colors = [], [], []
        for i, name in enumerate(names):
            data += [details["ppl"][name]["original"], details["ppl"][name]["rewritten"]]
            positions += [3 * i + 1, 3 * i + 2]
            colors += ["#8c8c8c", "#4c72b0"]
        box = ax.boxplot(data, positions=positions, widths=0.8, patch_artist=True, showfliers=False)
        for patch, color in zip(box["boxes"], colors):
            patch.set_facecolor(color)
        ax.set_xticks([3 * i + 1.5 for i in range(len(names))], names)
        ax.set_yscale("log")
        ax.set_ylabel("chunk perplexity")
        ax.legend([box["boxes"][0], box["boxes"][1]], ["original", "rewritten"])
        ax.set_title("PPL of original vs rewritten chunks", fontsize=10)
        paths.append(_save(fig, out / "ppl_rewrite.png"))
    labels = list(details.get("avgsim", {}))
    if labels:
        fig, ax = new_figure(figsize=(max(5.5, 2 + 1.6 * len(labels)), 3.5))
        width = 0.38
        x = np.arange(len(labels))
        for shift, key, color in ((-width / 2, "avgsim", "#4c72b0"), (width / 2, "pairsim", "#dd8452")):
            names = [f"{key}@{k}_{label}" for label in labels]
            values = [metrics.get(name, np.nan) for name in names]
            bars = ax.bar(x + shift, values, width, label=f"{key}@{k}", color=color,
                          yerr=_error_bars(details, names, values), capsize=3)  # fmt: skip
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_xticks(x, labels)
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=8)
        ax.set_title(
            f"top-{k} retrieved chunks: query-chunk (avgsim) and chunk-chunk (pairsim) cosine", fontsize=9
        )
        paths.append(_save(fig, out / "avgsim.png"))
    if details.get("cp") and labels:
        names = list(details["cp"])
        fig, ax = new_figure(figsize=(max(5.5, 2 + 1.6 * len(labels)), 3.5))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            keys = [f"cp_{name}_{label}" for label in labels]
            values = [metrics.get(key, np.nan) for key in keys]
            bars = ax.bar(np.arange(len(labels)) + (i - (len(names) - 1) / 2) * width, values, width, label=name,
                          yerr=_error_bars(details, keys, values), capsize=3)  # fmt: skip
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_xticks(np.arange(len(labels)), labels)
        ax.set_ylabel("CP (nats / answer token, lower = better)")
        ax.legend(fontsize=8)
        ax.set_title(f"CP: -mean log P(answer token | top-{k} chunks)", fontsize=10)
        paths.append(_save(fig, out / "cp.png"))
    return paths


def report_tables(result: dict, k: int) -> str:
    from metachunk.eval.report import format_value, markdown_table

    metrics, details, parts = result["metrics"], result["details"], []

    def cell(key):
        return format_value(metrics[key]) if key in metrics else "–"

    if details.get("ppl"):
        rows = [[m, cell(f"ppl_original_{m}"), cell(f"ppl_rewritten_{m}"), cell(f"ppl_rewritten_lower_share_{m}")]
                for m in details["ppl"]]  # fmt: skip
        parts += ["## PPL of original vs rewritten chunks", "",
                  markdown_table(["model", "mean ppl original", "mean ppl rewritten", "rewrite lower"], rows), ""]  # fmt: skip
    labels = list(details.get("avgsim", {}))
    if labels:
        cp_models = list(details.get("cp", {}))
        header = [
            "retrieval",
            f"avgsim@{k}",
            f"pairsim@{k}",
            f"retriever_avgsim@{k}",
            *[f"CP {m}" for m in cp_models],
        ]
        rows = [[label, cell(f"avgsim@{k}_{label}"), cell(f"pairsim@{k}_{label}"), cell(f"retriever_avgsim@{k}_{label}"),
                 *[cell(f"cp_{m}_{label}") for m in cp_models]] for label in labels]  # fmt: skip
        parts += ["## Retrieved chunks", "", markdown_table(header, rows), ""]
    stats = details.get("statistics")
    if stats and stats["intervals"]:
        level = f"{stats['confidence']:.0%}"

        def span(ci):
            return "–" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"

        rows = [[name, cell(name), span(s["interval"]), s["n"]] for name, s in stats["intervals"].items()]
        parts += [f"## {level} bootstrap intervals", "",
                  f"Over the items (chunks for PPL, questions for AVGSim and CP; percentile method, "
                  f"{stats['n_resamples']:,} resamples, seed {stats['seed']}):", "",
                  markdown_table(["metric", "mean", f"{level} interval", "items"], rows), ""]  # fmt: skip
        if stats["differences"]:
            rows = [[f"{d['metric']} − {d['baseline']}", f"{d['difference']:+.4f}",
                     "–" if d["interval"] is None else f"[{d['interval'][0]:+.4f}, {d['interval'][1]:+.4f}]",
                     d["paired_items"], "**resolved**" if d["resolved"] else "noise"]
                    for d in stats["differences"]]  # fmt: skip
            parts += ["## Paired differences", "",
                      "Item by item (a chunk's rewrite against the chunk; a question under one index text against "
                      "the first); **resolved** when the interval excludes 0:", "",
                      markdown_table(["difference", "mean", f"{level} interval", "items", ""], rows), ""]  # fmt: skip
    return "\n".join(parts)


def run(cfg: DiagnosticsConfig) -> Result:
    from metachunk.eval.report import write_run

    from metachunk.models import ModelNotFoundError

    try:
        result = evaluate(cfg)
    except (InputError, ModelNotFoundError) as e:
        print(f"eval diagnostics: {e}", file=sys.stderr)
        return Result(2)
    pngs = plot(cfg.out, result, cfg.k)
    result["details"]["plots"] = [p.name for p in pngs]
    write_run(cfg.out, "diagnostics", cfg, result["metrics"], result["details"], items=result["items"],
              run=result["run"])  # fmt: skip
    report = Path(cfg.out) / "report.md"
    text = report.read_text(encoding="utf-8")
    extra = report_tables(result, cfg.k) + "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs)
    with AtomicWriter(report) as f:
        f.write(text + "\n" + extra)
    for key, value in result["metrics"].items():
        print(f"{key:<40} {value:.4f}" if isinstance(value, float) else f"{key:<40} {value}", file=sys.stderr)
    print(
        f"wrote {Path(cfg.out) / 'metrics.json'}, report.md, {', '.join(p.name for p in pngs)}",
        file=sys.stderr,
    )
    from metachunk.eval.report import summary

    rejected = result["details"].get("rejects")
    return Result.with_rejects(summary(result["metrics"]), rejected)


def inputs(cfg: DiagnosticsConfig) -> Reads:
    """The chunks, each retrieval file (``LABEL=PATH``: the path) and the scoring models."""
    retrieval = [spec.partition("=")[2] if "=" in spec and "/" not in spec.partition("=")[0] else spec
                 for spec in cfg.retrieval or []]  # fmt: skip
    return Reads.of(paths=[cfg.chunks, *retrieval], models=[*(cfg.models or []), cfg.embedder])


def outputs(cfg: DiagnosticsConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
