"""``metachunk chunk``: the command, over `metachunk.chunking.shards`.

``-o FILE.jsonl`` writes one file and ``FILE.meta.json``; ``-o DIR`` writes a dataset folder of
shards and ``manifest.json``, resumable. Either manifest says what the output holds; how each attempt
ran (seconds, the method's and the students' blocks) is a line of ``FILE.runs.jsonl`` or
``DIR/runs.jsonl``, so a rerun writes the same bytes. Both are one implementation
(`chunk_corpus` here: a file is the one-shard plan), so every method
(moc and lumber too) and every option (``--rewrite``/``--summarize``, ``--plot``,
``--mean-chunk-chars``) works with either.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from metachunk.chunking.pipeline import ChunkConfig
from metachunk.chunking.shards import (
    DOCS_PER_SHARD,
    ShardedOutput,
    ShardPlan,
    ShardWorker,
    chunk_shard,
    default_workers,
    distributed_rank,
    is_dataset_dir,
    manifest_head,
    model_fingerprints,
    reads,
    recorded_config,
    replacement_dir,
    replacing_dir,
    run_local,
    run_ray,
    source_of,
)

from metachunk import config, stopping
from metachunk.artifacts import (
    RUN_LOG,
    SCHEMA_VERSION,
    InputError,
    OutputPair,
    append_run_log,
    jsonl_line,
    replace_dir,
    write_bytes,
)
from metachunk.command import Reads, Result
from metachunk.sources import DocumentSource, finish_rejects, rejects_path, skipped_exit

CONFIG = ChunkConfig


# ---- a run: one file, or a folder of shards -------------------------------------------------------


def fit_length(worker: ShardWorker, cfg, source: DocumentSource, goal: float, progress: bool):
    """``--mean-chunk-chars``: every document segmented (held in memory), then the one
    ``target_len`` whose chunks average ``goal`` characters (``cfg.target_len`` is set to it), and
    every document assembled at it. Returns ``(documents, length_fit)``."""
    from metachunk.chunking.pipeline import fit_target_len

    from metachunk.progress import bar as progress_bar

    chunker, group = worker.chunker, cfg.documents_per_call()
    segmented, docs = [], list(source.documents())
    with progress_bar(
        total=len(docs),
        unit="doc",
        desc=f"segment {cfg.method}",
        enabled=progress and not chunker.own_progress,
    ) as bar:
        for k in range(0, len(docs), group):
            batch = docs[k : k + group]
            segmented += chunker.segment([d.id for d in batch], [d.text for d in batch])
            bar.update(len(batch))
    length_fit = fit_target_len(chunker, segmented, goal, cfg.mean_chunk_chars_tolerance)
    cfg.target_len = length_fit["target_len"]
    for d in segmented:
        d.chunks = chunker.assemble(d, cfg.target_len)
    print(f"chunk: --target-len {cfg.target_len} gives a mean of {length_fit['mean_chunk_chars']} chars/chunk "
          f"for a goal of {length_fit['goal']} ({length_fit['tries']} tries"
          + ("" if length_fit["within_tolerance"] else f"; NOT within {cfg.mean_chunk_chars_tolerance:.0%}")
          + ")", file=sys.stderr)  # fmt: skip
    return segmented, length_fit


def chunk_corpus(cfg, progress: bool = True, restart_if_changed: bool = False) -> dict:
    """``metachunk chunk INPUT -o OUTPUT``: scan, plan, (resume,) chunk, finish; returns the run's
    manifest, with this attempt's run-log line under ``run``. ``-o FILE.jsonl`` is the one-shard
    plan, run here and written with ``FILE.meta.json`` as one pair; ``-o DIR`` is the folder of
    shards (`chunk_folder`). Every method and option works both ways.

    ``restart_if_changed``: a folder another run wrote is started again instead of refused (for a
    stage's own intermediate folder, such as ``data sample``'s ``OUT/ppl/``)."""
    from metachunk.chunking.pipeline import goal_mean_chars

    if cfg.input is None or cfg.output is None:
        raise InputError("command line", "usage: metachunk chunk INPUT -o OUTPUT.jsonl [options]")
    if Path(cfg.output).resolve() == Path(cfg.input).resolve():  # it would be replaced by its own chunks
        raise InputError(cfg.output, "-o is the input file; write the chunks to another file")
    goal = goal_mean_chars(cfg)
    if is_dataset_dir(cfg.output):
        return chunk_folder(cfg, goal, progress, restart_if_changed)
    return chunk_file(cfg, goal, progress)


def chunk_file(cfg, goal: float | None, progress: bool = True) -> dict:
    """The one-shard case: the output and ``OUTPUT.meta.json`` are replaced together or not at all
    (`OutputPair`); then the attempt's line in ``OUTPUT.runs.jsonl``."""
    from metachunk.progress import bar as progress_bar

    rejects = cfg.bad_rows.rejects(cfg.output)
    source = source_of(cfg, rejects)
    # Every line checked before any model loads: a bad line 9,000 should not cost a model load
    # and 8,999 documents of work. Texts are not kept; the run streams them again.
    index = source.scan(progress=progress)
    rejected = finish_rejects(rejects, "chunk")
    models = model_fingerprints(cfg)  # before any model loads, as a folder's manifest head
    plan = ShardPlan(index.documents, 1)
    started = time.perf_counter()
    worker = ShardWorker(cfg, index.documents, total_chars=index.chars, progress=progress)
    load_s = time.perf_counter() - started
    segmented, length_fit = (
        fit_length(worker, cfg, source, goal, progress) if goal is not None else (None, None)
    )
    with OutputPair(cfg.output) as pair:
        with progress_bar(
            total=index.documents,
            unit="doc",
            desc=f"chunk {cfg.method}",
            enabled=progress and not worker.chunker.own_progress,
        ) as bar:
            try:
                stats = chunk_shard(worker, cfg, source, index, plan, 0, lambda r: pair.file.write(jsonl_line(r)),
                                    bar.update, segmented)  # fmt: skip
            finally:
                worker.close()
        report = worker.report()  # before the clock stops: with no documents, a lazy model loads here
        seconds = time.perf_counter() - started
        load_s += worker.chunker.lazy_load_seconds  # a model loaded while the first group was prepared
        summary = {
            "documents": stats["documents"],
            "chunks": stats["chunks"],
            "mean_chunk_chars": round(stats["chunk_chars"] / stats["chunks"], 1) if stats["chunks"] else 0.0,
        }
        # What the file holds, as a folder's manifest says it: the settings that decide it (no runtime
        # ones), the models' fingerprints, every prompt's hash (the students' too). How this attempt
        # ran goes to the run log, so a rerun writes these bytes again.
        prompts = {
            **worker.chunker.prompt_sha256,
            **(worker.students.prompt_sha256 if worker.students else {}),
        }
        manifest = {"schema_version": SCHEMA_VERSION, "command": "chunk", "config": recorded_config(cfg),
                    "threshold": cfg.effective_threshold, "prompt_sha256": dict(sorted(prompts.items())),
                    "models": models, "summary": summary}  # fmt: skip
        if length_fit:
            manifest["length_fit"] = length_fit
        if rejected is not None:  # --on-bad-row skip: how many rows were left out, and where they went
            manifest["rejects"] = rejected
        run = {
            **config.runtime(cfg),
            "engine": "local",
            "workers": 1,
            "seconds": round(seconds, 2),
            # a method without a model spends them on its set-up (imports, a tokenizer), not a load
            ("model_load_seconds" if models else "setup_seconds"): round(load_s, 2),
            # the method's block (dtype, scoring; moc, lumber: windows, requests ...) and the students'
            **({"workers_report": [report]} if report else {}),
        }
        with stopping.deferred():  # the output and its run-log line land together (a paid lumber run's)
            pair.commit(manifest)
            append_run_log(cfg.output, run)
    print(f"{cfg.output}: {summary['documents']} documents, {summary['chunks']} chunks, mean "
          f"{summary['mean_chunk_chars']} chars/chunk, {seconds:.1f}s", file=sys.stderr)  # fmt: skip
    print_method_lines(worker.chunker.summary_lines(), report.get("students", {}))
    return {**manifest, "run": run}  # the caller's summary: this attempt's method counts too


def print_method_lines(lines: list[str], students: dict) -> None:
    for line in lines:
        print(line, file=sys.stderr)
    for task, run in students.items():
        print(f"  {task} ({run['model']}): '{run['field']}' on {run['chunks']} chunks, {run['new_tokens']} new "
              f"tokens, {run['seconds']:.1f}s", file=sys.stderr)  # fmt: skip


def chunk_folder(cfg, goal: float | None, progress: bool = True, restart_if_changed: bool = False) -> dict:
    """A dataset folder, shard by shard, resumable, on one of the engines. With ``--mean-chunk-chars``
    every document is segmented here first (in memory: an evaluation set, not a corpus) and the
    shards are written by this process."""
    from dataclasses import replace

    from metachunk.progress import bar as progress_bar

    rank, world = distributed_rank()
    if world > 1 and cfg.overwrite:
        raise InputError(
            "--overwrite", "every rank would clear the folder: run once without torchrun to clear it"
        )
    if world > 1 and goal is not None:
        raise InputError(
            "--mean-chunk-chars", "segments the whole input in one process: run it without torchrun"
        )
    # Under torchrun each rank is one worker; otherwise one per visible GPU on GPU, else 1.
    cfg = replace(cfg, workers=1 if world > 1 else (cfg.workers or default_workers(cfg.device)))
    if world > 1 and cfg.device in (None, "cuda"):
        import torch

        if torch.cuda.is_available():
            cfg = replace(cfg, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    started = time.perf_counter()
    rejects = cfg.bad_rows.rejects(cfg.output)
    source = source_of(cfg, rejects)
    index = source.scan(progress=progress)  # every file:line check, before any model loads
    scan_s = time.perf_counter() - started
    plan = ShardPlan(index.documents, cfg.shards or max(1, -(-index.documents // DOCS_PER_SHARD)))
    if cfg.method in ("ppl", "msp"):  # convert a preset once here, not in every worker at once
        from metachunk.models import check_causal_lm, check_device, pick_attention

        # What the workers' loads would refuse, refused here first: a worker's error reaches this process
        # as a broken pool, and after the manifest names the run.
        if cfg.device is not None:
            check_device(cfg.device)
        pick_attention(cfg.attn_implementation, str(cfg.device or "cpu"))
        check_causal_lm(cfg.model)
    head = manifest_head(cfg, source, index, plan)
    # A complete folder stays whole until its replacement is (ranks cannot agree on a swap: world 1 only).
    staging = (
        replacement_dir(cfg.output, head["fingerprint"], cfg.overwrite, restart_if_changed)
        if world == 1
        else None
    )
    if staging is not None:
        print(f"{cfg.output}: holds a complete run; this one is written in {staging} and replaces it once "
              "complete", file=sys.stderr)  # fmt: skip
        if rejects is not None:  # the complete folder keeps its own until the swap
            rejects.path = rejects_path(staging)
        output = ShardedOutput(staging, plan, cfg.output_format)
        done = output.open(head, overwrite=False, restart_if_changed=True)  # a stopped replacement resumes
    else:
        if (unfinished := replacing_dir(cfg.output)).is_dir():
            print(f"{cfg.output}: {unfinished} holds an unfinished replacement of this folder: "
                  "rerun the command that started it, or delete it", file=sys.stderr)  # fmt: skip
        output = ShardedOutput(cfg.output, plan, cfg.output_format)
        done = output.open(head, cfg.overwrite, restart_if_changed)
    rejected = finish_rejects(rejects, "chunk")
    if staging is not None and rejected and rejected.get("file"):
        rejected["file"] = str(rejects_path(cfg.output))  # where it is once swapped in
    mine = [i for i in range(plan.shards) if i % world == rank]
    pending = [i for i in mine if i not in done]
    output.remove_stale_temps(pending)
    skip_s = time.perf_counter() - started
    skipped_docs = sum(plan.bounds(i)[1] - plan.bounds(i)[0] for i in mine if i in done)
    todo_docs = sum(plan.bounds(i)[1] - plan.bounds(i)[0] for i in pending)
    who = f" (rank {rank} of {world})" if world > 1 else ""
    if done:
        print(f"{cfg.output}: resuming{who}: {len(done)} of {plan.shards} shards done, "
              f"{len(pending)} to chunk ({todo_docs} documents)", file=sys.stderr)  # fmt: skip
    worker = segmented = length_fit = None
    workers_asked = cfg.workers
    if goal is not None and pending:
        cfg = replace(cfg, workers=1)
        worker = ShardWorker(cfg, index.documents, total_chars=index.chars, progress=progress)
        segmented, length_fit = fit_length(worker, cfg, source, goal, progress)
    with progress_bar(total=todo_docs, unit="doc", desc=f"chunk {cfg.method}{who}", enabled=progress) as bar:
        try:
            if not pending:
                seconds, reports = {}, []
            elif cfg.engine == "ray" and worker is None:
                # the actors run the dtype the manifest records, whatever their own nodes would pick
                seconds, reports = run_ray(
                    replace(cfg, dtype=head["config"]["dtype"]), index, plan, output, pending, bar
                )
            else:
                seconds, reports = run_local(
                    cfg, source, index, plan, output, pending, bar, worker, segmented
                )
        except BaseException:
            # A signal can land inside a shard's write, after its temp file exists and before the writer's
            # cleanup is armed (inside tempfile.mkstemp): this run writes these shards and nothing else does.
            try:
                output.remove_stale_temps(pending, mine=True)
            finally:
                output.settle()
            raise
    # the workers that ran: no more than the pending shards, and one where a length fit chunked in-process
    workers_ran = 0 if not pending else 1 if worker is not None else min(cfg.workers, len(pending))
    run = {
        "engine": cfg.engine if world == 1 else f"torchrun ({world} ranks)",
        "workers": workers_ran,
        "workers_asked": workers_asked,
        "threads_per_worker": cfg.threads_per_worker,
        "streams": cfg.streams,
        "device": cfg.device,
        "seconds": round(time.perf_counter() - started, 2),
        "scan_seconds": round(scan_s, 2),
        "resume_check_seconds": round(skip_s, 2),
        "shards_skipped": len(mine) - len(pending),
        "documents_skipped": skipped_docs,
        "documents_chunked": todo_docs,
        "shard_seconds": {f"{i:05d}": round(s, 2) for i, s in sorted(seconds.items())},
        # each worker's method and students blocks (moc, lumber: windows, requests, fallbacks ...)
        **({"workers_report": reports} if any(reports) else {}),
    }
    manifest = output.finish(run, {"length_fit": length_fit, "rejects": rejected})
    if staging is not None and manifest["complete"]:
        swap_in(staging, cfg.output, rejects is not None)
    state = (
        "complete"
        if manifest["complete"]
        else f"{len(manifest['shards']['done'])} of {plan.shards} shards done"
    )
    summary = manifest.get("summary", {})
    print(
        f"{cfg.output}: {plan.shards} shards, {state}; this run{who} chunked {todo_docs} documents "
        f"({run['shards_skipped']} shards skipped) in {run['seconds']:.1f}s"
        + (f"; {summary['documents']} documents, {summary['chunks']} chunks, mean "
           f"{summary['mean_chunk_chars']} chars/chunk" if summary else ""),
        file=sys.stderr,
    )  # fmt: skip
    for report in reports:
        print_method_lines([], report.get("students", {}))
    return {**manifest, "run": run}  # the caller's summary: this attempt's method counts too


def swap_in(staging: Path, output: str | Path, with_rejects: bool) -> None:
    """Put a complete replacement at ``output``: the folder's earlier run log goes first in the new
    one (it is the folder's history), and the replacement's rejects file beside it."""
    earlier = Path(output) / RUN_LOG
    if earlier.is_file():
        history = earlier.read_bytes()
        history = history[: history.rfind(b"\n") + 1]  # a line a kill cut short would join the next
        log = staging / RUN_LOG
        write_bytes(log, history + (log.read_bytes() if log.is_file() else b""))
    replace_dir(staging, output)
    if with_rejects:
        if rejects_path(staging).is_file():
            os.replace(rejects_path(staging), rejects_path(output))
        else:  # this run left no row out
            rejects_path(output).unlink(missing_ok=True)


def run_sharded(cfg, progress: bool = True, restart_if_changed: bool = False) -> dict:
    """A dataset folder's run (``data sample``'s intermediate PPL chunks): `chunk_folder`."""
    from metachunk.chunking.pipeline import goal_mean_chars

    if not is_dataset_dir(cfg.output):
        raise InputError(cfg.output, "expected a folder for the shards")
    return chunk_folder(cfg, goal_mean_chars(cfg), progress, restart_if_changed)


def run(cfg: ChunkConfig) -> Result:
    manifest = chunk_corpus(cfg)
    rejected = manifest.get("rejects")
    return Result(skipped_exit(rejected), summary(manifest), rejects=rejected)


def summary(manifest: dict) -> dict:
    """A run's counts, from the manifest it wrote and its run log's line (``manifest["run"]``):
    documents, chunks and mean length; the fitted ``target_len``; MoC's windows, PPL fallbacks and
    stand-ins; what the students added."""
    out = {
        k: v
        for k, v in manifest.get("summary", {}).items()
        if k in ("documents", "chunks", "mean_chunk_chars")
    }
    rejects = manifest.get("rejects")
    if rejects:
        out["rejected_rows"] = rejects["rows"]
    blocks = manifest.get("run", {}).get("workers_report") or [{}]  # one per worker that reported
    fit = manifest.get("length_fit")
    if fit:
        out["target_len"] = fit["target_len"]
    mocs = [b["moc"] for b in blocks if "moc" in b]
    if mocs:
        out.update(windows=sum(m.get("windows") or 0 for m in mocs),
                   ppl_fallbacks=sum((m.get("fallback") or {}).get("windows") or 0 for m in mocs),
                   stand_ins=len(mocs[0].get("stand_ins") or {}))  # fmt: skip
    for task, run in (blocks[0].get("students") or {}).items():
        out[task] = (
            f"'{run.get('field')}' on {sum(b['students'][task].get('chunks') or 0 for b in blocks)} chunks"
        )
    return out


def inputs(cfg: ChunkConfig) -> Reads:
    return reads(cfg)


def teachers(cfg: ChunkConfig) -> dict[str, str]:
    """LumberChunker's teacher blocks' model names (the other methods ask no teacher)."""
    if cfg.method != "lumber":
        return {}
    return {name: str(block.get("model")) for name, block in (cfg.lumber.teachers or {}).items()}


def served(config: dict, teacher) -> dict:
    """The recipe with LumberChunker's teacher blocks (flat ``teachers:`` or under ``lumber:``)
    pointed at a served local teacher."""
    from metachunk.teacher import point_at

    config = dict(config)
    if config.get("teachers"):
        config["teachers"] = {k: point_at(b, teacher) for k, b in config["teachers"].items()}
    if (config.get("lumber") or {}).get("teachers"):
        blocks = config["lumber"]["teachers"]
        config["lumber"] = {
            **config["lumber"],
            "teachers": {k: point_at(b, teacher) for k, b in blocks.items()},
        }
    return config


def outputs(cfg: ChunkConfig) -> list:
    """The chunks, the score plots' folder, and the rows ``--on-bad-row skip`` left out."""
    return [cfg.output, *([cfg.plot] if cfg.plot else []), *cfg.bad_rows.outputs(cfg.output)]
