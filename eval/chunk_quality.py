"""``metachunk eval chunk-quality``: Boundary Clarity and Chunk Stickiness (MoC §3.1), no QA needed.

```
metachunk eval chunk-quality --chunks CHUNKS.jsonl --model PRESET_OR_DIR --out DIR \\
  [--k 0.8] [--max-pairs 1024] [--convention paper|released] [--limit N]
```

Both metrics come from perplexities of one chunk ``q`` read alone, ``ppl(q)``, and read right
after another chunk ``d`` of the same document, ``ppl(q|d)``. ``ppl = exp(mean token NLL)`` over
``q``'s tokens, each NLL from `metachunk.engine.scoring`. Every token of ``q`` is scored in both:
"alone" means after the tokens the tokenizer puts before any text (Gemma's ``<bos>``), or after a
single space where it puts none (SmolLM2, Qwen), as the authors' scripts do; "after ``d``" means
after those same lead tokens and ``d``'s tokens. Chunks are tokenized one by one and the ids
concatenated; a chunk longer than ``--max-chunk-tokens`` keeps its first tokens as ``q`` and its
last tokens as ``d`` (the part next to what follows).

**Matrices and direction.** For a document of chunks ``c_0..c_{N-1}``, ``C[i, j] = ppl(c_j | c_i)``:
the row is the context ``d``, the column the scored chunk ``q``.

* **Boundary Clarity** (Eq. 1), per boundary between adjacent chunks, ``d`` the chunk before it
  and ``q`` the chunk after (the released ``chunk_eval.py`` pairs them so):
  ``BC = ppl(q|d) / ppl(q) = C[i, i+1] / ppl(c_{i+1})``. Near 1: ``d`` tells nothing about ``q``, a
  clear boundary; near 0: the boundary cut related text. Higher is better. It can exceed 1 when
  ``d`` misleads. ``bc_mean`` averages over all boundaries of all documents; ``bc_doc_mean``
  averages the per-document means.
* **Edge weight** (Eq. 2): ``Edge(q, d) = (ppl(q) - ppl(q|d)) / ppl(q) = 1 - BC(q, d)``, positive
  when ``d`` makes ``q`` more predictable, so ``W[i, j] = 1 - C[i, j] / ppl(c_j)``.
* **Chunk Stickiness** (Eq. 3): every ordered pair ``(d=c_i, q=c_j)`` whose edge passes the rule
  below is one edge of a graph on the chunks; with degrees ``d_v`` (edges touching ``v``) and
  ``m`` edges, ``CS = -Σ_v (d_v / 2m) log2(d_v / 2m)``, the structural entropy of the degree
  distribution. Lower is better. The *complete* graph (``cs_complete``, the paper's CS_c) takes
  all ordered pairs ``i != j``, so two chunks can be joined twice (once each way), as in the
  released ``relation_eval.py``; the *sequence-aware incomplete* graph (``cs_incomplete``, CS_i)
  takes only pairs whose context comes first, ``j > i`` (δ = 0), under both conventions: the
  released ``create_graph_2``'s direction. Read literally, the paper's ``Edge(d_i, d_j)`` with
  ``j - i > δ`` scores the earlier chunk given the later one. A document whose graph keeps no
  edge (``m = 0``) has ``CS = 0``: no stickiness, the empty sum, and what the released script
  returns; ``docs_no_edges_*`` count them. Documents with fewer than two chunks have no boundary
  and no pair: they are skipped (``docs_skipped``).

**Convention** (``--convention``). The paper's text and the authors' released scripts
(IAAR-Shanghai/Meta-Chunking, ``MoC/our _metrics``) differ:

* ``paper`` (default): the equations as printed. ppl is ``exp(mean NLL)``; an edge is kept when
  ``Edge > K``, i.e. ``ppl(q|d) < (1 - K) ppl(q)``: ``d`` cuts ``q``'s perplexity by more than K.
  At K = 0.8 only strongly dependent pairs survive, so small models and ordinary prose give
  sparse graphs (often ``m = 0``).
* ``released``: what ``chunk_eval.py`` and ``relation_eval.py`` compute. BC divides mean NLLs
  (log-perplexities), ``NLL(q|d) / NLL(q)``; CS keeps an edge when ``ppl(q|d) / ppl(q) > K``
  (their ``create_graph_3`` stores ``1 - Edge`` and ``find_values_greater_than`` keeps it above
  0.8), i.e. when ``Edge < 1 - K``: the pairs where ``d`` helps ``q`` *little*. This is the rule
  that yields graphs dense enough for the magnitudes of the paper's Tables 3 and 4.

``details`` carries every document's matrices (mean NLLs; ``--no-save-matrices`` leaves them out), so
either convention and any K can be recomputed from one run. Both conventions are also reported as
they are: ``bc_mean@paper``, ``cs_complete@released``, ... (per-document means, in ``items.jsonl``
too), beside the unsuffixed metrics of ``--convention``.

**Cost and the cap.** The complete graph needs ``N (N - 1)`` conditional perplexities per
document. They are batched: each context ``d`` runs once and its KV cache is reused by batches of
all the ``q`` read after it, ``--batch-size`` of them per forward pass
(`metachunk.engine.scoring.continuation_nll`): faster than one forward pass per pair, since a
context's forward pass is shared by every chunk read after it (``bench/eval_speed.py``; the figures are
on the performance page). ``--max-pairs`` caps the
ordered pairs per document, but never below the ``N - 1`` adjacent forward pairs: BC is scored at
every boundary. The cap's other pairs are the nearest (by ``|i - j|``, forward before backward,
then by position). Pairs not computed are no edge, so under a cap of ``N - 1`` or less the graph
is the path of adjacent pairs and CS restates BC (``CS_c = CS_i``). ``pairs_computed``, ``pairs_total`` and ``docs_capped`` say what the cap
left out.

Writes ``OUT/metrics.json`` + ``report.md`` (`metachunk.eval.report.write_run`) and
``OUT/chunk_quality.png``: the histogram of BC over all boundaries and the edge-weight matrix of
one document (the first with two or more chunks, or ``--plot-doc``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from metachunk.chunking.shards import chunk_rows
from metachunk.eval.report import mean_of_known

from metachunk import config
from metachunk.artifacts import AtomicWriter, InputError, check_unicode, write_figure
from metachunk.command import Reads, Result
from metachunk.config import option
from metachunk.sources import MAX_ROW_BYTES, BadRows, Rejects, finish_rejects, refuse_or_skip

CONVENTIONS = ("paper", "released")


@dataclass
class ChunkQualityConfig:
    chunks: Path = option(None, "chunks JSONL from `metachunk chunk` (one row per document)")
    model: str = option("smollm2", "causal LM that reads the chunks: preset, local HF dir or Hub id")
    out: Path = option(None, "run dir: metrics.json, report.md, chunk_quality.png")
    k: float = option(0.8, "edge threshold K in (0, 1) for Chunk Stickiness (paper: 0.8; Table 4: 0.7-0.9)")
    convention: str = option(
        "paper",
        "paper: Edge = (ppl(q)-ppl(q|d))/ppl(q) > K, BC a ppl ratio; released: the authors' scripts "
        "(BC = NLL ratio, edge kept when ppl(q|d)/ppl(q) > K)",
        choices=list(CONVENTIONS),
    )
    max_pairs: int = option(
        1024,
        "ordered chunk pairs scored per document at most (nearest first), never fewer than the N-1 "
        "adjacent ones BC needs; 0 = all N(N-1)",
    )
    max_chunk_tokens: int = option(1024, "a longer chunk keeps its first tokens as q, its last as d")
    limit: int | None = option(None, "only the first N documents")
    batch_tokens: int = option(4096, "padded continuation tokens per forward pass")
    batch_size: int = option(16, "chunks read after one context per forward pass, at most")
    plot_doc: str | None = option(None, "document whose edge-weight matrix is plotted (default: the first)")
    save_matrices: bool = option(
        True, "keep each document's NLL matrices in metrics.json (recompute any K or convention later)"
    )
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda when available)", runtime=True)
    dtype: str = option(
        "auto",
        "model dtype, as `chunk --dtype`: auto = bfloat16 on a GPU or a CPU with native bfloat16 (AMX, "
        "AVX-512 BF16), else float32; float32 is exact, bfloat16 scores approximate",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    progress: bool = option(True, "progress bar", runtime=True)
    bad_rows: BadRows = config.block(BadRows, "what a bad chunks record does", prefix="")

    def __post_init__(self):
        config.check_choices(self)
        for name in ("chunks", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        if not 0 < self.k < 1:
            raise ValueError(f"field 'k' must be in (0, 1), got {self.k}")
        if self.max_pairs < 0:
            raise ValueError("field 'max_pairs' must be >= 0 (0 = no cap)")
        for name in ("max_chunk_tokens", "batch_tokens", "batch_size", "limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"field {name!r} must be >= 1, got {getattr(self, name)}")


CONFIG = ChunkQualityConfig


# ------------------------------------------------------------------ pure metrics on ppl arrays


def boundary_clarity(ppl_alone, ppl_cond, convention: str = "paper") -> np.ndarray:
    """BC of every boundary ``i -> i+1``: ``ppl(c_{i+1} | c_i) / ppl(c_{i+1})`` (``paper``), or the
    ratio of their logs, the mean NLLs (``released``). ``ppl_cond[i, j] = ppl(c_j | c_i)``; a
    boundary whose pair was not computed (NaN) gives NaN."""
    u = np.asarray(ppl_alone, dtype=np.float64)
    c = np.asarray(ppl_cond, dtype=np.float64)
    n = len(u)
    if n < 2:
        return np.zeros(0)
    cond, alone = c[np.arange(n - 1), np.arange(1, n)], u[1:]
    if convention == "paper":
        return cond / alone
    if convention == "released":
        with np.errstate(divide="ignore", invalid="ignore"):
            log_alone = np.log(alone)
            return np.where(log_alone > 0, np.log(cond) / log_alone, np.nan)
    raise ValueError(f"unknown convention {convention!r}")


def edge_weights(ppl_alone, ppl_cond) -> np.ndarray:
    """``W[i, j] = Edge(q=c_j, d=c_i) = (ppl(c_j) - ppl(c_j | c_i)) / ppl(c_j)``; NaN on the diagonal
    and where the pair was not computed."""
    u = np.asarray(ppl_alone, dtype=np.float64)
    w = 1.0 - np.asarray(ppl_cond, dtype=np.float64) / u[None, :]
    np.fill_diagonal(w, np.nan)
    return w


def kept_edges(ppl_alone, ppl_cond, k: float, convention: str = "paper", graph: str = "complete"):
    """Ordered pairs ``(i, j)`` (context ``c_i``, scored ``c_j``) that are edges of the CS graph."""
    w = edge_weights(ppl_alone, ppl_cond)
    with np.errstate(invalid="ignore"):
        if convention == "paper":
            keep = w > k
        elif convention == "released":
            keep = (1.0 - w) > k  # ppl(q|d) / ppl(q) > K
        else:
            raise ValueError(f"unknown convention {convention!r}")
    keep &= ~np.isnan(w)
    if graph == "incomplete":
        keep &= np.triu(np.ones_like(keep, dtype=bool), k=1)  # the context comes first: j > i
    elif graph != "complete":
        raise ValueError(f"unknown graph {graph!r}; complete or incomplete")
    return [(int(i), int(j)) for i, j in zip(*np.nonzero(keep))]


def structural_entropy(edges, n_nodes: int) -> float:
    """``-Σ (d_v / 2m) log2(d_v / 2m)`` over nodes with ``d_v > 0``; 0 for a graph without edges."""
    degree = np.zeros(n_nodes, dtype=np.float64)
    for i, j in edges:
        degree[i] += 1
        degree[j] += 1
    total = degree.sum()  # 2m
    if total == 0:
        return 0.0
    p = degree[degree > 0] / total
    return float(-(p * np.log2(p)).sum())


def chunk_stickiness(ppl_alone, ppl_cond, k: float, convention: str = "paper", graph: str = "complete"):
    """``(CS, m)`` of one document: the structural entropy of the kept-edge graph and its edge count."""
    edges = kept_edges(ppl_alone, ppl_cond, k, convention, graph)
    return structural_entropy(edges, len(ppl_alone)), len(edges)


def select_pairs(n: int, max_pairs: int = 0) -> list[tuple[int, int]]:
    """Ordered pairs ``(i, j)``, ``i != j``, nearest first: by ``|i - j|``, forward (``j > i``)
    before backward, then by position. The ``n - 1`` adjacent forward pairs, BC's, are always all
    there (a cap that took the first few would score a document's opening boundaries only); the
    others fill up to ``max_pairs`` (all when 0)."""
    pairs = sorted(
        ((i, j) for i in range(n) for j in range(n) if i != j),
        key=lambda p: (abs(p[0] - p[1]), p[1] < p[0], p[0]),
    )
    return pairs[: max(max_pairs, n - 1)] if max_pairs else pairs


# ------------------------------------------------------------------------------ model scoring


def lead_ids(tokenizer) -> tuple[list[int], list[int]]:
    """``(start, alone)``: the ids every sequence starts with (whatever the tokenizer puts before a
    text, e.g. Gemma's ``<bos>``; often nothing), and the prefix a text is read "alone" after
    (``start``, or a single space where ``start`` is empty, so that its first token is scored)."""
    from metachunk.engine.scoring import start_ids

    start = start_ids(tokenizer)
    return start, start or list(tokenizer(" ", add_special_tokens=False)["input_ids"])


def chunk_ids(tokenizer, texts, max_tokens: int) -> tuple[list[list[int]], list[list[int]], int]:
    """``(as_q, as_d, n_truncated)``: each chunk's ids as a scored text (first ``max_tokens``) and as
    context (last ``max_tokens``)."""
    full = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return (
        [f[:max_tokens] for f in full],
        [f[-max_tokens:] for f in full],
        sum(len(f) > max_tokens for f in full),
    )


def mean_nll_matrix(
    model,
    tokenizer,
    texts,
    pairs,
    max_tokens: int = 1024,
    batched: bool = True,
    batch_tokens: int = 4096,
    batch_size: int = 16,
    on_tokens=None,
    score_alone: bool = True,
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(alone, cond, n_truncated)``: mean token NLL (nats) of each chunk read alone, and
    ``cond[i, j]`` of ``c_j`` read after ``c_i`` for the given ``pairs`` (NaN elsewhere).

    ``batched`` reuses each context's KV cache over batches of the chunks read after it
    (`metachunk.engine.scoring.continuation_nll`); otherwise every pair is one forward pass over its
    concatenation (`metachunk.engine.scoring.token_nll`), the reference. ``score_alone=False`` leaves
    ``alone`` NaN (``bench/eval_speed.py`` times the two parts in separate blocks).
    """
    from metachunk.engine.scoring import continuation_nll, token_nll

    start, alone_prefix = lead_ids(tokenizer)
    as_q, as_d, truncated = chunk_ids(tokenizer, texts, max_tokens)
    n = len(texts)
    alone = np.full(n, np.nan)
    cond = np.full((n, n), np.nan)

    def mean(values) -> float:
        return float(np.mean(values, dtype=np.float64)) if len(values) else float("nan")

    kw = {"batch_tokens": batch_tokens, "max_batch_size": batch_size, "on_batch": on_tokens}
    if batched:
        for j, v in enumerate(continuation_nll(model, alone_prefix, as_q, **kw) if score_alone else []):
            alone[j] = mean(v)
        by_context: dict[int, list[int]] = {}
        for i, j in pairs:
            by_context.setdefault(i, []).append(j)
        for i, js in by_context.items():
            if not as_d[i]:
                continue
            for j, v in zip(js, continuation_nll(model, start + as_d[i], [as_q[j] for j in js], **kw)):
                cond[i, j] = mean(v)
        return alone, cond, truncated

    def one(prefix, q) -> float:
        if not q:
            return float("nan")
        ids = prefix + q
        (v,) = token_nll(model, [ids], max_context=max(len(ids), 2))
        if on_tokens:
            on_tokens(len(q))
        return mean(v[len(prefix) :])

    for j in range(n if score_alone else 0):
        alone[j] = one(alone_prefix, as_q[j])
    for i, j in pairs:
        if as_d[i]:
            cond[i, j] = one(start + as_d[i], as_q[j])
    return alone, cond, truncated


# ------------------------------------------------------------------------------------ the run


def read_chunk_docs(path: Path, limit: int | None = None, rejects: Rejects | None = None,
                    max_row_bytes: int = MAX_ROW_BYTES) -> list[tuple[str, list[str]]]:  # fmt: skip
    """``[(doc id, [chunk text, ...])]`` from a ``metachunk chunk`` output (a file or a folder); a
    bad record is an error or, with ``rejects`` (``--on-bad-row skip``), left out."""
    docs: list[tuple[str, list[str]]] = []
    for where, number, row in chunk_rows(path, rejects, max_row_bytes):
        try:
            try:
                doc_id, texts = str(row["id"]), [c["text"] for c in row["chunks"]]
                if not all(isinstance(t, str) for t in texts):
                    raise TypeError("a chunk's 'text' is not a string")
            except (KeyError, TypeError) as e:
                raise InputError(where, f"expected a chunks record with 'id' and 'chunks' of texts ({e})",
                                 number) from None  # fmt: skip
            for t in texts:
                check_unicode(where, number, "text", t)
            docs.append((doc_id, texts))
        except InputError as e:
            refuse_or_skip(rejects, e, json.dumps(row, ensure_ascii=False))
        if limit is not None and len(docs) >= limit:  # stop before reading (and judging) a row not used
            break
    if not docs:
        raise InputError(path, "no documents in the file")
    return docs


def _nan_to_none(a: np.ndarray, digits: int = 5):
    return (
        [_nan_to_none(x, digits) for x in a]
        if a.ndim > 1
        else [None if math.isnan(x) else round(float(x), digits) for x in a]
    )


def evaluate(cfg: ChunkQualityConfig) -> dict:
    from metachunk.models import load_causal_lm
    from metachunk.progress import bar as progress_bar

    rejects = cfg.bad_rows.rejects(cfg.out)
    docs = read_chunk_docs(cfg.chunks, cfg.limit, rejects, cfg.bad_rows.max_row_bytes)
    rejected = finish_rejects(rejects, "eval chunk-quality")
    if cfg.plot_doc is not None and all(
        doc_id != cfg.plot_doc for doc_id, _ in docs
    ):  # before the model loads
        raise InputError(cfg.chunks, f"--plot-doc: no document {cfg.plot_doc!r} among those read")
    model, tokenizer = load_causal_lm(cfg.model, device=cfg.device, dtype=cfg.dtype)
    plans = []
    for doc_id, texts in docs:
        pairs = select_pairs(len(texts), cfg.max_pairs) if len(texts) >= 2 else []
        plans.append((doc_id, texts, pairs))
    # progress in tokens: every scored chunk once alone, then once per pair it is the q of
    lengths = {
        doc_id: [
            min(len(tokenizer(t, add_special_tokens=False)["input_ids"]), cfg.max_chunk_tokens) for t in texts
        ]
        for doc_id, texts, _ in plans
    }
    total = sum(sum(lengths[d]) + sum(lengths[d][j] for _, j in pairs) for d, _, pairs in plans if pairs)
    t0 = time.perf_counter()
    per_doc, bcs, truncated = [], [], 0
    with progress_bar(
        total=total, unit="tok", unit_scale=True, desc="chunk-quality", enabled=cfg.progress
    ) as bar:
        for doc_id, texts, pairs in plans:
            row = {"id": doc_id, "n_chunks": len(texts), "pairs_total": len(texts) * (len(texts) - 1)}
            if not pairs:
                per_doc.append({**row, "skipped": "fewer than two chunks"})
                continue
            alone, cond, cut = mean_nll_matrix(
                model, tokenizer, texts, pairs, max_tokens=cfg.max_chunk_tokens, batch_tokens=cfg.batch_tokens,
                batch_size=cfg.batch_size, on_tokens=bar.update,
            )  # fmt: skip
            truncated += cut
            ppl_alone, ppl_cond = np.exp(alone), np.exp(cond)
            bc = boundary_clarity(ppl_alone, ppl_cond, cfg.convention)
            bcs += [float(x) for x in bc if not math.isnan(x)]
            cs_c, m_c = chunk_stickiness(ppl_alone, ppl_cond, cfg.k, cfg.convention, "complete")
            cs_i, m_i = chunk_stickiness(ppl_alone, ppl_cond, cfg.k, cfg.convention, "incomplete")
            # both conventions from the same matrices: the paper's equations and the released scripts
            both = {}
            for convention in CONVENTIONS:
                both[f"bc_mean@{convention}"] = mean_of_known(
                    boundary_clarity(ppl_alone, ppl_cond, convention).tolist()
                )
                for graph in ("complete", "incomplete"):
                    both[f"cs_{graph}@{convention}"] = chunk_stickiness(
                        ppl_alone, ppl_cond, cfg.k, convention, graph
                    )[0]
            per_doc.append({
                **row, "pairs_computed": len(pairs), "capped": len(pairs) < row["pairs_total"],
                "bc": _nan_to_none(bc), "bc_mean": mean_of_known(bc.tolist()),
                "cs_complete": cs_c, "edges_complete": m_c, "cs_incomplete": cs_i, "edges_incomplete": m_i,
                "conventions": both, "nll_alone": _nan_to_none(alone), "nll_cond": _nan_to_none(cond),
            })  # fmt: skip
    elapsed = time.perf_counter() - t0
    scored = [d for d in per_doc if "skipped" not in d]
    all_chunks = [t for _, texts in docs for t in texts]

    def avg(key):
        return mean_of_known([d[key] for d in scored])

    metrics = {
        "bc_mean": mean_of_known(bcs),
        "bc_doc_mean": avg("bc_mean"),
        "cs_complete": avg("cs_complete"),
        "cs_incomplete": avg("cs_incomplete"),
        "edges_complete_mean": avg("edges_complete"),
        "edges_incomplete_mean": avg("edges_incomplete"),
        "docs_no_edges_complete": sum(d["edges_complete"] == 0 for d in scored),
        "docs_no_edges_incomplete": sum(d["edges_incomplete"] == 0 for d in scored),
        "k": cfg.k,
        "boundaries": len(bcs),
        "pairs_computed": sum(d["pairs_computed"] for d in scored),
        "pairs_total": sum(d["pairs_total"] for d in scored),
        "max_pairs": cfg.max_pairs,
        "docs_capped": sum(d["capped"] for d in scored),
        "docs": len(scored),
        "docs_skipped": len(per_doc) - len(scored),
        "chunks": len(all_chunks),
        "avg_chunk_chars": round(sum(map(len, all_chunks)) / len(all_chunks), 2),
        "chunks_truncated": truncated,
    }
    metrics = {k: v for k, v in metrics.items() if v is not None}
    details = {
        "convention": cfg.convention,
        "model": cfg.model,
        "dtype": getattr(model, "metachunk_dtype", {"dtype": str(model.dtype)}),  # picked, and why
        "matrices": "nll_cond[i][j] = mean NLL (nats) of chunk j read after chunk i; nll_alone[j] of chunk j alone; "
        "ppl = exp(NLL)",
        "documents": per_doc,
    }
    # per document: bc_doc_mean and the CS values are means over these (bc_mean is over boundaries)
    items = [{"id": d["id"], "bc_doc_mean": d["bc_mean"], "cs_complete": d["cs_complete"],
              "cs_incomplete": d["cs_incomplete"], **d["conventions"]} for d in scored]  # fmt: skip
    for name in scored[0]["conventions"] if scored else {}:  # per-document means, as bc_doc_mean
        value = mean_of_known([d["conventions"][name] for d in scored])
        if value is not None:
            metrics[name] = value
    if rejected is not None:
        details["rejects"] = rejected
    return {"metrics": metrics, "details": details, "bc_values": bcs, "items": items,
            "run": {"seconds": round(elapsed, 2)}}  # fmt: skip


def plot(out: Path, bcs: list[float], doc: dict | None, convention: str, k: float) -> Path:

    from metachunk.artifacts import new_figure

    fig, axes = new_figure(1, 2, figsize=(10, 4))
    ax = axes[0]
    if bcs:
        ax.hist(bcs, bins=min(30, max(5, len(bcs) // 2)), color="#4c72b0")
        ax.axvline(float(np.mean(bcs)), color="k", ls="--", lw=1, label=f"mean {np.mean(bcs):.3f}")
        ax.legend()
    ax.set_title(f"Boundary Clarity over {len(bcs)} boundaries ({convention})")
    ax.set_xlabel("BC (higher = clearer boundary)")
    ax = axes[1]
    if doc is not None:
        alone = np.exp(np.array(doc["nll_alone"], dtype=float))
        cond = np.exp(
            np.array([[np.nan if x is None else x for x in r] for r in doc["nll_cond"]], dtype=float)
        )
        w = edge_weights(alone, cond)
        image = ax.imshow(np.ma.masked_invalid(w), cmap="viridis", vmin=min(0.0, np.nanmin(w)), vmax=1.0)
        fig.colorbar(image, ax=ax, label="Edge(q, d)")
        for i, j in kept_edges(alone, cond, k, convention, "complete"):
            ax.plot(j, i, "r.", ms=3)
        ax.set_title(f"edge weights, doc {doc['id']} (red: kept at K={k})", fontsize=9)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("q (chunk scored)")
        ax.set_ylabel("d (context chunk)")
    fig.tight_layout()
    path = Path(out) / "chunk_quality.png"
    write_figure(fig, path)
    return path


def run(cfg: ChunkQualityConfig) -> Result:
    from metachunk.eval.report import write_run

    from metachunk.models import ModelNotFoundError

    try:
        result = evaluate(cfg)
    except (InputError, ModelNotFoundError) as e:
        print(f"eval chunk-quality: {e}", file=sys.stderr)
        return Result(2)
    docs = [d for d in result["details"]["documents"] if "skipped" not in d]
    shown = next((d for d in docs if d["id"] == cfg.plot_doc), docs[0] if docs else None)
    png = plot(cfg.out, result["bc_values"], shown, cfg.convention, cfg.k)
    result["details"]["plot"] = png.name
    if not cfg.save_matrices:
        for d in docs:
            d.pop("nll_alone"), d.pop("nll_cond")
    write_run(cfg.out, "chunk-quality", cfg, result["metrics"], result["details"], items=result["items"],
              run=result["run"])  # fmt: skip
    report = Path(cfg.out) / "report.md"
    text = report.read_text(encoding="utf-8")
    with AtomicWriter(report) as f:
        f.write(
            text
            + f"\nConvention `{cfg.convention}`, K = {cfg.k}, model `{cfg.model}`.\n\n![chunk quality]({png.name})\n"
        )
    m = result["metrics"]
    print(
        f"BC {m.get('bc_mean', float('nan')):.4f}  CS_c {m.get('cs_complete', float('nan')):.4f}  "
        f"CS_i {m.get('cs_incomplete', float('nan')):.4f}  ({m['docs']} docs, {m['pairs_computed']}/{m['pairs_total']} "
        f"pairs, cap {cfg.max_pairs or 'none'}; {result['run']['seconds']} s) -> {Path(cfg.out) / 'metrics.json'}",
        file=sys.stderr,
    )
    from metachunk.eval.report import summary

    rejected = result["details"].get("rejects")
    return Result.with_rejects(summary(m), rejected)


def inputs(cfg: ChunkQualityConfig) -> Reads:
    return Reads.of(paths=[cfg.chunks], models=[cfg.model])


def outputs(cfg: ChunkQualityConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
