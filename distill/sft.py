"""``metachunk data build-sft TASK``: distilled records -> a prompt–completion dataset, streamed.

One builder for every task (rewrite, summary, moc-router, moc-expert). What differs per task is
its row maker (`metachunk.distill.sft_rows`): how a record reads, which rows it gives and the task's
own filters, the row's prompt and metadata columns, and the task's lines of the card. Everything
else is here, once: the distill run's meta file and the documents, the contamination check
against the test documents, exact and near duplicates, the student chat-template length filter,
the train/validation split, the parquet shards in a staging dir swapped into place, and the
card's numbers (teacher usage, token lengths, filters, leakage).

Rows are TRL's conversational prompt–completion format. Train and validation are split by
document (a seeded hash of the doc id), never by chunk or sample.

Filters run in this order; a row is counted by the first one that drops it:

1. the task's own (the row maker's): ``failed_or_empty``, ``refusal_or_off_format``,
   ``lost_content`` (rewrite, summary); ``failed_or_empty``, ``unrecoverable`` (MoC).
2. ``contaminated``: the document is a test document or a near-duplicate of one (MinHash).
3. ``exact_duplicate`` / ``near_duplicate``: the same text and target again, or a text that is
   a near-duplicate of one already kept (the chunk; MoC: the sample), within one dataset.
4. ``too_long``: prompt + completion over ``max_length`` in the student's chat template.

Records stream through: only the documents, the near-duplicate index and the token lengths are
held in memory, never the model outputs. Rows go to parquet shards as they pass.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from metachunk.distill.card import LEAKAGE_METHOD, build_entry, prompt_entries, token_lengths_entry
from metachunk.distill.sft_rows import ROW_MAKERS, Row

from metachunk import config
from metachunk.artifacts import InputError, read_json, replace_dir, write_json
from metachunk.command import Reads, Result
from metachunk.config import option
from metachunk.markdown import shown_argument, shown_path
from metachunk.sources import (
    BadRows,
    DocumentsFileError,
    DocumentTexts,
    finish_rejects,
    read_documents,
    read_records,
    refuse_or_skip,
)

SPLITS = ("train", "validation")


@dataclass
class BuildSftConfig:
    task: str = option(
        None, "which dataset", choices=["rewrite", "summary", "moc-router", "moc-expert"], positional=True
    )
    distilled: Path = option(
        None, "records of `metachunk distill TASK` (OUT/TASK.jsonl; moc-*: OUT/moc.jsonl)"
    )
    out: Path = option(None, "dataset dir: data/*.parquet, README.md (the card), token_lengths.png")
    documents: Path | None = option(
        None, "documents the records index into; default: the distill run's (from TASK.meta.json)"
    )
    test_documents: Path | None = option(
        None,
        "held-out test documents (prepare-crud's test_documents.jsonl): rows from them or their near-duplicates are dropped",
    )
    name: str | None = option(None, "dataset/card name; default metachunk-TASK-<out dir name>")
    cards_dir: Path = option(
        Path("data_cards"), "where the card is written as NAME.md (also copied to OUT/README.md)"
    )
    tokenizer: str = option(
        "smollm2", "the student's tokenizer (preset or local dir), for --max-length and the stats"
    )
    max_length: int = option(
        4096,
        "drop rows whose prompt + completion exceed this many student tokens (TRL's SFTConfig name;"
        " TRL would cut such a row, dropping it here keeps every completion whole)",
    )
    min_overlap: float = option(
        0.8, "rewrite: share of the chunk's words / character bigrams the rewrite must keep"
    )
    near_dup_threshold: float = option(
        0.8, "Jaccard (character 5-gram shingles) at which texts are near-duplicates"
    )
    validation_fraction: float = option(0.05, "share of documents in the validation split")
    seed: int = option(0, "seed of the document split")
    shard_rows: int = option(10_000, "rows per parquet shard")
    max_context_chars: int | None = option(
        None, "cut the rebuilt context to this; default: the distill run's"
    )
    license: str = option("other", "dataset license for the card (the source corpus's terms apply)")
    license_name: str | None = option(
        None, "license other: the license's id for the card (https://huggingface.co/docs/hub/datasets-cards)"
    )
    license_link: str | None = option(
        None, "license other: a URL to its text, or LICENSE for a file of that name in the dataset repo"
    )
    demo: bool = option(False, "card says: demo-scale set from a small local teacher, not training-grade")
    granularity: list[int] | None = option(
        None, "moc-expert: labels (0-3) to build, one dataset OUT-k with card NAME-k each; default all four"
    )
    bad_rows: BadRows = config.block(BadRows, "what a bad distilled record or document row does", prefix="")

    # Refused, naming TRL's name for the same limit (the student's SFTConfig.max_length).
    RENAMED = {"max_tokens": "max_length"}

    def __post_init__(self):
        config.check_choices(self)
        for name in ("task", "distilled", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError("'validation_fraction' must be in [0, 1)")
        if self.shard_rows < 1:
            raise ValueError(f"'shard_rows' must be >= 1, got {self.shard_rows}")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError(f"'near_dup_threshold' must be in (0, 1], got {self.near_dup_threshold}")
        config.check_number(self, "min_overlap", low=0.0, high=1.0)  # NaN passed every filter test, silently
        for name in ("max_length", "max_context_chars"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"field {name!r} must be >= 1, got {getattr(self, name)}")
        if (self.license_name or self.license_link) and self.license != "other":
            # the Hub's card spec: license_name and license_link name a license not on its list
            raise ValueError(
                f"'license_name' and 'license_link' go with license 'other', not {self.license!r}"
            )
        if self.name is None:
            self.name = f"metachunk-{self.task}-{Path(self.out).name}"
        if Path(self.name).name != self.name or self.name in (".", ".."):  # the card is CARDS_DIR/NAME.md
            raise ValueError(f"'name' must be a plain name, not a path, got {self.name!r}")


# ------------------------------------------------------------------------------------- split


def in_validation(doc_id: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# ------------------------------------------------------------------------------------- writing


class ShardWriter:
    """Rows of one split into ``data/SPLIT-xxxxx-of-yyyyy.parquet``; shards are renamed to their
    final ``-of-`` names once the count is known, and the whole dir only appears on success."""

    def __init__(self, data_dir: Path, split: str, schema, shard_rows: int):
        self.data_dir, self.split, self.schema, self.shard_rows = data_dir, split, schema, shard_rows
        self.buffer: list[dict] = []
        self.shards: list[Path] = []
        self.writer = None
        self.rows_in_shard = 0
        self.rows = 0

    def add(self, row: dict) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= 1000:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        while self.buffer:
            if self.writer is None:
                path = self.data_dir / f".{self.split}-{len(self.shards):05d}.parquet.partial"
                self.writer = pq.ParquetWriter(path, self.schema)
                self.shards.append(path)
                self.rows_in_shard = 0
            take = self.buffer[: self.shard_rows - self.rows_in_shard]
            self.buffer = self.buffer[len(take) :]
            self.writer.write_table(pa.Table.from_pylist(take, schema=self.schema))
            self.rows_in_shard += len(take)
            self.rows += len(take)
            if self.rows_in_shard >= self.shard_rows:
                self.writer.close()
                self.writer = None

    def close(self) -> list[Path]:
        self.flush()
        if self.writer is not None:
            self.writer.close()
        if not self.shards:  # an empty split still gets one (empty) shard, so the config resolves
            import pyarrow.parquet as pq

            path = self.data_dir / f".{self.split}-00000.parquet.partial"
            pq.ParquetWriter(path, self.schema).close()
            self.shards.append(path)
        final = []
        for i, path in enumerate(self.shards):
            target = self.data_dir / f"{self.split}-{i:05d}-of-{len(self.shards):05d}.parquet"
            path.replace(target)
            final.append(target)
        return final


# --------------------------------------------------------------------------------------- build


@dataclass
class Target:
    """One dataset being built: OUT (key None), or OUT-k for the expert set of label k."""

    key: int | None
    out: Path
    name: str
    staging: Path  # renamed into place at the end
    writers: dict
    near: object  # NearDuplicateIndex of the texts kept
    dropped: Counter = field(default_factory=Counter)
    inputs: int = 0  # rows offered to it, dropped or kept
    seen: set = field(default_factory=set)  # exact hashes of the rows kept
    prompt_lengths: list = field(default_factory=list)
    completion_lengths: list = field(default_factory=list)
    langs: Counter = field(default_factory=Counter)  # of the rows kept
    labels: Counter = field(default_factory=Counter)
    docs_by_split: dict = field(default_factory=lambda: {s: set() for s in SPLITS})


@dataclass
class Inputs:
    """What every dataset of one build read: the records, the documents, the test documents."""

    meta: dict
    documents_path: str | Path
    test_ids: set
    n_records: int = 0
    record_langs: Counter = field(default_factory=Counter)  # of every record read
    teachers: dict = field(default_factory=dict)  # stage -> models
    teacher_prompts: dict = field(default_factory=dict)  # (prompt name, sha256) -> stage
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0})
    rejects: dict | None = None  # --on-bad-row skip: the record rows left out (sources.Rejects.write)


def _distill_meta(cfg: BuildSftConfig) -> dict:
    meta_path = Path(cfg.distilled).with_suffix(".meta.json")
    return read_json(meta_path) if meta_path.is_file() else {}


def _record_rows(maker, record: dict, distilled: Path, line_no: int, document) -> tuple:
    """``(record, rows, entries)`` of one distilled record, every part of it made (the kept rows'
    columns too) before any of it is kept; or the ``file:line`` error that makes it a bad row."""
    try:
        if maker.wrong_task(record):  # before its fields: another task's record has other ones
            raise InputError(
                distilled, f"field 'task' is {record.get('task')!r}, not {maker.record_task!r}", line_no
            )
        rec = maker.read(record)
        if not isinstance(rec.lang, str):
            raise TypeError(f"'lang' must be a string, got {rec.lang!r}")
        rows = list(maker.rows(rec, partial(document, line_no=line_no)))
        for row in rows:
            if row.reason is None:  # kept so far: its document (the leakage check) and its columns
                document(row.doc_id, line_no)
                columns = row.columns()
                row.columns = lambda columns=columns: columns
        entries = [(stage, entry) for stage, entry in maker.entries(rec)]
        for stage, entry in entries:  # what _add_usage reads of it
            if not isinstance(entry, dict):
                raise TypeError(f"stage {stage!r}: its entry is not an object")
            for key in ("teacher", "prompt_sha256"):  # a set's members and a mapping's keys
                if entry.get(key) and not isinstance(entry[key], str):
                    raise TypeError(f"stage {stage!r}: {key} is not a string")
            spent = entry.get("spent") or {**entry.get("usage", {}), "cost": entry.get("cost", 0.0)}
            for key in ("prompt_tokens", "completion_tokens", "cost"):
                if not isinstance(spent.get(key, 0), (int, float)):
                    raise TypeError(f"stage {stage!r}: {key} is not a number")
    except InputError:  # already names its file and line (a document the record names is missing)
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(distilled, f"not a {maker.kind} record ({type(e).__name__}: {e})", line_no) from None
    return rec, rows, entries


def build_sft(cfg: BuildSftConfig, progress: bool = True) -> dict:
    """Stream the records into the dataset dir(s); returns the stats (also in the card).

    moc-expert builds one dataset per label: the stats are then ``{"name", "task", "datasets":
    {k: stats}, "outputs": [(dir, name)]}``."""
    import shutil
    import tempfile

    from metachunk.distill.corpus import NearDuplicateIndex
    from transformers import AutoTokenizer

    from metachunk.models import resolve
    from metachunk.progress import bar as progress_bar

    started = time.perf_counter()
    distilled = Path(cfg.distilled)
    if not distilled.is_file():
        raise InputError(distilled, "no such file")
    maker = ROW_MAKERS[cfg.task](cfg)
    meta = _distill_meta(cfg)
    maker.start(meta)
    documents_path = cfg.documents or meta.get("config", {}).get("documents")
    if documents_path is None:
        raise InputError(
            distilled, f"no documents: pass --documents (no {maker.meta_name} next to the records)"
        )
    rejects = cfg.bad_rows.rejects(cfg.out)
    # Read as the records ask, in bounded memory while they come in the documents' order (distill's).
    docs = DocumentTexts(documents_path, rejects=rejects, max_row_bytes=cfg.bad_rows.max_row_bytes)

    def document(doc_id: str, line_no: int) -> str:
        text = docs.get(doc_id)
        if text is None:
            raise InputError(distilled, f"document {doc_id!r} is not in {documents_path}", line_no)
        return text

    test_ids: set[str] = set()
    test_index = NearDuplicateIndex(threshold=cfg.near_dup_threshold)
    if cfg.test_documents:
        for d in read_documents(cfg.test_documents):
            test_ids.add(d.id)
            test_index.add(d.id, d.text)
    contaminated: dict[str, bool] = {}
    inputs = Inputs(meta, documents_path, test_ids)

    def contamination(doc_id: str, line_no: int) -> str | None:
        if doc_id not in contaminated:
            text = document(doc_id, line_no)
            contaminated[doc_id] = doc_id in test_ids or bool(test_index.query(text))
        return "contaminated" if contaminated[doc_id] else None

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(cfg.tokenizer)))
    schema = maker.features().arrow_schema
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    targets: dict[int | None, Target] = {}
    for key in maker.targets():
        where = out if key is None else out.with_name(f"{out.name}-{key}")
        if where.exists() and not where.is_dir():  # refused before the build, not at its swap
            raise InputError(where, "a file, where the dataset folder is to be written")
        staging = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=out.parent))
        (staging / "data").mkdir()
        writers = {s: ShardWriter(staging / "data", s, schema, cfg.shard_rows) for s in SPLITS}
        name = cfg.name if key is None else f"{cfg.name}-{key}"
        targets[key] = Target(key, where, name, staging, writers, NearDuplicateIndex(cfg.near_dup_threshold))
    try:
        with progress_bar(unit="rec", desc=f"build-sft {cfg.task}", enabled=progress) as bar:
            for line_no, raw, record in read_records(distilled, rejects, cfg.bad_rows.max_row_bytes):
                try:  # the whole record is checked, its rows made, before any row is kept
                    rec, rows, entries = _record_rows(maker, record, distilled, line_no, document)
                except DocumentsFileError:  # the documents file's fault, not this record's
                    raise
                except InputError as e:
                    refuse_or_skip(rejects, e, raw)
                    continue
                inputs.n_records += 1
                inputs.record_langs[rec.lang] += 1
                bar.update(1)
                _add_usage(inputs, entries, rec.lang)

                for row in rows:  # the first filter that drops a row counts it; a kept row is written
                    target = targets[row.target]
                    target.inputs += 1
                    reason = (
                        row.reason
                        or contamination(row.doc_id, line_no)
                        or _duplicate(target, row)
                        or _write_row(cfg, target, row, tokenizer, f"{distilled.name}:{line_no}")
                    )
                    if reason is None:  # only a kept row makes a later one a duplicate
                        _remember(target, row)
                    else:
                        target.dropped[reason] += 1
        docs.finish()  # every document row checked, asked for or not
        inputs.rejects = finish_rejects(rejects, "data build-sft")
        all_stats = {}
        for key, target in targets.items():
            all_stats[key] = _finish(cfg, maker, target, inputs, time.perf_counter() - started)
        for target in targets.values():  # replace previous builds only once every new one is complete
            replace_dir(target.staging, target.out)
    finally:
        for target in targets.values():
            if target.staging.exists():
                shutil.rmtree(target.staging)
    if list(targets) == [None]:
        return all_stats[None]
    return {
        "name": cfg.name,
        "task": cfg.task,
        "datasets": {str(k): s for k, s in all_stats.items()},
        "outputs": [(str(t.out), t.name) for t in targets.values()],
    }


def _write_row(cfg: BuildSftConfig, target: Target, row: Row, tokenizer, source_record: str) -> str | None:
    """Write ``row`` into its split, counted in the student's chat template; ``"too_long"`` (and
    nothing written) when prompt + completion exceed ``max_length``."""
    columns = row.columns()
    prompt = columns["prompt"]
    completion = [{"role": "assistant", "content": row.answer}]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    full_ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True)
    n_prompt, n_full = len(_ids(prompt_ids)), len(_ids(full_ids))
    if n_full > cfg.max_length:
        return "too_long"
    target.prompt_lengths.append(n_prompt)
    target.completion_lengths.append(n_full - n_prompt)
    split = "validation" if in_validation(row.doc_id, cfg.seed, cfg.validation_fraction) else "train"
    target.docs_by_split[split].add(row.doc_id)
    target.langs[row.lang] += 1
    target.labels[row.label] += 1
    target.writers[split].add(
        {**columns, "completion": completion, "doc_id": row.doc_id, "source_record": source_record}
    )
    return None


def _add_usage(inputs: Inputs, entries, lang: str) -> None:
    """The teacher models, prompt versions and spend of one record's stage entries."""
    for stage, entry in entries:
        if entry.get("teacher"):
            inputs.teachers.setdefault(stage, set()).add(entry["teacher"])
        if entry.get("prompt_sha256"):
            inputs.teacher_prompts[(f"{stage}.{lang}", entry["prompt_sha256"])] = stage
        spent = entry.get("spent") or {**entry.get("usage", {}), "cost": entry.get("cost", 0.0)}
        inputs.usage["prompt_tokens"] += spent.get("prompt_tokens", 0)
        inputs.usage["completion_tokens"] += spent.get("completion_tokens", 0)
        inputs.usage["cost_usd"] += spent.get("cost", 0.0)


def _duplicate(target: Target, row: Row) -> str | None:
    """exact_duplicate / near_duplicate of a row already kept in this dataset, else None."""
    if _row_hash(row) in target.seen:
        return "exact_duplicate"
    if target.near.query(row.text):
        return "near_duplicate"
    return None


def _remember(target: Target, row: Row) -> None:
    """A kept row, against which later rows are duplicates. Remembered only once written: a row
    dropped as too long had made the same chunk of a shorter document a "duplicate" of nothing kept."""
    exact = _row_hash(row)
    target.seen.add(exact)
    target.near.add(exact, row.text)


def _row_hash(row: Row) -> str:
    return hashlib.sha256(json.dumps([row.text, row.answer], ensure_ascii=False).encode()).hexdigest()


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)`` gives a list, or a BatchEncoding in newer versions."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def _finish(cfg: BuildSftConfig, maker, target: Target, inputs: Inputs, seconds: float) -> dict:
    """Close the shards, then the histogram, build_report.json and the card, in the staging dir."""
    # Looked up at call time (bench/sft_build.py wraps it to mark the end of the record loop).
    from metachunk.distill.card import plot_token_lengths, write_dataset_card

    for writer in target.writers.values():
        writer.close()
    plot_token_lengths(
        target.staging / "token_lengths.png",
        target.prompt_lengths,
        target.completion_lengths,
        cfg.tokenizer,
        cfg.max_length,
    )
    stats = _card_stats(cfg, maker, target, inputs)
    write_json(target.staging / "build_report.json", stats)
    write_dataset_card(target.staging, stats, maker.features(), cards_dir=Path(cfg.cards_dir))
    # The build's time is the caller's (the terminal, bench/sft_build.py, a regeneration's manifest), not
    # the dataset's: in its files it would change the bytes of every rebuild of the same records.
    total = sum(w.rows for w in target.writers.values())
    return {**stats, "timing": {"seconds": round(seconds, 2),
                                "rows_per_s": round(total / seconds, 1) if seconds > 0 else 0.0}}  # fmt: skip


def _card_stats(cfg: BuildSftConfig, maker, target: Target, inputs: Inputs) -> dict:
    langs = sorted(target.langs or inputs.record_langs) or ["en"]
    rows = {s: w.rows for s, w in target.writers.items()}
    total = sum(rows.values())
    filters = {name: target.dropped.get(name, 0) for name in maker.filters}
    documents_path = inputs.documents_path
    command = f"metachunk data build-sft {cfg.task} --distilled {shown_path(cfg.distilled)} --out {shown_path(cfg.out)}"
    return {
        "name": target.name,
        "task": cfg.task,
        "pretty_name": target.name,
        "license": cfg.license,
        **{k: v for k, v in (("license_name", cfg.license_name), ("license_link", cfg.license_link)) if v},
        "language": langs,
        "demo": cfg.demo,
        "rows": rows,
        "documents": {s: len(d) for s, d in target.docs_by_split.items()},
        "input_records": target.inputs,
        **maker.card_labels(target.key, target.labels),
        "source": {
            "corpus": Path(str(documents_path)).name,
            "path": shown_path(documents_path),
            "provenance": f"distilled records {Path(cfg.distilled).name} "
            f"({inputs.meta.get('command', maker.distill_command)}), "
            f"documents {shown_path(documents_path)}{maker.provenance_note}",
        },
        "teachers": [
            {"stage": s, "model": ", ".join(sorted(map(shown_argument, m)))}
            for s, m in sorted(inputs.teachers.items())
        ],  # a local server's model is its folder
        "prompts": prompt_entries(maker.students(langs), inputs.teacher_prompts),
        "filters": filters,
        "token_lengths": token_lengths_entry(
            shown_argument(cfg.tokenizer), cfg.max_length, target.prompt_lengths, target.completion_lengths
        ),
        "leakage": {
            "method": LEAKAGE_METHOD,
            "threshold": cfg.near_dup_threshold,
            "test_documents": len(inputs.test_ids),
            "rows_checked": target.inputs - sum(filters[name] for name in maker.own_filters),
            "contaminated": filters["contaminated"],
        },
        "teacher_usage": {**inputs.usage, "cost_usd": round(inputs.usage["cost_usd"], 6)},
        **({"rejects": inputs.rejects} if inputs.rejects is not None else {}),
        "build": build_entry(command + maker.command_args(target.key), cfg.seed),
        "limitations": maker.limitations(
            target.key, target.labels, total, inputs.n_records, len(inputs.test_ids), inputs.teachers
        ),
    }


def print_stats(stats: dict, file=None) -> None:
    """The card's numbers as a table on the terminal."""
    import sys

    file = file or sys.stdout
    if "datasets" in stats:  # moc-expert: one dataset per granularity label
        for one in stats["datasets"].values():
            print_stats(one, file)
        return
    rows, filters, lengths = stats["rows"], stats["filters"], stats["token_lengths"]
    print(f"{stats['name']}: {stats['input_records']} records -> {rows['train']} train + {rows['validation']} validation rows "
          f"({stats['documents']['train']} + {stats['documents']['validation']} documents)", file=file)  # fmt: skip
    for name, n in filters.items():
        print(f"  dropped {name:<22} {n:>6}", file=file)
    for part in ("prompt", "completion"):
        s = lengths[part]
        print(f"  {part:<10} tokens ({lengths['tokenizer']}): min {s['min']} mean {s['mean']} p50 {s['p50']} "
              f"p95 {s['p95']} max {s['max']}", file=file)  # fmt: skip
    usage, timing = stats["teacher_usage"], stats["timing"]
    print(f"  teacher usage: {usage['prompt_tokens']:,} prompt + {usage['completion_tokens']:,} completion tokens, "
          f"${usage['cost_usd']:.4f}; leakage: {stats['leakage']['contaminated']} contaminated of "
          f"{stats['leakage']['rows_checked']} checked against {stats['leakage']['test_documents']} test documents; "
          f"{timing['rows_per_s']} rows/s", file=file)  # fmt: skip


# ---- `metachunk data build-sft` ------------------------------------------------------------------

CONFIG = BuildSftConfig


def run(cfg: BuildSftConfig) -> Result:
    import sys

    stats = build_sft(cfg)
    print_stats(stats)
    for out, name in stats.get("outputs", [(cfg.out, cfg.name)]):  # moc-expert: one per label
        print(
            f"{out}: data/*.parquet, README.md, token_lengths.png; card {cfg.cards_dir}/{name}.md",
            file=sys.stderr,
        )
    if "datasets" in stats:  # moc-expert: one set per granularity
        sets = stats["datasets"]
        rejected = next(iter(sets.values()), {}).get("rejects")
        summary = {"train_rows": {f"expert {k}": (sets.get(str(k)) or {}).get("rows", {}).get("train")
                                  for k in range(4)}}  # fmt: skip
    else:
        rejected = stats.get("rejects")
        summary = {k: stats.get(k) for k in ("input_records", "rows", "filters")}
    return Result.with_rejects(summary, rejected)


def inputs(cfg: BuildSftConfig) -> Reads:
    from metachunk.prompts import prompt_files

    student = f"student_{cfg.task}" if cfg.task in ("rewrite", "summary") else cfg.task.replace("-", "_")
    return Reads.of(paths=[cfg.distilled, cfg.documents, cfg.test_documents], models=[cfg.tokenizer],
                    prompts=prompt_files("metachunk.chunking", student + "."))  # fmt: skip


def outputs(cfg: BuildSftConfig) -> list:
    """The dataset folder (moc-expert: one per granularity, OUT-0 .. OUT-3); the cards folder
    holds every dataset's card, so it is not one run's output."""
    if cfg.task == "moc-expert":
        return [*(f"{cfg.out}-{k}" for k in (cfg.granularity or range(4))), *cfg.bad_rows.outputs(cfg.out)]
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
