"""``metachunk data build-sft moc-router|moc-expert``: the distilled MoC records -> the router's and
the experts' SFT sets, with the prompts of :mod:`chunking.moc` (the ones ``chunk --method moc``
sends at inference). Moved verbatim from :mod:`distill.moc`."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from chunking.moc import (
    ROUTER_LABELS,
    check_placeholder,
    expert_messages,
    load_moc_prompt,
    router_messages,
)
from distill.card import LEAKAGE_METHOD, build_entry, card_path, prompt_entries, token_lengths_entry
from distill.moc import STAGE, TASK
from metachunk.artifacts import InputError, read_documents, replace_dir, write_json

if TYPE_CHECKING:
    from distill.sft import BuildSftConfig


SFT_FILTERS = (
    "failed_or_empty",
    "unrecoverable",
    "contaminated",
    "exact_duplicate",
    "near_duplicate",
    "too_long",
)


def moc_features():
    from datasets import Features, List, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            "prompt": List(message),
            "completion": List(message),
            "doc_id": Value("string"),
            "sample_index": Value("int64"),
            "start": Value("int64"),  # the sample's span in its document
            "end": Value("int64"),
            "lang": Value("string"),
            "label": Value("int64"),  # granularity 0..3 of the document
            "mean_chunk_chars": Value("float64"),  # of the sample's chunks
            "chunks": Value("int64"),
            "placeholder": Value("string"),
            "teachers": Value("string"),  # JSON {stage: model}
            "prompt_sha256": Value("string"),  # the router / expert prompt's version
            "teacher_prompt_sha256": Value("string"),  # JSON {stage: sha256}
            "source_record": Value("string"),  # FILE:LINE of the distilled record
        }
    )


@dataclass
class _Target:
    """One dataset being built: the router set, or the expert set of one granularity label."""

    label: int | None
    out: Path
    name: str
    staging: Path
    writers: dict
    dropped: Counter = field(default_factory=Counter)
    inputs: int = 0
    seen: set = field(default_factory=set)
    near: object = None
    prompt_lengths: list = field(default_factory=list)
    completion_lengths: list = field(default_factory=list)
    langs: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)
    docs_by_split: dict = field(default_factory=lambda: {"train": set(), "validation": set()})


def _check_granularity(cfg: BuildSftConfig) -> list[int]:
    labels = list(cfg.granularity) if cfg.granularity else list(range(len(ROUTER_LABELS)))
    bad = [k for k in labels if not 0 <= k < len(ROUTER_LABELS)]
    if bad or len(set(labels)) != len(labels):
        raise InputError("build-sft", f"--granularity takes distinct labels 0..3, got {labels}")
    return labels


def build_moc_sft(cfg: BuildSftConfig, progress: bool = True) -> dict:
    """``data build-sft moc-router|moc-expert``: the distilled MoC records -> prompt-completion sets.

    ``moc-router``: one dataset at OUT; completion = the label token. ``moc-expert``: one dataset
    per granularity label in ``granularity`` (default all four) at ``OUT-k`` with the card
    ``NAME-k``; completion = the JSON list of the sample's ``head+placeholder+tail`` rules. Returns
    the stats (for moc-expert ``{"task", "datasets": {k: stats}, "outputs"}``)."""
    import shutil
    import tempfile

    from tqdm import tqdm

    from distill.corpus import NearDuplicateIndex
    from distill.sft import ShardWriter, _distill_meta, _ids, in_validation

    role = cfg.task.removeprefix("moc-")
    started = time.perf_counter()
    distilled = Path(cfg.distilled)
    if not distilled.is_file():
        raise InputError(distilled, "no such file")
    labels = _check_granularity(cfg) if role == "expert" else None
    meta = _distill_meta(cfg)
    documents_path = cfg.documents or meta.get("config", {}).get("documents")
    if documents_path is None:
        raise InputError(distilled, "no documents: pass --documents (no moc.meta.json next to the records)")
    docs = {d.id: d.text for d in read_documents(documents_path)}
    test_ids: set[str] = set()
    test_index = NearDuplicateIndex(threshold=cfg.near_dup_threshold)
    if cfg.test_documents:
        for d in read_documents(cfg.test_documents):
            test_ids.add(d.id)
            test_index.add(d.id, d.text)
    contaminated: dict[str, bool] = {}
    tokenizer = _tokenizer(cfg.tokenizer)
    schema = moc_features().arrow_schema

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    targets: dict[int | None, _Target] = {}
    for label in labels if labels is not None else [None]:
        where = out if label is None else out.with_name(f"{out.name}-{label}")
        staging = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=out.parent))
        (staging / "data").mkdir()
        writers = {
            s: ShardWriter(staging / "data", s, schema, cfg.shard_rows) for s in ("train", "validation")
        }
        name = cfg.name if label is None else f"{cfg.name}-{label}"
        targets[label] = _Target(
            label, where, name, staging, writers, near=NearDuplicateIndex(cfg.near_dup_threshold)
        )
    teachers: dict[str, set[str]] = {}
    teacher_prompts: dict[tuple[str, str], str] = {}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
    record_langs: Counter = Counter()
    n_records = no_samples = 0
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
                    doc_id, lang, status = record["doc_id"], record["lang"], record["status"]
                    windows, samples = record["windows"], record.get("samples") or []
                    label = record.get("label")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise InputError(
                        distilled, f"not a moc record ({type(e).__name__}: {e})", line_no
                    ) from None
                if record.get("task") != TASK:
                    raise InputError(distilled, f"field 'task' is {record.get('task')!r}, not 'moc'", line_no)
                n_records += 1
                record_langs[lang] += 1
                bar.update(1)
                for w in windows:
                    entry = w.get("answer") or {}
                    if entry.get("teacher"):
                        teachers.setdefault(STAGE, set()).add(entry["teacher"])
                    if entry.get("prompt_sha256"):
                        teacher_prompts[(f"{STAGE}.{lang}", entry["prompt_sha256"])] = STAGE
                    spent = entry.get("spent") or {**entry.get("usage", {}), "cost": entry.get("cost", 0.0)}
                    usage["prompt_tokens"] += spent.get("prompt_tokens", 0)
                    usage["completion_tokens"] += spent.get("completion_tokens", 0)
                    usage["cost_usd"] += spent.get("cost", 0.0)

                if status != "ok" or not samples:
                    no_samples += 1
                    target = targets.get(None if labels is None else label)
                    if target is not None:  # the router set; an expert set only knows labelled records
                        target.inputs += 1
                        target.dropped["failed_or_empty"] += 1
                    continue
                target = targets.get(None if labels is None else label)
                if target is None:  # an expert set not asked for
                    continue
                text = docs.get(doc_id)
                if text is None:
                    raise InputError(distilled, f"document {doc_id!r} is not in {documents_path}", line_no)
                if doc_id not in contaminated:
                    contaminated[doc_id] = doc_id in test_ids or bool(test_index.query(text))
                placeholder = record.get("placeholder") or "[MASK]"
                check_placeholder(placeholder)
                answered = next((w["answer"] for w in windows if w.get("answer")), {})
                teacher = json.dumps({STAGE: answered.get("teacher")})
                teacher_prompt = json.dumps({STAGE: answered.get("prompt_sha256")})
                for index, sample in enumerate(samples):
                    target.inputs += 1
                    body = text[sample["start"] : sample["end"]]
                    if role == "expert":
                        answer = json.dumps(sample["elements"], ensure_ascii=False)
                        prompt = expert_messages(body, lang, placeholder)
                    else:
                        answer = ROUTER_LABELS[label]
                        prompt = router_messages(body, lang)
                    reason = None
                    if role == "expert" and not sample.get("recoverable", False):
                        reason = "unrecoverable"
                    elif contaminated[doc_id]:
                        reason = "contaminated"
                    else:
                        exact = hashlib.sha256(
                            json.dumps([body, answer], ensure_ascii=False).encode()
                        ).hexdigest()
                        if exact in target.seen:
                            reason = "exact_duplicate"
                        elif target.near.query(body):
                            reason = "near_duplicate"
                        else:
                            target.seen.add(exact)
                            target.near.add(exact, body)
                    if reason is not None:
                        target.dropped[reason] += 1
                        continue
                    completion = [{"role": "assistant", "content": answer}]
                    prompt_ids = tokenizer.apply_chat_template(
                        prompt, add_generation_prompt=True, tokenize=True
                    )
                    full_ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True)
                    n_prompt, n_full = len(_ids(prompt_ids)), len(_ids(full_ids))
                    if n_full > cfg.max_tokens:
                        target.dropped["too_long"] += 1
                        continue
                    target.prompt_lengths.append(n_prompt)
                    target.completion_lengths.append(n_full - n_prompt)
                    split = (
                        "validation" if in_validation(doc_id, cfg.seed, cfg.validation_fraction) else "train"
                    )
                    target.docs_by_split[split].add(doc_id)
                    target.langs[lang] += 1
                    target.labels[label] += 1
                    target.writers[split].add(
                        {
                            "prompt": prompt,
                            "completion": completion,
                            "doc_id": doc_id,
                            "sample_index": index,
                            "start": sample["start"],
                            "end": sample["end"],
                            "lang": lang,
                            "label": label,
                            "mean_chunk_chars": float(sample["mean_chunk_chars"]),
                            "chunks": len(sample["chunks"]),
                            "placeholder": placeholder,
                            "teachers": teacher,
                            "prompt_sha256": load_moc_prompt(role, lang).sha256,
                            "teacher_prompt_sha256": teacher_prompt,
                            "source_record": f"{distilled.name}:{line_no}",
                        }
                    )
        common = {
            "meta": meta,
            "documents_path": documents_path,
            "n_records": n_records,
            "no_samples": no_samples,
            "record_langs": record_langs,
            "teachers": teachers,
            "teacher_prompts": teacher_prompts,
            "usage": usage,
            "test_ids": test_ids,
            "role": role,
        }
        all_stats = {}
        for label, target in targets.items():
            all_stats[label] = _finish_target(cfg, target, common, time.perf_counter() - started)
        for target in targets.values():  # replace previous builds only once every new one is complete
            replace_dir(target.staging, target.out)
    finally:
        for target in targets.values():
            if target.staging.exists():
                shutil.rmtree(target.staging)
    if labels is None:
        return all_stats[None]
    return {
        "name": cfg.name,
        "task": cfg.task,
        "datasets": {str(k): s for k, s in all_stats.items()},
        "outputs": [(str(t.out), t.name) for t in targets.values()],
    }


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from metachunk.models import resolve

    return AutoTokenizer.from_pretrained(str(resolve(name)))


def _finish_target(cfg: BuildSftConfig, target: _Target, common: dict, seconds: float) -> dict:
    from distill.card import plot_token_lengths, write_dataset_card

    for writer in target.writers.values():
        writer.close()
    plot_token_lengths(
        target.staging / "token_lengths.png",
        target.prompt_lengths,
        target.completion_lengths,
        cfg.tokenizer,
        cfg.max_tokens,
    )
    stats = _card_stats(cfg, target, common, seconds)
    write_json(target.staging / "build_report.json", stats)
    write_dataset_card(target.staging, stats, moc_features(), cards_dir=Path(cfg.cards_dir))
    return stats


def _card_stats(cfg: BuildSftConfig, target: _Target, common: dict, seconds: float) -> dict:
    role = common["role"]
    langs = target.langs or common["record_langs"]
    students = [(f"moc_{role}.{lang}", load_moc_prompt(role, lang)) for lang in sorted(langs) or ["en"]]
    rows = {s: w.rows for s, w in target.writers.items()}
    total = sum(rows.values())
    documents_path = common["documents_path"]
    label_text = (
        "labels " + ", ".join(f"{k}: {target.labels.get(int(k), 0)}" for k in ROUTER_LABELS)
        if role == "router"
        else f"granularity label {target.label} only"
    )
    limitations = [
        "Chunk boundaries are the teacher's (a GPT-4o-class model), kept only where every chunk was "
        "found in the source within 10% edits; they are not human-checked.",
        f"Rows: {label_text}; {common['no_samples']} of {common['n_records']} distilled documents gave "
        "no sample (not finished, or no chunk accepted).",
    ]
    if total < 20_000:
        limitations.append(f"{total} rows: the MoC paper trains each component on 20,000.")
    if not common["test_ids"]:
        limitations.append("No test documents were given, so no decontamination was done.")
    from distill.sft import FILTERS

    # Every filter of the card's table (0 where it cannot fire here), then unrecoverable.
    filters = {name: target.dropped.get(name, 0) for name in (*FILTERS, *SFT_FILTERS)}
    meta = common["meta"]
    command = f"metachunk data build-sft {cfg.task} --distilled {card_path(cfg.distilled)} --out {card_path(cfg.out)}"
    if role == "expert":
        command += f" --granularity {target.label}"
    return {
        "name": target.name,
        "task": cfg.task,
        "pretty_name": target.name,
        "license": cfg.license,
        "language": sorted(langs) or ["en"],
        "demo": cfg.demo,
        "rows": rows,
        "documents": {s: len(d) for s, d in target.docs_by_split.items()},
        "input_records": target.inputs,
        "label": target.label,
        "labels": {k: target.labels.get(int(k), 0) for k in ROUTER_LABELS},
        "source": {
            "corpus": Path(str(documents_path)).name,
            "path": card_path(documents_path),
            "provenance": f"distilled records {Path(cfg.distilled).name} ({meta.get('command', 'metachunk distill moc')}), "
            f"documents {card_path(documents_path)}; one row per sample of whole teacher chunks",
        },
        "teachers": [
            {"stage": s, "model": ", ".join(sorted(m))} for s, m in sorted(common["teachers"].items())
        ],
        "prompts": prompt_entries(students, common["teacher_prompts"]),
        "filters": filters,
        "token_lengths": token_lengths_entry(
            cfg.tokenizer, cfg.max_tokens, target.prompt_lengths, target.completion_lengths
        ),
        "leakage": {
            "method": LEAKAGE_METHOD,
            "threshold": cfg.near_dup_threshold,
            "test_documents": len(common["test_ids"]),
            "rows_checked": target.inputs - filters["failed_or_empty"] - filters["unrecoverable"],
            "contaminated": filters["contaminated"],
        },
        "teacher_usage": {**common["usage"], "cost_usd": round(common["usage"]["cost_usd"], 6)},
        "build": build_entry(command, cfg.seed, seconds, total),
        "limitations": limitations,
    }
