"""DeepSpeed ZeRO for ``train/sft.py``: config validation at start-up and the CPU launch path.

Launch forms (``recipes/train/README.md`` has them all):

```
DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --module metachunk.train --config recipes/train/cpu_smoke.yaml \
    --deepspeed recipes/deepspeed/zero3.json --ddp_backend gloo ...
DS_ACCELERATOR=cpu accelerate launch --config_file recipes/accelerate/zero3.yaml -m metachunk.train \
    --config recipes/train/cpu_smoke.yaml --ddp_backend gloo ...
```

On CPU the process group must be gloo, and for ZeRO-3 it must exist *before* ``from_pretrained``
so that ``deepspeed.zero.Init`` partitions the weights while they load (transformers takes that
path when ``is_deepspeed_zero3_enabled()``, i.e. once a ``TrainingArguments`` with ``deepspeed=``
exists, which ``parse_args`` has already built).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Values the HF Trainer fills in from TrainingArguments; a hard-coded number here can silently
# disagree with --per_device_train_batch_size / --gradient_accumulation_steps / the world size.
AUTO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def validate_deepspeed_config(path: str | os.PathLike | dict) -> dict:
    """The parsed DeepSpeed config; ``ValueError`` naming the file and the key when it is unusable."""
    if isinstance(path, dict):  # SFTConfig.deepspeed may already be a dict
        where, cfg = "<dict>", path
    else:
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"deepspeed config {where}: cannot read it ({e.strerror or e})") from e
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"deepspeed config {where}: not JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"deepspeed config {where}: the top level must be a JSON object")
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        raise ValueError(f"deepspeed config {where}: key 'zero_optimization.stage' is missing")
    stage = zero["stage"]
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"deepspeed config {where}: key 'zero_optimization.stage' must be 0..3, got {stage!r}"
        )
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        raise ValueError(
            f"deepspeed config {where}: key 'zero_optimization.stage3_gather_16bit_weights_on_model_save' "
            "must be true for stage 3, or the saved checkpoint holds only empty partitions"
        )
    for key in AUTO_KEYS:
        if key in cfg and cfg[key] != "auto":
            raise ValueError(
                f'deepspeed config {where}: key {key!r} must be "auto" (the Trainer derives it from '
                f"the batch flags and the world size), got {cfg[key]!r}"
            )
    return cfg


def deepspeed_config_of(sft_args):
    """``--deepspeed`` of the run, else the JSON an ``accelerate launch`` DeepSpeed config names."""
    if getattr(sft_args, "deepspeed", None):
        return sft_args.deepspeed
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    return None


def check_deepspeed(sft_args) -> None:
    """Called from ``metachunk.train.sft.check``: validate the DeepSpeed config, if the run has one; and under
    ``accelerate launch`` with a DeepSpeed config file, refuse a ``deepspeed`` field that names another one."""
    cfg = deepspeed_config_of(sft_args)
    if cfg:
        validate_deepspeed_config(cfg)
    launched = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    own = getattr(sft_args, "deepspeed", None)
    # The Trainer builds DeepSpeed from its own field when it is set (TrainingArguments.deepspeed_plugin), so the
    # accelerate config's JSON would be ignored without a word: `--config_file zero3.yaml` training under ZeRO-2.
    if own and launched and validate_deepspeed_config(launched) != validate_deepspeed_config(own):
        named = "<dict>" if isinstance(own, dict) else own
        raise ValueError(
            f"field 'deepspeed' is {named} but the accelerate config names {launched}, another DeepSpeed config, and "
            f"the field's would run: pass --deepspeed {launched}, or launch with an accelerate config that names {named}"
        )


def check_deepspeed_file(recipe: dict, argv: list[str]) -> None:
    """Validate the DeepSpeed config file that ``--deepspeed FILE``, or without the flag the recipe's
    ``deepspeed:`` key, names, before ``SFTConfig`` parses it.

    ``SFTConfig.__post_init__`` loads the JSON itself, and its errors (a bare JSON decode error that
    names no file; an ``AttributeError`` traceback for a JSON array; accelerate's "Expected a string path
    to an existing deepspeed config ... Received: PATH") never name the field.
    """
    value = recipe.get("deepspeed")
    for i, arg in enumerate(argv):  # the flag wins over the recipe, as in TrlParser
        if arg == "--deepspeed" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--deepspeed="):
            value = arg.split("=", 1)[1]
    if not isinstance(value, str) or value.lstrip().startswith(
        "{"
    ):  # none, or inline JSON: SFTConfig's business
        return
    if not Path(value).is_file():
        raise ValueError(f"field 'deepspeed': no such DeepSpeed config file {value}")
    validate_deepspeed_config(value)


def on_cpu(sft_args) -> bool:
    import torch

    return bool(getattr(sft_args, "use_cpu", False)) or not torch.cuda.is_available()


def prepare_distributed(sft_args) -> None:
    """Before the model loads: under DeepSpeed on CPU, start the gloo process group.

    No-op without ``--deepspeed`` or on GPU (there the Trainer/accelerate set up NCCL themselves).
    Under a launcher (``WORLD_SIZE`` set) the group is created now so that ZeRO-3 can partition
    the weights inside ``from_pretrained``; a plain ``python -m metachunk.train`` run gets a world of one.
    """
    if not deepspeed_config_of(sft_args) or not on_cpu(sft_args):
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # Always through deepspeed: under a launcher accelerate's PartialState (built with SFTConfig)
    # has usually made the torch group already; deepspeed.comm must adopt it, or zero.Init sees a
    # world of one and fails its batch-size check.
    if "WORLD_SIZE" not in os.environ:  # single process without a launcher: a world of one
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed(dist_backend="gloo")
    unlink_allreduce_buffer()


# DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp, used when every rank is on this machine)
# gives each rank a 69 MB POSIX shared-memory buffer named as below, and never unlinks it: every launch left
# its ranks' buffers in /dev/shm, which is RAM, after it exited, until repeated runs left the machine short of
# memory (as sglang's CI, which kills jobs, found: sgl-project/sglang#38638).
ALLREDUCE_BUFFER = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def unlink_allreduce_buffer() -> None:
    """Take this rank's DeepSpeed shared-memory buffer out of /dev/shm once every rank has mapped it.

    Each rank maps every other rank's buffer by name while DeepSpeed's process group starts
    (``shm_initialize`` opens them in turn); after a barrier no one needs the names. A mapping outlives
    its name, so the all-reduce goes on working, and the kernel frees the memory when the last rank
    exits, killed or not."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    name = ALLREDUCE_BUFFER.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                                   port=os.environ.get("MASTER_PORT", ""), rank=dist.get_rank())  # fmt: skip
    (Path("/dev/shm") / name).unlink(missing_ok=True)
