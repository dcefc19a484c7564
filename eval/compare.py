"""``metachunk eval compare RUN_DIR... --out report.md``: eval runs side by side.

Reads each run's ``metrics.json`` (written by every ``metachunk eval`` command, see
`metachunk.eval.report`), writes one Markdown table (a row per metric, a column per run) and one PNG
bar chart per metric next to the report, and ``compare.json`` with the same numbers.

Chunk length decides much of a RAG score: longer chunks carry more context into the top-k. The
papers compare methods at equal average chunk length, so ``compare`` refuses to rank runs whose
``avg_chunk_chars`` differ by more than ``--length-tolerance`` (relative to the shortest) unless
``--force`` is given; forced reports say so in their first line.

**Confidence intervals.** Where the runs wrote per-item metrics (``items.jsonl``: one line per
question or document), every such metric gets a bootstrap interval of its mean over the items
(``scipy.stats.bootstrap``, percentile method, ``--n-resamples`` resamples, fixed ``--seed``), and
each run's difference from ``--baseline`` (default ``fixed`` when a run has that label) a paired
bootstrap interval over the items both runs scored. A difference whose interval excludes 0 is
*resolved*; the others are inside the noise, and the report says which.

Items that are not independent say so with a ``cluster`` field (``eval qa`` gives a CRUD question
its QA entry: the questions of one entry share an article). Then the bootstrap resamples whole
clusters, the statistic being the items' mean over the resampled clusters (sum over count: the
cluster bootstrap of a mean), so that correlated questions do not narrow the interval.
``--no-cluster`` resamples items regardless.

Runs given the same label are one column: ``eval qa`` and ``eval chunk-quality`` of one chunker
side by side with another's. A metric that two of them report is taken from the first given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from metachunk.eval.report import format_value, known, markdown_table, read_items, read_run

from metachunk.artifacts import AtomicWriter, InputError, write_figure
from metachunk.command import Reads, Result
from metachunk.config import option

LENGTH_KEY = "avg_chunk_chars"


@dataclass
class CompareConfig:
    runs: list[Path] | None = option(None, "eval run dirs (each with metrics.json)", positional=True)
    out: Path = option(Path("report.md"), "the Markdown report; PNGs go next to it")
    labels: list[str] | None = option(
        None, "one label per run (default: the run dir names); runs with the same label are one column"
    )
    metrics: list[str] | None = option(
        None,
        "metrics to show and plot (default: every metric any run reports in the table, and plots of the "
        "measured ones: those with per-item values, the retrieval (reranked too), boundary, stickiness and "
        "generation families, and avg_chunk_chars; not the counts and settings)",
    )
    length_tolerance: float = option(
        0.1, "max relative spread of avg_chunk_chars, (longest - shortest) / shortest, before refusing"
    )
    force: bool = option(False, "compare even when the average chunk lengths differ beyond the tolerance")
    plots: bool = option(True, "one PNG bar chart per metric (with the intervals drawn)")
    confidence: float = option(
        0.95, "bootstrap confidence level of the intervals (0: none); needs the runs' items.jsonl"
    )
    n_resamples: int = option(2000, "bootstrap resamples per interval")
    seed: int = option(0, "the bootstrap's random seed: the same runs give the same intervals")
    baseline: str | None = option(
        None, "the label the others are compared with, item by item (default: fixed, when a run has it)"
    )
    cluster: bool = option(
        True,
        "resample whole clusters where items.jsonl gives a 'cluster' (e.g. one CRUD QA entry's questions)",
    )

    def __post_init__(self):
        if not self.runs:
            raise ValueError("field 'runs': give at least one eval run dir")
        if self.labels and len(self.labels) != len(self.runs):
            raise ValueError(f"field 'labels': {len(self.labels)} labels for {len(self.runs)} runs")
        if not self.length_tolerance >= 0:  # NaN too: it would turn the length check off
            raise ValueError("field 'length_tolerance' must be a number >= 0")
        if Path(self.out).suffix == ".json":
            raise ValueError(
                "field 'out': the Markdown report (its numbers go beside it as OUT.json): name it .md"
            )
        if not 0 <= self.confidence < 1:
            raise ValueError("field 'confidence' must be in [0, 1)")
        if self.n_resamples < 100:
            raise ValueError("field 'n_resamples' must be >= 100")
        if self.seed < 0:  # numpy's generators take none below 0
            raise ValueError("field 'seed' must be >= 0")


CONFIG = CompareConfig


class LengthMismatch(ValueError):
    pass


def check_lengths(lengths: dict[str, float], tolerance: float) -> float | None:
    """The relative spread of the runs' average chunk lengths; raises when it is beyond ``tolerance``.

    None when fewer than two runs report a length (nothing to compare)."""
    known = {label: v for label, v in lengths.items() if v}
    if len(known) < 2:
        return None
    shortest, longest = min(known.values()), max(known.values())
    spread = (longest - shortest) / shortest
    if spread > tolerance:
        listing = ", ".join(f"{label} {v:.1f}" for label, v in known.items())
        raise LengthMismatch(
            f"average chunk lengths differ by {spread:.1%} (> {tolerance:.0%}): {listing} chars. The papers compare "
            "chunkers at equal average length; rechunk with the same --target-len, or pass --force"
        )
    return spread


def merged_runs(runs: list[Path], labels: list[str]) -> tuple[list[str], list[dict], dict[str, list[str]]]:
    """``(labels, docs, run dirs)``, one per distinct label: the metrics (and per-item values,
    ``items``: metric -> item id -> value) of a label's runs merged, the first given winning for a
    metric two report."""
    docs: dict[str, dict] = {}
    dirs: dict[str, list[str]] = {}
    for label, run in zip(labels, runs):
        doc = read_run(run)
        dirs.setdefault(label, []).append(str(run))
        items: dict[str, dict] = {}
        clusters: dict[str, str] = {}
        for row in read_items(run) or []:
            if row.get("cluster") is not None:
                clusters[str(row["id"])] = str(row["cluster"])
            for name, value in row.items():
                numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
                if name != "id" and numeric and known(value):  # a NaN: an item the metric did not measure
                    items.setdefault(name, {})[str(row["id"])] = float(value)
        if label not in docs:
            docs[label] = {"metrics": dict(doc["metrics"]), "command": doc.get("command"), "items": items,
                           "clusters": clusters}  # fmt: skip
            continue
        merged = docs[label]
        merged["metrics"].update((k, v) for k, v in doc["metrics"].items() if k not in merged["metrics"])
        merged["items"].update((k, v) for k, v in items.items() if k not in merged["items"])
        merged["clusters"] = {**clusters, **merged["clusters"]}
        merged["command"] = f"{merged['command']} + {doc.get('command')}"
    return list(docs), list(docs.values()), dirs


def bootstrap_interval(samples: list, confidence: float, n_resamples: int, seed: int,
                       clusters: list[str] | None = None) -> list[float] | None:  # fmt: skip
    """The percentile bootstrap interval of the mean of ``samples`` (one array), or of the mean
    difference of two paired arrays; None with fewer than two items (or clusters).

    With ``clusters`` (one label per item), whole clusters are resampled: each cluster is its sum
    and its item count, paired, and the statistic is sum over count, the items' mean."""
    import numpy as np
    from scipy.stats import bootstrap

    arrays = [np.asarray(a, dtype=np.float64) for a in samples]
    values = arrays[0] - arrays[1] if len(arrays) == 2 else arrays[0]
    if len(values) < 2:
        return None
    if np.all(values == values[0]):  # no spread: every resample has the same mean
        return [float(values[0]), float(values[0])]
    if clusters is not None:
        names, index = np.unique(np.asarray(clusters), return_inverse=True)
        if len(names) < 2:
            return None
        sums, counts = np.bincount(index, weights=values), np.bincount(index).astype(np.float64)
        data, statistic = (sums, counts), lambda s, n, axis: np.sum(s, axis=axis) / np.sum(n, axis=axis)
    else:
        data, statistic = (values,), lambda a, axis: np.mean(a, axis=axis)
    res = bootstrap(data, statistic, paired=len(data) == 2, vectorized=True, confidence_level=confidence,
                    n_resamples=n_resamples, method="percentile", rng=np.random.default_rng(seed))  # fmt: skip
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def intervals(labels: list[str], docs: list[dict], cfg: CompareConfig) -> dict:
    """``{"intervals": {metric: {label: [low, high]}}, "differences": {metric: {label: {...}}}}``
    over the metrics the runs have items for."""
    baseline = cfg.baseline or ("fixed" if "fixed" in labels else None)
    if baseline is not None and baseline not in labels:
        raise ValueError(f"field 'baseline': no run is labelled {baseline!r} (labels: {', '.join(labels)})")
    items = dict(zip(labels, (d["items"] for d in docs)))
    # One item -> cluster map over every run: the same question is in the same cluster in each.
    clusters = {i: c for d in docs for i, c in d.get("clusters", {}).items()} if cfg.cluster else {}
    names = list(dict.fromkeys(name for d in docs for name in d["items"]))
    out = {"confidence": cfg.confidence, "n_resamples": cfg.n_resamples, "seed": cfg.seed, "method": "percentile",
           "resampled": "clusters" if clusters else "items", "baseline": baseline, "items": {}, "clusters": {},
           "intervals": {}, "differences": {}}  # fmt: skip

    def of(ids):  # the ids' clusters, an unclustered item alone in its own
        return [clusters.get(i, f"item:{i}") for i in ids] if clusters else None

    for name in names:
        for label in labels:
            values = items[label].get(name)
            if not values:
                continue
            out["items"].setdefault(name, {})[label] = len(values)
            if clusters:
                out["clusters"].setdefault(name, {})[label] = len(set(of(values)))
            ci = bootstrap_interval([list(values.values())], cfg.confidence, cfg.n_resamples, cfg.seed,
                                    of(values))  # fmt: skip
            out["intervals"].setdefault(name, {})[label] = ci
            base = items.get(baseline, {}).get(name) if baseline else None
            if base is None or label == baseline:
                continue
            common = [i for i in values if i in base]
            a, b = [values[i] for i in common], [base[i] for i in common]
            ci = bootstrap_interval([a, b], cfg.confidence, cfg.n_resamples, cfg.seed, of(common))
            diff = sum(x - y for x, y in zip(a, b)) / len(common) if common else None
            out["differences"].setdefault(name, {})[label] = {
                "difference": diff, "interval": ci, "paired_items": len(common),
                "resolved": ci is not None and (ci[0] > 0 or ci[1] < 0),
            }  # fmt: skip
    return out


def compare(cfg: CompareConfig) -> dict:
    given = cfg.labels or [Path(run).name for run in cfg.runs]
    if not cfg.labels and len(set(given)) != len(given):
        raise ValueError(f"run dir names repeat ({given}): pass --labels")
    labels, docs, dirs = merged_runs(list(cfg.runs), given)
    lengths = {label: doc["metrics"].get(LENGTH_KEY) for label, doc in zip(labels, docs)}
    for label, length in lengths.items():
        if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
            raise InputError(
                Path(dirs[label][0]) / "metrics.json", f"field 'metrics.{LENGTH_KEY}': not a number"
            )
    try:
        spread = check_lengths(lengths, cfg.length_tolerance)
        forced = False
    except LengthMismatch:
        if not cfg.force:
            raise
        spread, forced = None, True
    reported = list(dict.fromkeys(k for doc in docs for k in doc["metrics"]))
    unknown = [name for name in cfg.metrics or () if name not in reported]
    if unknown:  # a typo showed a row of dashes
        raise InputError(
            "--metrics", f"no run reports {', '.join(map(repr, unknown))}; they report {', '.join(reported)}"
        )
    names = cfg.metrics or reported
    table = {name: {label: doc["metrics"].get(name) for label, doc in zip(labels, docs)} for name in names}
    stats = intervals(labels, docs, cfg) if cfg.confidence else None
    if stats and cfg.metrics:
        for key in ("items", "intervals", "differences"):
            stats[key] = {k: v for k, v in stats[key].items() if k in names}
    result = {
        "runs": {label: dirs[label][0] if len(dirs[label]) == 1 else dirs[label] for label in labels},
        "commands": {label: doc.get("command") for label, doc in zip(labels, docs)},
        "length_spread": spread,
        "forced": forced,
        "metrics": table,
        "statistics": stats,
    }
    out = Path(cfg.out)
    plots = {}
    if cfg.plots:
        cis = (stats or {}).get("intervals")
        plotted = table if cfg.metrics else {name: table[name] for name in measured(names, docs)}
        plots = {
            **plot_families(plotted, out.with_suffix(""), cis),
            **plot_metrics(plotted, out.with_suffix(""), cis),
        }
    result["plots"] = {name: str(path) for name, path in plots.items()}
    lines = [f"# metachunk eval compare: {', '.join(labels)}", ""]
    if forced:
        lines += ["**Forced:** the runs' average chunk lengths differ beyond the tolerance; the ranking is not "
                  "length-controlled.", ""]  # fmt: skip
    elif spread is not None:
        lines += [
            f"Average chunk lengths within {spread:.1%} of each other (tolerance {cfg.length_tolerance:.0%}).",
            "",
        ]
    rows = [
        [name] + [format_value(v) if v is not None else "–" for v in table[name].values()] for name in names
    ]
    lines.append(markdown_table(["metric", *labels], rows))
    if stats and stats["intervals"]:
        lines += ["", *interval_tables(labels, stats)]
    if plots:
        lines += ["", *[f"![{name}]({path.relative_to(out.parent)})" for name, path in plots.items()]]
    with AtomicWriter(out) as f:
        f.write("\n".join(lines) + "\n")
    with AtomicWriter(out.with_suffix(".json")) as f:
        f.write(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
    return result


def interval_tables(labels: list[str], stats: dict) -> list[str]:
    """The report's Markdown for the intervals and the paired differences."""
    level = f"{stats['confidence']:.0%}"
    how = ("whole clusters resampled (items.jsonl's 'cluster', e.g. one QA entry's questions)"
           if stats.get("resampled") == "clusters" else "items resampled")  # fmt: skip
    lines = [f"**{level} bootstrap intervals** of each mean over its items (questions or documents; {how}; "
             f"percentile method, {stats['n_resamples']:,} resamples, seed {stats['seed']}):", ""]  # fmt: skip

    def cell(name, label):
        ci = stats["intervals"].get(name, {}).get(label)
        n = stats["items"].get(name, {}).get(label)
        k = stats.get("clusters", {}).get(name, {}).get(label)
        size = f"n={n}" + (f", {k} clusters" if k is not None else "")
        return "–" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}] ({size})"

    rows = [[name] + [cell(name, label) for label in labels] for name in stats["intervals"]]
    lines.append(markdown_table(["metric", *labels], rows))
    base = stats["baseline"]
    if base and stats["differences"]:
        others = [label for label in labels if label != base]
        lines += ["", f"**Paired differences from `{base}`** (mean of the item-by-item differences, its {level} "
                  "paired bootstrap interval; **resolved** when the interval excludes 0, else inside the noise):", ""]  # fmt: skip

        def diff_cell(name, label):
            d = stats["differences"].get(name, {}).get(label)
            if not d or d["interval"] is None:
                return "–"
            lo, hi = d["interval"]
            verdict = "**resolved**" if d["resolved"] else "noise"
            # Paired over the items both runs scored: a run cut short (--limit, skipped rows) is compared
            # on fewer items than its column's mean, and the cell says so.
            most = max(stats["items"][name].get(label, 0), stats["items"][name].get(base, 0))
            fewer = f" (paired n={d['paired_items']} of {most})" if d["paired_items"] < most else ""
            return f"{d['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] {verdict}{fewer}"

        rows = [[name] + [diff_cell(name, label) for label in others] for name in stats["differences"]]
        lines.append(markdown_table(["metric", *others], rows))
    return lines


def measured(names: list[str], docs: list[dict]) -> list[str]:
    """The names that measure the chunks, not count or configure a run (``docs``, ``k``,
    ``max_pairs``): a metric some run has per-item values for, one of a family (`FAMILIES`), or the
    average chunk length."""
    import re

    itemized = {name for doc in docs for name in doc["items"]}
    return [
        name for name in names
        if name in itemized or name == LENGTH_KEY or any(re.match(p, name) for p in FAMILIES.values())
    ]  # fmt: skip


def plot_metrics(table: dict[str, dict[str, float | None]], prefix: Path,
                 intervals: dict[str, dict[str, list | None]] | None = None) -> dict[str, Path]:  # fmt: skip
    """One bar chart per numeric metric: ``{prefix}_{metric}.png``, each written atomically, with
    the bootstrap intervals as error bars where there are any."""
    from metachunk.artifacts import new_figure

    paths = {}
    for name, values in table.items():
        numeric = {
            label: v for label, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if not numeric:
            continue
        fig, ax = new_figure(figsize=(1.2 + 1.1 * len(numeric), 3.2))
        cis = (intervals or {}).get(name, {})
        yerr = None
        if any(cis.get(label) for label in numeric):
            yerr = [[max(0.0, v - cis[label][0]) if cis.get(label) else 0.0 for label, v in numeric.items()],
                    [max(0.0, cis[label][1] - v) if cis.get(label) else 0.0 for label, v in numeric.items()]]  # fmt: skip
        bars = ax.bar(list(numeric), list(numeric.values()), color="#4c72b0", yerr=yerr, capsize=4)
        ax.bar_label(bars, labels=[format_value(v) for v in numeric.values()], fontsize=8)
        ax.set_title(name)
        ax.margins(y=0.15)
        fig.tight_layout()
        path = prefix.parent / f"{prefix.name}_{name}.png"
        write_figure(fig, path)
        paths[name] = path
    return paths


# Metric families drawn together, one grouped bar chart each (the metrics of a family share a scale).
FAMILIES = {
    "retrieval": r"^(hits|mrr|map|dcg)@\d+$",
    "reranked_retrieval": r"^reranked_(hits|mrr|map|dcg)@\d+$",
    "boundary_clarity": r"^bc_",
    "chunk_stickiness": r"^cs_",
    "generation": r"^(bleu|rouge|bertscore|f1)",
}


def plot_families(table: dict[str, dict[str, float | None]], prefix: Path,
                  intervals: dict[str, dict[str, list | None]] | None = None) -> dict[str, Path]:  # fmt: skip
    """One grouped bar chart per metric family (`FAMILIES`) with two or more metrics:
    ``{prefix}_family_{family}.png``, a bar per run in each metric's group, the intervals drawn."""
    import re

    import numpy as np

    from metachunk.artifacts import new_figure

    paths = {}
    for family, pattern in FAMILIES.items():
        names = [n for n in table if re.match(pattern, n)]
        if len(names) < 2:
            continue
        labels = list(dict.fromkeys(label for n in names for label in table[n]))
        width = 0.8 / len(labels)
        fig, ax = new_figure(figsize=(min(10.0, 2.0 + 0.35 * len(names) * len(labels)), 3.8))
        x = np.arange(len(names))
        for k, label in enumerate(labels):
            values = [table[n].get(label) for n in names]
            heights = [v if isinstance(v, (int, float)) else 0.0 for v in values]
            cis = [(intervals or {}).get(n, {}).get(label) for n in names]
            yerr = [[max(0.0, h - ci[0]) if ci else 0.0 for h, ci in zip(heights, cis)],
                    [max(0.0, ci[1] - h) if ci else 0.0 for h, ci in zip(heights, cis)]]  # fmt: skip
            ax.bar(x + (k - (len(labels) - 1) / 2) * width, heights, width, label=label,
                   yerr=yerr if any(cis) else None, capsize=2)  # fmt: skip
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_title(family.replace("_", " ") + (" (95% bootstrap intervals)" if intervals else ""))
        ax.legend(fontsize=7, ncols=min(len(labels), 4))
        ax.margins(y=0.15)
        fig.tight_layout()
        path = prefix.parent / f"{prefix.name}_family_{family}.png"
        write_figure(fig, path)
        paths[f"family:{family}"] = path
    return paths


def print_table(result: dict) -> None:
    labels = list(result["runs"])
    width = max([len(n) for n in result["metrics"]] + [6])
    print(f"{'metric':<{width}} " + " ".join(f"{label:>14}" for label in labels))
    for name, values in result["metrics"].items():
        cells = [format_value(values[label]) if values[label] is not None else "–" for label in labels]
        print(f"{name:<{width}} " + " ".join(f"{c:>14}" for c in cells))


def run(cfg: CompareConfig) -> Result:
    try:
        result = compare(cfg)
    except ValueError as e:
        print(f"eval compare: {e}", file=sys.stderr)
        return Result(2)
    print_table(result)
    print(f"{cfg.out}: {len(result['runs'])} runs, {len(result['metrics'])} metrics, {len(result['plots'])} plots",
          file=sys.stderr)  # fmt: skip
    # counts, not the report's path: the regeneration manifest is published, and the path is its outputs'
    return Result(
        summary={
            "runs": len(result["runs"]),
            "metrics": len(result["metrics"]),
            "plots": len(result["plots"]),
        }
    )


def inputs(cfg: CompareConfig) -> Reads:
    return Reads.of(paths=cfg.runs or [])


def outputs(cfg: CompareConfig) -> list:
    """The report and, beside it, its numbers (``OUT.json``); the plots are named from them."""
    return [cfg.out, Path(cfg.out).with_suffix(".json")] if cfg.out else []
