"""``metachunk run RECIPE.yaml``: a dataset regeneration job, from corpus to published dataset.

A regeneration recipe names its stages in order. Each stage is an existing ``metachunk`` command
and its ``config:`` block is exactly the YAML that command's ``--config`` reads:

```
name: crud-rewrite-summary
state: runs/regen/crud            # the run's state.json, stage configs, regen_manifest.json
local_teacher: {model: smollm2}   # optional: `metachunk teacher serve`, started when needed
stages:
  - name: sample
    run: data sample
    config: {pool: runs/crud/train_pool.jsonl, out: runs/regen/crud/sample, n_docs: 20000}
  - name: rewrite
    run: distill rewrite
    local_teacher: true           # optional: its teacher blocks point at it (the command's `served`)
    allow_exit: [0, 4]            # optional: exit statuses that count as done (default [0])
    config: {chunks: runs/regen/crud/sample/chunks.jsonl, ...}
```

**Empty stages.** A command that finds nothing to do (a training set its filters left without
rows) exits with `EXIT_EMPTY`; with that status in ``allow_exit`` the
stage is done and *empty*: it wrote nothing. A later stage that reads what an empty stage would
have written is skipped as empty too, and so on downstream, unless it says
``on_empty_inputs: run`` (its command copes: ``chunk --method moc --moc-stand-in``).

**Bad rows.** A stage's ``config:`` may say ``on_bad_row: skip`` (and ``max_bad_rows``), as its
command's flags do. Such a stage that leaves rows out exits with
`EXIT_SKIPPED` and is done: the manifest's stage entry carries its
``rejects`` (the count, the rejects file and its sha256), and ``metachunk run`` itself exits with
that status once every stage is done, so that a scheduler sees rows were left out.

**Fingerprints.** Before a stage runs, its fingerprint is taken: the sha256 of its command, its
config (less its ``runtime=True`` fields: `metachunk.config.computed`), the content hash of every
existing path its config names (less the outputs and answer stores its command names), the
fingerprint of every local model it names (`metachunk.models.fingerprint`), the hashes of the
prompt and schema files its command says it can read (a new LumberChunker schema does not
rerun a day of PPL chunking), and the code its command runs (`metachunk.code_digest.command_code`:
the import closure of its entry modules, hashed). A stage whose fingerprint matches the last successful
run, and whose outputs still hash as they did, is skipped. A stage downstream of one that wrote
new bytes sees a changed input and runs; one downstream of a stage that reran to the same bytes
does not. Inside a stage nothing is paid or scored twice anyway: the teacher's answer store and
the chunker's shards make each command resume itself, so the runner only sequences and compares.

``--plan`` takes the fingerprints and prints which stages would run, with the teacher stages'
estimated requests, tokens and cost (``distill ... --dry-run``); it runs nothing.

``--rerun STAGE...`` runs the named stages even where their fingerprint is unchanged (a library
upgraded underneath, say: the fingerprint covers metachunk's own code, not its dependencies'); the
stages downstream rerun only if its outputs change. A teacher stage's answers still come from its store.

``regen_manifest.json`` (in ``state``) records how the rows were made: the recipe text and its
hash, the metachunk version and git commit, every stage's inputs, outputs, models and summary,
the prompt and schema hashes, the teachers' model names (never keys or URLs) and the wall time.
``manifest_sha256`` hashes what was made: the recipe's hash, and per stage its fingerprint (what it
ran on and with) and the hashes of what it wrote. Not when, how long, nor what a run paid or read from
a store (a rerun from the answer store makes the same bytes), nor where the files lie; so
``data push --regen-manifest`` can tell that the Hub already holds this exact run.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from metachunk import config
from metachunk.artifacts import (
    EXIT_EMPTY,
    AtomicWriter,
    InputError,
    file_sha256,
    is_run_log,
    json_sha256,
    remove_dead_temps_of,
    write_json,
)
from metachunk.command import Registry, Result
from metachunk.config import option
from metachunk.markdown import shown_argument, shown_keys, shown_path, shown_paths_in
from metachunk.models import ModelNotFoundError
from metachunk.named_data import MissingDataset, name_of
from metachunk.redaction import redact
from metachunk.sources import EXIT_SKIPPED, rows_left_out, skipped_exit, total_rejects

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Stage:
    name: str
    run: str
    config: dict
    local_teacher: bool = False
    allow_exit: list[int] = field(default_factory=lambda: [0])
    on_empty_inputs: str = "skip"  # or "run": when an input is what an empty stage did not write

    @property
    def argv(self) -> list[str]:
        return self.run.split()


@dataclass
class Recipe:
    path: Path
    text: str
    name: str
    state: Path
    stages: list[Stage]
    local_teacher: dict | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def load_recipe(path: str | Path, registry: Registry | None = None) -> Recipe:
    """The recipe at ``path``, checked: every problem names the file and the stage's field (with
    ``registry``, also that each ``run:`` names a command a stage can run: one that declares what
    it reads and writes)."""

    from metachunk import shipped

    path = shipped.resolve(path)
    if not path.is_file():
        raise InputError(path, "no such recipe (nor a shipped one of that name: `metachunk recipes list`)")
    text = config.read_text_file(path, "regeneration recipe")  # kept as read: its sha256 is the recipe's
    raw = config.yaml_mapping(text, path, "regeneration recipe")
    if not isinstance(raw.get("stages"), list) or not raw["stages"]:
        raise InputError(path, "a regeneration recipe needs 'stages:', a list of {name, run, config}")
    raw = shipped.localize(raw, shipped.is_shipped(path))
    # x-*: blocks for YAML anchors (&teacher ... *teacher), as in compose files; the runner ignores them
    unknown = {k for k in raw if not str(k).startswith("x-")} - {"name", "state", "stages", "local_teacher"}
    if unknown:
        raise InputError(path, f"unknown top-level key(s): {', '.join(sorted(map(repr, unknown)))}")
    stages, seen = [], set()
    for i, s in enumerate(raw["stages"]):
        where = f"stages[{i}]"
        if not isinstance(s, dict):
            raise InputError(path, f"{where}: expected a mapping with name, run and config")
        extra = set(s) - {"name", "run", "config", "local_teacher", "allow_exit", "on_empty_inputs"}
        if extra:
            raise InputError(path, f"{where}: unknown key(s) {', '.join(sorted(map(repr, extra)))}")
        name, run, cfg = s.get("name"), s.get("run"), s.get("config", {})
        if not isinstance(name, str) or not name or name in seen:
            raise InputError(path, f"{where}.name: a unique stage name is required (got {name!r})")
        if not STAGE_NAME.fullmatch(name):  # it names files in the state folder: ../ would escape it
            raise InputError(
                path, f"{where}.name: letters, digits, '_', '-' and '.', not first, got {name!r}"
            )
        stages_run = [] if registry is None else [c.name for c in registry.commands if c.is_stage]
        if not isinstance(run, str) or not run.split() or (registry and not any(
                run.split()[: len(name.split())] == name.split() for name in stages_run)):  # fmt: skip
            raise InputError(path, f"{where}.run: a metachunk command a stage can run ({', '.join(stages_run)}), "
                             f"got {run!r}")  # fmt: skip
        if not isinstance(cfg, dict):
            raise InputError(path, f"{where}.config: expected a mapping (the command's --config YAML)")
        on_empty = s.get("on_empty_inputs", "skip")
        if on_empty not in ("skip", "run"):
            raise InputError(path, f"{where}.on_empty_inputs: skip or run, got {on_empty!r}")
        allow_exit = s.get("allow_exit", [0])
        if not isinstance(allow_exit, list) or not all(type(x) is int for x in allow_exit):
            raise InputError(
                path, f"{where}.allow_exit: a list of exit statuses ([0, 3]), got {allow_exit!r}"
            )
        if not isinstance(s.get("local_teacher", False), bool):
            raise InputError(path, f"{where}.local_teacher: true or false (the recipe's top-level local_teacher: "
                             f"says which), got {s['local_teacher']!r}")  # fmt: skip
        seen.add(name)
        stages.append(Stage(name, run, cfg, s.get("local_teacher", False), allow_exit, on_empty))
    if not isinstance(raw.get("state") or "", str):
        raise InputError(path, f"state: a folder path, got {raw['state']!r}")
    state = Path(raw.get("state") or Path("runs") / "regen" / path.stem)
    if state.exists() and not state.is_dir():
        raise InputError(path, f"state: {state} is a file, where the run's state folder is to be")
    return Recipe(path, text, str(raw.get("name") or path.stem), state, stages, local_teacher_spec(path, raw))


def local_teacher_spec(path: Path, raw: dict) -> dict | None:
    """The top-level ``local_teacher:`` mapping (``model``, ``backend``, ``threads``), checked."""
    from metachunk.local_teacher import BACKENDS

    spec = raw.get("local_teacher")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise InputError(path, f"local_teacher: a mapping of model, backend and threads, got {spec!r}")
    unknown = set(spec) - {"model", "backend", "threads"}
    if unknown:
        raise InputError(path, f"local_teacher: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    if spec.get("backend", "auto") not in BACKENDS:
        raise InputError(
            path, f"local_teacher.backend: one of {', '.join(BACKENDS)}, got {spec['backend']!r}"
        )
    threads = spec.get("threads")
    if threads is not None and (type(threads) is not int or threads < 1):
        raise InputError(path, f"local_teacher.threads: a positive integer, got {threads!r}")
    if not isinstance(spec.get("model", "smollm2"), str):
        raise InputError(path, f"local_teacher.model: a preset or a model folder, got {spec['model']!r}")
    return spec


# ---- hashing ------------------------------------------------------------------------------------


class Digests:
    """Content hashes of files and folders, remembered by (size, mtime) between runs."""

    def __init__(self, known: dict | None = None):
        self.known: dict[str, list] = dict(known or {})

    def file(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self.known.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        digest = file_sha256(path)
        self.known[key] = [st.st_size, st.st_mtime_ns, digest]
        return digest

    def path(self, path: str | Path) -> str | None:
        """A file's sha256, or a folder's (its files by relative path, less hidden files, locks,
        answer stores and run logs), or an ``hf://datasets/...`` dataset's commit; None if absent."""
        if str(path).startswith("hf:/"):  # a Hub dataset (a Path has folded hf:// to hf:/): its commit,
            from metachunk import hub  # asked of the Hub without downloading the files (a plan reads nothing)

            ref = "hf://" + str(path).split(":/", 1)[1].lstrip("/")
            try:
                return f"hf commit {hub.commit_of(ref, 'dataset')}"
            except hub.HubNotFound as e:
                raise InputError(str(path), str(e)) from None
        path = Path(path)
        if path.is_file():
            return self.file(path)
        if not path.is_dir():
            return None
        digest = hashlib.sha256()
        for p in sorted(path.rglob("*")):
            rel = p.relative_to(path)
            # Hidden files, locks, answer stores (shared, append-only) and run logs (how each attempt
            # went: `metachunk.artifacts.is_run_log`) are not what a stage made.
            if (
                p.is_file()
                and not any(part.startswith(".") for part in rel.parts)
                and not (".sqlite" in p.name or p.suffix == ".lock" or is_run_log(p.name))
            ):
                digest.update(f"{rel.as_posix()}\0{self.file(p)}\n".encode())
        return digest.hexdigest()


def metachunk_version() -> dict:
    from metachunk import __version__  # "0+unknown" from a checkout that was never installed

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        commit = done.stdout.strip() or None if done.returncode == 0 else None
    return {"version": __version__, "git_commit": commit}


@dataclass
class Fingerprint:
    sha256: str
    inputs: dict[str, str | None]
    models: dict[str, dict]
    outputs: list[str]
    reads: list[str] = field(default_factory=list)  # every path it reads (models too), as its config names it
    prompts: dict[str, str] = field(default_factory=dict)
    teachers: dict[str, str] = field(
        default_factory=dict
    )  # each teacher block's model name (never a URL or key)

    @property
    def missing(self) -> list[str]:
        return [p for p, d in self.inputs.items() if d is None]


def fingerprint(stage: Stage, registry: Registry, config_path: Path, digests: Digests,
                written: frozenset[str] = frozenset()) -> Fingerprint:  # fmt: skip
    """The stage's fingerprint, from what its command says it reads and writes (the contract,
    [`metachunk.command`][metachunk.command]): its config less runtime settings, the content hash of every path it
    reads, the fingerprint of every model, the hash of every prompt and schema file, and its code.
    A model under ``written`` (the real paths the recipe's stages write) that is not there yet is a
    folder to come, not a Hub id (``runs/ckpt`` reads like ``ORG/NAME``)."""
    from metachunk import code_digest, models
    from metachunk.prompts import file_hashes

    command, cfg = registry.config([*stage.argv, "--config", str(config_path)])
    reads = registry.inputs(command, cfg)
    inputs: dict[str, str | None] = {}
    model_prints: dict[str, dict] = {}
    for path in reads.paths:
        inputs[path] = digests.path(path)
    for name in reads.models:
        if _under_any(name, written) and not os.path.exists(name):
            inputs[name] = None  # an earlier stage's output, not written yet (or left empty)
        elif models.is_model(name):
            model_prints[name] = models.fingerprint(name)
        else:
            inputs[name] = digests.path(name)
    prompts = file_hashes(reads.prompts)
    # a named dataset's file by its name: where it was found does not change what the stage makes
    named = {name_of(p) or p: d for p, d in inputs.items()}
    material = {"run": stage.run, "config": registry.identity(command, cfg), "inputs": named,
                "models": model_prints, "prompts": prompts, "code": code_digest.command_code((command.module,))}  # fmt: skip
    sha = json_sha256(material)
    teachers = command.load().teachers(cfg) if hasattr(command.load(), "teachers") else {}
    return Fingerprint(sha, inputs, model_prints, registry.outputs(command, cfg),
                       [*reads.paths, *reads.models], prompts, teachers)  # fmt: skip


# ---- the run ------------------------------------------------------------------------------------


def _under_any(path: str, folders) -> bool:
    """Whether ``path`` is one of ``folders`` (outputs, files or folders, as `os.path.realpath` gives them)
    or lies inside one; compared by real path, so a relative, an absolute and a symlinked spelling agree."""
    path = os.path.realpath(path)
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def _meets(path: str, outputs) -> bool:
    """Whether a stage reading ``path`` reads what ``outputs`` (real paths) write: ``path`` is one of them
    or inside one, or one of them is written inside the folder ``path``."""
    real = os.path.realpath(path).rstrip(os.sep) + os.sep
    return _under_any(path, outputs) or any(out.startswith(real) for out in outputs)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Runner:
    """Runs a `Recipe`'s stages in order, skipping those whose fingerprint is unchanged."""

    def __init__(self, recipe: Recipe, registry: Registry, rerun: Sequence[str] = ()):
        self.recipe = recipe
        names = [stage.name for stage in recipe.stages]
        unknown = [name for name in rerun if name not in names]
        if unknown:
            raise InputError(recipe.path, f"--rerun: no stage named {', '.join(map(repr, unknown))} "
                             f"(stages: {', '.join(names)})")  # fmt: skip
        self.rerun = set(rerun)  # stages run even when cached
        self.registry = registry  # the CLI's commands (metachunk.cli passes them: no import cycle)
        self.state_dir = recipe.state
        self.state_path = self.state_dir / "state.json"
        self.state = _read_json(self.state_path) or {"stages": {}, "digests": {}}
        self.digests = Digests(self.state.get("digests"))
        self.prompts: dict[str, str] = {}  # every prompt and schema file a stage of this run reads
        self.version = metachunk_version()
        self.written: frozenset[str] = frozenset()  # what the stages write, as real paths (`check_stages`)
        self._teacher = None
        self._teacher_started = False

    def _save_state(self) -> None:
        self.state["digests"] = self.digests.known
        write_json(self.state_path, self.state)

    def cached(self, stage: Stage, fp: Fingerprint) -> bool:
        if stage.name in self.rerun:
            return False
        done = self.state["stages"].get(stage.name)
        if not done or done.get("fingerprint") != fp.sha256 or done.get("retry"):
            return False
        return all(self.digests.path(p) == d for p, d in done.get("outputs", {}).items())

    def fitted(self, stage: Stage) -> Stage:
        """The stage as it runs here: its config taking this run's manifest along where its command
        does (``with_run_manifest``), and its teacher blocks pointed at the local teacher if it asks
        for one (``served``)."""
        cfg = stage.config
        with_manifest = self.registry.hook(stage.argv, "with_run_manifest")
        if with_manifest:
            cfg = with_manifest(cfg, str(self.state_dir / "regen_manifest.json"))
        if stage.local_teacher:
            serve = self.registry.hook(stage.argv, "served")
            if serve is None:
                raise InputError(self.recipe.path, f"stage {stage.name!r}: `{stage.run}` sends no teacher "
                                 "requests; drop local_teacher")  # fmt: skip
            cfg = serve(json.loads(json.dumps(cfg)), self.local_teacher(start=False))
        if cfg is stage.config:
            return stage
        return Stage(stage.name, stage.run, cfg, stage.local_teacher, stage.allow_exit, stage.on_empty_inputs)

    def local_teacher(self, start: bool = True):
        from metachunk.local_teacher import LocalTeacher

        if self._teacher is None:
            spec = dict(self.recipe.local_teacher or {"model": "smollm2"})
            try:
                self._teacher = LocalTeacher(spec.get("model", "smollm2"), backend=spec.get("backend", "auto"),
                                             threads=spec.get("threads"), log=self.state_dir / "teacher.log")  # fmt: skip
            except RuntimeError as e:  # a model its backend cannot serve: the recipe's field
                raise InputError(self.recipe.path, f"field 'local_teacher': {e}") from None
            self._teacher_started = False
        if start and not self._teacher_started:
            started = time.perf_counter()
            print(f"== run: local teacher: {self._teacher.describe()}", file=sys.stderr, flush=True)
            self._exit.enter_context(self._teacher)
            self._teacher_started = True
            print(
                f"   ready in {time.perf_counter() - started:.0f}s at {self._teacher.base_url}",
                file=sys.stderr,
            )
        return self._teacher

    def check_stages(self, plan: bool = False) -> None:
        """Every stage's config parsed, every file it reads there or written by an earlier stage, and no two
        stages writing one output, before anything runs: a typo in the last stage stopped a run only once
        the stages before it had run (a training among them). Each error names the recipe and the stage.
        With ``plan``, a stage waiting for a named dataset is the plan's to say (`metachunk data fetch`), and
        what reads after it is not checked."""
        import tempfile

        import yaml

        # each output, and the stage that writes it; the manifest so far is the runner's, for `data push`
        written = {os.path.realpath(self.state_dir / "regen_manifest.json"): "(the runner)"}
        with tempfile.TemporaryDirectory(prefix="metachunk-check-") as folder:
            for stage in self.recipe.stages:
                fitted = self.fitted(stage)
                path = Path(folder) / f"{stage.name}.yaml"
                path.write_text(
                    yaml.safe_dump(fitted.config, sort_keys=False, allow_unicode=True), encoding="utf-8"
                )
                try:
                    command, cfg = self.registry.config([*fitted.argv, "--config", str(path)])
                except MissingDataset:
                    if plan:
                        return
                    raise
                except InputError as e:
                    raise self._named_in_recipe(e, path, stage) from None
                for read in self.registry.inputs(command, cfg).paths:
                    # an hf:// dataset is the Hub's to find (a Path field has made "hf://" "hf:/")
                    local = "://" not in str(read) and not str(read).startswith("hf:/")
                    if local and not os.path.exists(read) and not _meets(read, written):
                        raise InputError(self.recipe.path, f"stage {stage.name!r} reads {read}, which is not there "
                                         "and no earlier stage writes it (a recipe that makes it runs first?)")  # fmt: skip
                # two stages writing one output: the later would replace the earlier's, every run
                for out in self.registry.outputs(command, cfg):
                    if written.setdefault(os.path.realpath(out), stage.name) != stage.name:
                        raise InputError(self.recipe.path, f"stages {written[os.path.realpath(out)]!r} and "
                                         f"{stage.name!r} both write {out}: give each its own output")  # fmt: skip
                self.written = frozenset(written)

    def plan(self, out=None) -> list[dict]:
        """Which stages would run, and what the teacher stages would cost; runs nothing."""
        out = out or sys.stdout
        rows, total = [], {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}
        upstream_writes: set[str] = set()  # the outputs of the stages that will run, as real paths
        unknown_upstream = False
        print(f"plan: {self.recipe.name} ({self.recipe.path}), state {self.state_dir}", file=out)
        self.check_stages(plan=True)
        for stage in self.recipe.stages:
            stage = self.fitted(stage)
            try:
                fp = self.fingerprint(stage, suffix=".plan.yaml")
            except MissingDataset as e:  # the plan says what to fetch; the run itself stops there
                unknown_upstream = True
                rows.append({"stage": stage.name, "run": stage.run, "status": "needs data", "estimate": None})
                print(
                    f"  {stage.name:<20} {stage.run:<26} needs `metachunk data fetch {e.dataset}`", file=out
                )
                continue
            except ModelNotFoundError as e:  # a model folder the recipe names but this machine lacks
                unknown_upstream = True
                rows.append(
                    {"stage": stage.name, "run": stage.run, "status": "needs a model", "estimate": None}
                )
                print(f"  {stage.name:<20} {stage.run:<26} needs a model: {e}", file=out)
                continue
            # as `run` decides: cached unless it reads what a stage before it will write again (a stage
            # the plan could not fingerprint may write anything)
            rewritten = unknown_upstream or any(_meets(r, upstream_writes) for r in fp.reads)
            if self.cached(stage, fp) and not rewritten:
                status = "cached"
            elif stage.name in self.rerun:
                status = "runs (--rerun)"
            elif fp.missing:
                status = f"runs once earlier stages write {', '.join(fp.missing)}"
            else:
                status = "runs"
            if status != "cached":
                upstream_writes.update(map(os.path.realpath, fp.outputs))
            estimate = None
            if status == "runs":
                estimate = self.estimate(stage)
                for k in total:
                    total[k] += (estimate or {}).get(k, 0)
            rows.append({"stage": stage.name, "run": stage.run, "status": status, "estimate": estimate})
            line = f"  {stage.name:<20} {stage.run:<26} {status}"
            if estimate:
                line += (f"  [{estimate['calls']} requests, {estimate['prompt_tokens']:,} prompt + at most "
                         f"{estimate['completion_tokens']:,} completion tokens, at most ${estimate['cost']:.4f}]")  # fmt: skip
            print(line, file=out)
        print(f"total for the stages that can be estimated now: {total['calls']} requests, "
              f"{total['prompt_tokens']:,} prompt tokens, at most {total['completion_tokens']:,} completion tokens, "
              f"at most ${total['cost']:.4f}; nothing was run or sent", file=out)  # fmt: skip
        from filelock import Timeout

        try:  # the digests it computed, for the next run; not while a run holds the state (it would erase its stages)
            with self._lock():
                self.state = {
                    **(_read_json(self.state_path) or {"stages": {}}),
                    "digests": self.digests.known,
                }
                self._save_state()
        except Timeout:
            pass
        return rows

    def estimate(self, stage: Stage) -> dict | None:
        """A teacher stage's requests, tokens and worst-case cost (its command's dry run, whose
        [`Result`][metachunk.command.Result] carries the estimate); None for any other stage."""
        path = self.state_dir / "stages" / f"{stage.name}.plan.yaml"
        with contextlib.redirect_stdout(io.StringIO()):  # the dry run's own table is for a person
            try:
                return self.registry.estimate([*stage.argv, "--config", str(path)])
            except InputError:  # an input an earlier stage has yet to write
                return {}

    def fingerprint(self, stage: Stage, suffix: str = ".yaml") -> Fingerprint:
        """The stage's config as its command will read it, written to ``stages/``, and its fingerprint.
        A bad value in it is the recipe's, and named there: the copy is the runner's."""
        path = self._write_stage_config(stage, suffix)
        try:
            fp = fingerprint(stage, self.registry, path, self.digests, self.written)
        except InputError as e:
            raise self._named_in_recipe(e, path, stage) from None
        self.prompts.update(fp.prompts)
        return fp

    def _named_in_recipe(self, error: InputError, path: Path, stage: Stage) -> InputError:
        """A bad value in the runner's copy of a stage's config (``path``) is the recipe's, and named there;
        any other error (another file's, a missing dataset, whose plan says to fetch it) stays as it is."""
        if type(error) is not InputError:
            return error
        if Path(error.path) == path:
            return InputError(self.recipe.path, f"stage {stage.name!r}, config: {error.reason}")
        return error

    def _write_stage_config(self, stage: Stage, suffix: str = ".yaml") -> Path:
        import yaml

        path = self.state_dir / "stages" / f"{stage.name}{suffix}"
        with AtomicWriter(path) as f:
            yaml.safe_dump(stage.config, f, sort_keys=False, allow_unicode=True)
        return path

    def _lock(self):
        """The state folder's lock, held for a whole run: two runs of one recipe had both run every stage,
        and a `--plan` beside a run saved the state it had read, erasing a stage the run had finished."""
        from filelock import FileLock

        self.state_dir.mkdir(parents=True, exist_ok=True)
        return FileLock(self.state_dir / "run.lock", timeout=0)

    def run(self) -> dict:
        from filelock import Timeout

        started = time.perf_counter()
        report = []
        empty: set[str] = set()  # what the empty stages of this run did not write
        with contextlib.ExitStack() as self._exit:
            try:
                self._exit.enter_context(self._lock())
            except Timeout:
                raise InputError(self.state_dir, "another `metachunk run` of this recipe is running on this "
                                 "state folder; wait for it, or give this one another state folder") from None  # fmt: skip
            self.state = _read_json(self.state_path) or {
                "stages": {},
                "digests": {},
            }  # as the last run left it
            self.digests = Digests(self.state.get("digests"))
            self.check_stages()
            for stage in self.recipe.stages:
                t0 = time.perf_counter()
                if stage.local_teacher:  # before the fingerprint: the backend decides the schema setting
                    self.local_teacher(start=False)
                fitted = self.fitted(stage)
                fp = self.fingerprint(fitted)
                # Before the cache: a stage whose input this run left empty has nothing to do, whatever an
                # earlier run of it made (that output is not this run's, and later stages must not read it).
                unwritten = [p for p in dict.fromkeys(fp.reads) if os.path.realpath(p) in empty]
                if unwritten and stage.on_empty_inputs == "skip":
                    print(f"== run: {stage.name} ({stage.run}): skipped, nothing to do: {', '.join(unwritten)} "
                          "was left empty upstream", file=sys.stderr, flush=True)  # fmt: skip
                    empty.update(map(os.path.realpath, fp.outputs))
                    report.append(self._entry(stage, fp, "empty", 0.0))
                    continue
                if self.cached(fitted, fp):
                    done = self.state["stages"][stage.name]
                    empty.update(map(os.path.realpath, done.get("empty", [])))
                    status = "empty" if done.get("empty") else "cached"
                    for out in fp.outputs:  # a later run that was killed writing them left its temps
                        remove_dead_temps_of(out)
                    print(
                        f"== run: {stage.name} ({stage.run}): {status}, skipped", file=sys.stderr, flush=True
                    )
                    report.append(self._entry(stage, fp, status, 0.0))
                    continue
                missing = [p for p in fp.missing if os.path.realpath(p) not in empty]
                if missing:
                    raise InputError(self.recipe.path, f"stage {stage.name!r}: missing input(s) {', '.join(missing)} "
                                     "(no earlier stage wrote them)")  # fmt: skip
                if stage.local_teacher:
                    try:
                        self.local_teacher(start=True)
                    except RuntimeError as e:  # it did not start, or died on its first completion
                        self._save_state()
                        print(
                            f"metachunk: stage {stage.name!r} needs the local teacher: {e}", file=sys.stderr
                        )
                        return {"failed": stage.name, "exit": 1}
                    fitted = self.fitted(stage)
                if self.registry.hook(stage.argv, "with_run_manifest"):  # the manifest so far goes along
                    self.write_manifest(report, time.perf_counter() - started)
                path = self._write_stage_config(fitted)
                argv = [*stage.argv, "--config", str(path)]
                print(f"\n== run: {stage.name}: metachunk {' '.join(argv)}", file=sys.stderr, flush=True)
                result = self.registry.run(argv)
                code = result.exit
                died = self._teacher.failure() if stage.local_teacher else None
                if died:  # its requests failed to connect: the stage's exit status does not tell
                    self._save_state()
                    print(f"metachunk: the local teacher {died} during stage {stage.name!r} (see "
                          f"{self._teacher.log}); the stage is not recorded as done, a rerun runs it again",
                          file=sys.stderr)  # fmt: skip
                    return {"failed": stage.name, "exit": code or 1}
                left_out = code == EXIT_SKIPPED and rows_left_out(result.rejects) > 0  # its on_bad_row: skip
                if code not in stage.allow_exit and not left_out:
                    self._save_state()
                    print(f"metachunk: stage {stage.name!r} exited with status {code}; fix it and rerun: "
                          "the stages before it are skipped", file=sys.stderr)  # fmt: skip
                    return {"failed": stage.name, "exit": code}
                nothing = code == EXIT_EMPTY
                outputs = {} if nothing else {p: self.digests.path(p) for p in fp.outputs if Path(p).exists()}
                self.state["stages"][stage.name] = {
                    "fingerprint": fp.sha256,
                    "outputs": outputs,
                    "exit": code,
                    "seconds": round(time.perf_counter() - t0, 2),  # what making it took, for later manifests
                    "summary": result.summary,
                    **({"empty": fp.outputs} if nothing else {}),
                    **({"rejects": result.rejects} if rows_left_out(result.rejects) else {}),
                    **({"retry": True} if result.retry else {}),
                }
                if result.retry:
                    print(f"metachunk: stage {stage.name!r} left requests a rerun can finish (failed in transport, "
                          "or not sent); it is recorded, and the next `metachunk run` runs it again, its "
                          "answers so far from the store", file=sys.stderr)  # fmt: skip
                if nothing:
                    empty.update(map(os.path.realpath, fp.outputs))
                self._save_state()
                report.append(self._entry(stage, fp, "empty" if nothing else "ran", time.perf_counter() - t0))
                self.write_manifest(report, time.perf_counter() - started)
        manifest = self.write_manifest(report, time.perf_counter() - started)
        self.print_summary(report, time.perf_counter() - started)
        return manifest

    def _entry(self, stage: Stage, fp: Fingerprint, status: str, seconds: float) -> dict:
        done = self.state["stages"].get(stage.name, {})
        return {"name": stage.name, "run": stage.run, "fingerprint": fp.sha256, "status": status,
                "seconds": round(seconds, 2), "inputs": fp.inputs, "models": fp.models,
                "outputs": done.get("outputs", {}), "teachers": fp.teachers,
                "summary": done.get("summary", {}),
                **({"rejects": done["rejects"]} if done.get("rejects") else {})}  # fmt: skip

    def write_manifest(self, report: list[dict], seconds: float) -> dict:
        what = {
            # The text as written, less any key or URL password in it (redaction.redact), and with each
            # absolute path by its last part (the manifest and the card it goes into are published).
            "recipe": {
                "path": shown_path(self.recipe.path),
                "sha256": self.recipe.sha256,
                "text": shown_paths_in(redact(self.recipe.text)),
            },
            "metachunk": self.version,
            "prompts": dict(sorted(self.prompts.items())),
            "stages": [_published(e) for e in report],
        }
        made = {"recipe": self.recipe.sha256,
                "stages": [[e["name"], e["run"], e["fingerprint"], sorted(v for v in e["outputs"].values() if v)]
                           for e in report]}  # fmt: skip
        sha = hashlib.sha256(json.dumps(made, ensure_ascii=False).encode()).hexdigest()
        manifest = {"schema_version": 1, "name": self.recipe.name, "manifest_sha256": sha, **what,
                    # seconds: this invocation; made_in_seconds: the run that made the stage's outputs
                    "run": {"stages": {e["name"]: {"status": e["status"], "seconds": e["seconds"],
                                                   "made_in_seconds": self.state["stages"].get(e["name"], {}).get(
                                                       "seconds", e["seconds"])} for e in report},
                            "wall_seconds": round(seconds, 2)}}  # fmt: skip
        write_json(self.state_dir / "regen_manifest.json", manifest)
        return manifest

    def print_summary(self, report: list[dict], seconds: float) -> None:
        header = f"{'stage':<22} {'command':<26} {'status':<7} {'seconds':>8}  summary"
        print(f"\n{header}\n{'-' * len(header)}")
        for e in report:
            summary = ", ".join(f"{k} {_cell(v)}" for k, v in e["summary"].items() if v is not None)
            print(f"{e['name']:<22} {e['run']:<26} {e['status']:<7} {e['seconds']:>8.1f}  {summary[:160]}")
        if self._teacher_started:
            print(f"local teacher: {self._teacher.describe()}")
        print(f"total {seconds:.1f} s; manifest {self.state_dir / 'regen_manifest.json'}")


def _cell(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_cell(v)}" for k, v in value.items()) + "}"
    return str(value)


@dataclass
class RunConfig:
    recipe: str = option(
        None, "the regeneration recipe (YAML), or the name of a shipped one", positional=True
    )
    plan: bool = option(
        False,
        "print which stages would run and the teacher stages' estimated requests, tokens and cost; "
        "run and send nothing (it writes only the recipe's state folder)",
    )
    rerun: list[str] | None = option(
        None,
        "run these stages even if cached (after a dependency upgrade that alters their output: the fingerprint "
        "covers metachunk's own code, not its dependencies'); the stages "
        "after them rerun only if their outputs' bytes change",
    )


def run(cfg: RunConfig, registry: Registry) -> Result:
    """``metachunk run``: ``registry`` is the CLI's table of commands, which runs each stage."""
    if cfg.recipe is None:
        raise InputError("command line", "usage: metachunk run RECIPE [--plan] [--rerun STAGE ...]")
    recipe = load_recipe(cfg.recipe, registry)
    runner = Runner(recipe, registry, cfg.rerun or ())
    if cfg.plan:
        runner.plan()
        return Result()
    result = runner.run()
    if "failed" in result:
        return Result(result.get("exit", 0))
    left_out = total_rejects([stage.get("rejects") for stage in result["stages"]])
    return Result(skipped_exit(left_out), rejects=left_out)


def _published(entry: dict) -> dict:
    """A stage's report entry as the manifest records it: data push uploads the manifest, so a path
    (an input, an output, a local model's or a served teacher's folder, the rejects file) is shown as a
    card shows it (`markdown.shown_path`), never with the user's home; this invocation's status and
    seconds are the manifest's ``run``."""
    shown = {k: v for k, v in entry.items() if k not in ("status", "seconds")}
    for key in ("inputs", "outputs"):
        shown[key] = shown_keys(entry[key])
    shown["models"] = {
        name: {**facts, "name": shown_argument(facts["name"])}
        for name, facts in shown_keys(entry["models"]).items()
    }
    shown["teachers"] = {stage: shown_argument(model) for stage, model in entry["teachers"].items()}
    if entry.get("rejects", {}).get("file"):
        shown["rejects"] = {**entry["rejects"], "file": shown_argument(entry["rejects"]["file"])}
    return shown
