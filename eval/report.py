"""What every eval command writes: ``metrics.json`` (machine-readable) and ``report.md`` (a table).

Both are written atomically, so a crash mid-run never leaves a half-written report over a good one.
``metrics.json`` is the contract ``eval compare`` reads: ``{"schema_version", "command", "run",
"config", "metrics": {name: number}, "details": {...}}``; ``metrics`` holds flat numbers only.

How the run went (seconds, what it loaded, what it sent, the device) is one line of
``runs.jsonl`` (`metachunk.artifacts.append_run_log`), not part of ``metrics.json``: the same inputs
give the same ``metrics.json``, and what reads it (``eval compare``, ``metachunk run``) sees no change.

``items.jsonl`` (when the command has them) holds the same metrics per item, one line per question
(``eval qa``) or document (``eval chunk-quality``): ``{"id", METRIC: value, ...}``, where every
metric named there is the mean of its items. ``eval compare`` bootstraps its confidence intervals,
and pairs two runs item by item, from these lines.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from metachunk import config as configs
from metachunk import markdown, stopping
from metachunk.artifacts import AtomicWriter, InputError, append_run_log, read_json
from metachunk.sources import read_records

SCHEMA_VERSION = 1


def write_run(out: Path, command: str, cfg, metrics: dict[str, float], details: dict | None = None,
              title: str | None = None, items: list[dict] | None = None, run: dict | None = None) -> dict:  # fmt: skip
    """Write ``out/metrics.json`` (with ``cfg``'s settings that decide the result: `metachunk.config.computed`
    of a config dataclass, or a dict as it is), ``out/report.md``
    and, given ``items``, ``out/items.jsonl``; append ``run`` (how it went) and ``cfg``'s runtime
    settings to ``out/runs.jsonl``. Returns the metrics.json object."""
    out = Path(out)
    dataclass = cfg is not None and not isinstance(cfg, dict)  # a command's config, or its settings as given
    config = configs.computed(cfg) if dataclass else dict(cfg or {})
    doc = {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "run": out.name,
        "config": config,
        "metrics": metrics,
        "details": details or {},
    }
    lines = [f"# {title or f'metachunk eval {command}: {out.name}'}", "", markdown_table(
        ["metric", "value"], [[name, format_value(value)] for name, value in metrics.items()])]  # fmt: skip
    runtime = configs.runtime(cfg) if dataclass else {}
    with stopping.deferred():  # the items, their metrics, the report and the run-log line land together
        if items is not None:
            with AtomicWriter(out / "items.jsonl") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in items)
        with AtomicWriter(out / "metrics.json") as f:
            f.write(json.dumps(doc, ensure_ascii=False, indent=1, default=str) + "\n")
        with AtomicWriter(out / "report.md") as f:
            f.write("\n".join(lines) + "\n")
        append_run_log(out, {"command": f"eval {command}", **runtime, **(run or {})})
    return doc


def read_run(run_dir: Path) -> dict:
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.json (not an eval run dir)")
    doc = read_json(path)
    if not isinstance(doc.get("metrics"), dict):
        raise InputError(path, "field 'metrics' is missing or not an object")
    return doc


def read_items(run_dir: Path) -> list[dict] | None:
    """A run's per-item metrics (``items.jsonl``), or None when it has none. A NaN (as `known`
    says) is an item the metric did not measure."""
    path = Path(run_dir) / "items.jsonl"
    if not path.is_file():
        return None
    rows = []
    for number, _, row in read_records(path):
        if "id" not in row:
            raise InputError(path, "field 'id' is missing", number)
        for name, value in row.items():
            # Python's json reads Infinity; no metric here is infinite, so the file is damaged.
            if isinstance(value, float) and math.isinf(value):
                raise InputError(path, f"field {name!r}: {value} is not a metric's value", number)
        rows.append(row)
    return rows


def known(value) -> bool:
    """Whether a metric's value was measured: not None, not NaN."""
    return value is not None and not math.isnan(value)


def mean_of_known(values) -> float | None:
    """The mean of the `known` values; None when there are none."""
    import numpy as np

    values = [v for v in values if known(v)]
    return float(np.mean(values)) if values else None


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """The reports' table: cells keep their own spacing (run labels, model names)."""
    return markdown.table(header, rows, cell=markdown.report_cell)


# The headline numbers of a run, as a regeneration manifest records them.
SUMMARY_PREFIXES = (
    "hits@",
    "mrr@",
    "bc_mean",
    "cs_complete",
    "cs_incomplete",
    "avg_chunk_chars",
    "questions",
)


def summary(metrics: dict) -> dict:
    """The metrics a run's summary shows (`SUMMARY_PREFIXES`), floats to 4 places."""
    return {
        k: round(v, 4) if isinstance(v, float) else v
        for k, v in metrics.items()
        if k.startswith(SUMMARY_PREFIXES)
    }
