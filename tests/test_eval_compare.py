"""`metachunk eval compare`: side-by-side table, bar charts, and the equal-length guard."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from metachunk.eval.compare import (
    CompareConfig,
    LengthMismatch,
    bootstrap_interval,
    check_lengths,
    compare,
    run,
)
from metachunk.eval.report import read_run, write_run

from metachunk.artifacts import InputError


def _runs(tmp_path, lengths):
    dirs = []
    for i, length in enumerate(lengths):
        out = tmp_path / f"run{i}"
        write_run(
            out,
            "qa",
            {"chunks": f"c{i}.jsonl"},
            {
                "hits@8": 0.5 + i / 10,
                "mrr@8": 0.25,
                "avg_chunk_chars": length,
                "n_questions": 30,
                "reranked_hits@8": 0.7,
            },
        )
        dirs.append(out)
    return dirs


def test_report_round_trip(tmp_path):
    (run_dir,) = _runs(tmp_path, [500.0])
    doc = read_run(run_dir)
    assert doc["metrics"] == {
        "hits@8": 0.5,
        "mrr@8": 0.25,
        "avg_chunk_chars": 500.0,
        "n_questions": 30,
        "reranked_hits@8": 0.7,
    }
    assert "| hits@8 | 0.5000 |" in (run_dir / "report.md").read_text()


def test_side_by_side_table_and_one_png_per_metric(tmp_path):
    dirs = _runs(tmp_path, [500.0, 520.0])
    out = tmp_path / "cmp" / "report.md"
    result = compare(CompareConfig(runs=dirs, out=out, labels=["fixed", "ppl"]))
    text = out.read_text()
    assert "| metric | fixed | ppl |" in text and "| hits@8 | 0.5000 | 0.6000 |" in text
    assert "within 4.0%" in text
    for name in ("hits@8", "mrr@8", "avg_chunk_chars", "family_retrieval"):
        assert (tmp_path / "cmp" / f"report_{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "| n_questions | 30 | 30 |" in text  # a count is in the table, not drawn
    assert set(result["plots"]) == {
        "hits@8",
        "mrr@8",
        "avg_chunk_chars",
        "family:retrieval",
        "reranked_hits@8",
    }
    assert json.loads(out.with_suffix(".json").read_text())["metrics"] == result["metrics"]


def test_unequal_lengths_are_refused_unless_forced(tmp_path, capsys):
    dirs = _runs(tmp_path, [400.0, 600.0])
    out = tmp_path / "report.md"
    assert run(CompareConfig(runs=dirs, out=out)).exit == 2
    assert "differ by 50.0%" in capsys.readouterr().err and not out.exists()
    assert run(CompareConfig(runs=dirs, out=out, force=True, plots=False)).exit == 0
    assert out.read_text().splitlines()[2].startswith("**Forced:**")


def test_length_guard_edges():
    assert check_lengths({"a": 100.0, "b": 110.0}, 0.1) == pytest.approx(0.1)
    with pytest.raises(LengthMismatch):
        check_lengths({"a": 100.0, "b": 110.5}, 0.1)
    assert check_lengths({"a": 100.0, "b": None}, 0.1) is None  # nothing to compare


def test_bad_run_dir_is_named(tmp_path):
    with pytest.raises(ValueError, match="no metrics.json"):
        compare(CompareConfig(runs=[tmp_path], out=tmp_path / "r.md"))
    metrics = tmp_path / "metrics.json"
    for text, error in (
        ("nope", r"metrics.json:1: invalid JSON"),
        ("[1]", r"metrics.json: expected a JSON object, got list"),
        ("{}", r"metrics.json: field 'metrics' is missing"),
    ):
        metrics.write_text(text)
        with pytest.raises(InputError, match=error):
            compare(CompareConfig(runs=[tmp_path], out=tmp_path / "r.md"))


def test_a_chunk_output_folder_with_a_bad_manifest_is_named(tmp_path):
    """`eval qa`, `eval chunk-quality` and `data sample` read a `metachunk chunk -o DIR` through its manifest."""
    from metachunk.chunking.shards import chunk_rows

    manifest = tmp_path / "manifest.json"
    for text, error in (
        ("garbage", r":1: invalid JSON \(Expecting value at column 1\)"),
        ("[]", ": expected a JSON object"),
        ('{"complete": true}', ": field 'shards.done' is missing"),
    ):
        manifest.write_text(text)
        with pytest.raises(InputError, match=f"manifest.json{error}"):
            list(chunk_rows(tmp_path))


def test_a_chunks_record_without_an_id_is_named(tmp_path):
    from metachunk.eval.chunk_quality import read_chunk_docs

    path = tmp_path / "c.jsonl"
    path.write_text('{"chunks": [{"text": "a"}]}\n')
    with pytest.raises(InputError, match=r"c.jsonl:1: expected a chunks record with 'id'"):
        read_chunk_docs(path)


def test_runs_with_one_label_are_one_column(tmp_path):
    """eval qa and eval chunk-quality of one chunker: one column, the first run's value first."""
    qa = [tmp_path / "fixed_qa", tmp_path / "ppl_qa"]
    quality = [tmp_path / "fixed_q", tmp_path / "ppl_q"]
    for i, (a, b) in enumerate(zip(qa, quality)):
        write_run(a, "qa", None, {"hits@8": 0.5 + i / 10, "avg_chunk_chars": 500.0 + i})
        write_run(b, "chunk-quality", None, {"bc": 0.9 - i / 10, "avg_chunk_chars": 999.0})
    out = tmp_path / "cmp.md"
    result = compare(CompareConfig(runs=[qa[0], quality[0], qa[1], quality[1]], out=out,
                                   labels=["fixed", "fixed", "ppl", "ppl"], plots=False))  # fmt: skip
    assert result["metrics"] == {
        "hits@8": {"fixed": 0.5, "ppl": 0.6},
        "avg_chunk_chars": {"fixed": 500.0, "ppl": 501.0},  # from qa, given first
        "bc": {"fixed": 0.9, "ppl": 0.8},
    }
    assert result["runs"]["ppl"] == [str(qa[1]), str(quality[1])]
    assert "| metric | fixed | ppl |" in out.read_text()


def _items_run(path, values: dict[str, float], length=500.0):
    rows = [{"id": f"q{i}", "hits@1": v} for i, v in values.items()]
    write_run(
        path,
        "qa",
        None,
        {"hits@1": sum(values.values()) / len(values), "avg_chunk_chars": length},
        items=rows,
    )
    return path


def test_bootstrap_intervals_and_paired_differences(tmp_path):
    """Hits@1 per question: B beats fixed on 27 of 30 questions (resolved), C differs on one (noise)."""
    base = {i: 0.0 for i in range(30)}
    better = {i: 1.0 if i < 27 else 0.0 for i in range(30)}
    noise = {**base, 0: 1.0}
    runs = [_items_run(tmp_path / n, v) for n, v in (("fixed", base), ("b", better), ("c", noise))]
    out = tmp_path / "cmp.md"
    result = compare(CompareConfig(runs=runs, out=out, plots=True, n_resamples=1000))
    stats = result["statistics"]
    assert stats["baseline"] == "fixed" and stats["items"]["hits@1"] == {"fixed": 30, "b": 30, "c": 30}
    lo, hi = stats["intervals"]["hits@1"]["b"]
    assert lo < 0.9 < hi and 0.7 < lo and hi <= 1.0
    assert stats["intervals"]["hits@1"]["fixed"] == [0.0, 0.0]  # no spread
    d = stats["differences"]["hits@1"]
    assert d["b"]["resolved"] and abs(d["b"]["difference"] - 0.9) < 1e-9
    assert not d["c"]["resolved"] and d["c"]["interval"][0] == 0.0  # one question in 30: inside the noise
    text = out.read_text()
    assert "95% bootstrap intervals" in text and "**resolved**" in text and "noise" in text
    # the same runs, the same seed: the same intervals
    again = compare(CompareConfig(runs=runs, out=tmp_path / "again.md", plots=False, n_resamples=1000))
    assert again["statistics"] == stats
    assert (tmp_path / "cmp_hits@1.png").read_bytes()[:4] == b"\x89PNG"
    assert "paired n=" not in text  # every item in both
    short = [runs[0], _items_run(tmp_path / "d", {i: 1.0 for i in range(20)})]  # a run cut short
    compare(CompareConfig(runs=short, out=tmp_path / "short.md", plots=False, n_resamples=1000))
    assert "(paired n=20 of 30)" in (tmp_path / "short.md").read_text()


def test_a_baseline_no_run_has_is_named(tmp_path):
    runs = [_items_run(tmp_path / "a", {0: 1.0, 1: 0.0})]
    with pytest.raises(ValueError, match="baseline"):
        compare(CompareConfig(runs=runs, out=tmp_path / "c.md", baseline="fixed", plots=False))


def test_clustered_items_resample_whole_clusters(tmp_path):
    """30 questions from 6 QA entries, 5 questions each, scored alike within an entry: resampling
    questions would treat them as 30 independent draws; resampling entries sees 6."""

    def clustered(path, values):
        rows = [
            {"id": f"e{i // 5}#{i % 5}", "cluster": f"e{i // 5}", "hits@1": v} for i, v in enumerate(values)
        ]
        write_run(
            path, "qa", None, {"hits@1": sum(values) / len(values), "avg_chunk_chars": 500.0}, items=rows
        )
        return path

    base = [0.0] * 30
    better = [1.0 if i // 5 in (0, 1, 2, 3) else 0.0 for i in range(30)]  # 4 of 6 entries answered
    runs = [clustered(tmp_path / "fixed", base), clustered(tmp_path / "b", better)]
    by_cluster = compare(CompareConfig(runs=runs, out=tmp_path / "c.md", plots=False, n_resamples=2000))[
        "statistics"
    ]
    by_item = compare(CompareConfig(runs=runs, out=tmp_path / "i.md", plots=False, n_resamples=2000,
                                    cluster=False))["statistics"]  # fmt: skip
    assert by_cluster["resampled"] == "clusters" and by_item["resampled"] == "items"
    assert by_cluster["clusters"]["hits@1"] == {"fixed": 6, "b": 6} and by_item["clusters"] == {}
    (clo, chi), (ilo, ihi) = by_cluster["intervals"]["hits@1"]["b"], by_item["intervals"]["hits@1"]["b"]
    assert clo < ilo and chi > ihi  # wider: 6 draws, not 30
    assert clo >= 0.0 and chi <= 1.0
    d = by_cluster["differences"]["hits@1"]["b"]
    assert (
        abs(d["difference"] - 4 / 6) < 1e-9 and d["paired_items"] == 30
    )  # the point estimate is the items' mean
    assert "6 clusters" in (tmp_path / "c.md").read_text()
    # one cluster only: no interval can be drawn from it
    assert bootstrap_interval([[0.0, 1.0, 1.0]], 0.95, 1000, 0, ["a", "a", "a"]) is None


def test_an_unmeasured_item_is_left_out_and_an_infinite_one_is_named(tmp_path):
    """A NaN in items.jsonl (Python's json writes and reads it) is an item the metric did not measure:
    the interval is drawn from the others. Infinity is no metric's value: the file and line are named."""
    values = {i: float(i % 2) for i in range(10)}
    run_dir = _items_run(tmp_path / "a", {**values, 10: float("nan")})
    stats = compare(CompareConfig(runs=[run_dir], out=tmp_path / "c.md", plots=False, n_resamples=500))
    assert stats["statistics"]["items"]["hits@1"] == {"a": 10}
    lo, hi = stats["statistics"]["intervals"]["hits@1"]["a"]
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    lines = (run_dir / "items.jsonl").read_text().splitlines()
    lines[3] = lines[3].replace('"hits@1": 1.0', '"hits@1": Infinity')
    (run_dir / "items.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"items.jsonl:4: field 'hits@1': inf"):
        compare(CompareConfig(runs=[run_dir], out=tmp_path / "d.md", plots=False))


def test_plots_leave_matplotlibs_backend_and_pyplot_alone(tmp_path):
    # a notebook's backend is the user's: the charts are drawn off screen without pyplot
    code = f"""
import sys, matplotlib
matplotlib.use("svg")
from pathlib import Path
from metachunk.eval.compare import CompareConfig, compare
from tests.test_eval_compare import _runs
tmp = Path({str(tmp_path)!r})
compare(CompareConfig(runs=_runs(tmp, [500.0, 520.0]), out=tmp / "c.md", labels=["fixed", "ppl"]))
assert (tmp / "c_hits@8.png").read_bytes()[:4] == b"\\x89PNG"
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["svg", "False"]


def test_a_metric_no_run_reports_is_named(tmp_path):
    dirs = _runs(tmp_path, [500.0, 520.0])
    with pytest.raises(InputError, match=r"--metrics: no run reports 'hits@5'; they report hits@8, mrr@8"):
        compare(CompareConfig(runs=dirs, out=tmp_path / "c.md", metrics=["hits@8", "hits@5"], plots=False))


def test_the_summary_a_regeneration_manifest_publishes_holds_no_path(tmp_path, capsys):
    from metachunk.eval.compare import run

    dirs = _runs(tmp_path, [500.0, 520.0])
    summary = run(
        CompareConfig(runs=dirs, out=tmp_path / "cmp" / "report.md", labels=["fixed", "ppl"])
    ).summary
    assert summary["runs"] == 2 and summary["metrics"] > 0 and str(tmp_path) not in json.dumps(summary)
