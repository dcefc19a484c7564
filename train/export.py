"""Export a training run as a clean Hugging Face model folder with its model card, and publish it.

``metachunk export --checkpoint runs/train/rewriter --out models/rewriter [--merge-lora] [--push ORG/NAME]``

``metachunk export --out models/rewriter --push ORG/NAME`` (no ``--checkpoint``) publishes the export
already at ``--out``: a push that failed is retried without loading and writing the model again.

The flow, top to bottom (`export`):

1. **Check everything before any model loads.** `find_weights` says what the checkpoint
   holds, one of:

   * ``full``: ``model.safetensors`` (or sharded ``model-*.safetensors`` + index). A training
     ``output_dir``, a ``checkpoint-N``, and a ZeRO-3 ``checkpoint-N`` too: our DeepSpeed configs
     require ``stage3_gather_16bit_weights_on_model_save``, so the Trainer writes the gathered
     weights there next to the shards, and those are what we load.
   * ``lora``: ``adapter_config.json`` + ``adapter_model.safetensors``. Needs ``--merge-lora``:
     the adapter is merged into its base model (``adapter_config.json``'s
     ``base_model_name_or_path``, else ``metachunk_run.json``'s ``base_model_dir``, or
     ``--base-model``). We export plain models only, because ``metachunk chunk --rewrite`` /
     ``--summarize`` load plain models; an adapter without ``--merge-lora`` is an error.
   * ``zero``: only DeepSpeed ZeRO shards (``global_stepN/*_model_states.pt`` +
     ``*_optim_states.pt``, named by ``latest``). Needs ``--trust-zero-shards``; see below.

   Pickled weights (``pytorch_model.bin``, ``adapter_model.bin``, ``*.pt`` ...) are refused with
   an error that names the file; trainer state files that are pickles too (``optimizer.pt``,
   ``rng_state.pth``, ``training_args.bin``) are never read and never exported. ``--out``, and for
   ``--push`` the repo id, the token and the offline switch are checked here too.
2. **Load the model**: ``from_pretrained(..., use_safetensors=True)``; for ``lora`` the base the
   same way, then ``PeftModel.from_pretrained(...).merge_and_unload()``; for ``zero`` DeepSpeed's
   own ``get_fp32_state_dict_from_zero_checkpoint`` into the model built from ``config.json``
   (the fp32 master weights).
3. **Write a temp folder next to --out**: the weights with ``save_pretrained(safe_serialization=
   True)``, split into ``--max-shard-size`` files with an index when bigger, and ``config.json`` (``use_cache`` back on: training turns the KV cache off), the
   tokenizer with its chat template (checked to survive the round trip), the checkpoint's
   ``generation_config.json`` (else the base model's, else one derived from the tokenizer's
   eos/pad tokens), ``loss.png`` (copied, or plotted from a ``checkpoint-N``'s own log),
   ``eval_results.json`` when the checkpoint has one, and ``README.md``, the model card.
4. **Swap it into place** (`metachunk.artifacts.replace_dir`): a previous export at ``--out`` (any other
   folder only with ``--overwrite``) is renamed aside, the new folder renamed in, the old one deleted. An
   interrupted export leaves ``--out`` as it was; only a hidden ``.NAME.export-*`` temp folder
   can remain next to it.
5. **Push** (``--push ORG/NAME``): `metachunk.hub.push_folder` (shared with ``metachunk
   data push``) uploads exactly the exported files to a model repo, and deletes the files of an
   earlier export it no longer has (`MODEL_FILE_PATTERNS`); the token comes from ``HF_TOKEN`` only and
   is never printed. Without ``--checkpoint`` the folder already at ``--out`` is pushed, and refused if
   it holds a file no export writes (`EXPORT_FILE_PATTERNS`): the push would send a ``.env`` or a
   notebook left there along with the model.

The card (``metachunk.train.card.render_model_card``) says only what the run recorded: `read_run` reads
``metachunk_run.json`` (``metachunk.train.sft.run_facts``: base model, dataset build report, hyperparameters,
counts) and the trainer's log history (``train_log.json``, or a ``checkpoint-N``'s
``trainer_state.json``, whose losses and step are that checkpoint's, not the run's end); the export adds
its own facts (the weights written, the title, the Hub ids). A missing fact reads "not recorded".

Trust boundary. Only safetensors and JSON are read, except on the ``zero`` path: DeepSpeed
0.19.8's ``zero_to_fp32`` reads the shards with ``torch.load(..., weights_only=False)``, i.e.
full pickle, which can run arbitrary code from the file. That path is therefore opt-in
(``--trust-zero-shards``), meant for checkpoints you produced yourself, and used only when the
checkpoint has no gathered ``model.safetensors``. (Under bf16 the gathered weights are the bf16
copy DeepSpeed rounds from the fp32 masters; the shards hold the fp32 masters themselves.)
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metachunk.train.card import NOT_RECORDED, Run, card_license, last_logged, render_model_card
from metachunk.train.sft import RUN_FACTS

from metachunk import config
from metachunk.artifacts import InputError, ordinary_mode, read_json, read_json_value, replace_dir
from metachunk.command import Reads, Result
from metachunk.config import option
from metachunk.markdown import shown_path
from metachunk.models import named_load_errors

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# Pickle files the Trainer writes next to the weights; never read, never exported.
TRAINER_PICKLES = re.compile(
    r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|training_args\.bin)$"
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclass
class ExportConfig:
    checkpoint: Path = option(
        None, "training output_dir or checkpoint-N (full weights, a LoRA adapter, or DeepSpeed ZeRO shards)"
    )
    out: Path = option(
        None, "folder to write the HF model into (written next to it, then renamed into place)"
    )
    merge_lora: bool = option(
        False, "the checkpoint is a LoRA adapter: merge it into its base model and export that"
    )
    base_model: str | None = option(
        None,
        "--merge-lora: base model dir or preset; default: the adapter's base_model_name_or_path, then the "
        "run's base_model_dir",
    )
    trust_zero_shards: bool = option(
        False,
        "when the checkpoint has no model.safetensors, consolidate its DeepSpeed ZeRO shards. DeepSpeed reads "
        "them with pickle (torch.load weights_only=False), which can run code: only for checkpoints you made",
    )
    dtype: str = option(
        "auto",
        "weights dtype of the export: auto (as loaded: the checkpoint's; fp32 masters from ZeRO shards)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    max_shard_size: str = option(
        "5GB",
        "largest safetensors file of the export; a bigger model is split into model-0000K-of-0000N files "
        "with an index (the Hub's usual size; Qwen2.5-3B in fp32 is ~12 GB)",
    )
    overwrite: bool = option(
        False,
        "replace an existing --out folder that is not an earlier export (an earlier export is replaced "
        "anyway); the old folder stays until the new export is complete",
        runtime=True,
    )
    push: str | None = option(
        None, "then upload the folder to this Hub model repo, 'namespace/name' (HF_TOKEN)"
    )
    private: bool = option(
        False, "--push: create the repo as private (an existing repo keeps its visibility)"
    )
    commit_message: str | None = option(
        None, "--push: commit message; default: 'Upload <out name> with metachunk'"
    )
    revision: str | None = option(
        None, "--push: branch to publish to (created from main if new); default main"
    )
    tag: str | None = option(
        None,
        "--push: tag the published commit (one per release): from_pretrained(repo, revision=TAG) loads it",
    )
    base_model_id: str | None = option(
        None, "the card's base_model (a Hub id); default: known for presets, else left out (local dirs)"
    )
    dataset_id: str | None = option(
        None,
        "Hub id of the training dataset (`metachunk data push`), linked from the card; default: not linked",
    )
    license: str | None = option(
        None,
        "the card's license, a Hub license id (https://huggingface.co/docs/hub/repositories-licenses); "
        "default: the base model's card's, known for presets, else other",
    )
    license_name: str | None = option(
        None, "license other: the license's id for the card (the Hub's model card spec asks for one)"
    )
    license_link: str | None = option(
        None, "license other: a URL to its text, or LICENSE for a file in the repo"
    )

    def __post_init__(self):
        config.check_choices(self)
        if self.out is None:
            raise ValueError("field 'out' is required (--out)")
        if self.checkpoint is None and self.push is None:
            raise ValueError(
                "field 'checkpoint' is required (--checkpoint); without it, --push publishes the export at --out"
            )
        self.checkpoint = None if self.checkpoint is None else Path(self.checkpoint)
        self.out = Path(self.out)
        from transformers.utils.hub import convert_file_size_to_int  # what save_pretrained parses it with

        try:
            convert_file_size_to_int(self.max_shard_size)
        except ValueError:
            raise ValueError(
                f"field 'max_shard_size' must be a size like '5GB' or '500MiB', got {self.max_shard_size!r}"
            ) from None
        if (self.license_name or self.license_link) and self.license != "other":
            raise ValueError(
                f"'license_name' and 'license_link' go with license 'other' (--license other), not {self.license!r}"
            )
        for name in ("push", "base_model_id", "dataset_id"):
            value = getattr(self, name)
            if value is not None and value.count("/") != 1:
                raise ValueError(f"field {name!r} must be 'namespace/name', got {value!r}")


@dataclass
class Weights:
    kind: str  # "full" | "lora" | "zero"
    files: list[Path]  # what will be read


@dataclass
class ExportResult:
    out: Path
    kind: str
    files: int
    bytes: int
    parameters: int
    dtype: str
    url: str | None = None

    def summary(self) -> str:
        line = (
            f"{self.out}: {self.files} files, {self.bytes:,} bytes, {self.parameters:,} parameters "
            f"({self.dtype}, from {self.kind} weights)"
        )
        return line + (f"; pushed to {self.url}" if self.url else "")


# ------------------------------------------------------------------------------------------ checks


def _pickles(folder: Path) -> list[Path]:
    """Pickled weight files in ``folder`` (trainer state files excluded)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(PICKLE_SUFFIXES) and not TRAINER_PICKLES.match(p.name)
    )


def _refuse_pickle(path: Path):
    return InputError(
        path,
        "pickled weights: metachunk export loads safetensors only (unpickling a file can run code). "
        "Re-save the model with save_pretrained(safe_serialization=True) where you trust the file",
    )


def find_weights(folder: Path) -> Weights:
    """What ``folder`` holds, checked without loading anything; ``InputError`` when nothing usable."""
    if not folder.is_dir():
        raise InputError(folder, "no such checkpoint directory")
    full = sorted(folder.glob("model*.safetensors"))
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return Weights("full", full + sorted(folder.glob("model.safetensors.index.json")))
    if (folder / "adapter_config.json").is_file():
        if (folder / "adapter_model.safetensors").is_file():
            return Weights("lora", [folder / "adapter_config.json", folder / "adapter_model.safetensors"])
        if (folder / "adapter_model.bin").is_file():
            raise _refuse_pickle(folder / "adapter_model.bin")
        raise InputError(folder, "adapter_config.json but no adapter_model.safetensors")
    latest = folder / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        shards = sorted((folder / tag).glob("*_model_states.pt")) + sorted(
            (folder / tag).glob("*_optim_states.pt")
        )
        if shards:
            return Weights("zero", shards)
    pickles = _pickles(folder)
    if pickles:
        raise _refuse_pickle(pickles[0])
    raise InputError(
        folder,
        "no weights: expected model.safetensors (or a sharded index), adapter_model.safetensors, "
        "or DeepSpeed ZeRO shards (latest + global_stepN/)",
    )


def _check_out(cfg: ExportConfig) -> None:
    out, source = cfg.out.resolve(), cfg.checkpoint.resolve()
    if out == source or out in source.parents:
        raise InputError(
            cfg.out, f"--out would replace the checkpoint {cfg.checkpoint} itself; pick another folder"
        )
    if cfg.out.exists():
        if not cfg.out.is_dir():
            raise InputError(cfg.out, "--out exists and is not a folder")
        if any(cfg.out.iterdir()) and not cfg.overwrite and not is_export(cfg.out):
            raise InputError(
                cfg.out,
                "--out exists and is not a metachunk export; pass --overwrite to replace it (after the new "
                "export is done)",
            )


def is_export(folder: Path) -> bool:
    """An earlier ``metachunk export``: config.json and a card tagged ``metachunk``. Replaced without --overwrite."""
    from huggingface_hub import ModelCard

    card = folder / "README.md"
    if not ((folder / "config.json").is_file() and card.is_file()):
        return False
    try:
        tags = ModelCard.load(card).data.tags
    except Exception:  # noqa: BLE001 - a card the Hub's parser cannot read is not ours
        return False
    return "metachunk" in (tags or [])


def check(cfg: ExportConfig) -> Weights:
    """Every check that needs no model: the weights, --out, --push. Returns what will be loaded."""
    weights = find_weights(cfg.checkpoint)
    if weights.kind == "lora" and not cfg.merge_lora:
        raise InputError(
            cfg.checkpoint,
            "a LoRA adapter: pass --merge-lora to merge it into its base model and export a plain model "
            "(metachunk exports plain models only)",
        )
    if weights.kind != "lora" and cfg.merge_lora:
        raise InputError(
            cfg.checkpoint, f"--merge-lora, but this checkpoint holds {weights.kind} weights, no adapter"
        )
    if weights.kind == "zero":
        if not cfg.trust_zero_shards:
            raise InputError(
                cfg.checkpoint,
                f"no model.safetensors, only DeepSpeed ZeRO shards ({weights.files[0].parent.name}/*.pt). DeepSpeed "
                "reads them with pickle (torch.load weights_only=False), which can run code from the file: if you "
                "made this checkpoint yourself, pass --trust-zero-shards to consolidate them",
            )
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise InputError(cfg.checkpoint, "ZeRO shards need deepspeed: pip install -e '.[train]'")
        if not (cfg.checkpoint / "config.json").is_file():
            raise InputError(cfg.checkpoint, "ZeRO shards but no config.json to build the model from")
    _check_out(cfg)
    _check_push(cfg)
    return weights


def _check_push(cfg: ExportConfig) -> None:
    if cfg.push:
        from metachunk.hub import check_online_allowed, hub_token

        try:
            hub_token()
            check_online_allowed()
        except ValueError as e:  # no token, or HF_HUB_OFFLINE=1: before any work
            raise InputError("export --push", str(e)) from None


# ------------------------------------------------------------------------------------ what the run was


def read_run(folder: Path) -> Run:
    """The run's facts and log; a ``checkpoint-N`` takes the static facts from its run folder and its
    losses and step from its own ``trainer_state.json``."""
    run = Run()
    step = CHECKPOINT_DIR.match(folder.name)
    if (folder / RUN_FACTS).is_file():
        run.facts = read_json(folder / RUN_FACTS)
    elif step and (folder.parent / RUN_FACTS).is_file():
        run.facts = read_json(folder.parent / RUN_FACTS)
    if (folder / "train_log.json").is_file():
        run.log = read_json_value(folder / "train_log.json")
        run.global_step = run.facts.get("global_steps") or last_logged(run.log, "step")
    elif (folder / "trainer_state.json").is_file():
        state = read_json(folder / "trainer_state.json")
        run.log, run.global_step = state.get("log_history") or [], state.get("global_step")
        run.checkpoint_step = run.global_step if step else None
    else:
        run.global_step = run.facts.get("global_steps")
    if (folder / "eval_results.json").is_file():
        run.eval_results = read_json(folder / "eval_results.json")
    if (folder / "loss.png").is_file():
        run.loss_png = folder / "loss.png"
    return run


# ------------------------------------------------------------------------------------------- loading


def _torch_dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def _lora_base(cfg: ExportConfig, facts: dict) -> Path:
    from metachunk.models import PRESETS, ModelNotFoundError, resolve

    adapter = read_json(cfg.checkpoint / "adapter_config.json")
    named = [cfg.base_model] if cfg.base_model else []
    named += [adapter.get("base_model_name_or_path"), facts.get("base_model_dir"), facts.get("base_model")]
    for name in filter(None, named):
        if (Path(name).expanduser() / "config.json").is_file() or name in PRESETS or name == cfg.base_model:
            try:
                base = resolve(name)
            except ModelNotFoundError as e:
                raise InputError(cfg.checkpoint, f"base model of the adapter: {e}") from None
            if find_weights(base).kind != "full":
                raise InputError(base, "the adapter's base model has no model.safetensors")
            return base
    raise InputError(
        cfg.checkpoint,
        f"the adapter's base model ({', '.join(map(str, filter(None, named))) or NOT_RECORDED}) is not a local "
        "model dir or preset here: pass --base-model DIR",
    )


def _load_zero(folder: Path):
    """DeepSpeed's consolidation of the ZeRO shards (fp32 masters) into the model of ``config.json``.

    Trust boundary: this unpickles the shards (see the module docstring); `check` lets us
    here only with ``--trust-zero-shards``.
    """
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    with contextlib.redirect_stdout(sys.stderr):  # its progress prints; stdout is for the push URL
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder))  # tag from the `latest` file
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    loaded = model.load_state_dict(state, strict=False)
    if loaded.unexpected_keys:
        raise InputError(folder, f"ZeRO shards hold weights the model has not: {loaded.unexpected_keys[:5]}")
    model.tie_weights()
    own = model.state_dict()
    filled = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in loaded.missing_keys if own[k].data_ptr() not in filled]  # tied ones are filled
    if missing:
        raise InputError(folder, f"ZeRO shards lack weights of the model: {missing[:5]}")
    return model


def load_model(cfg: ExportConfig, weights: Weights, run: Run):
    """The model to export, and the folders (in order) its tokenizer / generation config may come from."""
    from transformers import AutoModelForCausalLM

    folders = [cfg.checkpoint]
    if CHECKPOINT_DIR.match(cfg.checkpoint.name):
        folders.append(cfg.checkpoint.parent)
    if weights.kind == "full":
        model = AutoModelForCausalLM.from_pretrained(
            cfg.checkpoint, dtype=_torch_dtype(cfg.dtype), use_safetensors=True
        )
    elif weights.kind == "lora":
        from peft import PeftModel

        base_dir = _lora_base(cfg, run.facts)
        trained_dtype = (run.facts.get("model_args") or {}).get("dtype") or "auto"
        base = AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=_torch_dtype(trained_dtype), use_safetensors=True
        )
        model = PeftModel.from_pretrained(base, cfg.checkpoint).merge_and_unload()
        folders.append(base_dir)
    else:
        model = _load_zero(cfg.checkpoint)
    if cfg.dtype != "auto":
        model = model.to(_torch_dtype(cfg.dtype))
    model.config.use_cache = True  # training turns the KV cache off; the export is for generation
    return model.eval(), folders


def _tokenizer_dir(folders: list[Path]) -> Path:
    for folder in folders:
        if (folder / "tokenizer_config.json").is_file():
            return folder
    raise InputError(folders[0], f"no tokenizer (tokenizer_config.json) in {', '.join(map(str, folders))}")


# ------------------------------------------------------------------------------------------- writing


def write_generation_config(folders: list[Path], tokenizer, into: Path) -> str:
    """Copy the first ``generation_config.json`` found, else derive one from the tokenizer's special tokens."""
    from transformers import GenerationConfig

    for folder in folders:
        if (folder / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(folder)  # it must parse
            shutil.copyfile(folder / "generation_config.json", into / "generation_config.json")
            return f"copied from {shown_path(folder, relative_to_cwd=False)}"
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(into)
    return "derived from the tokenizer's special tokens"


def _publishable_modes(folder: Path, files: list[Path]) -> None:
    """The umask's ordinary modes: ``mkdtemp`` makes the folder 0700, and some writers make files 0600."""
    ordinary_mode(folder, folder=True)
    for path in files:
        ordinary_mode(path)


def export(cfg: ExportConfig, progress=None) -> ExportResult:
    """Check, load, write into a temp folder next to ``cfg.out``, swap into place, push. Without a
    checkpoint, push the export already at ``cfg.out``."""
    say = progress or (lambda msg: print(f"export: {msg}", file=sys.stderr))
    if cfg.checkpoint is None:
        if not is_export(cfg.out):
            raise InputError(
                cfg.out, "holds no metachunk export to push: export a --checkpoint into it first"
            )
        exporting = [name for name, default in EXPORT_ONLY.items() if getattr(cfg, name) != default]
        if exporting:  # what only an export does: the folder and its card are written already
            raise InputError("export", f"--{exporting[0].replace('_', '-')} shapes an export; without "
                             "--checkpoint, --push publishes the export at --out as it is")  # fmt: skip
        if f'"{cfg.push}"' not in (cfg.out / "README.md").read_text(encoding="utf-8", errors="replace"):
            # its card's usage lines load the repo it was exported for, or a local placeholder
            raise InputError(cfg.out, f"its model card was written for another repo, or none: export it again "
                             f"with --checkpoint and --push {cfg.push}")  # fmt: skip
        _check_push(cfg)
        model_config = read_json(cfg.out / "config.json")
        files = sorted(p for p in cfg.out.rglob("*") if p.is_file() and not never_uploaded(cfg.out, p))
        strangers = [p.relative_to(cfg.out).as_posix() for p in files if not is_export_file(cfg.out, p)]
        if strangers:
            raise InputError(cfg.out, f"holds {len(strangers)} files no export writes ({', '.join(strangers[:5])}"
                             f"{', ...' if len(strangers) > 5 else ''}): move them out, or export again "
                             "with --checkpoint, before publishing it")  # fmt: skip
        result = ExportResult(cfg.out, "exported", len(files), sum(p.stat().st_size for p in files),
                              _safetensors_parameters(cfg.out),
                              str(model_config.get("dtype") or model_config.get("torch_dtype") or "unknown"))  # fmt: skip
        return _push(cfg, result, files, say)
    weights = check(cfg)
    run = read_run(cfg.checkpoint)
    from transformers import AutoTokenizer

    say(f"loading {weights.kind} weights from {cfg.checkpoint}")
    with named_load_errors(cfg.checkpoint):
        model, folders = load_model(cfg, weights, run)
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(folders))
    parameters = sum(p.numel() for p in model.parameters())
    dtype = str(model.dtype).removeprefix("torch.")

    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.export-", dir=cfg.out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=cfg.max_shard_size)
        tokenizer.save_pretrained(tmp)
        if AutoTokenizer.from_pretrained(tmp).chat_template != tokenizer.chat_template:
            raise RuntimeError("the chat template did not survive tokenizer.save_pretrained")
        generation = write_generation_config(folders, tokenizer, tmp)
        if run.loss_png is not None:
            shutil.copyfile(run.loss_png, tmp / "loss.png")
        elif any("loss" in e for e in run.log):
            from metachunk.train.sft import plot_losses

            plot_losses(run.log, tmp / "loss.png")
        if run.eval_results is not None:
            shutil.copyfile(cfg.checkpoint / "eval_results.json", tmp / "eval_results.json")
        export_facts = {
            "checkpoint": str(cfg.checkpoint),
            "kind": weights.kind,
            "parameters": parameters,
            "dtype": dtype,
            "generation_config": generation,
            "loss_png": (tmp / "loss.png").is_file(),
            "title": cfg.push.split("/")[1] if cfg.push else cfg.out.name,
            "repo_id": cfg.push,
            "base_model_id": cfg.base_model_id,
            "dataset_id": cfg.dataset_id,
            "license": cfg.license,
            "license_name": cfg.license_name,
            "license_link": cfg.license_link,
        }
        if card_license(run, export_facts) == {"license": "other"}:
            say("the card's license is 'other' with no name: the base model's folder declares none; "
                "name it with --license (or --license other --license-name ID --license-link URL)")  # fmt: skip
        card = render_model_card(run, export_facts)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        pickled = [p.name for p in files if p.name.endswith(PICKLE_SUFFIXES)]
        if pickled:  # an invariant: nothing we write is a pickle
            raise RuntimeError(f"export wrote pickle files {pickled}")
        _publishable_modes(tmp, files)
        replace_dir(tmp, cfg.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the swap succeeded

    files = sorted(p for p in cfg.out.rglob("*") if p.is_file())
    result = ExportResult(
        cfg.out, weights.kind, len(files), sum(p.stat().st_size for p in files), parameters, dtype
    )
    return _push(cfg, result, files, say)


# The settings that shape an export (its weights, its card), refused where --push only publishes one.
EXPORT_ONLY = {"merge_lora": False, "base_model": None, "trust_zero_shards": False, "dtype": "auto",
               "max_shard_size": "5GB", "overwrite": False, "base_model_id": None, "dataset_id": None,
               "license": None, "license_name": None, "license_link": None}  # fmt: skip


def _safetensors_parameters(folder: Path) -> int:
    """The parameters in a folder's safetensors files, from their headers (no tensor is read)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def _push(cfg: ExportConfig, result: ExportResult, files: list[Path], say) -> ExportResult:
    if cfg.push:
        from metachunk.hub import push_folder

        say(f"pushing {len(files)} files to {cfg.push}")
        result.url = push_folder(
            cfg.out,
            cfg.push,
            repo_type="model",
            allow_patterns=[p.relative_to(cfg.out).as_posix() for p in files],
            delete_patterns=MODEL_FILE_PATTERNS,
            private=cfg.private,
            commit_message=cfg.commit_message,
            revision=cfg.revision,
            tag=cfg.tag,
        )
    return result


# What `from_pretrained` reads from a model repo, and what an export writes beside it, so what a push
# replaces: an earlier export's weights, index or chat templates left beside the new ones would be loaded
# instead of them (transformers reads model.safetensors before an index, chat_template.jinja before
# tokenizer_config.json's template, and every additional_chat_templates/*.jinja). Top-level files only
# (`metachunk.hub.matches`): a quantized variant someone keeps in a subfolder stays.
MODEL_FILE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                       "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                       "added_tokens.json", "vocab.*", "merges.txt", "chat_template.jinja", "chat_template.json",
                       "additional_chat_templates/*.jinja", "loss.png", "eval_results.json"]  # fmt: skip
# What an export writes: safetensors weights (never a pickle: a training_args.bin holds paths and
# maybe a token), the config and tokenizer files, its card, its loss curve and its eval results.
EXPORT_FILE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                        "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                        "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
                        "README.md", "loss.png", "eval_results.json"]  # fmt: skip
# What a push never sends (`metachunk.hub.folder_files`, as upload_folder): no reason to refuse it.
NEVER_UPLOADED = (".git", ".cache/huggingface")


def is_export_file(folder: Path, path: Path) -> bool:
    """Whether ``path`` (in ``folder``) is a file an export writes, by `EXPORT_FILE_PATTERNS` (a pattern
    without a folder matches a file at the top only)."""
    from metachunk.hub import matches

    return matches(path.relative_to(folder).as_posix(), EXPORT_FILE_PATTERNS)


def never_uploaded(folder: Path, path: Path) -> bool:
    relative = path.relative_to(folder).as_posix()
    return any(relative == skip or relative.startswith(skip + "/") for skip in NEVER_UPLOADED)


# ---- `metachunk export` --------------------------------------------------------------------------

CONFIG = ExportConfig


def run(cfg: ExportConfig) -> Result:
    try:
        result = export(cfg)
    except ValueError as e:  # a push refused by the Hub client before sending (bad repo id, token)
        if isinstance(e, InputError):
            raise
        raise InputError("export", str(e)) from None
    print(result.summary(), file=sys.stderr)
    if result.url:
        print(result.url)
    return Result()


def inputs(cfg: ExportConfig) -> Reads:
    return Reads.of(models=[cfg.checkpoint, cfg.base_model])


def outputs(cfg: ExportConfig) -> list:
    return [cfg.out]
