"""``metachunk data build-sft rewrite|summary``: distilled records -> a prompt–completion dataset.

(``moc-router`` / ``moc-expert``, the MoC router's and experts' sets from ``distill moc`` records,
are built by :func:`distill.sft_moc.build_moc_sft`, with the same shards, split, decontamination and card.)

The student does not learn the teacher's three stages. It learns to go from chunk plus context
straight to the final answer (Meta-Chunking §3.2, trained with the loss of Eq. 3 on the
completion), with one versioned student instruction per task and language
(``chunking/prompts/student_{task}.{lang}.txt``). Its context is the one the teacher saw, rebuilt
from the record's ``context_spans``. The prompt is built by :func:`chunking.students.student_messages`,
the function ``metachunk chunk --rewrite/--summarize`` builds the inference prompt with.

Rows are TRL's conversational prompt–completion format: ``prompt`` = [system, user] messages,
``completion`` = [assistant] message, plus metadata (doc id, chunk offsets, teacher models, prompt
hashes, source record). Train and validation are split by document (a seeded hash of the doc
id), never by chunk.

Filters run in this order; a record is counted by the first one that drops it:

1. ``failed_or_empty``: the record did not end ok / complete_as_is, or its output is empty.
2. ``refusal_or_off_format``: a refusal, a preface ("Here is…"), leaked stage markup (``<think>``,
   "missing:", JSON items), or a "summary" that is not a short summary.
3. ``lost_content`` (rewrite): under ``min_overlap`` of the chunk's words (en) or character
   bigrams (zh) survive in the rewrite.
4. ``contaminated``: the document is a test document or a near-duplicate of one (MinHash).
5. ``exact_duplicate`` / ``near_duplicate``: the same chunk text and target again, or a chunk
   that is a near-duplicate of one already kept.
6. ``too_long``: prompt + completion over ``max_tokens`` in the student's chat template.

Records stream through: only the documents, the near-duplicate index and the token lengths are
held in memory, never the model outputs. Rows go to parquet shards as they pass.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from chunking.students import load_student_prompt, student_messages
from distill.card import LEAKAGE_METHOD, build_entry, card_path, prompt_entries, token_lengths_entry
from distill.prompts import load_prompt
from metachunk import config
from metachunk.artifacts import InputError, read_documents, replace_dir, write_json
from metachunk.config import option

FILTERS = (
    "failed_or_empty",
    "refusal_or_off_format",
    "lost_content",
    "contaminated",
    "exact_duplicate",
    "near_duplicate",
    "too_long",
)
TEACHER_STAGES = {
    "rewrite": ("reflection", "refinement", "completion"),
    "summary": ("summary_global", "summary_local", "summary_fuse"),
}


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
        "smollm2", "the student's tokenizer (preset or local dir), for --max-tokens and the stats"
    )
    max_tokens: int = option(4096, "drop rows whose prompt + completion exceed this many student tokens")
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
    demo: bool = option(False, "card says: demo-scale set from a small local teacher, not training-grade")
    granularity: list[int] | None = option(
        None, "moc-expert: labels (0-3) to build, one dataset OUT-k with card NAME-k each; default all four"
    )

    def __post_init__(self):
        config.check_choices(self)
        for name in ("task", "distilled", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError("'validation_fraction' must be in [0, 1)")
        if self.name is None:
            self.name = f"metachunk-{self.task}-{Path(self.out).name}"


# ------------------------------------------------------------------------------------ filters

_REFUSAL = re.compile(
    r"(?i)\b(i'?m sorry|i am sorry|i cannot|i can'?t|as an ai|i am unable|i'?m unable)\b"
    r"|抱歉|对不起|作为(一个)?(AI|人工智能)|我无法|我不能"
)
_PREFACE = re.compile(
    r"(?i)^\s*(here is|here's|here are|sure[,!.]|certainly[,!.]|below is|the rewritten|rewritten (text|chunk)"
    r"|summary:|以下是|好的[，,]|改写后|摘要[:：])"
)
_STAGE_MARKUP = re.compile(r"(?i)<think>|</think>|\bmissing:|\bsupplement:|\"score\"\s*:|缺失：|补充：")
_SENTENCE_END = re.compile(r"[.!?。！？]+(?=\s|$)")


def off_format(task: str, output: str, chunk: str) -> bool:
    if _REFUSAL.search(output) or _PREFACE.search(output) or _STAGE_MARKUP.search(output):
        return True
    if task == "summary":  # one enhanced sentence: short, not a second copy of the chunk
        return len(_SENTENCE_END.findall(output.strip())) > 3 or len(output) > max(2 * len(chunk), 400)
    return False


def _grams(text: str, lang: str) -> set[str]:
    if lang == "zh":
        chars = [c for c in text if c.isalnum()]
        return {a + b for a, b in zip(chars, chars[1:])}
    return set(re.findall(r"\w+", text.lower()))


def content_kept(chunk: str, rewrite: str, lang: str) -> float:
    """Share of the chunk's words (en) or character bigrams (zh) present in the rewrite."""
    source = _grams(chunk, lang)
    return len(source & _grams(rewrite, lang)) / len(source) if source else 1.0


def in_validation(doc_id: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# ------------------------------------------------------------------------------------- writing


def features():
    from datasets import Features, List, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            "prompt": List(message),
            "completion": List(message),
            "doc_id": Value("string"),
            "chunk_index": Value("int64"),
            "start": Value("int64"),
            "end": Value("int64"),
            "lang": Value("string"),
            "teachers": Value("string"),  # JSON {stage: model}
            "prompt_sha256": Value("string"),  # the student instruction's version
            "teacher_prompt_sha256": Value("string"),  # JSON {stage: sha256}
            "source_record": Value("string"),  # FILE:LINE of the distilled record
        }
    )


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


def _distill_meta(cfg: BuildSftConfig) -> dict:
    meta_path = Path(cfg.distilled).with_suffix(".meta.json")
    return json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}


def build_sft(cfg: BuildSftConfig, progress: bool = True) -> dict:
    """Stream the records into the dataset dir; returns the stats (also in the card)."""
    import shutil
    import tempfile

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from distill.card import plot_token_lengths, write_dataset_card
    from distill.corpus import NearDuplicateIndex
    from metachunk.models import resolve

    if cfg.task.startswith("moc-"):
        from distill.sft_moc import build_moc_sft

        return build_moc_sft(cfg, progress)
    started = time.perf_counter()
    distilled = Path(cfg.distilled)
    if not distilled.is_file():
        raise InputError(distilled, "no such file")
    meta = _distill_meta(cfg)
    run_config = meta.get("config", {})
    documents_path = cfg.documents or run_config.get("documents")
    if documents_path is None:
        raise InputError(distilled, "no documents: pass --documents (no TASK.meta.json next to the records)")
    max_context = cfg.max_context_chars or run_config.get("max_context_chars") or 8000
    docs = {d.id: d.text for d in read_documents(documents_path)}

    test_ids: set[str] = set()
    test_index = NearDuplicateIndex(threshold=cfg.near_dup_threshold)
    if cfg.test_documents:
        for d in read_documents(cfg.test_documents):
            test_ids.add(d.id)
            test_index.add(d.id, d.text)
    contaminated_docs: dict[str, bool] = {}

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(cfg.tokenizer)))
    schema = features().arrow_schema
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # renamed into place at the end
    (staging / "data").mkdir()
    writers = {s: ShardWriter(staging / "data", s, schema, cfg.shard_rows) for s in ("train", "validation")}

    dropped: Counter = Counter()
    seen_exact: set[str] = set()
    chunk_index = NearDuplicateIndex(threshold=cfg.near_dup_threshold)
    prompt_lengths: list[int] = []
    completion_lengths: list[int] = []
    teachers: dict[str, set[str]] = {}
    teacher_prompts: dict[tuple[str, str], str] = {}
    langs: Counter = Counter()  # of the rows kept
    record_langs: Counter = Counter()  # of every record read
    docs_by_split: dict[str, set[str]] = {"train": set(), "validation": set()}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
    n_records = 0
    try:
        with (
            distilled.open(encoding="utf-8") as f,
            tqdm(unit="rec", desc=f"build-sft {cfg.task}", disable=not progress) as bar,
        ):
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    doc_id, chunk, output = record["doc_id"], record["text"], record.get("output") or ""
                    lang, status, stages = record["lang"], record["status"], record["stages"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise InputError(
                        distilled, f"not a distill record ({type(e).__name__}: {e})", line_no
                    ) from None
                if record.get("task", cfg.task) != cfg.task:
                    raise InputError(
                        distilled, f"field 'task' is {record.get('task')!r}, not {cfg.task!r}", line_no
                    )
                n_records += 1
                record_langs[lang] += 1
                bar.update(1)
                for stage, entry in stages.items():
                    if entry.get("teacher"):
                        teachers.setdefault(stage, set()).add(entry["teacher"])
                    if entry.get("prompt_sha256"):
                        teacher_prompts[(f"{stage}.{lang}", entry["prompt_sha256"])] = stage
                    spent = entry.get("spent") or {**entry.get("usage", {}), "cost": entry.get("cost", 0.0)}
                    usage["prompt_tokens"] += spent.get("prompt_tokens", 0)
                    usage["completion_tokens"] += spent.get("completion_tokens", 0)
                    usage["cost_usd"] += spent.get("cost", 0.0)

                reason = _drop_reason(cfg, record, chunk, output, lang, status)
                if reason is None:
                    if doc_id not in contaminated_docs:
                        text = docs.get(doc_id)
                        if text is None:
                            raise InputError(
                                distilled, f"document {doc_id!r} is not in {documents_path}", line_no
                            )
                        contaminated_docs[doc_id] = doc_id in test_ids or bool(test_index.query(text))
                    if contaminated_docs[doc_id]:
                        reason = "contaminated"
                if reason is None:
                    exact = hashlib.sha256(
                        json.dumps([chunk, output], ensure_ascii=False).encode()
                    ).hexdigest()
                    if exact in seen_exact:
                        reason = "exact_duplicate"
                    elif chunk_index.query(chunk):
                        reason = "near_duplicate"
                    else:
                        seen_exact.add(exact)
                        chunk_index.add(exact, chunk)
                if reason is not None:
                    dropped[reason] += 1
                    continue

                student = load_student_prompt(cfg.task, lang)
                # The one prompt builder: the chunker's --rewrite/--summarize sends exactly this.
                prompt = student_messages(
                    cfg.task, lang, docs[doc_id], chunk, record.get("context_spans"), max_context
                )
                completion = [{"role": "assistant", "content": output}]
                prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                full_ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True)
                n_prompt, n_full = len(_ids(prompt_ids)), len(_ids(full_ids))
                if n_full > cfg.max_tokens:
                    dropped["too_long"] += 1
                    continue
                prompt_lengths.append(n_prompt)
                completion_lengths.append(n_full - n_prompt)
                split = "validation" if in_validation(doc_id, cfg.seed, cfg.validation_fraction) else "train"
                docs_by_split[split].add(doc_id)
                langs[lang] += 1
                writers[split].add(
                    {
                        "prompt": prompt,
                        "completion": completion,
                        "doc_id": doc_id,
                        "chunk_index": record.get("chunk_index", -1),
                        "start": record["start"],
                        "end": record["end"],
                        "lang": lang,
                        "teachers": json.dumps(
                            {s: e.get("teacher") for s, e in stages.items()}, ensure_ascii=False
                        ),
                        "prompt_sha256": student.sha256,
                        "teacher_prompt_sha256": json.dumps(
                            {s: e.get("prompt_sha256") for s, e in stages.items()}
                        ),
                        "source_record": f"{distilled.name}:{line_no}",
                    }
                )
        for writer in writers.values():
            writer.close()
        seconds = time.perf_counter() - started
        rows = {s: w.rows for s, w in writers.items()}
        plot_token_lengths(
            staging / "token_lengths.png", prompt_lengths, completion_lengths, cfg.tokenizer, cfg.max_tokens
        )
        stats = _card_stats(cfg, meta, documents_path, n_records, rows, docs_by_split, dropped, langs or record_langs, teachers,
                            teacher_prompts, prompt_lengths, completion_lengths, usage, test_ids, seconds)  # fmt: skip
        write_json(staging / "build_report.json", stats)
        write_dataset_card(staging, stats, features(), cards_dir=Path(cfg.cards_dir))
        replace_dir(staging, out)  # the previous build is replaced only now that the new one is complete
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return stats


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)`` gives a list, or a BatchEncoding in newer versions."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def _drop_reason(
    cfg: BuildSftConfig, record: dict, chunk: str, output: str, lang: str, status: str
) -> str | None:
    if status not in ("ok", "complete_as_is") or not output.strip():
        return "failed_or_empty"
    if status == "ok" and off_format(cfg.task, output, chunk):
        return "refusal_or_off_format"
    if cfg.task == "rewrite" and content_kept(chunk, output, lang) < cfg.min_overlap:
        return "lost_content"
    return None


def _card_stats(cfg, meta, documents_path, n_records, rows, docs_by_split, dropped, langs, teachers,
                teacher_prompts, prompt_lengths, completion_lengths, usage, test_ids, seconds) -> dict:  # fmt: skip
    students = [
        (f"student_{cfg.task}.{lang}", load_prompt(f"student_{cfg.task}", lang))
        for lang in sorted(langs) or ["en"]
    ]
    total_rows = sum(rows.values())
    teacher_models = sorted({m for models in teachers.values() for m in models})
    return {
        "name": cfg.name,
        "task": cfg.task,
        "pretty_name": cfg.name,
        "license": cfg.license,
        "language": sorted(langs) or ["en"],
        "demo": cfg.demo,
        "rows": rows,
        "documents": {s: len(d) for s, d in docs_by_split.items()},
        "input_records": n_records,
        "source": {
            "corpus": Path(str(documents_path)).name,
            "path": card_path(documents_path),
            "provenance": f"distilled records {Path(cfg.distilled).name} ({meta.get('command', 'metachunk distill')}), "
            f"documents {card_path(documents_path)}",
        },
        "teachers": [{"stage": s, "model": ", ".join(sorted(m))} for s, m in sorted(teachers.items())],
        "prompts": prompt_entries(students, teacher_prompts),
        "filters": {name: dropped.get(name, 0) for name in FILTERS},
        "token_lengths": token_lengths_entry(
            cfg.tokenizer, cfg.max_tokens, prompt_lengths, completion_lengths
        ),
        "leakage": {
            "method": LEAKAGE_METHOD,
            "threshold": cfg.near_dup_threshold,
            "test_documents": len(test_ids),
            "rows_checked": n_records
            - dropped.get("failed_or_empty", 0)
            - dropped.get("refusal_or_off_format", 0)
            - dropped.get("lost_content", 0),
            "contaminated": dropped.get("contaminated", 0),
        },
        "teacher_usage": {**usage, "cost_usd": round(usage["cost_usd"], 6)},
        "build": build_entry(
            f"metachunk data build-sft {cfg.task} --distilled {card_path(cfg.distilled)} --out {card_path(cfg.out)}",
            cfg.seed,
            seconds,
            total_rows,
        ),
        "limitations": _limitations(cfg, teacher_models, total_rows, len(test_ids)),
    }


def _limitations(cfg, teacher_models, total_rows, n_test) -> list[str]:
    notes = [
        "Targets are teacher outputs filtered by heuristics (refusals, prefaces, content overlap, length); "
        "they are not human-checked.",
    ]
    if total_rows < 20_000:
        notes.append(f"{total_rows} rows: the paper trains on 20,000 per component.")
    if n_test == 0:
        notes.append("No test documents were given, so no decontamination was done.")
    if any(m in ("smollm2", "gemma3-270m") or "models/" in m for m in teacher_models):
        notes.append(
            "Distilled from a small local teacher (SmolLM2-135M); only the pipeline is demonstrated."
        )
    return notes


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
    usage, build = stats["teacher_usage"], stats["build"]
    print(f"  teacher usage: {usage['prompt_tokens']:,} prompt + {usage['completion_tokens']:,} completion tokens, "
          f"${usage['cost_usd']:.4f}; leakage: {stats['leakage']['contaminated']} contaminated of "
          f"{stats['leakage']['rows_checked']} checked against {stats['leakage']['test_documents']} test documents; "
          f"{build['rows_per_s']} rows/s", file=file)  # fmt: skip
