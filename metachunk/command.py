"""The contract every ``metachunk`` command keeps, and the table that lists them.

A command is a module (``metachunk.distill.sample``, ``metachunk.eval.qa``, ...) that exports:

* ``CONFIG``: its config dataclass ([`metachunk.config`][metachunk.config]: YAML recipe and CLI flags);
* ``run(cfg) -> Result``: the work, returning its exit status and what it made;
* ``inputs(cfg) -> Reads``: the files, folders, models and prompt or schema files it reads;
* ``outputs(cfg) -> list[str]``: the paths it writes, which a later run checks are still as it left them
  (and which the CLI refuses when they would replace what ``inputs`` names:
  [`refuse_writing_over_inputs`][metachunk.command.refuse_writing_over_inputs]).

Optionally ``estimate(cfg) -> Result`` (a teacher stage's dry run: ``Result.estimate``),
``teachers(cfg) -> dict[str, str]`` (the model name of each teacher block it sends requests with),
``served(config, teacher) -> dict`` (its recipe mapping with those blocks pointed at a served
teacher: ``metachunk run``'s ``local_teacher: true``), ``with_run_manifest(config, path) -> dict``
(its recipe mapping taking a regeneration run's manifest along: ``data push``),
``parse_config(argv)`` (``train`` reads its config with TRL's own parser) and
``identity(cfg) -> dict``, the settings that decide what the run makes (default:
[`metachunk.config.computed`][metachunk.config.computed], the config less its runtime fields).

The CLI (`metachunk.cli`) is a table of [`Command`][metachunk.command.Command] rows over these modules, and the
regeneration runner (`metachunk.regen`) fingerprints, skips, summarises and estimates stages
through the same contract, handed to it as a [`Registry`][metachunk.command.Registry]: it never parses a command's
printed output nor reads another module's manifest.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from metachunk.artifacts import EXIT_SKIPPED, InputError


@dataclass(frozen=True)
class Reads:
    """What a run reads: ``paths`` (files and folders, hashed by content), ``models`` (presets,
    local model folders or Hub ids, fingerprinted by `metachunk.models.fingerprint`) and
    ``prompts`` (prompt and answer-schema files, hashed by `metachunk.prompts.file_hashes`)."""

    paths: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    prompts: tuple[Path, ...] = ()

    @classmethod
    def of(cls, paths=(), models=(), prompts=()) -> Reads:
        """Drops what is unset (None, ""), keeps the first of each duplicate, in order."""

        def keep(values):
            return tuple(dict.fromkeys(str(v) for v in values if v not in (None, "")))

        return cls(keep(paths), keep(models), tuple(dict.fromkeys(Path(p) for p in prompts)))


def refuse_writing_over_inputs(module: ModuleType, cfg) -> None:
    """Refuse a run whose output would replace what it reads: an output that is an input, one inside
    an input folder (a shard of the corpus; a run's own metrics; a resume would read it back as
    input), or an output folder holding an input (replaced by the run's own files)."""
    reads, writes = getattr(module, "inputs", None), getattr(module, "outputs", None)
    if reads is None or writes is None:
        return
    inputs = [Path(p).resolve() for p in reads(cfg).paths]
    for output in writes(cfg):
        if output in (None, ""):
            continue
        out = Path(output).resolve()
        for read in inputs:
            if out == read:
                raise InputError(output, "is the input the run reads: write the output elsewhere")
            if read in out.parents and read.is_dir():
                raise InputError(output, f"an output inside the input folder {read}: write it elsewhere")
            if out in read.parents and (out.is_dir() or not out.suffix):
                raise InputError(output, f"an output folder holding what the run reads ({read}): it would be "
                                 "replaced; write it elsewhere")  # fmt: skip


@dataclass
class Result:
    """What a run did: its exit status, the counts it reports (``summary``, a flat mapping a
    regeneration manifest records), for a teacher stage's dry run, its ``estimate``
    (``calls``, ``prompt_tokens``, ``completion_tokens``, ``cost``) and, under ``--on-bad-row
    skip``, its ``rejects`` (``rows``, and where there were any, the rejects ``file`` and its
    ``sha256``: `metachunk.sources.Rejects.write`)."""

    exit: int = 0
    summary: dict = field(default_factory=dict)
    estimate: dict | None = None
    rejects: dict | None = None
    # A rerun can finish what this run could not (teacher requests that failed in transport, or were
    # never sent): `metachunk run` records the stage, and runs it again the next time.
    retry: bool = False

    @classmethod
    def with_rejects(cls, summary: dict, rejects: dict | None, exit: int = 0) -> Result:
        """A run that read under ``--on-bad-row``: its summary counts the rows it left out
        (``rejected_rows``), and it exits `EXIT_SKIPPED` when there were
        any, unless ``exit`` already says something (a teacher's trouble says more)."""
        if rejects:
            summary = {**summary, "rejected_rows": rejects["rows"]}
        left_out = bool(rejects and rejects.get("rows"))
        return cls(exit or (EXIT_SKIPPED if left_out else 0), summary, rejects=rejects)


@dataclass(frozen=True)
class Command:
    """One verb: its words (``("data", "sample")``), the module that implements it (imported when
    the verb is used, so ``metachunk --help`` stays fast), its help, and the names of the module's
    config class and run function where they differ from ``CONFIG`` and ``run``. ``preset`` fixes
    config fields the words already say (``distill rewrite``: ``task: rewrite``)."""

    words: tuple[str, ...]
    module: str
    help: str
    config: str = "CONFIG"
    run: str = "run"
    preset: dict = field(default_factory=dict)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def name(self) -> str:
        return " ".join(self.words)

    @property
    def is_stage(self) -> bool:
        """A command a regeneration stage can run: its module says what it reads and writes."""
        module = self.load()
        return hasattr(module, "inputs") and hasattr(module, "outputs")


class Registry:
    """The commands, and the two things a runner asks of them: a stage's config ([`config`][metachunk.command.Registry.config])
    and its run (`run`), both from the argv the stage would be run with."""

    def __init__(self, commands: list[Command], parse: Callable, run: Callable, computed: Callable):
        self.commands = commands
        self._parse = parse  # argv -> (Command, cfg); raises InputError
        self._run = run  # argv -> Result, with the CLI's error handling
        self._computed = computed  # cfg -> its settings less the runtime ones (metachunk.config.computed)

    def config(self, argv: list[str]):
        """``(command, cfg)`` for ``argv`` (``["distill", "rewrite", "--config", PATH]``)."""
        return self._parse(argv)

    def run(self, argv: list[str]) -> Result:
        return self._run(argv)

    def find(self, words: list[str]) -> Command:
        """The command a stage's ``run:`` words name (``data build-sft moc-expert``: ``data build-sft``)."""
        matches = [c for c in self.commands if tuple(words[: len(c.words)]) == c.words]
        if not matches:
            raise KeyError(" ".join(words))
        return max(matches, key=lambda c: len(c.words))

    def hook(self, words: list[str], name: str):
        """The optional contract function ``name`` of the command ``words`` name, or None."""
        return getattr(self.find(words).load(), name, None)

    def estimate(self, argv: list[str]) -> dict | None:
        """A teacher stage's dry run (``calls``, ``prompt_tokens``, ``completion_tokens``, ``cost``);
        None for a command that sends no teacher requests (its module has no ``estimate``)."""
        command, cfg = self.config(argv)
        module = command.load()
        return module.estimate(cfg).estimate if hasattr(module, "estimate") else None

    def inputs(self, command: Command, cfg) -> Reads:
        return command.load().inputs(cfg)

    def outputs(self, command: Command, cfg) -> list[str]:
        return [str(p) for p in command.load().outputs(cfg)]

    def identity(self, command: Command, cfg) -> dict:
        """The settings that decide what the run makes: the module's ``identity``, or its config
        less the runtime fields."""
        module = command.load()
        return module.identity(cfg) if hasattr(module, "identity") else self._computed(cfg)
