"""Supervised fine-tuning of the student (rewriter, summarizer, MoC router/experts) with TRL.

One recipe, top to bottom: parse the config, check it, load the dataset and the model, train,
save, plot the loss. ``python -m train --config recipes/train/cpu_smoke.yaml [--flag value ...]``.

The config is TRL's own: :class:`ModelDataArguments` (what to train, on what) plus TRL's
``SFTConfig`` (how), read by TRL's ``TrlParser`` from the recipe YAML with command-line flags on
top, every field with its help text (``--help``). TRL users know these flags; a recipe is the
same file ``trl sft`` would read, plus our model and dataset fields.

The loss is Eq. 3 of Meta-Chunking: cross-entropy on the completion tokens only. The rows are
conversational prompt–completion pairs (``metachunk data build-sft``), so TRL renders them with
the tokenizer's chat template and masks every prompt token out of the labels
(``completion_only_loss``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelDataArguments:
    model: str = field(metadata={"help": "base model: a preset name (smollm2, ...) or a local HF model dir"})
    dataset: str = field(
        metadata={"help": "dataset dir written by `metachunk data build-sft` (parquet + card)"}
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "weights dtype: auto (the checkpoint's), float32, bfloat16, float16"},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "attention kernel: sdpa (the default), eager, flex_attention (GPU: no backward on CPU), "
            "flash_attention_2 (GPU, flash-attn installed); packing / padding_free need one of these"
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


def parse_args(argv: list[str] | None = None):
    """``(ModelDataArguments, SFTConfig)`` from ``--config`` YAML and flags; errors name the field."""
    from trl import SFTConfig, TrlParser

    from train.distributed import check_deepspeed_flag

    check_deepspeed_flag(sys.argv[1:] if argv is None else argv)  # SFTConfig reads the JSON as it is built
    parser = TrlParser((ModelDataArguments, SFTConfig))
    model_args, sft_args = parser.parse_args_and_config(argv)
    check(model_args, sft_args)
    return model_args, sft_args


def check(model_args: ModelDataArguments, sft_args) -> None:
    """Fail before any model loads."""
    if model_args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(
            f"field 'dtype' must be auto, float32, bfloat16 or float16, got {model_args.dtype!r}"
        )
    if not (Path(model_args.dataset) / "data").is_dir():
        raise ValueError(
            f"field 'dataset': {model_args.dataset} has no data/ dir (run `metachunk data build-sft`)"
        )
    report = Path(model_args.dataset) / "build_report.json"
    if report.is_file() and sft_args.eval_strategy != "no":
        rows = json.loads(report.read_text(encoding="utf-8")).get("rows", {})
        if rows.get("validation") == 0:
            raise ValueError(
                f"field 'eval_strategy' is '{sft_args.eval_strategy.value}' but {model_args.dataset} has no "
                "validation rows: rebuild it with a validation_fraction, or pass --eval_strategy no"
            )
    if model_args.use_peft and not 0 < model_args.lora_r:
        raise ValueError(f"field 'lora_r' must be >= 1, got {model_args.lora_r}")
    resume_point(sft_args)  # a missing checkpoint is a config error, found before the model loads
    from train.distributed import check_deepspeed  # --deepspeed JSON, or accelerate's DeepSpeed config

    check_deepspeed(sft_args)
    if sft_args.completion_only_loss is False:
        raise ValueError(
            "field 'completion_only_loss' must stay on: the loss is on the completion only (Eq. 3)"
        )
    check_packing(model_args.attn_implementation, sft_args)
    if model_args.attn_implementation == "flex_attention" and sft_args.use_cpu:
        # it would load and run the first forward, then fail in backward (torch 2.13)
        raise ValueError(
            "field 'attn_implementation': flex_attention has no backward on CPU in PyTorch; use sdpa (or eager) "
            "with use_cpu"
        )
    if sft_args.use_liger_kernel:
        from transformers.utils import is_liger_kernel_available

        if sft_args.use_cpu or not is_liger_kernel_available():
            raise ValueError(
                "field 'use_liger_kernel' needs a CUDA GPU and `pip install liger-kernel` (Triton kernels); "
                "not available here"
            )


def padding_free(sft_args) -> bool:
    """TRL's rule: ``padding_free``, or ``packing`` with a bfd strategy (it flattens the packed rows)."""
    return bool(
        sft_args.padding_free or (sft_args.packing and sft_args.packing_strategy in ("bfd", "bfd_split"))
    )


def check_packing(attn_implementation: str | None, sft_args) -> None:
    """Padding-free batches are one flattened row per micro-batch, the rows told apart only by ``position_ids``
    restarting at 0. transformers 5 turns that into a block-diagonal causal mask for sdpa, eager and flex_attention
    (``masking_utils.find_packed_sequence_indices``); the flash-attention kernels take the boundaries (``cu_seq_lens``)
    from TRL's collator. Any other attention would let the rows attend to each other, silently."""
    if sft_args.padding_free and not sft_args.packing and sft_args.max_length is not None:
        raise ValueError(
            "field 'padding_free' without packing does not truncate rows to max_length: set max_length: null "
            "(--max_length None), or use --packing true (bfd, which truncates each row at max_length)"
        )
    impl = attn_implementation
    if (
        padding_free(sft_args)
        and impl is not None
        and impl not in ("sdpa", "eager", "flex_attention")
        and "flash" not in impl
    ):
        raise ValueError(
            f"field 'attn_implementation': {impl!r} cannot keep the rows of a packed / padding-free batch apart; "
            "use sdpa, eager, flex_attention or flash_attention_2"
        )


def resume_point(sft_args) -> str | None:
    """``--resume_from_checkpoint latest`` (the newest checkpoint in ``output_dir``) or a path."""
    from transformers.trainer_utils import get_last_checkpoint

    wanted = sft_args.resume_from_checkpoint
    if wanted in (None, ""):
        return None
    if str(wanted).lower() in ("latest", "true"):
        last = get_last_checkpoint(sft_args.output_dir) if Path(sft_args.output_dir).is_dir() else None
        if last is None:
            raise ValueError(f"field 'resume_from_checkpoint': no checkpoint-* in {sft_args.output_dir}")
        return last
    if not Path(wanted).is_dir():
        raise ValueError(f"field 'resume_from_checkpoint': {wanted} is not a checkpoint dir")
    return str(wanted)


def effective_batch_size(sft_args) -> int:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return sft_args.per_device_train_batch_size * sft_args.gradient_accumulation_steps * world


def plot_losses(log_history: list[dict], path: Path) -> None:
    """Training (and validation) loss against the step, written atomically."""
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    valid = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (completion tokens)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


RUN_FACTS = "metachunk_run.json"  # what `metachunk export` writes the model card from


def run_facts(model_args, sft_args, model_dir, trainer, **counts) -> dict:
    """What this run was, measured, not remembered: the model card is written from this file."""
    import dataclasses

    import torch.distributed as dist

    history = trainer.state.log_history
    train_losses = [e["loss"] for e in history if "loss" in e]
    eval_losses = [e["eval_loss"] for e in history if "eval_loss" in e]
    build_report = Path(model_args.dataset) / "build_report.json"
    hyper = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
             "gradient_accumulation_steps", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_length",
             "bf16", "packing", "packing_strategy", "padding_free", "seed", "deepspeed", "completion_only_loss")  # fmt: skip
    return {
        "base_model": model_args.model,
        "base_model_dir": str(model_dir),
        "dataset": str(Path(model_args.dataset).resolve()),
        "dataset_report": json.loads(build_report.read_text(encoding="utf-8"))
        if build_report.is_file()
        else None,
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


def write_json_atomic(path: Path, obj) -> None:
    from metachunk.artifacts import AtomicWriter

    with AtomicWriter(path) as f:
        f.write(json.dumps(obj, ensure_ascii=False, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        model_args, sft_args = parse_args(argv)
    except ValueError as e:
        print(f"train: invalid config: {e}", file=sys.stderr)
        return 2

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from metachunk.models import resolve
    from train.distributed import prepare_distributed

    model_dir = str(resolve(model_args.model))
    data = load_dataset(model_args.dataset)
    keep = ["prompt", "completion"]  # the metadata columns stay in the dataset, not in the batches
    train_set = data["train"].select_columns(keep)
    if model_args.max_train_rows:
        train_set = train_set.select(range(min(model_args.max_train_rows, len(train_set))))
    eval_set = data["validation"].select_columns(keep) if "validation" in data else None
    if eval_set is not None and len(eval_set) == 0:
        eval_set = None

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = "auto" if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    prepare_distributed(sft_args)  # DeepSpeed on CPU: gloo group first, so ZeRO-3 partitions at load
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, use_safetensors=True, attn_implementation=model_args.attn_implementation
    )
    impl = model.config._attn_implementation  # what transformers picked when none was asked for
    try:
        check_packing(impl, sft_args)
    except ValueError as e:
        print(f"train: invalid config: {e}", file=sys.stderr)
        return 2
    if padding_free(sft_args) and "flash" not in impl:
        print(f"train: padding-free batches with {impl}: each micro-batch is one flattened row and attention is "
              "computed densely under a block-diagonal mask (time and memory quadratic in the row); "
              "see recipes/train/README.md", file=sys.stderr)  # fmt: skip
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
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    # TRL folds the completion mask into `labels`: -100 on every prompt token.
    completion = sum(sum(label != -100 for label in labels) for labels in trainer.train_dataset["labels"])
    batch = effective_batch_size(sft_args)
    packed = "seq_lengths" in trainer.train_dataset.column_names  # TRL's bfd packing: one row = several rows
    rows = sum(map(len, trainer.train_dataset["seq_lengths"])) if packed else len(trainer.train_dataset)
    steps = (
        sft_args.max_steps
        if sft_args.max_steps > 0
        else math.ceil((len(trainer.train_dataset) if packed else len(train_set)) / batch)
        * sft_args.num_train_epochs
    )
    if trainer.is_world_process_zero():
        fit = (
            f"{rows} rows packed into {len(trainer.train_dataset)} sequences of <= {sft_args.max_length} tokens"
            if packed
            else f"{rows} of {len(train_set)} rows fit max_length"
        )
        print(
            f"train: {fit}, {tokens:,} tokens ({completion:,} completion tokens carry the loss); "
            f"effective global batch {batch} {'packed sequences' if packed else 'rows'}; {steps} optimizer steps",
            file=sys.stderr,
        )
    resume = resume_point(sft_args)
    if resume and trainer.is_world_process_zero():
        state = json.loads((Path(resume) / "trainer_state.json").read_text(encoding="utf-8"))
        print(f"train: resuming from {resume} at step {state['global_step']}", file=sys.stderr)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(sft_args.output_dir)
    if trainer.is_world_process_zero():
        out = Path(sft_args.output_dir)
        plot_losses(trainer.state.log_history, out / "loss.png")
        write_json_atomic(out / "train_log.json", trainer.state.log_history)
        facts = run_facts(model_args, sft_args, model_dir, trainer, rows=rows, tokens=tokens,
                          completion_tokens=completion, global_batch=batch, argv=sys.argv[1:] if argv is None else argv)  # fmt: skip
        write_json_atomic(out / RUN_FACTS, facts)
        print(f"train: final train loss {facts['final_train_loss']}, validation loss {facts['final_eval_loss']}; "
              f"wrote {out}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
