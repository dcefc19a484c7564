"""The dataset card (README.md) of a distilled SFT set, written from measured numbers only.

The SFT builder measures everything it reports (rows, filters, token lengths, the leakage check,
teacher spend) into a ``stats`` dict and calls `write_dataset_card`. The card says only what
``stats`` says: a number that is missing is printed as "not measured", never estimated, so the
card can be trusted as a record of the build. The YAML header is built with
``huggingface_hub.DatasetCardData`` and ``datasets``' own ``MetadataConfigs`` / ``DatasetInfosDict``,
so ``load_dataset(DIR)`` and the Hub read the same ``configs`` and ``dataset_info`` we write; when
``dataset_info`` carries split sizes, ``load_dataset`` checks the row counts against them.

The ``stats`` schema. Only ``name``, ``task`` and ``rows`` are required; every other key may be
missing, at any depth:

```
{"name": "metachunk-rewrite-demo",            # file name of the card in data_cards/
 "task": "rewrite" | "summary" | "moc-router" | "moc-expert",
 "pretty_name": str,                          # default: name
 "license": str,                              # default: "apache-2.0"
 "license_name": str, "license_link": str,    # with license "other": its id, and a URL or LICENSE
 "language": ["zh", "en"],
 "demo": bool,                                # True: teacher was the local SmolLM2-135M demo model
 "rows": {"train": int, "validation": int},   # one entry per split that has a parquet file
 "documents": {"train": int, "validation": int},
 "input_records": int,                        # candidate rows (a record's, or a MoC sample's)
 "source": {"corpus": str, "path": str, "provenance": str},
 "teachers": [{"stage": str, "model": str}],
 "prompts": [{"name": str, "sha256": str, "text": str, "role": "student" | "teacher"}],
 "filters": {"failed_or_empty": int, "refusal_or_off_format": int, "too_long": int,
             "exact_duplicate": int, "near_duplicate": int, "lost_content": int,
             "contaminated": int},            # rows removed by each filter
 "token_lengths": {"tokenizer": str, "max_length": int,
                   "prompt": {"min", "mean", "p50", "p95", "max"},
                   "completion": {"min", "mean", "p50", "p95", "max"},
                   "histogram": "token_lengths.png"},   # relative to the dataset dir
 "leakage": {"method": str, "threshold": float, "test_documents": int, "rows_checked": int,
             "contaminated": int},
 "teacher_usage": {"prompt_tokens": int, "completion_tokens": int, "cost_usd": float},
 "build": {"command": str, "seed": int},   # what made it; how long it took is no property of the data
 "limitations": [str],
 "sizes": {"train": {"num_bytes": int, "download_size": int}, ...}}
```

``sizes`` is not the builder's business: `write_dataset_card` measures it from the parquet
files (Arrow bytes in memory, bytes on disk). Without it the ``dataset_info`` block lists the
features only, since ``datasets`` wants a byte count next to every split size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from metachunk import markdown
from metachunk.artifacts import AtomicWriter, InputError, write_figure

NOT_MEASURED = "not measured"
SPLIT_ORDER = ("train", "validation", "test")
TAGS = ["rag", "text-chunking", "meta-chunking", "distillation"]

# The Hub's size_categories buckets: (upper bound, label), first bound above n wins.
_SIZE_BUCKETS = [
    (10**3, "n<1K"),
    (10**4, "1K<n<10K"),
    (10**5, "10K<n<100K"),
    (10**6, "100K<n<1M"),
    (10**7, "1M<n<10M"),
    (10**8, "10M<n<100M"),
    (10**9, "100M<n<1B"),
    (10**10, "1B<n<10B"),
    (10**11, "10B<n<100B"),
    (10**12, "100B<n<1T"),
]

FILTERS = {
    "failed_or_empty": "the teacher call failed, or the answer was empty",
    "refusal_or_off_format": "the answer was a refusal or did not follow the requested format",
    "too_long": "over the token limit (`max_length`)",
    "exact_duplicate": "exact duplicate of another row",
    "near_duplicate": "near-duplicate of another row",
    "lost_content": "the completion lost content of the original chunk",
    "contaminated": "overlaps a held-out test document (see Leakage check)",
}
# Filters only some tasks have: listed only when the build counted them.
TASK_FILTERS = {
    "unrecoverable": "MoC expert target whose chunk starts do not come back through regex recovery"
}

TASKS = {
    "rewrite": (
        "rewriter",
        "rewrite a text chunk cut out of a document so that it can be understood on its own: unresolved "
        "references, missing background and unexplained terms are filled in from the document, and every "
        "original fact is kept",
    ),
    "summary": (
        "summarizer",
        "write one enhanced summary sentence for a text chunk, using the document around it",
    ),
    "moc-router": (
        "MoC granularity router",
        "read a text (a sample of whole teacher chunks, about `moc_sample_chars` characters: 1,024 in the "
        "paper) and answer one label token, 0-3, the granularity "
        "its chunks should have (mean chunk length in (0,120], (120,150], (150,180] or over 180 characters)",
    ),
    "moc-expert": (
        "MoC meta-chunker (one granularity interval)",
        "chunk a text by writing a JSON list of `head[placeholder]tail` rules, one per chunk, "
        "from which the chunks are recovered as exact spans",
    ),
}
# The metadata columns of each task's rows, before the ones every task has (`features` and
# `moc_features` in sft_rows.py).
_MOC_METADATA = (
    "`doc_id`, `sample_index`, `start`, `end` (where the sample lies in its document), `label`, "
    "`mean_chunk_chars` and `chunks` (the mean length and number of the sample's chunks), `placeholder`"
)
METADATA = {
    None: "`doc_id`, `chunk_index`, `start`, `end` (where the chunk lies in its document)",
    "moc-router": _MOC_METADATA,
    "moc-expert": _MOC_METADATA,
}
# Where each task comes from, and what its user message holds.
SOURCES = {"moc-router": "MoC §3.2.2", "moc-expert": "MoC §3.2.3"}
PROMPT_INPUTS = {
    "moc-router": "the router prompt filled with the text",
    "moc-expert": "the expert prompt filled with the text",
}


LEAKAGE_METHOD = (
    "document id match, then MinHash LSH over character 5-gram shingles verified by exact Jaccard"
)


def prompt_entries(
    students: Sequence[tuple[str, object]], teacher_prompts: Mapping[tuple[str, str], str]
) -> list[dict]:
    """The card's prompts: each student prompt the rows were rendered with (``(name, Prompt)``), then
    each teacher prompt the distilled records name, ``{(name.lang, sha256): stage}``. A teacher
    prompt whose sha256 is not this checkout's version is listed without a text, not with the wrong one."""
    from metachunk.distill.prompts import load_prompt

    def text(prompt) -> str:
        return f"<<<system>>>\n{prompt.system}\n<<<user>>>\n{prompt.user}"

    entries = [{"name": name, "sha256": p.sha256, "text": text(p), "role": "student"} for name, p in students]
    for (name, sha), stage in sorted(teacher_prompts.items()):
        current = load_prompt(stage, name.rsplit(".", 1)[1])
        shown = (
            text(current)
            if current.sha256 == sha
            else "(a different version than this checkout's; see its sha256)"
        )
        entries.append({"name": name, "sha256": sha, "text": shown, "role": "teacher"})
    return entries


def length_stats(values: Sequence[int]) -> dict:
    """min, mean, p50, p95 and max of token lengths (zeros for an empty set)."""
    if not values:
        return {"min": 0, "mean": 0.0, "p50": 0, "p95": 0, "max": 0}
    ordered = sorted(values)

    def pick(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"min": ordered[0], "mean": round(sum(ordered) / len(ordered), 1), "p50": pick(0.5),
            "p95": pick(0.95), "max": ordered[-1]}  # fmt: skip


def token_lengths_entry(
    tokenizer: str, max_length: int, prompts: Sequence[int], completions: Sequence[int]
) -> dict:
    return {
        "tokenizer": tokenizer,
        "max_length": max_length,
        "prompt": length_stats(prompts),
        "completion": length_stats(completions),
        "histogram": "token_lengths.png",
    }


def build_entry(command: str, seed: int) -> dict:
    """The card's and build_report.json's ``build``: only what decides the rows, so that a rebuild of
    the same records writes the same bytes (and a regeneration does not retrain on an unchanged set)."""
    return {"command": command, "seed": seed}


def size_category(n: int) -> str:
    for bound, label in _SIZE_BUCKETS:
        if n < bound:
            return label
    return "n>1T"


def _splits(stats: dict) -> list[str]:
    """Splits with at least one row, train and validation first."""
    rows = stats.get("rows") or {}
    named = [s for s in SPLIT_ORDER if s in rows] + sorted(s for s in rows if s not in SPLIT_ORDER)
    return [s for s in named if (rows.get(s) or 0) > 0]


def data_files(stats: dict) -> list[dict]:
    """The ``configs`` data_files: one ``data/<split>-*.parquet`` pattern per non-empty split."""
    return [{"split": s, "path": f"data/{s}-*.parquet"} for s in _splits(stats)]


def _num(value, fmt: str = "") -> str:
    if value is None:
        return NOT_MEASURED
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and fmt:
        return format(value, fmt)
    return str(value)


def _yaml_header(stats: dict, features) -> str:
    from datasets import DatasetInfo, SplitDict, SplitInfo
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCardData

    rows = stats["rows"]
    card_data = DatasetCardData(
        license=stats.get("license") or "apache-2.0",
        # https://github.com/huggingface/hub-docs/blob/main/datasetcard.md: a license not on the Hub's list
        license_name=stats.get("license_name"),
        license_link=stats.get("license_link"),
        language=stats.get("language") or None,  # unknown: left out rather than guessed
        task_categories=["text-generation"],
        size_categories=[size_category(sum(rows.values()))],
        tags=TAGS + [stats["task"]],
        pretty_name=stats.get("pretty_name") or stats["name"],
    )
    MetadataConfigs({"default": {"data_files": data_files(stats)}}).to_dataset_card_data(card_data)
    if features is not None:
        info = DatasetInfo(features=features)
        sizes = stats.get("sizes") or {}
        splits = _splits(stats)
        if splits and all(s in sizes for s in splits):
            info.splits = SplitDict()
            for s in splits:
                info.splits.add(SplitInfo(s, num_bytes=sizes[s]["num_bytes"], num_examples=rows[s]))
            info.dataset_size = sum(sizes[s]["num_bytes"] for s in splits)
            info.download_size = sum(sizes[s]["download_size"] for s in splits)
        DatasetInfosDict({"default": info}).to_dataset_card_data(card_data)
    return card_data.to_yaml()


def _summary(stats: dict) -> str:
    task = stats["task"]
    student, what = TASKS.get(task, (task, f"perform the {task!r} task"))
    rows, documents = stats["rows"], stats.get("documents") or {}
    out = [f"# {stats.get('pretty_name') or stats['name']}", ""]
    if stats.get("demo"):
        out += [
            "> **Demo-scale set, not a training-grade dataset.** The completions were distilled from "
            "SmolLM2-135M-Instruct, the small local demo teacher, to exercise the pipeline end to end. "
            "Do not train a model you intend to use on it.",
            "",
        ]
    out += [
        "## Summary and intended use",
        "",
        f"Supervised fine-tuning data for the student **{student}** of {SOURCES.get(task, 'Meta-Chunking §3.2')} "
        f"(task `{task}`): each row teaches a small model to {what}. The targets were produced by the "
        "teacher models listed below and filtered as described in this card.",
        "",
        "Rows are TRL conversational prompt–completion pairs: `prompt` is a list of messages (system, "
        f"then user: {PROMPT_INPUTS.get(task, 'the student prompt filled with the document context and the chunk')}), `completion` "
        f"is one assistant message, the teacher's target. Metadata columns: {METADATA.get(task, METADATA[None])}, "
        "`teachers` (JSON), `prompt_sha256` (the student prompt template, see below) and `source_record`.",
        "",
        markdown.table(
            ["split", "rows", "documents"],
            [[s, _num(rows.get(s)), _num(documents.get(s))] for s in _splits(stats) or list(rows)],
        ),
        "",
        "Load it, and fine-tune a student with TRL (loss on the completion only):",
        "",
        markdown.fenced(
            "from datasets import load_dataset\n"
            "from trl import SFTConfig, SFTTrainer\n"
            "\n"
            f'ds = load_dataset("<namespace>/{stats["name"]}")  # or the local dataset directory\n'
            'ds = ds.select_columns(["prompt", "completion"])\n'
            "trainer = SFTTrainer(\n"
            '    model="<student model>",\n'
            '    train_dataset=ds["train"],\n'
            '    eval_dataset=ds.get("validation"),\n'
            '    args=SFTConfig(output_dir="student", completion_only_loss=True),\n'
            ")\n"
            "trainer.train()",
            "python",
        ),
    ]
    return "\n".join(out)


def _source(stats: dict) -> str:
    source = stats.get("source") or {}
    return "\n".join(
        [
            "## Source corpus and provenance",
            "",
            f"- Corpus: {_num(source.get('corpus'))}",
            f"- Path: {'`' + source['path'] + '`' if source.get('path') else NOT_MEASURED}",
            f"- Provenance: {_num(source.get('provenance'))}",
            f"- Candidate rows from the distilled records: {_num(stats.get('input_records'))}",
        ]
    )


def _teachers(stats: dict) -> str:
    teachers = stats.get("teachers")
    body = (
        markdown.table(
            ["stage", "model"],
            [[t.get("stage", NOT_MEASURED), t.get("model", NOT_MEASURED)] for t in teachers],
        )
        if teachers
        else f"Teacher models: {NOT_MEASURED}."
    )
    return "## Teacher models\n\n" + body


def _prompts(stats: dict) -> str:
    prompts = stats.get("prompts")
    if not prompts:
        return f"## Prompt templates\n\nPrompt templates: {NOT_MEASURED}."
    out = [
        "## Prompt templates",
        "",
        "The sha256 of a template file is its version; each row's `prompt_sha256` names the student "
        "template its prompt was built from.",
    ]
    for p in prompts:
        role = f" ({p['role']} prompt)" if p.get("role") else ""
        out += [
            "",
            f"### {p.get('name', NOT_MEASURED)}{role}",
            "",
            f"sha256: `{p['sha256']}`" if p.get("sha256") else f"sha256: {NOT_MEASURED}",
            "",
            markdown.fenced(p["text"]) if p.get("text") is not None else f"Text: {NOT_MEASURED}.",
        ]
    return "\n".join(out)


def _filters(stats: dict) -> str:
    filters = stats.get("filters") or {}
    names = list(FILTERS) + sorted(k for k in filters if k not in FILTERS)
    table = markdown.table(
        ["filter", "removes", "rows removed"],
        [[f"`{k}`", FILTERS.get(k) or TASK_FILTERS.get(k, ""), _num(filters.get(k))] for k in names],
    )
    inputs = stats.get("input_records")
    kept = sum(stats["rows"].values())
    out = [
        "## Filters",
        "",
        table,
        "",
        f"- Candidate rows: {_num(inputs)}",
        f"- Rows kept: {kept}",
    ]
    removed = [filters.get(k) for k in names]
    if inputs is not None and None not in removed and inputs - sum(removed) != kept:
        out.append(
            f"- Note: candidate rows − rows removed = {inputs - sum(removed)}, which differs from the "
            f"{kept} rows kept; the counts above are reported as measured."
        )
    return "\n".join(out)


def _token_lengths(stats: dict) -> str:
    lengths = stats.get("token_lengths") or {}
    keys = ["min", "mean", "p50", "p95", "max"]

    def row(name):
        values = lengths.get(name) or {}
        return [f"{name} tokens"] + [_num(values.get(k), ".1f") for k in keys]

    histogram = lengths.get("histogram")
    return "\n".join(
        [
            "## Token length statistics",
            "",
            f"Tokenizer: {'`' + lengths['tokenizer'] + '`' if lengths.get('tokenizer') else NOT_MEASURED}. "
            f"Token limit (`max_length`): {_num(lengths.get('max_length', lengths.get('max_tokens')))}.",  # or a report's old key
            "",
            markdown.table([""] + keys, [row("prompt"), row("completion")]),
            "",
            f"![Prompt and completion token lengths]({histogram})"
            if histogram
            else f"Histogram: {NOT_MEASURED}.",
        ]
    )


def _leakage(stats: dict) -> str:
    leakage = stats.get("leakage") or {}
    contaminated = leakage.get("contaminated")
    verdict = (
        f"The check found {contaminated} contaminated rows."
        if contaminated is not None
        else f"The number of contaminated rows was {NOT_MEASURED}."
    )
    return "\n".join(
        [
            "## Leakage check",
            "",
            "The rows were compared with the held-out test documents, so that evaluation on them "
            "does not measure memorised training data.",
            "",
            f"- Method: {_num(leakage.get('method'))}",
            f"- Threshold: {_num(leakage.get('threshold'), 'g')}",
            f"- Test documents: {_num(leakage.get('test_documents'))}",
            f"- Rows checked: {_num(leakage.get('rows_checked'))}",
            f"- Contaminated rows: {_num(contaminated)}",
            "",
            verdict,
        ]
    )


def _usage(stats: dict) -> str:
    usage = stats.get("teacher_usage") or {}
    cost = usage.get("cost_usd")
    return "\n".join(
        [
            "## Teacher usage",
            "",
            f"- Prompt tokens: {_num(usage.get('prompt_tokens'))}",
            f"- Completion tokens: {_num(usage.get('completion_tokens'))}",
            f"- Cost: {NOT_MEASURED if cost is None else f'{cost:.4f} USD'}",
        ]
    )


def _build(stats: dict) -> str:
    build = stats.get("build") or {}
    command = build.get("command")
    return "\n".join(
        [
            "## Build",
            "",
            markdown.fenced(command, "bash") if command else f"Command: {NOT_MEASURED}.",
            "",
            f"- Seed: {_num(build.get('seed'))}",
        ]
    )


def _limitations(stats: dict) -> str:
    items = list(stats.get("limitations") or [])
    if stats.get("demo"):
        items.append(
            "Demo scale: the teacher was SmolLM2-135M-Instruct, a 135M-parameter model run locally. A model "
            "this small often writes wrong, incomplete or off-task completions, and the filters remove only "
            "the ones they detect; the set exists to test the pipeline end to end."
        )
    items.append("Completions are machine-generated by the teacher models listed above.")
    return "## Limitations\n\n" + "\n".join(f"- {' '.join(str(item).split())}" for item in items)


def render_dataset_card(stats: dict, features=None) -> str:
    """The card's text: YAML header, then one Markdown section per part of ``stats``.

    ``features`` (a ``datasets.Features``) adds a ``dataset_info`` block to the header.
    """
    for key in ("name", "task", "rows"):
        if key not in stats:
            raise ValueError(f"stats needs {key!r} (has: {', '.join(stats) or 'nothing'})")
    sections = [
        _summary(stats),
        _source(stats),
        _teachers(stats),
        _prompts(stats),
        _filters(stats),
        _token_lengths(stats),
        _leakage(stats),
        _usage(stats),
        _build(stats),
        _limitations(stats),
    ]
    return "---\n" + _yaml_header(stats, features) + "\n---\n\n" + "\n\n".join(sections) + "\n"


def plot_token_lengths(
    path: str | Path,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    tokenizer: str,
    max_length: int | None = None,
) -> Path:
    """Write ``path`` (PNG): histograms of prompt and completion token counts, side by side, with a
    dashed line at ``max_length`` when given. Written to a temp file, then renamed into place."""
    from metachunk.artifacts import new_figure

    path = Path(path)
    fig, axes = new_figure(1, 2, figsize=(10, 3.6))
    for ax, lengths, name, color in (
        (axes[0], prompt_lengths, "prompt", "tab:blue"),
        (axes[1], completion_lengths, "completion", "tab:green"),
    ):
        lengths = list(lengths)
        if lengths:
            ax.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color=color, alpha=0.85)
        else:
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
        if max_length is not None:
            ax.axvline(max_length, color="tab:red", ls="--", lw=1, label=f"max_length = {max_length}")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_xlabel(f"{name} tokens ({tokenizer})")
        ax.set_ylabel("rows")
        ax.set_title(f"{name}: {len(lengths)} rows", fontsize=9)
    fig.tight_layout()
    return write_figure(fig, path)


def measure_sizes(dataset_dir: str | Path, splits: Sequence[str]) -> dict:
    """``{split: {"num_bytes", "download_size"}}`` from ``data/<split>-*.parquet``: Arrow bytes once
    loaded (what ``datasets`` calls num_bytes) and parquet bytes on disk. One shard in memory at a time."""
    import pyarrow.parquet as pq

    sizes = {}
    for split in splits:
        files = sorted((Path(dataset_dir) / "data").glob(f"{split}-*.parquet"))
        sizes[split] = {
            "num_bytes": sum(pq.read_table(f).nbytes for f in files),
            "download_size": sum(f.stat().st_size for f in files),
        }
    return sizes


def write_dataset_card(
    dataset_dir: str | Path, stats: dict, features=None, cards_dir: str | Path = Path("data_cards")
) -> Path:
    """Render the card, write ``cards_dir/<name>.md`` and ``dataset_dir/README.md`` (both atomically),
    and return the path of the first.

    Checks first that every split in ``stats["rows"]`` has parquet files and that the histogram the card
    links to exists. ``features`` defaults to the ones stored in the first parquet shard; split byte
    sizes are measured from the files.
    """
    import pyarrow.parquet as pq
    from datasets import Features

    dataset_dir = Path(dataset_dir)
    splits = _splits(stats)
    for pattern in data_files(stats):
        if not list(dataset_dir.glob(pattern["path"])):
            raise InputError(
                dataset_dir,
                f"stats has {stats['rows'][pattern['split']]} {pattern['split']} rows but no file matches "
                f"{pattern['path']}",
            )
    histogram = (stats.get("token_lengths") or {}).get("histogram")
    if histogram and not (dataset_dir / histogram).is_file():
        raise InputError(dataset_dir / histogram, "the card links to this histogram, but it does not exist")
    if features is None and splits:
        first = sorted(dataset_dir.glob(f"data/{splits[0]}-*.parquet"))[0]
        features = Features.from_arrow_schema(pq.read_schema(first))
    stats = dict(stats)
    stats.setdefault("sizes", measure_sizes(dataset_dir, splits))
    text = render_dataset_card(stats, features)
    card_path = Path(cards_dir) / f"{stats['name']}.md"
    for target in (card_path, dataset_dir / "README.md"):
        with AtomicWriter(target) as f:
            f.write(text)
    return card_path
