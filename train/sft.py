"""Supervised fine-tuning of the student (rewriter, summarizer, MoC router/experts) with TRL.

One recipe, top to bottom: parse the config, check it, load the dataset and the model, train,
save, plot the loss. ``python -m metachunk.train --config recipes/train/cpu_smoke.yaml [--flag value ...]``.

The config is TRL's own: `ModelDataArguments` (what to train, on what) plus TRL's
``SFTConfig`` (how), read by TRL's ``TrlParser`` from the recipe YAML with command-line flags on
top, every field with its help text (``--help``). TRL users know these flags; a recipe is the
same file ``trl sft`` reads: the model and dataset fields carry TRL's names (``model_name_or_path``,
``dataset_name``, ``dataset_test_split``; ``tests/test_recipes.py`` parses every recipe with
``trl sft``'s own parser).

The loss is Eq. 3 of Meta-Chunking up to a per-batch scale: cross-entropy on the completion tokens
only, averaged over the batch's completion tokens (TRL's) where Eq. 3 divides by its rows. The rows are
conversational prompt–completion pairs (``metachunk data build-sft``), so TRL renders them with
the tokenizer's chat template and masks every prompt token out of the labels
(``completion_only_loss``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.artifacts import EXIT_EMPTY, EmptyInput, read_json, write_figure
from metachunk.command import Reads, Result
from metachunk.config import check_number


@dataclass
class ModelDataArguments:
    # model_name_or_path, dataset_name and dataset_test_split are the names of TRL's ModelConfig and
    # ScriptArguments, so that `trl sft --config` reads the same recipe
    model_name_or_path: str = field(
        metadata={
            "help": "base model: a preset name (smollm2, ...), a local HF model dir or a Hub id ORG/NAME"
        }
    )
    dataset_name: str = field(
        metadata={
            "help": "dataset dir written by `metachunk data build-sft` (parquet + card), or a Hub dataset id"
        }
    )
    dataset_test_split: str = field(
        default="validation",
        metadata={
            "help": "the split evaluated during training; build-sft writes 'validation' (`trl sft` defaults "
            "to 'test', so every recipe names it)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "weights dtype: auto (the checkpoint's), float32, bfloat16, float16"},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "attention kernel: sdpa, eager, flex_attention (GPU: no backward on CPU), flash_attention_2 "
            "(GPU, flash-attn installed); unset, transformers picks (sdpa where the model has it); packing / "
            "padding_free need one of these"
        },
    )
    max_train_rows: int | None = field(default=None, metadata={"help": "use only the first N training rows"})
    # LoRA is opt-in; full fine-tuning is the paper's setup. Same names as TRL's ModelConfig.
    use_peft: bool = field(
        default=False, metadata={"help": "train a LoRA adapter (peft) instead of all weights"}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling alpha"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on the LoRA branch"})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "module names to adapt; default: every linear layer but the LM head"}
    )


@dataclass
class TrainConfig:
    """What ``metachunk train`` runs: TRL's two config objects, and the argv they were read from
    (the run's facts record it). Read by `parse_config`, with TRL's own parser."""

    model_args: ModelDataArguments
    sft_args: object  # trl.SFTConfig
    argv: list[str]


def parse_config(argv: list[str]) -> TrainConfig:
    """The config alone (the dataset is checked when the run starts, `run`); a bad field is a ValueError."""
    model_args, sft_args = parse_args(argv, check_inputs=False)
    return TrainConfig(model_args, sft_args, list(argv))


def parse_args(argv: list[str] | None = None, check_inputs: bool = True):
    """``(ModelDataArguments, SFTConfig)`` from ``--config`` YAML and flags; errors name the field."""
    from metachunk.train.distributed import check_deepspeed_file
    from trl import SFTConfig, TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    # TrlParser finds the recipe as the word after "--config" only: --config=FILE had been left unread
    argv = [part for a in argv for part in (a.split("=", 1) if a.startswith("--config=") else [a])]
    argv = shipped_config(argv)
    recipe = read_recipe(argv)  # TrlParser reads it too, but a missing file or bad YAML is a traceback there
    check_value_types(recipe, argv, (ModelDataArguments, SFTConfig))
    check_renamed(recipe, argv)
    check_deepspeed_file(recipe, argv)  # SFTConfig reads the JSON as it is built
    argv = argv + default_checkpointing_argv(recipe, argv, SFTConfig)

    class RecipeParser(TrlParser):
        def error(self, message: str):
            # argparse prints the usage of every SFTConfig flag (9 KB) before its one line; a recipe's
            # value is named as its field instead (TrlParser passes the YAML's values as defaults).
            flag, _, problem = message.partition(": ")
            name = flag.removeprefix("argument --").split("/")[0]
            flags = {a.split("=")[0].removeprefix("--").replace("-", "_") for a in argv if a.startswith("--")}
            given = any(name.startswith(f) for f in flags if f)  # argparse takes an abbreviated flag too
            if flag.startswith("argument --") and name in recipe and not given:
                raise ValueError(f"--config {argv[argv.index('--config') + 1]}: field '{name}': {problem}")
            raise ValueError(message)

    parser = RecipeParser(
        (ModelDataArguments, SFTConfig),
        prog="metachunk train",
        usage="metachunk train --config RECIPE.yaml [--FIELD VALUE ...]\n"
        "       deepspeed --module metachunk.train --config RECIPE.yaml [--FIELD VALUE ...]",
        description="Fine-tune a student with TRL's SFTTrainer. --config names a recipe (recipes/train/, or a "
        "shipped one by name); every field below can be set in it, and a flag overrides the recipe.",
    )
    model_args, sft_args = parser.parse_args_and_config(argv)
    if (
        sft_args.hub_token
    ):  # any spelling (--hub-token, an abbreviation): the record and card quote the command
        raise ValueError(
            "field 'hub_token': the Hub token is read from HF_TOKEN only, never from a recipe or a flag"
        )
    check_values(sft_args)
    if check_inputs:
        check(model_args, sft_args)
    dtype = weights_dtype(model_args)
    if sft_args.bf16 and not bf16_given(recipe, argv) and dtype != "bfloat16":
        # TRL's SFTConfig turns an unset bf16 into True: bf16 autocast over float32 weights, and under
        # DeepSpeed bf16 weights trained and saved. Unset, it follows the weights instead. SFTConfig
        # derives its mixed precision (and DeepSpeed's) as it is built, hence a second parse, not a setattr.
        model_args, sft_args = parser.parse_args_and_config(argv + ["--bf16", "false"])
    check_precision(dtype, model_args, sft_args)
    return model_args, sft_args


def shipped_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config NAME`` pointing at the shipped recipe NAME when no such file exists
    (`metachunk.shipped`); one whose paths to shipped configs must point at the shipped copies
    is read through a localized copy (TrlParser reads the file itself), kept in the cache under its
    content's hash: one file per distinct recipe, however many runs and ranks read it."""
    import hashlib

    import yaml

    from metachunk import shipped
    from metachunk.artifacts import AtomicWriter, cache_dir

    if "--config" not in argv or argv.index("--config") + 1 == len(argv):
        return argv
    i = argv.index("--config") + 1
    path = shipped.resolve(argv[i])
    if shipped.is_shipped(path) and path.suffix in (".yaml", ".yml"):
        recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
        local = shipped.localize(recipe, True)
        if local != recipe:
            text = yaml.safe_dump(local, sort_keys=False)
            path = cache_dir() / "recipes" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}-{path.name}"
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                with AtomicWriter(path) as f:
                    f.write(text)
    return [*argv[:i], str(path), *argv[i + 1 :]]


def read_recipe(argv: list[str]) -> dict:
    """The ``--config`` YAML (``{}`` without one), read the way TrlParser reads it, as a one-line error."""
    import yaml

    from metachunk.config import load_yaml_text

    if "--config" not in argv:
        return {}
    i = argv.index("--config")
    if i + 1 == len(argv):
        raise ValueError("--config needs a recipe file (recipes/train/*.yaml)")
    path = Path(argv[i + 1])
    try:
        recipe = load_yaml_text(path.read_text(encoding="utf-8"))  # a key written twice: refused
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise ValueError(f"--config {path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"--config {path}: not a YAML mapping of field: value")
    from metachunk.config import check_keys

    check_keys(recipe, path)
    return recipe


SCALARS = {str, int, float, bool}  # a str field's, an enum's: one value, which argparse converts


def check_value_types(recipe: dict, argv: list[str], classes) -> None:
    """Each recipe value has its field's YAML type. TrlParser hands a recipe's values to argparse
    as defaults, and argparse converts and checks a default only when it is a string: a list where
    a number goes (``max_steps: [1, 2]``) reached the Trainer after the model had loaded. A string
    is left to argparse, which converts it as it converts a flag."""
    import dataclasses
    import types
    import typing

    path = argv[argv.index("--config") + 1] if "--config" in argv else "the recipe"
    fields = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        fields |= {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}

    def accepts(kind) -> set[type]:
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            return set().union(*(accepts(a) for a in typing.get_args(kind) if a is not type(None)))
        kind = typing.get_origin(kind) or kind
        if kind in (list, tuple, set):
            return {list}
        if kind is dict:
            return {dict}
        return {bool: {bool}, int: {int}, float: {int, float}}.get(kind, SCALARS)

    for key, value in recipe.items():
        if not isinstance(key, str):
            raise ValueError(f"--config {path}: key {key!r} is not a field name; quote it")
        if key not in fields or value is None or isinstance(value, str):
            continue  # an unknown name is argparse's to refuse, with its usage
        got = type(value)
        if got not in accepts(fields[key]):
            kinds = accepts(fields[key])
            names = "one value" if kinds == SCALARS else " or ".join(sorted(t.__name__ for t in kinds))
            raise ValueError(f"--config {path}: field {key!r} must be {names}, got {got.__name__} {value!r}")


RENAMED = {"model": "model_name_or_path", "dataset": "dataset_name"}  # the old names: TRL's now


# transformers 5's new names for TRL's (deprecated aliases): the old one is read only when the new one is unset
ALIASED = {"gradient_checkpointing": "activation_checkpointing",
           "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}  # fmt: skip


def field_given(name: str, recipe: dict, argv: list[str]) -> bool:
    """Whether the recipe or a flag sets field ``name``. A flag is any spelling HfArgumentParser
    takes: ``--a_b`` and ``--a-b``, and for a boolean that defaults to True ``--no_a_b`` and
    ``--no-a-b`` (``--no_gradient_checkpointing``, which ``--help`` lists)."""
    spellings = {name, f"no_{name}"}
    flags = {f"--{n}" for n in spellings} | {f"--{n.replace('_', '-')}" for n in spellings}
    return name in recipe or any(a.split("=", 1)[0] in flags for a in argv)


def check_renamed(recipe: dict, argv: list[str]) -> None:
    """An old field name, in the recipe or as a flag, is an error that names the new one (argparse alone
    would call ``--model`` ambiguous, and TrlParser a recipe's ``model:`` unknown). A deprecated alias
    given beside its new name is one too: transformers would ignore it without a word (every shipped
    recipe sets ``activation_checkpointing``, so ``--gradient_checkpointing false`` did nothing)."""

    def given(name: str) -> bool:
        return field_given(name, recipe, argv)

    for old, new in RENAMED.items():
        if given(old):
            raise ValueError(f"field {old!r} is now {new!r}, TRL's name (`trl sft` reads the same recipes)")
    for old, new in ALIASED.items():
        if given(old) and given(new):
            raise ValueError(f"field {old!r} is transformers' old name for {new!r}, which is also set: it would be "
                             f"ignored; set {new!r} (--{new})")  # fmt: skip


def default_checkpointing_argv(recipe: dict, argv: list[str], sft_config) -> list[str]:
    """``--activation_checkpointing`` at TRL's default, when neither the recipe nor a flag sets it (nor its
    old name). TRL's SFTConfig gives its default (True) under transformers' deprecated name
    ``gradient_checkpointing``, which prints transformers' FutureWarning; said under the new name, it is
    the same value without the warning."""
    if any(field_given(n, recipe, argv) for n in ("activation_checkpointing", "gradient_checkpointing")):
        return []
    trl_default = sft_config.__dataclass_fields__["gradient_checkpointing"].default
    return ["--activation_checkpointing", str(trl_default)]


def bf16_given(recipe: dict, argv: list[str]) -> bool:
    """Whether the recipe or a flag sets bf16 (SFTConfig cannot tell: it turns None into True)."""
    return recipe.get("bf16") is not None or any(a == "--bf16" or a.startswith("--bf16=") for a in argv)


def weights_dtype(model_args: ModelDataArguments) -> str | None:
    """The dtype the weights load in: ``dtype``, or for ``auto`` the checkpoint's ``config.json``
    (None when it does not say). Resolves the model only for ``auto``."""
    if model_args.dtype != "auto":
        return model_args.dtype
    from metachunk.models import resolve

    config = read_json(resolve(model_args.model_name_or_path) / "config.json")
    return config.get("dtype") or config.get("torch_dtype")


def check_precision(dtype: str | None, model_args: ModelDataArguments, sft_args) -> None:
    """The weights' dtype and the mixed precision must agree: bf16 autocast over float16 weights (or fp16
    over bfloat16) is a contradiction, and so is any autocast over float32 weights on CPU, where it buys
    nothing and changes every number (under DeepSpeed, the weights are trained and saved in 16 bits)."""
    from metachunk.train.distributed import on_cpu

    autocast = autocast_of(sft_args)
    if autocast is None or dtype is None:
        return
    # what asked for it: the field, or accelerate's environment (`accelerate launch --mixed_precision`)
    source = f"{autocast}: true" if getattr(sft_args, autocast) else f"ACCELERATE_MIXED_PRECISION={autocast}"
    named = f"{dtype} (auto: the checkpoint's)" if model_args.dtype == "auto" else dtype
    if dtype in ("bfloat16", "float16") and {"bfloat16": "bf16", "float16": "fp16"}[dtype] != autocast:
        raise ValueError(
            f"field 'dtype' is {named} but {source} asks for {autocast} mixed precision: 16-bit weights take "
            "the mixed precision of their own type (bfloat16: bf16), or none"
        )
    if dtype == "float32" and on_cpu(sft_args):
        raise ValueError(
            f"field 'dtype' is {named} but {source} asks for {autocast} mixed precision on CPU: "
            f"set {autocast}: false (--{autocast} false) to train in float32, or dtype: bfloat16 with bf16: true"
        )


def autocast_of(sft_args) -> str | None:
    """The mixed precision the Trainer hands to accelerate: "bf16", "fp16" or None. Besides bf16 / fp16 it
    takes ``ACCELERATE_MIXED_PRECISION`` when neither is set."""
    mixed = getattr(sft_args, "mixed_precision", "no")
    return mixed if mixed in ("bf16", "fp16") else None


def check_values(sft_args) -> None:
    """Values that torch or the Trainer would refuse only once the model has loaded, with a traceback
    (no file is read: `metachunk run` checks them before its first stage)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(sft_args, name) < 1:  # else torch's sampler or the Trainer fails once the model has loaded
            raise ValueError(f"field {name!r} must be >= 1, got {getattr(sft_args, name)}")
    check_number(sft_args, "learning_rate", low=0.0)  # AdamW refuses NaN and negatives, after the load
    check_number(sft_args, "num_train_epochs", low=0.0)
    if sft_args.max_steps <= 0 and sft_args.num_train_epochs == 0:
        raise ValueError(
            "fields 'max_steps' and 'num_train_epochs': both say no step; nothing would be trained"
        )


def lora_targets(value: str | list[str] | None) -> str | list[str] | None:
    """PEFT's ``target_modules`` for a recipe value or flags. PEFT reads a string as one regular
    expression over the whole module name (``all-linear``: its shorthand), a list as module names: a
    recipe's ``lora_target_modules: q_proj`` means the module, as the flag does (``[q_proj]``), while
    ``all-linear`` or a pattern stays a string in either form (TRL unwraps a one-item list the same way)."""
    items = [value] if isinstance(value, str) else value
    if items and len(items) == 1 and (items[0] == "all-linear" or set(items[0]) & set(".*+?[]()|^$\\")):
        return items[0]
    return items


def check(model_args: ModelDataArguments, sft_args) -> None:
    """Fail before any model loads."""
    if model_args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(
            f"field 'dtype' must be auto, float32, bfloat16 or float16, got {model_args.dtype!r}"
        )
    if not Path(model_args.dataset_name).exists():  # a Hub id: the dataset repo's snapshot (metachunk.hub)
        from metachunk import hub

        if hub.parse_hub_id(model_args.dataset_name, "dataset") is not None:
            try:
                model_args.dataset_name = str(hub.snapshot(model_args.dataset_name, "dataset"))
            except hub.HubNotFound as e:
                raise ValueError(f"field 'dataset_name': {e}") from None
    if not (Path(model_args.dataset_name) / "data").is_dir():
        raise ValueError(
            f"field 'dataset_name': {model_args.dataset_name} has no data/ dir (run `metachunk data build-sft`)"
        )
    report = Path(model_args.dataset_name) / "build_report.json"
    rows = read_json(report).get("rows", {}) if report.is_file() else {}
    if rows.get("train") == 0:  # build-sft's filters may leave a small run nothing; that is not a crash
        raise EmptyInput(model_args.dataset_name, "the 'train' split has no rows: nothing to train")
    if sft_args.eval_strategy != "no":
        if rows.get(model_args.dataset_test_split) == 0:
            raise ValueError(
                f"field 'eval_strategy' is '{sft_args.eval_strategy.value}' but {model_args.dataset_name} has no "
                "validation rows: rebuild it with a validation_fraction, or pass --eval_strategy no"
            )
    if model_args.use_peft and not 0 < model_args.lora_r:
        raise ValueError(f"field 'lora_r' must be >= 1, got {model_args.lora_r}")
    if (
        model_args.use_peft and not 0 <= model_args.lora_dropout < 1
    ):  # torch's Dropout refuses it after the load
        raise ValueError(f"field 'lora_dropout' must be in [0, 1), got {model_args.lora_dropout}")
    model_args.lora_target_modules = lora_targets(model_args.lora_target_modules)
    if model_args.max_train_rows is not None and model_args.max_train_rows < 1:
        raise ValueError(
            f"field 'max_train_rows' must be >= 1 (or unset: every row), got {model_args.max_train_rows}"
        )
    if Path(sft_args.output_dir).exists() and not Path(sft_args.output_dir).is_dir():
        raise ValueError(
            f"field 'output_dir': {sft_args.output_dir} is a file; checkpoints are written in a folder"
        )
    template = sft_args.chat_template_path
    if template and str(template).endswith((".jinja", ".j2")) and not Path(template).is_file():
        raise ValueError(f"field 'chat_template_path': no file {template}")
    from metachunk.train.distributed import (
        check_deepspeed,  # --deepspeed JSON, or accelerate's DeepSpeed config
    )

    check_deepspeed(sft_args)
    if sft_args.completion_only_loss is False:
        raise ValueError(
            "field 'completion_only_loss' must stay on: the loss is on the completion only (Eq. 3)"
        )
    check_packing(sft_args)
    # an attention asked for is checked now; the one transformers picks, once the model has loaded
    if model_args.attn_implementation is not None:
        check_attention(model_args.attn_implementation, sft_args)
    if model_args.attn_implementation == "flex_attention" and sft_args.use_cpu:
        # it would load and run the first forward, then fail in backward
        raise ValueError(
            "field 'attn_implementation': flex_attention has no backward on CPU in PyTorch; use sdpa (or eager) "
            "with use_cpu"
        )
    check_report_to(sft_args.report_to)
    if sft_args.use_liger_kernel:
        from transformers.utils import is_liger_kernel_available

        if sft_args.use_cpu or not is_liger_kernel_available():
            raise ValueError(
                "field 'use_liger_kernel' needs a CUDA GPU and `pip install liger-kernel` (Triton kernels); "
                "not available here"
            )


def check_report_to(report_to: list[str]) -> None:
    """Names the Trainer knows, and installed (it would fail only after the model loads)."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    unknown = [name for name in report_to if name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(
            f"field 'report_to': unknown {', '.join(map(repr, unknown))}; use none, all or any of "
            + ", ".join(INTEGRATION_TO_CALLBACK)
        )
    available = get_available_reporting_integrations()
    # azure_ml (hidden when mlflow is installed) and flyte are not in transformers' availability list
    missing = [name for name in report_to if name not in available and name not in ("azure_ml", "flyte")]
    if missing:
        raise ValueError(
            f"field 'report_to': {', '.join(missing)} is not installed (pip install it, or drop it)"
        )


def padding_free(sft_args) -> bool:
    """TRL's rule: ``padding_free``, or ``packing`` with a bfd strategy (it flattens the packed rows)."""
    return bool(
        sft_args.padding_free or (sft_args.packing and sft_args.packing_strategy in ("bfd", "bfd_split"))
    )


def check_packing(sft_args) -> None:
    """What TRL's SFTTrainer would refuse or do silently, refused before any model loads."""
    evaluates = sft_args.eval_strategy != "no"
    if (sft_args.packing or (evaluates and sft_args.eval_packing)) and sft_args.max_length is None:
        # SFTTrainer raises "When packing is enabled, `max_length` can't be `None`" once the model is loaded.
        raise ValueError(
            "field 'max_length': packing cuts rows into sequences of max_length tokens, so it needs one "
            "(--max_length 12288, say)"
        )
    if sft_args.padding_free and not sft_args.packing and sft_args.max_length is not None:
        raise ValueError(
            "field 'padding_free' without packing does not truncate rows to max_length: set max_length: null "
            "(--max_length None), or use --packing true (bfd, which truncates each row at max_length)"
        )


def check_attention(impl: str, sft_args) -> None:
    """Padding-free batches are one flattened row per micro-batch, the rows told apart only by ``position_ids``
    restarting at 0. transformers 5 turns that into a block-diagonal causal mask for sdpa, eager and flex_attention
    (``masking_utils.find_packed_sequence_indices``); the flash-attention kernels take the boundaries (``cu_seq_lens``)
    from TRL's collator. Any other attention would let the rows attend to each other, silently."""
    if padding_free(sft_args) and impl not in ("sdpa", "eager", "flex_attention") and "flash" not in impl:
        raise ValueError(
            f"field 'attn_implementation': {impl!r} cannot keep the rows of a packed / padding-free batch apart; "
            "use sdpa, eager, flex_attention or flash_attention_2"
        )


def dense_attention_note(impl: str, sft_args) -> str | None:
    """What a padding-free run is told when its attention computes a flattened row's whole square under the
    block-diagonal mask: sdpa and eager do. flex attention gets the mask as a BlockMask and skips the blocks
    masked out whole; flash-attention's varlen kernel never sees the other rows."""
    if not padding_free(sft_args) or impl not in ("sdpa", "eager"):
        return None
    return (
        f"padding-free batches with {impl}: each micro-batch is one flattened row and attention is computed "
        "densely under a block-diagonal mask (time and memory quadratic in the row); see recipes/train/README.md"
    )


def master_weights_note(dtype: str, model_args: ModelDataArguments, sft_args) -> str | None:
    """What a full fine-tune of 16-bit weights without DeepSpeed is told: the optimizer steps the 16-bit
    weights themselves. DeepSpeed's bf16 engine keeps an fp32 master copy; the Trainer keeps none, so an
    update smaller than a weight's last bit (bfloat16 keeps 8 bits: lr 1e-5 moves few) is rounded away."""
    from metachunk.train.distributed import deepspeed_config_of

    # an accelerate config may hold DeepSpeed's settings inline, with no file for deepspeed_config_of to name
    under_deepspeed = (
        deepspeed_config_of(sft_args) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    )
    if dtype not in ("bfloat16", "float16") or model_args.use_peft or under_deepspeed:
        return None
    return (
        f"{dtype} weights trained without DeepSpeed: the optimizer updates them in {dtype}, with no float32 master "
        "copy, and small updates round away; train under deepspeed (its bf16 engine keeps one), or set dtype: "
        "float32 with bf16: true"
    )


def resume_point(sft_args) -> str | None:
    """``--resume_from_checkpoint latest`` (the newest whole checkpoint in ``output_dir``) or a path."""
    wanted = sft_args.resume_from_checkpoint
    if wanted in (None, ""):
        return None
    if str(wanted).lower() in ("latest", "true"):
        last = last_whole_checkpoint(Path(sft_args.output_dir))  # an output_dir not there: none
        if last is None:
            raise ValueError(
                f"field 'resume_from_checkpoint': no whole checkpoint-* in {sft_args.output_dir}"
            )
    elif not Path(wanted).is_dir():
        raise ValueError(f"field 'resume_from_checkpoint': {wanted} is not a checkpoint dir")
    elif not whole_checkpoint(
        Path(wanted)
    ):  # a dataset folder, a save cut short: refused before the model loads
        raise ValueError(
            f"field 'resume_from_checkpoint': {wanted} holds no whole {TRAINER_STATE}: not a checkpoint, "
            "or its save was cut short (`latest` takes the newest whole one)"
        )
    else:
        last = str(wanted)
    check_zero_world_size(Path(last))
    return last


def check_zero_world_size(checkpoint: Path) -> None:
    """A DeepSpeed ZeRO checkpoint holds one optimizer shard per data-parallel rank, and DeepSpeed
    refuses to load it into another number of ranks (``ZeRORuntimeException``), after the model has
    loaded: a job saved on 2 GPUs and requeued on 1 is refused here, before the load."""
    latest = checkpoint / "latest"
    if not latest.is_file():
        return  # not DeepSpeed's: the Trainer's own optimizer.pt loads on any world size
    shards = len(list((checkpoint / latest.read_text(encoding="utf-8").strip()).glob("*_optim_states.pt")))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if shards and shards != world:
        raise ValueError(
            f"field 'resume_from_checkpoint': {checkpoint} was saved by {shards} processes, and this run has "
            f"{world}: DeepSpeed loads a ZeRO checkpoint into as many as saved it (launch with --num_gpus "
            f"{shards}, or convert it with DeepSpeed's ds_to_universal.py and load it universally)"
        )


TRAINER_STATE = "trainer_state.json"  # transformers.trainer's TRAINER_STATE_NAME (not in trainer_utils)


def whole_checkpoint(folder: Path) -> bool:
    """``folder``'s ``trainer_state.json`` is there and reads as JSON. The Trainer writes that file last (after the
    weights, optimizer, scheduler and RNG states), and opens it before writing it: until then, the save is partial."""
    try:
        json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return False


def last_whole_checkpoint(output_dir: Path) -> str | None:
    """The newest `whole_checkpoint` ``checkpoint-N``. A run killed while saving leaves a newer, partial one;
    transformers' ``get_last_checkpoint`` takes the highest number and the resume then fails on it. A partial
    one is skipped, and said."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    numbered = []
    for folder in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = folder.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if folder.is_dir() and step.isdigit():
            numbered.append((int(step), folder))
    for _, folder in sorted(numbered, reverse=True):
        if whole_checkpoint(folder):
            return str(folder)
        print(f"train: {folder} skipped: no whole {TRAINER_STATE} (a save cut short)", file=sys.stderr)
    return None


def load_dataset_named(folder: str):
    """``datasets.load_dataset(folder)``, each parquet shard's footer read first: a shard cut short (by a
    copy, say) is a ValueError naming it. datasets' own DatasetGenerationError names no file, and its
    cache may serve the rows of an earlier, whole copy of the folder without reading the shards."""
    import pyarrow.parquet as pq
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    for shard in sorted(Path(folder).glob("data/*.parquet")):
        try:
            pq.read_metadata(shard)
        except Exception as bad:  # noqa: BLE001 - pyarrow's errors for a broken file are of several kinds
            raise ValueError(f"field 'dataset_name': {shard} does not read as parquet ({bad})") from None
    try:
        return load_dataset(folder)
    except DatasetGenerationError as e:
        raise ValueError(f"field 'dataset_name': {folder} does not load ({e.__cause__ or e})") from None


def load_rows(model_args: ModelDataArguments, sft_args):
    """``(model_dir, tokenizer, train_set, eval_set, over)``, everything checked before the model loads: the model
    exists, its tokenizer has a chat template, and the rows fit ``max_length`` (``over``: how many did not, per
    split; they are dropped)."""
    from transformers import AutoTokenizer

    from metachunk.models import resolve

    model_dir = str(resolve(model_args.model_name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=sft_args.trust_remote_code)
    rendering = chat_template_tokenizer(tokenizer, sft_args, model_dir)
    data = load_dataset_named(model_args.dataset_name)
    keep = ["prompt", "completion"]  # the metadata columns stay in the dataset, not in the batches
    train_set = data["train"].select_columns(keep)
    if model_args.max_train_rows:
        train_set = train_set.select(range(min(model_args.max_train_rows, len(train_set))))
    split = model_args.dataset_test_split
    eval_set = data[split].select_columns(keep) if split in data else None
    if eval_set is not None and len(eval_set) == 0:
        eval_set = None

    n_train, n_eval = len(train_set), len(eval_set) if eval_set is not None else 0
    if n_train == 0:  # build-sft's filters may leave a small run nothing; that is not a crash
        raise EmptyInput(model_args.dataset_name, "the 'train' split has no rows: nothing to train")
    if eval_set is None and sft_args.eval_strategy != "no":  # the Trainer's own error is a traceback
        has = (
            f"has no rows in its {split!r} split"
            if split in data
            else f"has no split {split!r} ({', '.join(data)})"
        )
        raise ValueError(
            f"field 'dataset_test_split': {model_args.dataset_name} {has}, and eval_strategy is "
            f"'{sft_args.eval_strategy.value}': name another split, or pass --eval_strategy no"
        )
    train_set, over_train = fit_max_length(train_set, rendering, sft_args)
    eval_set, over_eval = fit_max_length(eval_set, rendering, sft_args)
    limit = f"fits in {sft_args.max_length} tokens (prompt + completion)"
    if over_train == n_train > 0:
        raise ValueError(f"field 'max_length': none of the {n_train} training rows {limit}: raise max_length")
    if over_eval == n_eval > 0:
        if sft_args.eval_strategy != "no":
            raise ValueError(
                f"field 'max_length': none of the {n_eval} validation rows {limit}: raise max_length, or pass "
                "--eval_strategy no"
            )
        eval_set = None
    # once, from rank 0 of a launcher (the process group does not exist yet)
    if (over_train or over_eval) and os.environ.get("RANK", "0") == "0":
        print(f"train: dropped {over_train} of {n_train} training rows and {over_eval} of {n_eval} validation rows "
              f"longer than max_length ({sft_args.max_length} tokens), which TRL would cut and train on",
              file=sys.stderr)  # fmt: skip
    return model_dir, tokenizer, train_set, eval_set, {"train": over_train, "validation": over_eval}


def chat_template_tokenizer(tokenizer, sft_args, model_dir: str):
    """The tokenizer as TRL will render the rows (chat messages) with it: ``chat_template_path`` applied, on a
    copy (TRL applies it to the real one, and to the model, once the model has loaded). ValueError without a
    chat template."""
    path = sft_args.chat_template_path
    if path:
        import copy

        tokenizer = copy.deepcopy(tokenizer)
        if Path(path).is_file() and path.endswith((".jinja", ".j2")):
            tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
        else:  # TRL's clone_chat_template: the template and the added tokens of another tokenizer
            from transformers import AutoTokenizer

            source = AutoTokenizer.from_pretrained(path, trust_remote_code=sft_args.trust_remote_code)
            tokenizer.chat_template = source.get_chat_template()
            tokenizer.add_tokens(
                [t for t in source.added_tokens_decoder.values() if t.content not in tokenizer.vocab]
            )
    if not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer of {model_dir} has no chat template, and the rows are chat messages: train an "
            "instruct model, or set chat_template_path (a .jinja file, or a tokenizer to copy the template from)"
        )
    return tokenizer


def fit_max_length(rows, tokenizer, sft_args):
    """``(the rows that fit max_length, how many did not)``. TRL cuts a longer row at ``max_length`` (with
    truncation_mode keep_start the end of the completion; bfd packing cuts it too) and trains on the rest,
    silently; it is dropped here instead. The length is TRL's: the chat template over prompt + completion.
    ``bfd_split`` and ``wrapped`` packing lose nothing of a long row (split into pieces; the rows concatenated
    and cut into blocks): every row is kept."""
    if (
        rows is None
        or sft_args.max_length is None
        or (sft_args.packing and sft_args.packing_strategy in ("bfd_split", "wrapped"))
    ):
        return rows, 0
    lengths = rows.map(
        _row_length,
        fn_kwargs={"tokenizer": tokenizer},
        remove_columns=rows.column_names,
        num_proc=sft_args.dataset_num_proc,
        desc="Measuring rows against max_length",
    )["n_tokens"]
    keep = [i for i, n in enumerate(lengths) if n <= sft_args.max_length]
    return rows.select(keep), len(rows) - len(keep)


def _row_length(row: dict, tokenizer) -> dict:
    ids = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)
    return {"n_tokens": len(ids["input_ids"])}


def effective_batch_size(sft_args) -> int:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return sft_args.per_device_train_batch_size * sft_args.gradient_accumulation_steps * world


def plot_losses(log_history: list[dict], path: Path) -> None:
    """Training (and validation) loss against the step, written atomically."""
    from metachunk.artifacts import new_figure

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    valid = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    fig, ax = new_figure(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (completion tokens)")
    ax.legend()
    fig.tight_layout()
    write_figure(fig, path, dpi=120)


RUN_FACTS = "metachunk_run.json"  # what `metachunk export` writes the model card from
FINAL_STAGING = ".final-model.partial"  # inside output_dir: the same file system, so each move is a rename


# The files a final save writes for one kind of model and not for another (a PEFT adapter, a full model).
SAVED_ONLY_BY_SOME = ("adapter_config.json", "config.json", "generation_config.json")


def save_final_model(trainer, output_dir: str | Path) -> None:
    """``trainer.save_model`` into ``output_dir``, beside its checkpoints, without ever leaving a half-written
    model there: a rerun into the same folder (``metachunk run`` after a change) killed mid-save left a cut
    ``model.safetensors`` over a good one, or a new shard beside the old ones, which loads without an error.

    Every rank saves (ZeRO-3 gathers the weights) into a staging folder inside ``output_dir``; rank 0 then
    renames each file into place: a sharded save's old index goes first, so that a kill between two renames
    leaves a folder that fails to load, never one that loads a mix, and the new index last. The last run's
    facts and log go before the weights move: they would vouch for the old weights. With ``push_to_hub`` the
    Trainer's own save and upload run as they are (it would upload the staging folder too)."""
    out = Path(output_dir)
    if getattr(trainer.args, "push_to_hub", False):  # the Trainer saves into output_dir and uploads it itself
        trainer.save_model(str(out))
        return
    staging = out / FINAL_STAGING
    if trainer.is_world_process_zero():
        shutil.rmtree(staging, ignore_errors=True)  # a killed save's
    trainer.save_model(str(staging))
    if not trainer.is_world_process_zero():
        return
    new = {p.name for p in staging.iterdir()}
    for name in (RUN_FACTS, "train_log.json", *(p.name for p in out.glob("*.index.json"))):
        (out / name).unlink(missing_ok=True)
    # What one kind of save writes and another does not: a LoRA run's adapter files left beside a full
    # run's weights made transformers load the folder as an adapter, and fail.
    for name in (*SAVED_ONLY_BY_SOME, *(p.name for p in out.glob("adapter_model*.safetensors"))):
        if name not in new:
            (out / name).unlink(missing_ok=True)
    for old in out.glob("*.safetensors"):  # an older save's weights the new one does not have (its shards),
        if old.name not in new:  # gone before the new index comes: a single old file would load first
            old.unlink()
    for name in sorted(new, key=lambda n: n.endswith(".index.json")):  # the index last
        if (out / name).is_dir():  # a folder (DeepSpeed's own checkpoint layout) is not renamed over
            shutil.rmtree(out / name)
        os.replace(staging / name, out / name)
    staging.rmdir()


def run_facts(model_args, sft_args, model_dir, trainer, **counts) -> dict:
    """What this run was, measured, not remembered: the model card is written from this file."""
    import dataclasses

    import torch.distributed as dist

    history = trainer.state.log_history
    train_losses = [e["loss"] for e in history if "loss" in e]
    eval_losses = [e["eval_loss"] for e in history if "eval_loss" in e]
    build_report = Path(model_args.dataset_name) / "build_report.json"
    hyper = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
             "gradient_accumulation_steps", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_length",
             "bf16", "packing", "packing_strategy", "padding_free", "seed", "deepspeed", "completion_only_loss")  # fmt: skip
    return {
        "base_model": model_args.model_name_or_path,
        "base_model_dir": str(model_dir),
        "dataset": str(Path(model_args.dataset_name).resolve()),
        "dataset_report": read_json(build_report) if build_report.is_file() else None,
        "model_args": dataclasses.asdict(model_args),
        "hyperparameters": {k: getattr(sft_args, k, None) for k in hyper},
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        "global_steps": trainer.state.global_step,
        "final_train_loss": train_losses[-1] if train_losses else None,
        "final_eval_loss": eval_losses[-1] if eval_losses else None,
        "train_runtime_s": next(
            (e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None
        ),
        "command": counts.pop("argv"),
        **counts,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m metachunk.train`` (also under ``deepspeed`` and ``accelerate launch``)."""
    return run_argv(list(sys.argv[1:] if argv is None else argv)).exit


def run_argv(argv: list[str]) -> Result:
    """``metachunk train ARGV``: a bad config is one line, exit 2."""
    try:
        cfg = parse_config(argv)
    except ValueError as e:
        print(f"train: invalid config: {e}", file=sys.stderr)
        return Result(2)
    return run(cfg)


# Settings that say how a run is watched, not what it trains: left out of its fingerprint.
RUNTIME_FIELDS = ("report_to", "logging_dir")


def identity(cfg: TrainConfig) -> dict:
    """The recipe and flags as given, less `RUNTIME_FIELDS` (TRL's SFTConfig has hundreds of
    derived fields; what a recipe says is what decides the run)."""
    argv = shipped_config(cfg.argv)
    recipe = {k: v for k, v in read_recipe(argv).items() if k not in RUNTIME_FIELDS}
    flags, left_out = [], False
    for arg in argv:  # less --config FILE and the runtime flags, each with its values
        if arg.startswith("--"):  # transformers' parser takes --report-to for --report_to
            left_out = arg.split("=")[0].removeprefix("--").replace("-", "_") in ("config", *RUNTIME_FIELDS)
        if not left_out:
            flags.append(arg)
    return {"recipe": recipe, "flags": flags}


def inputs(cfg: TrainConfig) -> Reads:
    from metachunk import hub

    dataset = cfg.model_args.dataset_name
    local = Path(dataset).exists() or hub.parse_hub_id(dataset, "dataset") is None
    return Reads.of(paths=[dataset] if local else [], models=[cfg.model_args.model_name_or_path])


def outputs(cfg: TrainConfig) -> list:
    return [cfg.sft_args.output_dir]


def run(cfg: TrainConfig) -> Result:
    """Check the dataset, load the model, train, save; the summary is the run's facts."""
    model_args, sft_args, argv = cfg.model_args, cfg.sft_args, cfg.argv
    try:
        check(model_args, sft_args)
        resume = resume_point(sft_args)  # no such checkpoint is a config error, before the model loads
        # what TRL would find only after the model has loaded, or not at all (max_length)
        model_dir, tokenizer, train_set, eval_set, over = load_rows(model_args, sft_args)
    except EmptyInput as e:
        print(f"train: {e} (exit status {EXIT_EMPTY}; no checkpoint written)", file=sys.stderr)
        return Result(EXIT_EMPTY)
    except ValueError as e:
        print(f"train: invalid config: {e}", file=sys.stderr)
        return Result(2)

    import torch
    from metachunk.train.distributed import prepare_distributed
    from metachunk.train.throughput import ThroughputCallback, summary_line
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from metachunk.artifacts import write_json
    from metachunk.models import attention_of

    dtype = "auto" if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    prepare_distributed(sft_args)  # DeepSpeed on CPU: gloo group first, so ZeRO-3 partitions at load
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        use_safetensors=True,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=sft_args.trust_remote_code,  # SFTConfig's field, as `trl sft` passes it
    )
    impl = attention_of(model)  # what transformers picked when none was asked for
    loaded = str(model.dtype).removeprefix("torch.")
    try:
        if model_args.attn_implementation is None:  # the one transformers picked (a named one is checked)
            check_attention(impl, sft_args)
        check_precision(loaded, model_args, sft_args)  # again: config.json may not have said (dtype auto)
    except ValueError as e:
        print(f"train: invalid config: {e}", file=sys.stderr)
        return Result(2)
    for note in (dense_attention_note(impl, sft_args), master_weights_note(loaded, model_args, sft_args)):
        if note:
            print(f"train: {note}", file=sys.stderr)
    peft_config = None
    if model_args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=model_args.lora_target_modules or "all-linear",
            task_type="CAUSAL_LM",
        )
    trainer = SFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    throughput = ThroughputCallback().attach(trainer)  # tokens/s, TFLOP/s and MFU in every training log line
    # Counted in Arrow, not as Python lists: a 20K-row 3B set holds ~80M tokens, on every rank.
    import pyarrow.compute as pc

    columns = trainer.train_dataset.with_format("arrow")
    tokens = pc.sum(pc.list_value_length(columns["input_ids"])).as_py() or 0
    # TRL folds the completion mask into `labels`: -100 on every prompt token.
    completion = pc.sum(pc.not_equal(pc.list_flatten(columns["labels"]), -100)).as_py() or 0
    batch = effective_batch_size(sft_args)
    packed = "seq_lengths" in trainer.train_dataset.column_names  # TRL's bfd packing: one row = several rows
    rows = (
        (pc.sum(pc.list_value_length(columns["seq_lengths"])).as_py() or 0)
        if packed
        else len(trainer.train_dataset)
    )
    steps = (  # as the Trainer counts them: a fraction of an epoch is a whole step more
        sft_args.max_steps
        if sft_args.max_steps > 0
        else math.ceil(
            math.ceil((len(trainer.train_dataset) if packed else len(train_set)) / batch)
            * sft_args.num_train_epochs
        )
    )
    if trainer.is_world_process_zero():
        fit = (
            f"{rows} rows packed into {len(trainer.train_dataset)} sequences of <= {sft_args.max_length} tokens"
            if packed
            else f"{rows} of {len(train_set) + over['train']} rows fit max_length"
        )
        print(
            f"train: {fit}, {tokens:,} tokens ({completion:,} completion tokens carry the loss); "
            f"effective global batch {batch} {'packed sequences' if packed else 'rows'}; {steps} optimizer steps",
            file=sys.stderr,
        )
    if resume and trainer.is_world_process_zero():
        state = json.loads((Path(resume) / TRAINER_STATE).read_text(encoding="utf-8"))
        print(f"train: resuming from {resume} at step {state['global_step']}", file=sys.stderr)
    trainer.train(resume_from_checkpoint=resume)
    save_final_model(trainer, sft_args.output_dir)
    summary = {}
    if trainer.is_world_process_zero():
        out = Path(sft_args.output_dir)
        plot_losses(trainer.state.log_history, out / "loss.png")
        write_json(out / "train_log.json", trainer.state.log_history, default=str)
        # the weights as trained and saved: DeepSpeed's bf16 / fp16 engine casts them
        saved = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
        precision = {"dtype": loaded, "bf16": sft_args.bf16, "fp16": sft_args.fp16,
                     "autocast": autocast_of(sft_args), "bf16_given": bf16_given(read_recipe(argv), argv),
                     "saved_dtype": saved}  # fmt: skip
        facts = run_facts(model_args, sft_args, model_dir, trainer, rows=rows, tokens=tokens,
                          completion_tokens=completion, global_batch=batch, rows_over_max_length=over,
                          precision=precision, throughput=throughput.summary, argv=argv)  # fmt: skip
        write_json(out / RUN_FACTS, facts, default=str)
        if throughput.summary:
            print(f"train: {summary_line(throughput.summary)}", file=sys.stderr)
        print(f"train: final train loss {facts['final_train_loss']}, validation loss {facts['final_eval_loss']}; "
              f"wrote {out}", file=sys.stderr)  # fmt: skip
        loss = facts.get("final_train_loss")
        summary = {"rows": facts.get("rows"), "steps": facts.get("global_steps"),
                   "final_train_loss": round(loss, 4) if loss is not None else None}  # fmt: skip
    end_process_group()
    return Result(summary=summary)


def end_process_group() -> None:
    """Wait for every rank, then take the process group down, before the process exits.

    Without this a rank that finished its part of ``save_model`` returned and exited while rank 0
    was still writing: its communication threads were torn down with the interpreter, and it died
    of SIGABRT ("terminate called without an active exception") now and then when ranks finish at
    different times, failing a run that had trained and saved. It still does, rarely, under DeepSpeed:
    ``destroy_process_group`` leaves gloo's worker and transport threads running, because ZeRO-3's
    parameters and DeepSpeed's engine still hold the groups, and DeepSpeed's module globals hold those
    (``parameter_offload.FWD_MODULE_STACK``, an ``lru_cache`` over the parameter coordinator), so the
    groups go only as the interpreter ends. Freeing them earlier means clearing DeepSpeed's internals."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
