"""Corpus-scale chunking: one config over a whole corpus, into a dataset folder, shard by shard.

``metachunk chunk CORPUS -o DIR/`` writes:

```
DIR/train-00000-of-00008.jsonl      (or .parquet with --output-format parquet)
...
DIR/manifest.json                   config, θ, prompt hashes, fingerprints, shards done, counts
DIR/.shards-done.jsonl              the shards finished since the manifest was last written (hidden)
DIR/runs.jsonl                      how each finished attempt ran: engine, workers, device, seconds
```

The shard names follow the ``datasets`` split convention, so ``load_dataset("json", data_dir=DIR)``
reads the shards and leaves ``manifest.json`` alone (with ``part-*`` names it would try to read the
manifest as data).

**Which document goes where.** ``--shards N`` is fixed up front (default: one shard per
`DOCS_PER_SHARD` documents). Shard ``i`` holds the documents at input positions
``floor(i*n/N)`` to ``floor((i+1)*n/N) - 1``: contiguous, so the shards read in name order are the
input in order. The assignment depends on the input alone, never on how many workers run.

**Resume.** Each shard is written to a temp file and renamed in; only then is it entered (with its
sha256) in the folder's journal of finished shards, one line appended under a file lock, which the
manifest's ``shards.done`` takes in often at first and then ever more rarely (`ShardedOutput`), so
a run of many thousands of shards does not rewrite a growing manifest after each. A rerun of the
same command checks the manifest's fingerprint (config, input bytes, model files, prompts,
metachunk version), keeps every done shard, of the manifest or the journal, whose file still has
its hash, and chunks the rest. So a kill -9 costs at most the shards in flight: one per worker. A changed config, model or
input is refused (``--overwrite`` starts again). The manifest says what the folder holds, never how
an attempt ran (that goes to ``runs.jsonl``), so a rerun or a resume leaves it byte-identical.

**Replacing a complete folder.** A run that replaces a complete one (``--overwrite``, or ``data
sample``'s changed config) is written beside it, in ``.NAME.replacing`` (`replacement_dir`), and
swapped in by `metachunk.artifacts.replace_dir` once complete: until then the folder keeps the
good run, and a rerun of the replacing command resumes the replacement.

**Engines**, all running `chunk_shard` on shards and `ShardedOutput.commit` on the
results, so they write the same bytes:

* ``local`` (default): ``--workers N`` processes (spawned, each with its own model, threads and
  device; on a GPU machine one per visible GPU by default), or this process when N is 1;
* under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE`` > 1): rank r takes shards i with
  ``i % world_size == r``; the last rank to finish writes the summary;
* ``ray``: a Ray Data ``map_batches`` stage over the pending shard numbers with an actor pool
  (``ActorPoolStrategy(size=--workers)``, ``num_cpus`` = --threads-per-worker, ``num_gpus`` 1 on GPU); the
  driver writes what the actors return. The actors read the input themselves, so on a cluster it
  must be on storage every node sees.

Runtime settings (engine, workers, threads, device) are not part of the fingerprint: a resumed run
may use more machines. Different hardware (or thread counts) may change scores in the last float
digits, so a resume on other hardware is not byte-identical; ``runs.jsonl`` says what ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.overlap import overlapped

from metachunk import config, stopping
from metachunk.artifacts import (
    SCHEMA_VERSION,
    InputError,
    append_record,
    append_run_log,
    file_sha256,
    json_sha256,
    jsonl_line,
    read_json,
    read_records_appended,
    staged_bytes,
    temp_writer_gone,
    write_bytes,
    write_json,
)
from metachunk.command import Reads
from metachunk.sources import MAX_ROW_BYTES, DocumentSource, Rejects, SourceIndex, read_records

DOCS_PER_SHARD = 256
MANIFEST = "manifest.json"
# The shards finished since the manifest was last written (`ShardedOutput`); hidden, so ``datasets``,
# a folder read as a corpus and `metachunk run`'s digest of the folder pass it by.
JOURNAL = ".shards-done.jsonl"
# Where a run reads from and writes to: the input is fingerprinted by its bytes, and a folder may move.
PLACE_FIELDS = ("input", "output")


def source_of(cfg, rejects: Rejects | None = None) -> DocumentSource:
    """The run's input. With ``--on-bad-row skip`` bad rows go to ``rejects`` (a worker, which reads
    ranges the driver already checked, gets a sink of its own: the driver writes the file)."""
    if cfg.bad_rows.on_bad_row == "skip" and rejects is None:
        rejects = Rejects(None)
    return DocumentSource(cfg.input, cfg.input_format, cfg.text_field, cfg.id_field, rejects=rejects,
                          max_row_bytes=cfg.bad_rows.max_row_bytes)  # fmt: skip


def is_dataset_dir(output: str | Path) -> bool:
    """``-o FILE.jsonl`` is one file; ``-o DIR/``, a name without a suffix or an existing folder is
    a dataset folder; anything else (``chunks.json``, ``x.parquet``) is refused as ambiguous."""
    text, path = str(output), Path(output)
    if text.endswith(".jsonl") and not path.is_dir():
        return False
    if text.endswith(("/", os.sep)) or path.is_dir() or not path.suffix:
        if path.exists() and not path.is_dir():  # /dev/null, or a file named without a suffix
            raise InputError(output, "-o without a .jsonl suffix names a folder, and this is a file: "
                             "give FILE.jsonl, or a folder")  # fmt: skip
        return True
    raise InputError(output, "-o takes FILE.jsonl (one file) or a folder (DIR/: a sharded dataset)")


@dataclass(frozen=True)
class ShardPlan:
    documents: int
    shards: int

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.documents // self.shards, (i + 1) * self.documents // self.shards

    def name(self, i: int, fmt: str) -> str:
        return f"train-{i:05d}-of-{self.shards:05d}.{fmt}"


# ---- the unit of work ---------------------------------------------------------------------------


def _parquet_schema(emit_sentences: bool, student_fields: tuple[str, ...] = ()):
    """The shard's columns; ``student_fields`` (``rewritten``, ``summary``: what ``--rewrite`` and
    ``--summarize`` add to each chunk) join the chunk struct. Left out, pyarrow dropped them unsaid."""
    import pyarrow as pa

    chunk = pa.struct([("text", pa.string()), ("start", pa.int64()), ("end", pa.int64()),
                       *((name, pa.string()) for name in student_fields)])  # fmt: skip
    fields = [("schema_version", pa.int64()), ("id", pa.string()), ("method", pa.string()),
              ("chunks", pa.list_(chunk))]  # fmt: skip
    if emit_sentences:
        sentence = pa.struct([("start", pa.int64()), ("end", pa.int64()), ("score", pa.float64())])
        fields.append(("sentences", pa.list_(sentence)))
    return pa.schema(fields)


class ShardWorker:
    """What one worker holds, loaded once: the method's [`Chunker`][metachunk.chunking.pipeline.Chunker]
    and the students (``--rewrite``/``--summarize``: their model dirs are checked before any model
    loads). ``documents`` and ``total_chars`` size the students' and the method's own progress."""

    def __init__(self, cfg, documents: int, total_chars: int | None = None, progress: bool = False):
        from metachunk.chunking.pipeline import Chunker
        from metachunk.chunking.students import ChunkStudents

        self.cfg = cfg
        self.students = ChunkStudents.from_config(cfg, expected_docs=documents)
        # A run that reads ahead of the model loads it once its first group is being prepared (chunk_shard).
        self.chunker = Chunker(
            cfg, total_chars=total_chars, progress=progress, lazy_model=cfg.prefetch_depth() > 0
        )

    def close(self) -> None:
        self.chunker.close()
        if self.students:
            self.students.close()

    def report(self) -> dict:
        """The method's own block (moc, lumber) and the students', as a run's log records them."""
        out = {"students": self.students.manifest()} if self.students else {}
        return {**out, **self.chunker.manifest()}


def _safe_name(doc_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in doc_id)[:80]


def chunk_shard(worker: ShardWorker, cfg, source: DocumentSource, index: SourceIndex, plan: ShardPlan, i: int,
                write: Callable[[dict], None], on_documents: Callable[[int], None] | None = None,
                segmented: list | None = None) -> dict:  # fmt: skip
    """Shard ``i``'s records, each passed to ``write``; returns its counts. Documents are chunked in
    groups that start at the shard's first document, so the records depend on the shard alone (not
    on who runs it, or after which other shard). ``segmented``: every document of the run already
    cut and assembled (``--mean-chunk-chars``), by input position."""
    from metachunk.chunking.plots import plot_profile

    start, stop = plan.bounds(i)
    group = cfg.documents_per_call()  # documents scored together; bounds memory for huge corpora
    stats = {"documents": stop - start, "chunks": 0, "chunk_chars": 0}
    position = start

    def with_students(chunked) -> tuple[list, list]:  # each chunk's "rewritten" and "summary"
        return chunked, worker.students.apply(chunked) if worker.students else [[] for _ in chunked]

    def emit(chunked_with_students) -> None:
        nonlocal position
        chunked, added = chunked_with_students
        for doc, fields in zip(chunked, added):
            record = doc.to_json(cfg.method, cfg.emit_sentences)
            for chunk, extra in zip(record["chunks"], fields):  # "rewritten", "summary"
                chunk.update(extra)
            write({"schema_version": SCHEMA_VERSION, **record})
            stats["chunks"] += len(doc.chunks)
            stats["chunk_chars"] += sum(len(c.text) for c in doc.chunks)
            if cfg.plot and doc.text.strip():  # a blank document has nothing to plot
                # The input position keeps names unique when two ids sanitise to the same string.
                png = Path(cfg.plot) / f"{position:05d}_{_safe_name(doc.id)}.png"
                plot_profile(png, doc, cfg.method, cfg.effective_threshold)
            position += 1
        if on_documents:
            on_documents(len(chunked))

    if segmented is not None:
        for k in range(start, stop, group):
            emit(with_students(segmented[k : min(k + group, stop)]))
        return stats

    chunker = worker.chunker

    def prepare(docs):
        return chunker.prepare([d.id for d in docs], [d.text for d in docs])

    def assemble(segmented_docs):  # merged to the target length: the chunks a record holds
        for d in segmented_docs:
            d.chunks = chunker.assemble(d, cfg.target_len)
        return segmented_docs

    # Read, split and tokenized ahead of the model; merged and written behind it (chunking/overlap.py).
    # The students generate on the merged chunks with their own models: in the thread that drives
    # the device, so a stop never waits for a group's generation in another thread.
    if worker.students:
        score, finish = lambda prepared: with_students(assemble(chunker.decide(prepared))), emit
    else:
        score, finish = chunker.decide, lambda decided: emit(with_students(assemble(decided)))
    documents = source.documents(start, stop, index)
    groups = iter(lambda: list(itertools.islice(documents, group)), [])
    # on_start: the model loads (if it has not) while the thread ahead prepares the first group.
    overlapped(groups, prepare, score, finish, depth=cfg.prefetch_depth(), on_start=chunker.load_model)
    return stats


def shard_bytes(worker: ShardWorker, cfg, source, index, plan, i, on_documents=None, segmented=None):
    """Shard ``i`` as its file's bytes (jsonl, or parquet with ``--output-format parquet``) and counts."""
    records: list[dict] = []
    stats = chunk_shard(worker, cfg, source, index, plan, i, records.append, on_documents, segmented)
    if cfg.output_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        from metachunk.chunking.students import FIELDS

        students = tuple(FIELDS[task] for task, flag in (("rewrite", "rewrite"), ("summary", "summarize"))
                         if getattr(cfg.students, flag))  # fmt: skip
        pq.write_table(
            pa.Table.from_pylist(records, schema=_parquet_schema(cfg.emit_sentences, students)), buf
        )
        return buf.getvalue(), stats
    return "".join(jsonl_line(r) for r in records).encode("utf-8"), stats


# ---- the output folder --------------------------------------------------------------------------


class ShardedOutput:
    """The dataset folder: its shards, and the manifest that says which are done.

    A finished shard is entered in a journal (`JOURNAL`, one appended line), not straight into the
    manifest: rewriting a manifest that lists every done shard after each shard would cost time and
    bytes that grow with the square of the shards (a 10M-document corpus makes ~39K shards and a ~8 MB
    manifest). The manifest takes in the journal when the shards since its last rewrite reach a
    sixteenth of those it lists (so after each of the first 16, then ever more rarely: the bytes
    written stay a small multiple of the final manifest's), when a run opens or finishes the folder,
    and on a resume, which reads both. The journal's first line names the run's fingerprint: a run
    with another config that takes the folder over starts a new one."""

    def __init__(self, root: str | Path, plan: ShardPlan, fmt: str):
        from filelock import FileLock

        self.root, self.plan, self.fmt = Path(root), plan, fmt
        self.manifest_path = self.root / MANIFEST
        self.journal = self.root / JOURNAL
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.root / f".{MANIFEST}.lock"))  # hidden: datasets skips it
        self.fingerprint = None  # this run's, once `open` has written its manifest
        self.listed = 0  # shards the manifest listed when this process last wrote it
        self.unlisted = 0  # shards this process entered in the journal since

    def path(self, i: int) -> Path:
        return self.root / self.plan.name(i, self.fmt)

    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return read_json(self.manifest_path)
        except InputError as e:  # not UTF-8, not JSON, not an object
            raise InputError(e.path, f"{e.reason}; use --overwrite to start again", e.line) from None

    def journal_owner(self) -> str | None:
        """The fingerprint on the journal's first line (written whole, by a rename), or None."""
        try:
            with open(self.journal, "rb") as f:
                return json.loads(f.readline()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            return None

    def write_manifest(self, manifest: dict) -> None:
        """The manifest, then a journal holding only its header: every shard is in the manifest now.
        A kill between the two leaves the old journal, whose shards the manifest already lists."""
        write_json(self.manifest_path, manifest)
        write_bytes(self.journal, jsonl_line({"fingerprint": manifest["fingerprint"]}).encode())
        self.listed, self.unlisted = len(manifest["shards"]["done"]), 0

    def open(self, head: dict, overwrite: bool, restart_if_changed: bool = False) -> set[int]:
        """Start or resume: returns the shards already done. ``head`` is the manifest's fixed part
        (config, fingerprints, input, shards plan); a different fingerprint is refused once a shard
        is done (before that, the run starts again)."""
        with self.lock:
            self.remove_bookkeeping_temps()
            previous = self.read_manifest()
            if previous is None and any(
                p.name not in (f".{MANIFEST}.lock", JOURNAL) for p in self.root.iterdir()
            ):
                if not overwrite:
                    raise InputError(
                        self.root, "exists and holds no manifest.json: not a metachunk chunk folder "
                        "(use --overwrite to replace its shards, or another -o)"
                    )  # fmt: skip
            if previous is not None:
                previous = with_journal(previous, self.journal)
            if previous is not None and previous.get("fingerprint") != head["fingerprint"]:
                # A run that stopped before its first shard (its model refused, say) leaves nothing to keep.
                overwrite = overwrite or restart_if_changed or not previous.get("shards", {}).get("done")
                if not overwrite:
                    changed = [k for k, v in head["fingerprint_of"].items()
                               if previous.get("fingerprint_of", {}).get(k) != v]  # fmt: skip
                    if "config" in changed:  # which fields: a dtype that auto picked differently here, say
                        before, now = previous.get("config", {}), head["config"]
                        fields = [f"{k} {before.get(k)!r} -> {now.get(k)!r}"
                                  for k in sorted(before.keys() | now.keys()) if before.get(k) != now.get(k)]  # fmt: skip
                        changed[changed.index("config")] = (
                            f"config: {', '.join(fields)}" if fields else "config"
                        )
                    raise InputError(
                        self.manifest_path,
                        f"this folder was written by another run (changed: {', '.join(changed) or 'format'}); "
                        "rerun with --overwrite to start again, or write to another -o",
                    )
                previous = None
            if overwrite:
                previous = None
                for p in self.root.glob("train-*-of-*.*"):
                    p.unlink()
                # the journal first: a run still writing here stops at its next shard, even if this one
                # is killed before it writes its own
                self.journal.unlink(missing_ok=True)
                self.manifest_path.unlink(missing_ok=True)
            done = {}
            if previous is not None:
                for key, entry in previous["shards"]["done"].items():
                    path = self.root / entry["file"]
                    if path.is_file() and file_sha256(path) == entry["sha256"]:
                        done[key] = entry
            self.fingerprint = head["fingerprint"]
            if previous is not None and previous.get("complete") and len(done) == self.plan.shards:
                return {int(k) for k in done}  # whole already: a reader alongside never sees it incomplete
            manifest = {**head, "shards": {**head["shards"], "done": done}, "complete": False}
            # what the done shards were chunked with (a manifest written before runs.jsonl kept it in "run")
            fit = (previous or {}).get("length_fit") or (previous or {}).get("run", {}).get("length_fit")
            if fit:
                manifest["length_fit"] = fit
            self.write_manifest(manifest)
            return {int(k) for k in done}

    def current_manifest(self) -> dict:
        """The manifest with its journal, still this run's: another run on the folder with another
        config (started while this one loaded its model, before a shard was done) has replaced it, and
        this one stops rather than enter its shards there. Called under the lock."""
        manifest = self.read_manifest()
        if manifest is None or manifest.get("fingerprint") != self.fingerprint:
            raise self.taken_over()
        return with_journal(manifest, self.journal)

    def taken_over(self) -> InputError:
        return InputError(
            self.manifest_path, "another run with another config took this folder over while this one "
            "ran; this one stops (its shards are not entered)"
        )  # fmt: skip

    def remove_stale_temps(self, shards, mine: bool = False) -> None:
        """Temp files these shards' writers left and no longer write: a killed run's, or with ``mine``
        this process's own (a stop inside a write). A live run's (the same command started twice) is
        left alone. One pass over the folder, whatever the number of shards."""
        names = {self.plan.name(i, self.fmt) for i in shards}
        for p in self.root.glob(".train-*.tmp"):
            name, _, tail = p.name[1:].partition(f".{self.fmt}.")
            if f"{name}.{self.fmt}" in names and temp_writer_gone(tail, mine):
                p.unlink(missing_ok=True)

    def commit(self, i: int, data: bytes, stats: dict) -> None:
        """The shard's file, written aside, renamed in, then its entry in the journal (and, when due,
        the manifest). The rename waits for the lock and the check that the folder is still this
        run's: a run another config took the folder from never replaces that run's shard."""
        path = self.path(i)
        entry = {"file": path.name, **stats, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with staged_bytes(path, data) as rename_in, self.lock:
            if self.journal_owner() != self.fingerprint:
                raise self.taken_over()
            rename_in()
            append_record(self.journal, {"shard": f"{i:05d}", "entry": entry})
            self.unlisted += 1
            if self.unlisted * 16 >= self.listed:
                self.write_manifest(self.current_manifest())

    def remove_bookkeeping_temps(self) -> None:
        """Every manifest and journal write holds the lock: a temp file of theirs found by a holder of
        the lock is a killed writer's, or this process's own, cut short by a stop. Called under the lock."""
        for stale in (*self.root.glob(f".{MANIFEST}.*.tmp"), *self.root.glob(f".{JOURNAL}.*.tmp")):
            stale.unlink(missing_ok=True)

    def settle(self) -> None:
        """A stopped run's last act (SIGTERM, Ctrl-C, an error): the manifest takes the journal in, so
        it lists every shard done, and a manifest or journal write the stop cut short leaves no temp
        file. Best effort: a kill -9 cannot, and a resume reads the journal anyway."""
        with contextlib.suppress(Exception), self.lock.acquire(timeout=10):  # a stop does not wait long
            self.remove_bookkeeping_temps()
            if self.fingerprint is not None and self.journal_owner() == self.fingerprint and self.unlisted:
                self.write_manifest(self.current_manifest())

    def finish(self, run: dict, made: dict) -> dict:
        """Enters ``made`` (the fitted ``length_fit``, the ``rejects``: what the output is, set when not
        None) and, when every shard is done, the summary; appends ``run`` (how this attempt went) to
        the run log."""
        with self.lock:
            manifest = self.current_manifest()
            manifest.update({k: v for k, v in made.items() if v is not None})
            done = manifest["shards"]["done"]
            if len(done) == self.plan.shards:
                n_chunks = sum(e["chunks"] for e in done.values())
                chars = sum(e["chunk_chars"] for e in done.values())
                manifest["summary"] = {
                    "documents": sum(e["documents"] for e in done.values()),
                    "chunks": n_chunks,
                    "mean_chunk_chars": round(chars / n_chunks, 1) if n_chunks else 0.0,
                }
                manifest["complete"] = True
            with stopping.deferred():  # the manifest and its run-log line land together
                self.write_manifest(manifest)
                append_run_log(self.root, run)
            return manifest


def replacing_dir(root: str | Path) -> Path:
    """``.NAME.replacing`` beside the folder ``root``: where a run that replaces it writes."""
    whole = Path(os.path.abspath(root))  # `-o .` has no name of its own
    return whole.parent / f".{whole.name}.replacing"


def replacement_dir(
    root: str | Path, fingerprint: str, overwrite: bool, restart_if_changed: bool
) -> Path | None:
    """Where a run writes that replaces the complete run in ``root``: `replacing_dir`, swapped in once
    complete, so that a stop part-way leaves the good folder as it was. None when the run writes in
    ``root`` itself: nothing complete is there, the same run is (a resume), the run may not replace it
    (`ShardedOutput.open` then refuses), or ``root`` holds the working directory (``-o .``), which
    cannot be renamed away."""
    staging = replacing_dir(root)
    if Path.cwd().resolve().is_relative_to(Path(os.path.abspath(root)).resolve()):
        return None
    try:
        previous = read_json(Path(root) / MANIFEST)
    except InputError:  # none, or unreadable: nothing complete to keep
        # a swap stopped between its two renames left no folder and a complete replacement: finish it
        return staging if not Path(root).exists() and (staging / MANIFEST).is_file() else None
    if previous.get("complete") is not True:
        return None
    changed = previous.get("fingerprint") != fingerprint
    return staging if overwrite or (restart_if_changed and changed) else None


def with_journal(manifest: dict, journal: Path) -> dict:
    """``manifest`` with the shards its run's journal lists and it does not yet."""
    records = read_records_appended(journal)
    if records and records[0].get("fingerprint") == manifest.get("fingerprint"):
        done = manifest["shards"]["done"]
        done.update((r["shard"], r["entry"]) for r in records[1:] if "shard" in r)
        manifest["shards"]["done"] = dict(sorted(done.items()))
    return manifest


def shards_done(root: str | Path) -> dict:
    """The shards a chunk folder holds done, by number: its manifest's and its journal's (the two
    differ while a run is on, or after a kill -9). {} when it has no manifest yet."""
    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return with_journal(manifest, Path(root) / JOURNAL)["shards"]["done"]


# ---- what a run reads, and its fingerprint -------------------------------------------------------


def reads(cfg) -> Reads:
    """Everything a chunk run reads besides its config: the input (and the run whose mean chunk
    length it matches, and LumberChunker's teacher YAML), the models its method and students load,
    and their prompt and schema files. ``metachunk chunk``'s ``inputs`` (the regeneration runner's
    fingerprint) and a folder's resume fingerprint both use it."""
    from metachunk.prompts import prompt_files

    models, heads = [], []
    if cfg.method in ("ppl", "msp") or (cfg.len_unit == "token" and cfg.method != "lumber"):
        models.append(cfg.model)
    if cfg.method == "semantic":
        models.append(cfg.embedder)
    if cfg.method == "msp":
        heads.append(f"msp_{cfg.msp_prompt}.")
    if cfg.method == "moc":
        moc = cfg.moc
        models += [
            moc.router,
            *(e.strip() for e in (moc.experts or "").split(",")),
            moc.stand_in,
            moc.fallback_model,
        ]
        heads.append("moc_")
    if cfg.method == "lumber":
        heads.append("lumber.")
    st = cfg.students
    for task, model in (("rewrite", st.rewrite), ("summary", st.summarize)):
        if model:
            models.append(model)
            heads.append(f"student_{task}.")
    if (st.rewrite or st.summarize) and st.context == "related":
        models.append(cfg.embedder)
    paths = [
        cfg.input,
        cfg.mean_chunk_chars_of,
        cfg.lumber.teacher_config if cfg.method == "lumber" else None,
    ]
    return Reads.of(
        paths=paths, models=models, prompts=prompt_files("metachunk.chunking", *heads) if heads else []
    )


def model_fingerprints(cfg) -> dict:
    """The fingerprint of every model a chunk run reads (`reads`), by name: what a file's meta and a
    folder's manifest record. A model that cannot be found stops the run here, before any loads."""
    from metachunk.models import fingerprint, is_model

    return {name: fingerprint(name) for name in reads(cfg).models if is_model(name)}


def recorded_config(cfg) -> dict:
    """The config a chunk run's meta and manifest record, and its resume compares: `config.computed`,
    with ``dtype: auto`` replaced by what auto picks for the run's language models on this machine
    (`models.pick_dtype`: bfloat16 or float32 cut different chunks), so two machines that would
    chunk differently never record one config, and a folder is not resumed in another dtype."""
    computed = config.computed(cfg)
    loads_lm = cfg.method in ("ppl", "msp", "moc") or cfg.students.rewrite or cfg.students.summarize
    if cfg.dtype == "auto" and loads_lm:
        from metachunk.models import default_device, pick_dtype

        computed["dtype"] = pick_dtype("auto", str(cfg.device or default_device()))[0]
    # What the run does not read is not its config: a fixed-size folder had been refused a resume when
    # only --model (or --msp-prompt) differed. The model counts where the run reads it (`reads`: PPL and
    # MSP, or the tokenizer of --len-unit token).
    students = cfg.students.rewrite or cfg.students.summarize
    unused = {k for k, unread in (("model", cfg.model not in reads(cfg).models),
                                  ("msp_mode", cfg.method != "msp"), ("msp_prompt", cfg.method != "msp"),
                                  ("embedder", cfg.method != "semantic"
                                   and not (students and cfg.students.context == "related"))) if unread}  # fmt: skip
    for method in ("moc", "lumber"):
        if cfg.method != method:
            unused |= config.block_keys(type(cfg), method)
    return {k: v for k, v in computed.items() if k not in unused}


def manifest_head(cfg, source: DocumentSource, index: SourceIndex, plan: ShardPlan) -> dict:
    """The deterministic part of the manifest, with the fingerprint that resume compares."""
    from metachunk import __version__
    from metachunk.prompts import file_hashes

    computed = {k: v for k, v in recorded_config(cfg).items() if k not in PLACE_FIELDS}
    models = model_fingerprints(cfg)
    prompts = file_hashes(reads(cfg).prompts)
    fingerprint_of = {
        "config": json_sha256(computed),
        "input": index.sha256,
        "models": json_sha256(models),
        "prompts": json_sha256(prompts),
        "metachunk": __version__,
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "chunk",
        "fingerprint": json_sha256(fingerprint_of),
        "fingerprint_of": fingerprint_of,
        "config": computed,
        "threshold": cfg.effective_threshold,
        "prompt_sha256": prompts,
        "models": models,
        "input": {
            **source.describe(),
            "documents": index.documents,
            "chars": index.chars,
            "sha256": index.sha256,
        },  # fmt: skip
        "shards": {
            "count": plan.shards,
            "format": cfg.output_format,
            "assignment": "contiguous input positions: shard i holds documents floor(i*n/N) .. floor((i+1)*n/N)-1",
        },
    }


# ---- engines ------------------------------------------------------------------------------------


def default_workers(device: str | None) -> int:
    """One per visible GPU when running on GPU, else 1."""
    if device is not None and not str(device).startswith("cuda"):
        return 1
    with contextlib.suppress(ImportError):
        import torch

        if torch.cuda.is_available() and (device is None or device == "cuda"):
            return torch.cuda.device_count()
    return 1


def worker_devices(device: str | None, workers: int) -> list[str | None]:
    """Worker k's device: ``cuda:k mod #GPUs`` on GPU (each pinned), else as configured."""
    if workers > 1 and device in (None, "cuda"):
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return [f"cuda:{k % n}" for k in range(workers)]
    return [device] * workers


def _set_threads(threads: int | None) -> None:
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
        import torch

        torch.set_num_threads(threads)


# A spawned worker's state, set by _init_worker; its ShardWorker is built by its first shard, so that a load's
# error (a model that is no causal LM) reaches the run as itself: one raised in an initializer breaks the pool.
_WORKER: dict = {}


def _init_worker(cfg, index_json: dict, plan: ShardPlan, slots, progress) -> None:
    import multiprocessing
    from dataclasses import replace

    from metachunk.stopping import die_with_parent

    # A SIGKILLed run leaves no worker behind, even one killed while this worker was starting.
    die_with_parent(multiprocessing.parent_process().pid)
    slot, device, threads = slots.get()
    _set_threads(threads)
    cfg = replace(cfg, device=device)
    _WORKER.update(cfg=cfg, plan=plan, progress=progress, slot=slot,
                   source=source_of(cfg),
                   index=SourceIndex.from_json(index_json))  # fmt: skip


def _worker_shard(i: int) -> tuple[int, bytes, dict, float, int, dict]:
    w = _WORKER
    if "worker" not in w:
        w["worker"] = ShardWorker(w["cfg"], w["plan"].documents)
    started = time.perf_counter()
    data, stats = shard_bytes(w["worker"], w["cfg"], w["source"], w["index"], w["plan"], i,
                              on_documents=w["progress"].put)  # fmt: skip
    return i, data, stats, time.perf_counter() - started, w["slot"], w["worker"].report()


def run_local(cfg, source, index, plan, output: ShardedOutput, pending: list[int], bar,
              worker: ShardWorker | None = None, segmented: list | None = None) -> tuple[dict, list]:  # fmt: skip
    """The shards in ``pending``, by ``cfg.workers`` processes (this one when 1, or when ``worker``
    is given: the run's own, which holds ``segmented``). Returns each shard's seconds and each
    worker's report (`ShardWorker.report`)."""
    seconds: dict[int, float] = {}
    devices = worker_devices(cfg.device, cfg.workers)
    threads = cfg.threads_per_worker
    if worker is not None or cfg.workers == 1 or len(pending) <= 1:
        from dataclasses import replace

        if worker is None:
            _set_threads(threads)
            cfg = replace(cfg, device=devices[0])
            worker = ShardWorker(cfg, plan.documents)
        for i in pending:
            started = time.perf_counter()
            data, stats = shard_bytes(worker, cfg, source, index, plan, i, bar.update, segmented)
            output.commit(i, data, stats)
            seconds[i] = time.perf_counter() - started
        worker.close()
        return seconds, [worker.report()]

    import multiprocessing as mp
    import queue
    import threading
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")  # a fresh interpreter per worker: CUDA and OpenMP need it
    slots, progress = ctx.Queue(), ctx.Queue()
    n_workers = min(cfg.workers, len(pending))
    # Without --threads-per-worker the cores are shared out, rather than each worker taking all.
    threads = threads or max(1, (os.cpu_count() or 1) // n_workers)
    for k in range(n_workers):
        slots.put((k, devices[k], threads))
    stop = threading.Event()
    reports: dict[int, dict] = {}

    def show_progress():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                bar.update(progress.get(timeout=0.2))

    reader = threading.Thread(target=show_progress, daemon=True)
    reader.start()
    try:
        with ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(cfg, index.to_json(), plan, slots, progress)) as pool:  # fmt: skip
            try:
                # A shard's future holds its bytes: each reaches this loop once, through the queue, and is
                # dropped once committed (a list of them all, or as_completed's, kept every shard of the run
                # in this process's memory until the end; wait() rescans them all on each return).
                finished: queue.SimpleQueue = queue.SimpleQueue()
                for i in pending:
                    pool.submit(_worker_shard, i).add_done_callback(finished.put)
                for _ in pending:
                    future = None
                    while future is None:  # short waits: a signal is handled between two
                        with contextlib.suppress(queue.Empty):
                            future = finished.get(timeout=0.5)
                    i, data, stats, s, slot, report = future.result()
                    output.commit(i, data, stats)
                    seconds[i] = s
                    reports[slot] = report  # a worker's counts so far: its last shard's report holds them all
            except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed: the workers' shards are not awaited
                pool.shutdown(wait=False, cancel_futures=True)
                for process in mp.active_children():
                    process.terminate()
                raise
    finally:
        stop.set()
        reader.join()
        while not progress.empty():  # what arrived after the last poll
            bar.update(progress.get())
    return seconds, [reports[k] for k in sorted(reports)]


class _RayShardChunker:
    """A Ray Data actor: one model, any number of shards (one per batch row)."""

    def __init__(self, cfg, index_json: dict, plan: ShardPlan):
        import uuid

        _set_threads(cfg.threads_per_worker)
        self.cfg, self.plan, self.index = cfg, plan, SourceIndex.from_json(index_json)
        self.source = source_of(cfg)
        self.worker = ShardWorker(cfg, plan.documents)
        self.name = uuid.uuid4().hex  # which actor a report came from

    def __call__(self, batch: dict) -> dict:
        out = {"shard": [], "data": [], "stats": [], "seconds": [], "actor": [], "report": []}
        for i in batch["shard"]:
            started = time.perf_counter()
            data, stats = shard_bytes(self.worker, self.cfg, self.source, self.index, self.plan, int(i))
            out["shard"].append(int(i))
            out["data"].append(data)
            out["stats"].append(json.dumps(stats))
            out["seconds"].append(time.perf_counter() - started)
            out["actor"].append(self.name)
            out["report"].append(json.dumps(self.worker.report(), default=str))
        return out


def run_ray(cfg, index, plan, output: ShardedOutput, pending: list[int], bar) -> tuple[dict, list]:
    """The pending shards as one Ray Data ``map_batches`` stage over an actor pool."""
    try:
        import ray
    except ImportError:
        raise InputError("--engine ray", "needs Ray: pip install 'metachunk[ray]'") from None
    from metachunk.stopping import keep_signal_handlers, reap_on_death

    started = not ray.is_initialized()
    local = started and cfg.ray_address is None  # a cluster this run starts, and so stops
    with reap_on_death() if local else contextlib.nullcontext():
        if started:
            with keep_signal_handlers():  # ray.init's own SIGTERM handler would exit 15, not stop the run
                # WARNING: no INFO lines from the driver ("Started a local Ray instance") beside our bar
                ray.init(address=cfg.ray_address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            with ray_data_quiet():
                return _ray_shards(ray, cfg, index, plan, output, pending, bar)
        finally:
            if local:  # the local cluster this run started goes with it
                ray.shutdown()


class _WarningsOnly(logging.Filter):
    """Ray Data's console lines at WARNING and above, less the one that says its progress bars are off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not record.getMessage().startswith(
            "Progress bars disabled"
        )


@contextlib.contextmanager
def ray_data_quiet():
    """Our progress bar stands for the run, so Ray Data's own goes (a second bar on a terminal; off
    one, 10 INFO lines every few seconds: https://github.com/ray-project/ray/issues/42191), and its
    console says only warnings. Put back after the run: a caller's own Ray Data is theirs. A logging
    config of the user's own (``RAY_DATA_LOGGING_CONFIG``) is left as it is."""
    import ray.data

    context = ray.data.DataContext.get_current()
    bars = context.enable_progress_bars
    context.enable_progress_bars = False
    handlers = []
    if not os.environ.get("RAY_DATA_LOGGING_CONFIG"):
        # the console's (a StreamHandler); its session log file (a plain Handler) keeps every line
        handlers = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    only = _WarningsOnly()
    for handler in handlers:
        handler.addFilter(only)
    try:
        yield
    finally:
        context.enable_progress_bars = bars
        for handler in handlers:
            handler.removeFilter(only)


def _ray_shards(ray, cfg, index, plan, output: ShardedOutput, pending: list[int], bar) -> tuple[dict, list]:
    gpu = cfg.device in (None, "cuda") and ray.cluster_resources().get("GPU", 0) > 0
    ds = ray.data.from_items([{"shard": i} for i in pending], override_num_blocks=len(pending))
    results = ds.map_batches(
        _RayShardChunker,
        fn_constructor_kwargs={"cfg": cfg, "index_json": index.to_json(), "plan": plan},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(
            size=min(cfg.workers, len(pending))
        ),  # `concurrency` is deprecated
        num_cpus=cfg.threads_per_worker or 1,
        num_gpus=1 if gpu else 0,
    )
    seconds, reports = {}, {}
    for row in results.iter_rows():  # streamed: each shard is committed as it arrives
        i, stats = int(row["shard"]), json.loads(row["stats"])
        output.commit(i, bytes(row["data"]), stats)
        seconds[i] = float(row["seconds"])
        reports[row["actor"]] = json.loads(row["report"])
        bar.update(stats["documents"])
    return seconds, list(reports.values())


def distributed_rank() -> tuple[int, int]:
    """``(rank, world size)`` under torchrun / accelerate launch, else ``(0, 1)``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def chunk_rows(path: str | Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES):
    """``(file, line, record)`` for every record of a ``metachunk chunk`` output: a ``.jsonl`` file,
    or a dataset folder's shards in order (jsonl or parquet). A folder whose manifest says the run is
    not complete is refused; a line that is not UTF-8 JSON is a ``file:line`` error, or with
    ``rejects`` (``--on-bad-row skip``) left out."""
    path = Path(path)
    if path.is_dir():
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise InputError(path, "a folder without manifest.json is not a metachunk chunk output")
        manifest = read_json(manifest_path)
        if not manifest.get("complete"):
            raise InputError(
                manifest_path, "the run is not complete: rerun the same `metachunk chunk` to finish it"
            )
        try:
            files = [path / entry["file"] for entry in manifest["shards"]["done"].values()]
        except (KeyError, TypeError, AttributeError):
            raise InputError(
                manifest_path, "field 'shards.done' is missing or not a mapping of shard files"
            ) from None
    elif path.is_file():
        files = [path]
    else:
        raise InputError(path, "no such file")
    for file in files:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            number = 0
            for batch in pq.ParquetFile(file).iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    number += 1
                    yield file, number, row
            continue
        for number, _, record in read_records(file, rejects, max_row_bytes):
            yield file, number, record


def read_chunk_records(path: str | Path):
    """The records of a ``metachunk chunk`` output, file or folder (see `chunk_rows`)."""
    return (record for _, _, record in chunk_rows(path))
