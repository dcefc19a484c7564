"""Corpus-scale chunking: one config over a whole corpus, into a dataset folder, shard by shard.

``metachunk chunk CORPUS -o DIR/`` writes::

    DIR/train-00000-of-00008.jsonl      (or .parquet with --output-format parquet)
    ...
    DIR/manifest.json                   config, θ, prompt hashes, fingerprints, shards done, counts

The shard names follow the ``datasets`` split convention, so ``load_dataset("json", data_dir=DIR)``
reads the shards and leaves ``manifest.json`` alone (with ``part-*`` names it would try to read the
manifest as data).

**Which document goes where.** ``--shards N`` is fixed up front (default: one shard per
:data:`DOCS_PER_SHARD` documents). Shard ``i`` holds the documents at input positions
``floor(i*n/N)`` to ``floor((i+1)*n/N) - 1``: contiguous, so the shards read in name order are the
input in order. The assignment depends on the input alone, never on how many workers run.

**Resume.** Each shard is written to a temp file and renamed in; only then is it entered in the
manifest's ``shards.done`` (with its sha256), which is replaced atomically under a file lock. A
rerun of the same command checks the manifest's fingerprint (config, input bytes, model files,
prompts, metachunk version), keeps every done shard whose file still has its hash, and chunks the
rest. So a kill -9 costs at most the shards in flight: one per worker. A changed config, model or
input is refused (``--overwrite`` starts again).

**Engines**, all running :func:`chunk_shard` on shards and :meth:`ShardedOutput.commit` on the
results, so they write the same bytes:

* ``local`` (default): ``--workers N`` processes (spawned, each with its own model, threads and
  device; on a GPU machine one per visible GPU by default), or this process when N is 1;
* under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE`` > 1): rank r takes shards i with
  ``i % world_size == r``; the last rank to finish writes the summary;
* ``ray``: a Ray Data ``map_batches`` stage over the pending shard numbers with an actor pool
  (``concurrency`` = --workers, ``num_cpus`` = --threads-per-worker, ``num_gpus`` 1 on GPU); the
  driver writes what the actors return. The actors read the input themselves, so on a cluster it
  must be on storage every node sees.

Runtime settings (engine, workers, threads, device) are not part of the fingerprint: a resumed run
may use more machines. Different hardware (or thread counts) may change scores in the last float
digits, so a resume on other hardware is not byte-identical; the manifest's ``run`` block says what
ran.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metachunk import config
from metachunk.artifacts import SCHEMA_VERSION, InputError, jsonl_line, write_bytes, write_json
from metachunk.sources import DocumentSource, SourceIndex

DOCS_PER_SHARD = 256
MANIFEST = "manifest.json"
# Fields of ChunkConfig that say how a run is executed, not what it computes.
RUNTIME_FIELDS = ("input", "output", "workers", "threads_per_worker", "device", "engine", "ray_address",
                  "overwrite")  # fmt: skip
SHARDED_METHODS = ("ppl", "msp", "fixed", "sentence", "semantic")


def is_dataset_dir(output: str | Path) -> bool:
    """``-o FILE.jsonl`` is one file; ``-o DIR/``, a name without a suffix or an existing folder is
    a dataset folder; anything else (``chunks.json``, ``x.parquet``) is refused as ambiguous."""
    text, path = str(output), Path(output)
    if text.endswith(".jsonl") and not path.is_dir():
        return False
    if text.endswith(("/", os.sep)) or path.is_dir() or not path.suffix:
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


def _parquet_schema(emit_sentences: bool):
    import pyarrow as pa

    chunk = pa.struct([("text", pa.string()), ("start", pa.int64()), ("end", pa.int64())])
    fields = [("schema_version", pa.int64()), ("id", pa.string()), ("method", pa.string()),
              ("chunks", pa.list_(chunk))]  # fmt: skip
    if emit_sentences:
        sentence = pa.struct([("start", pa.int64()), ("end", pa.int64()), ("score", pa.float64())])
        fields.append(("sentences", pa.list_(sentence)))
    return pa.schema(fields)


def chunk_shard(chunker, cfg, source: DocumentSource, index: SourceIndex, plan: ShardPlan, i: int,
                on_documents: Callable[[int], None] | None = None) -> tuple[bytes, dict]:  # fmt: skip
    """Shard ``i``'s file contents and counts. Documents are chunked in groups that start at the
    shard's first document, so the bytes depend on the shard alone (not on who runs it, or after
    which other shard)."""
    start, stop = plan.bounds(i)
    group = max(cfg.batch_size * 4, 16)
    records, docs = [], []
    n_chunks = chunk_chars = 0

    def flush():
        nonlocal n_chunks, chunk_chars
        for doc in chunker.chunk([d.id for d in docs], [d.text for d in docs]):
            records.append({"schema_version": SCHEMA_VERSION, **doc.to_json(cfg.method, cfg.emit_sentences)})
            n_chunks += len(doc.chunks)
            chunk_chars += sum(len(c.text) for c in doc.chunks)
        if on_documents:
            on_documents(len(docs))
        docs.clear()

    for doc in source.documents(start, stop, index):
        docs.append(doc)
        if len(docs) == group:
            flush()
    if docs:
        flush()
    if cfg.output_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(records, schema=_parquet_schema(cfg.emit_sentences)), buf)
        data = buf.getvalue()
    else:
        data = "".join(jsonl_line(r) for r in records).encode("utf-8")
    stats = {"documents": stop - start, "chunks": n_chunks, "chunk_chars": chunk_chars}
    return data, stats


# ---- the output folder --------------------------------------------------------------------------


class ShardedOutput:
    """The dataset folder: its shards, and the manifest that says which are done."""

    def __init__(self, root: str | Path, plan: ShardPlan, fmt: str):
        from filelock import FileLock

        self.root, self.plan, self.fmt = Path(root), plan, fmt
        self.manifest_path = self.root / MANIFEST
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.root / f".{MANIFEST}.lock"))  # hidden: datasets skips it

    def path(self, i: int) -> Path:
        return self.root / self.plan.name(i, self.fmt)

    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            return json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise InputError(
                self.manifest_path, f"invalid JSON ({e.msg}); use --overwrite to start again"
            ) from None

    def open(self, head: dict, overwrite: bool, restart_if_changed: bool = False) -> set[int]:
        """Start or resume: returns the shards already done. ``head`` is the manifest's fixed part
        (config, fingerprints, input, shards plan); a different fingerprint is refused."""
        with self.lock:
            previous = self.read_manifest()
            if previous is None and any(p.name != f".{MANIFEST}.lock" for p in self.root.iterdir()):
                if not overwrite:
                    raise InputError(
                        self.root, "exists and holds no manifest.json: not a metachunk chunk folder "
                        "(use --overwrite to replace its shards, or another -o)"
                    )  # fmt: skip
            if previous is not None and previous.get("fingerprint") != head["fingerprint"]:
                overwrite = overwrite or restart_if_changed
                if not overwrite:
                    changed = [k for k, v in head["fingerprint_of"].items()
                               if previous.get("fingerprint_of", {}).get(k) != v]  # fmt: skip
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
                self.manifest_path.unlink(missing_ok=True)
            done = {}
            if previous is not None:
                for key, entry in previous["shards"]["done"].items():
                    path = self.root / entry["file"]
                    if path.is_file() and _sha256(path) == entry["sha256"]:
                        done[key] = entry
            manifest = {**head, "shards": {**head["shards"], "done": done}, "complete": False}
            manifest["run"] = (previous or {}).get("run", {"attempts": 0, "seconds": 0.0})
            manifest["run"]["attempts"] += 1
            write_json(self.manifest_path, manifest)
            return {int(k) for k in done}

    def remove_stale_temps(self, shards) -> None:
        """Temp files a killed run left for these shards (only their writer makes them)."""
        names = {self.plan.name(i, self.fmt) for i in shards}
        for p in self.root.glob(".*.tmp"):
            if any(p.name.startswith(f".{n}.") for n in names):
                p.unlink(missing_ok=True)

    def commit(self, i: int, data: bytes, stats: dict) -> None:
        """The shard's file, renamed in, then its entry in the manifest."""
        path = self.path(i)
        write_bytes(path, data)
        entry = {"file": path.name, **stats, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with self.lock:
            manifest = self.read_manifest()
            manifest["shards"]["done"][f"{i:05d}"] = entry
            manifest["shards"]["done"] = dict(sorted(manifest["shards"]["done"].items()))
            write_json(self.manifest_path, manifest)

    def finish(self, run: dict) -> dict:
        """Adds this attempt's ``run`` figures; when every shard is done, the summary."""
        with self.lock:
            manifest = self.read_manifest()
            previous = manifest.get("run", {})
            run = {**run, "attempts": previous.get("attempts", 1),
                   "seconds": round(previous.get("seconds", 0.0) + run["this_attempt_seconds"], 2)}  # fmt: skip
            manifest["run"] = run
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
            write_json(self.manifest_path, manifest)
            return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- what a run computes: the fingerprint -------------------------------------------------------


def prompt_hashes(cfg) -> dict[str, str]:
    if cfg.method != "msp":
        return {}
    from metachunk.chunking.msp import load_msp_prompt

    return {
        f"msp_{cfg.msp_prompt}.{lang}": load_msp_prompt(cfg.msp_prompt, lang).sha256 for lang in ("en", "zh")
    }


def manifest_head(cfg, source: DocumentSource, index: SourceIndex, plan: ShardPlan) -> dict:
    """The deterministic part of the manifest, with the fingerprint that resume compares."""
    from importlib.metadata import version

    from metachunk.models import fingerprint as model_fingerprint

    computed = {k: v for k, v in config.to_dict(cfg).items() if k not in RUNTIME_FIELDS}
    models = {}
    if cfg.method in ("ppl", "msp") or cfg.len_unit == "token":
        models["model"] = model_fingerprint(cfg.model)
    if cfg.method == "semantic":
        models["embedder"] = model_fingerprint(cfg.embedder)
    prompts = prompt_hashes(cfg)
    fingerprint_of = {
        "config": _json_sha(computed),
        "input": index.sha256,
        "models": _json_sha(models),
        "prompts": _json_sha(prompts),
        "metachunk": version("metachunk"),
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "chunk",
        "fingerprint": _json_sha(fingerprint_of),
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


def _json_sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


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


# A spawned worker's state: its Chunker, built once by _init_worker.
_WORKER: dict = {}


def _init_worker(cfg, index_json: dict, plan: ShardPlan, slots, progress) -> None:
    from dataclasses import replace

    from metachunk.chunking.pipeline import Chunker

    slot, device, threads = slots.get()
    _set_threads(threads)
    cfg = replace(cfg, device=device)
    _WORKER.update(cfg=cfg, plan=plan, progress=progress, slot=slot,
                   source=DocumentSource(cfg.input, cfg.input_format, cfg.text_field, cfg.id_field),
                   index=SourceIndex.from_json(index_json), chunker=Chunker(cfg, progress=False))  # fmt: skip


def _worker_shard(i: int) -> tuple[int, bytes, dict, float]:
    w = _WORKER
    started = time.perf_counter()
    data, stats = chunk_shard(w["chunker"], w["cfg"], w["source"], w["index"], w["plan"], i,
                              on_documents=w["progress"].put)  # fmt: skip
    return i, data, stats, time.perf_counter() - started


def run_local(cfg, source, index, plan, output: ShardedOutput, pending: list[int], bar) -> dict[int, float]:
    """The shards in ``pending``, by ``cfg.workers`` processes (this one when 1)."""
    seconds: dict[int, float] = {}
    devices = worker_devices(cfg.device, cfg.workers)
    threads = cfg.threads_per_worker
    if cfg.workers == 1 or len(pending) <= 1:
        from dataclasses import replace

        from metachunk.chunking.pipeline import Chunker

        _set_threads(threads)
        cfg = replace(cfg, device=devices[0])
        chunker = Chunker(cfg, progress=False)
        for i in pending:
            started = time.perf_counter()
            data, stats = chunk_shard(chunker, cfg, source, index, plan, i, on_documents=bar.update)
            output.commit(i, data, stats)
            seconds[i] = time.perf_counter() - started
        return seconds

    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = mp.get_context("spawn")  # a fresh interpreter per worker: CUDA and OpenMP need it
    slots, progress = ctx.Queue(), ctx.Queue()
    n_workers = min(cfg.workers, len(pending))
    # Without --threads-per-worker the cores are shared out, rather than each worker taking all.
    threads = threads or max(1, (os.cpu_count() or 1) // n_workers)
    for k in range(n_workers):
        slots.put((k, devices[k], threads))
    stop = threading.Event()

    def show_progress():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                bar.update(progress.get(timeout=0.2))

    reader = threading.Thread(target=show_progress, daemon=True)
    reader.start()
    try:
        with ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(cfg, index.to_json(), plan, slots, progress)) as pool:  # fmt: skip
            futures = [pool.submit(_worker_shard, i) for i in pending]
            for future in as_completed(futures):
                i, data, stats, s = future.result()
                output.commit(i, data, stats)
                seconds[i] = s
    finally:
        stop.set()
        reader.join()
        while not progress.empty():  # what arrived after the last poll
            bar.update(progress.get())
    return seconds


class _RayShardChunker:
    """A Ray Data actor: one model, any number of shards (one per batch row)."""

    def __init__(self, cfg, index_json: dict, plan: ShardPlan):
        from metachunk.chunking.pipeline import Chunker

        _set_threads(cfg.threads_per_worker)
        self.cfg, self.plan, self.index = cfg, plan, SourceIndex.from_json(index_json)
        self.source = DocumentSource(cfg.input, cfg.input_format, cfg.text_field, cfg.id_field)
        self.chunker = Chunker(cfg, progress=False)

    def __call__(self, batch: dict) -> dict:
        out = {"shard": [], "data": [], "stats": [], "seconds": []}
        for i in batch["shard"]:
            started = time.perf_counter()
            data, stats = chunk_shard(self.chunker, self.cfg, self.source, self.index, self.plan, int(i))
            out["shard"].append(int(i))
            out["data"].append(data)
            out["stats"].append(json.dumps(stats))
            out["seconds"].append(time.perf_counter() - started)
        return out


def run_ray(cfg, index, plan, output: ShardedOutput, pending: list[int], bar) -> dict[int, float]:
    """The pending shards as one Ray Data ``map_batches`` stage over an actor pool."""
    try:
        import ray
    except ImportError:
        raise InputError("--engine ray", "needs Ray: pip install 'metachunk[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=cfg.ray_address, log_to_driver=False)
    gpu = cfg.device in (None, "cuda") and ray.cluster_resources().get("GPU", 0) > 0
    ds = ray.data.from_items([{"shard": i} for i in pending], override_num_blocks=len(pending))
    results = ds.map_batches(
        _RayShardChunker,
        fn_constructor_kwargs={"cfg": cfg, "index_json": index.to_json(), "plan": plan},
        batch_size=1,
        concurrency=min(cfg.workers, len(pending)),
        num_cpus=cfg.threads_per_worker or 1,
        num_gpus=1 if gpu else 0,
    )
    seconds = {}
    for row in results.iter_rows():  # streamed: each shard is committed as it arrives
        i, stats = int(row["shard"]), json.loads(row["stats"])
        output.commit(i, bytes(row["data"]), stats)
        seconds[i] = float(row["seconds"])
        bar.update(stats["documents"])
    return seconds


def distributed_rank() -> tuple[int, int]:
    """``(rank, world size)`` under torchrun / accelerate launch, else ``(0, 1)``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_sharded(cfg, progress: bool = True, restart_if_changed: bool = False) -> dict:
    """``metachunk chunk INPUT -o DIR/``: scan, plan, resume, run the engine, finish.

    ``restart_if_changed``: a folder another run wrote is started again instead of refused (for a
    stage's own intermediate folder, such as ``data sample``'s ``OUT/ppl/``)."""
    from tqdm import tqdm

    if cfg.method not in SHARDED_METHODS:
        raise InputError(
            cfg.output, f"--method {cfg.method} writes one file: use -o FILE.jsonl (a folder takes "
            f"{', '.join(SHARDED_METHODS)})"
        )  # fmt: skip
    if cfg.students.rewrite or cfg.students.summarize or cfg.plot:
        raise InputError(cfg.output, "--rewrite, --summarize and --plot write one file: use -o FILE.jsonl")
    from dataclasses import replace

    rank, world = distributed_rank()
    if world > 1 and cfg.overwrite:
        raise InputError(
            "--overwrite", "every rank would clear the folder: run once without torchrun to clear it"
        )
    # Under torchrun each rank is one worker; otherwise one per visible GPU on GPU, else 1.
    cfg = replace(cfg, workers=1 if world > 1 else (cfg.workers or default_workers(cfg.device)))
    if world > 1 and cfg.device in (None, "cuda"):
        import torch

        if torch.cuda.is_available():
            cfg = replace(cfg, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    started = time.perf_counter()
    source = DocumentSource(cfg.input, cfg.input_format, cfg.text_field, cfg.id_field)
    index = source.scan()  # every file:line check, before any model loads
    scan_s = time.perf_counter() - started
    plan = ShardPlan(index.documents, cfg.shards or max(1, -(-index.documents // DOCS_PER_SHARD)))
    if cfg.method in ("ppl", "msp"):  # convert a preset once here, not in every worker at once
        from metachunk.models import resolve

        resolve(cfg.model)
    output = ShardedOutput(cfg.output, plan, cfg.output_format)
    head = manifest_head(cfg, source, index, plan)
    done = output.open(head, cfg.overwrite, restart_if_changed)
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
    with tqdm(total=todo_docs, unit="doc", desc=f"chunk {cfg.method}{who}", dynamic_ncols=True,
              disable=not progress) as bar:  # fmt: skip
        if not pending:
            seconds = {}
        elif cfg.engine == "ray":
            seconds = run_ray(cfg, index, plan, output, pending, bar)
        else:
            seconds = run_local(cfg, source, index, plan, output, pending, bar)
    run = {
        "engine": cfg.engine if world == 1 else f"torchrun ({world} ranks)",
        "workers": cfg.workers,
        "threads_per_worker": cfg.threads_per_worker,
        "device": cfg.device,
        "this_attempt_seconds": round(time.perf_counter() - started, 2),
        "scan_seconds": round(scan_s, 2),
        "resume_check_seconds": round(skip_s, 2),
        "shards_skipped": len(mine) - len(pending),
        "documents_skipped": skipped_docs,
        "documents_chunked": todo_docs,
        "shard_seconds": {f"{i:05d}": round(s, 2) for i, s in sorted(seconds.items())},
    }
    manifest = output.finish(run)
    state = (
        "complete"
        if manifest["complete"]
        else f"{len(manifest['shards']['done'])} of {plan.shards} shards done"
    )
    summary = manifest.get("summary", {})
    print(
        f"{cfg.output}: {plan.shards} shards, {state}; this run chunked {todo_docs} documents "
        f"({run['shards_skipped']} shards skipped) in {run['this_attempt_seconds']:.1f}s"
        + (f"; {summary['documents']} documents, {summary['chunks']} chunks, mean "
           f"{summary['mean_chunk_chars']} chars/chunk" if summary else ""),
        file=sys.stderr,
    )  # fmt: skip
    return manifest


def chunk_rows(path: str | Path):
    """``(file, line, record)`` for every record of a ``metachunk chunk`` output: a ``.jsonl`` file,
    or a dataset folder's shards in order (jsonl or parquet). A folder whose manifest says the run is
    not complete is refused; a line that is not UTF-8 JSON is a ``file:line`` error."""
    path = Path(path)
    if path.is_dir():
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise InputError(path, "a folder without manifest.json is not a metachunk chunk output")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not manifest.get("complete"):
            raise InputError(
                manifest_path, "the run is not complete: rerun the same `metachunk chunk` to finish it"
            )
        files = [path / entry["file"] for entry in manifest["shards"]["done"].values()]
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
        with file.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InputError(file, f"invalid UTF-8 at byte {e.start} of the line", number) from None
                if not line.strip():
                    continue
                try:
                    yield file, number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(file, f"invalid JSON ({e.msg} at column {e.colno})", number) from None


def read_chunk_records(path: str | Path):
    """The records of a ``metachunk chunk`` output, file or folder (see :func:`chunk_rows`)."""
    return (record for _, _, record in chunk_rows(path))
