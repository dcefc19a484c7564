"""``metachunk eval compare RUN_DIR... --out report.md``: eval runs side by side.

Reads each run's ``metrics.json`` (written by every ``metachunk eval`` command, see
:mod:`eval.report`), writes one Markdown table (a row per metric, a column per run) and one PNG
bar chart per metric next to the report, and ``compare.json`` with the same numbers.

Chunk length decides much of a RAG score: longer chunks carry more context into the top-k. The
papers compare methods at equal average chunk length, so ``compare`` refuses to rank runs whose
``avg_chunk_chars`` differ by more than ``--length-tolerance`` (relative to the shortest) unless
``--force`` is given; forced reports say so in their first line.

Runs given the same label are one column: ``eval qa`` and ``eval chunk-quality`` of one chunker
side by side with another's. A metric that two of them report is taken from the first given.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eval.report import format_value, markdown_table, read_run
from metachunk.artifacts import AtomicWriter
from metachunk.config import option

LENGTH_KEY = "avg_chunk_chars"


@dataclass
class CompareConfig:
    runs: list[Path] | None = option(None, "eval run dirs (each with metrics.json)", positional=True)
    out: Path = option(Path("report.md"), "the Markdown report; PNGs go next to it")
    labels: list[str] | None = option(
        None, "one label per run (default: the run dir names); runs with the same label are one column"
    )
    metrics: list[str] | None = option(None, "metrics to show (default: every metric any run reports)")
    length_tolerance: float = option(
        0.1, "max relative spread of avg_chunk_chars, (longest - shortest) / shortest, before refusing"
    )
    force: bool = option(False, "compare even when the average chunk lengths differ beyond the tolerance")
    plots: bool = option(True, "one PNG bar chart per metric")

    def __post_init__(self):
        if not self.runs:
            raise ValueError("field 'runs': give at least one eval run dir")
        if self.labels and len(self.labels) != len(self.runs):
            raise ValueError(f"field 'labels': {len(self.labels)} labels for {len(self.runs)} runs")
        if self.length_tolerance < 0:
            raise ValueError("field 'length_tolerance' must be >= 0")


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
    """``(labels, docs, run dirs)``, one per distinct label: the metrics of a label's runs merged,
    the first given winning for a metric two report."""
    docs: dict[str, dict] = {}
    dirs: dict[str, list[str]] = {}
    for label, run in zip(labels, runs):
        doc = read_run(run)
        dirs.setdefault(label, []).append(str(run))
        if label not in docs:
            docs[label] = {"metrics": dict(doc["metrics"]), "command": doc.get("command")}
            continue
        merged = docs[label]
        merged["metrics"].update((k, v) for k, v in doc["metrics"].items() if k not in merged["metrics"])
        merged["command"] = f"{merged['command']} + {doc.get('command')}"
    return list(docs), list(docs.values()), dirs


def compare(cfg: CompareConfig) -> dict:
    given = cfg.labels or [Path(run).name for run in cfg.runs]
    if not cfg.labels and len(set(given)) != len(given):
        raise ValueError(f"run dir names repeat ({given}): pass --labels")
    labels, docs, dirs = merged_runs(list(cfg.runs), given)
    lengths = {label: doc["metrics"].get(LENGTH_KEY) for label, doc in zip(labels, docs)}
    try:
        spread = check_lengths(lengths, cfg.length_tolerance)
        forced = False
    except LengthMismatch:
        if not cfg.force:
            raise
        spread, forced = None, True
    names = cfg.metrics or list(dict.fromkeys(k for doc in docs for k in doc["metrics"]))
    table = {name: {label: doc["metrics"].get(name) for label, doc in zip(labels, docs)} for name in names}
    result = {
        "runs": {label: dirs[label][0] if len(dirs[label]) == 1 else dirs[label] for label in labels},
        "commands": {label: doc.get("command") for label, doc in zip(labels, docs)},
        "length_spread": spread,
        "forced": forced,
        "metrics": table,
    }
    out = Path(cfg.out)
    plots = plot_metrics(table, out.with_suffix("")) if cfg.plots else {}
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
    if plots:
        lines += ["", *[f"![{name}]({path.relative_to(out.parent)})" for name, path in plots.items()]]
    with AtomicWriter(out) as f:
        f.write("\n".join(lines) + "\n")
    with AtomicWriter(out.with_suffix(".json")) as f:
        f.write(json.dumps(result, ensure_ascii=False, indent=1) + "\n")
    return result


def plot_metrics(table: dict[str, dict[str, float | None]], prefix: Path) -> dict[str, Path]:
    """One bar chart per numeric metric: ``{prefix}_{metric}.png``, each written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for name, values in table.items():
        numeric = {
            label: v for label, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if not numeric:
            continue
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(numeric), 3.2))
        bars = ax.bar(list(numeric), list(numeric.values()), color="#4c72b0")
        ax.bar_label(bars, labels=[format_value(v) for v in numeric.values()], fontsize=8)
        ax.set_title(name)
        ax.margins(y=0.15)
        fig.tight_layout()
        path = prefix.parent / f"{prefix.name}_{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
        os.close(fd)
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        paths[name] = path
    return paths


def print_table(result: dict) -> None:
    labels = list(result["runs"])
    width = max([len(n) for n in result["metrics"]] + [6])
    print(f"{'metric':<{width}} " + " ".join(f"{label:>14}" for label in labels))
    for name, values in result["metrics"].items():
        cells = [format_value(values[label]) if values[label] is not None else "–" for label in labels]
        print(f"{name:<{width}} " + " ".join(f"{c:>14}" for c in cells))


def run(cfg: CompareConfig) -> int:
    try:
        result = compare(cfg)
    except ValueError as e:
        print(f"eval compare: {e}", file=sys.stderr)
        return 2
    print_table(result)
    print(f"{cfg.out}: {len(result['runs'])} runs, {len(result['metrics'])} metrics, {len(result['plots'])} plots",
          file=sys.stderr)  # fmt: skip
    return 0
