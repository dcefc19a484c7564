"""Training throughput measured by the trainer itself: tokens/s, model TFLOP/s per device and MFU.

`ThroughputCallback` is a transformers ``TrainerCallback`` (the events and their order:
https://huggingface.co/docs/transformers/v5.12.0/trainer_callbacks). It counts the real tokens of every
training forward through a forward pre-hook on the model (the Trainer hands a callback no batch), times the
steps between logs, and adds three keys to each training log line: ``tokens_per_second`` (the whole job: all
ranks), ``tflops`` (model FLOPs achieved per device, in TFLOP/s) and, where the device's dense bf16 peak is
known (`peak_tflops`), ``mfu`` (``tflops`` / peak). At the end of training its `summary` (the steps after
warm-up, peak device memory on CUDA) is what ``metachunk.train.sft`` writes into ``metachunk_run.json`` and
``metachunk.train.card`` into the model card.

Model FLOPs of a step (`ModelShape.flops`; ``bench/train_mfu_gpu.py`` uses the same function):

```
dense     = (4 * (N - H) + 2 * (Nt - Ht)) * T + (4 * H + 2 * Ht) * S
                           N = parameters in matmuls (`matmul_params`: every parameter but the input
                           embedding, plus the LM head even when it is tied); H = the LM head's (`head_params`);
                           Nt, Ht = the trainable ones among them (N and H in a full fine-tune, the adapters'
                           under LoRA); T = real tokens in the step; S = tokens scored (labels not -100, after
                           the shift): the head is needed only where the loss reads it, and TRL's fused head on
                           a GPU computes it only there (``trl.trainer.utils``, ``hidden_states[mask]``), so a
                           completion-only run's prompt tokens pass through the body alone;
                           forward 2 FLOPs per parameter per token, backward 2 for the input's gradient and 2
                           for the weight's, which a frozen weight does not need: 6 * N * T in a full fine-tune
attention = 6 * heads * head_dim * sum over layers and sequences of K
                           causal attention inside each sequence of L real tokens: forward QK^T and AV are
                           2 * head_dim FLOPs per head per query-key pair, the causal half only, backward 2x;
                           K = L^2 in a full-attention layer, and in a sliding-window layer of window w (Gemma-3's
                           `layer_types`) the sum over positions p of 2 * min(p + 1, w) - 1
```

A forward without labels counts the head on every real token (S = T).

Recomputation (activation checkpointing), padding, and the blocks a kernel computes under a mask are not
model FLOPs: MFU compares the work the model needs with what the device could do. A sequence is what
attention sees: a row of a padded batch (its ``attention_mask``), or one of the rows a padding-free /
packed batch flattens into one (its ``position_ids`` restart at 0).
"""

from __future__ import annotations

import platform
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s per device: half the "with sparsity" BF16 figure of
# NVIDIA's datasheets, the specifications tables of
#   https://www.nvidia.com/en-us/data-center/h100/         (H100 SXM, PCIe, NVL)
#   https://www.nvidia.com/en-us/data-center/h200/         (H200 SXM, NVL)
#   https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/
#   https://www.nvidia.com/en-us/data-center/a100/         (SXM and PCIe alike)
#   https://www.nvidia.com/en-us/data-center/l40s/
#   https://www.nvidia.com/en-us/data-center/a40/
#   https://www.nvidia.com/en-us/data-center/products/a10-gpu/
#   https://www.nvidia.com/en-us/data-center/l4/
# The A800 and H800 are the A100 and H100 SXM with a slower NVLink: the same tensor cores and clocks. Matched on
# torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA A800-SXM4-80GB", ...); the first match wins, so
# a variant comes before its family. A device not listed gets no MFU rather than a guessed one.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH200\b.*\bNVL\b", 835.0),
    (r"\bH100\b", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bH200\b", 989.0),
    (r"\bGH200\b", 989.0),  # Grace Hopper: the H100 SXM's tensor cores
    (r"\bH800\b(?!.*\bPCIe\b)", 989.0),
    (r"\bA100\b", 312.0),  # SXM4 and PCIe alike
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bA40\b", 150.0),
    (r"\bA10\b", 125.0),
    (r"\bL4\b", 121.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a CUDA device by its name (`PEAK_BF16_TFLOPS`), or None when it is not known."""
    return next((peak for pattern, peak in PEAK_BF16_TFLOPS if re.search(pattern, device_name, re.I)), None)


def _numel(param) -> int:
    # under ZeRO-3 a rank holds a partition of each parameter (numel() 0); ds_numel is the whole
    return getattr(param, "ds_numel", None) or param.numel()


def matmul_params(model) -> int:
    """Parameters that take part in a matmul: all but the input embedding (a lookup), plus the LM head, once,
    even when it shares the embedding's matrix (``model.parameters()`` yields a shared matrix once)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(_numel(p) for p in model.parameters())
    tied = head is not None and head.weight is embedding
    return total - _numel(embedding) + (_numel(embedding) if tied else 0)


def head_params(model) -> int:
    """The LM head's parameters (its weight and bias), counted once whether or not it is tied."""
    head = model.get_output_embeddings()
    return sum(_numel(p) for p in head.parameters()) if head is not None else 0


def trainable_matmul_params(model) -> tuple[int, int]:
    """``(Nt, Ht)``: the trainable parameters among `matmul_params` and `head_params` (all of them in a full
    fine-tune; a PEFT model's frozen base weights are not, its adapters are)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(_numel(p) for p in model.parameters() if p.requires_grad)
    tied = head is not None and head.weight is embedding
    if embedding.requires_grad and not tied:
        total -= _numel(embedding)  # a lookup
    trainable_head = sum(_numel(p) for p in head.parameters() if p.requires_grad) if head is not None else 0
    return total, trainable_head


def sliding_windows(config) -> tuple[int, ...]:
    """The window of each sliding-window attention layer (``layer_types``, ``sliding_window``): one entry per
    such layer, none for a model whose every layer attends to the whole sequence."""
    window, kinds = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not window or not kinds:
        return ()
    return tuple(window for kind in kinds if kind == "sliding_attention")


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a step depend on, besides its tokens."""

    matmul_params: int
    layers: int
    heads: int
    head_dim: int
    head_params: int = 0
    trainable_params: int | None = None  # of matmul_params; None: all (a full fine-tune)
    trainable_head_params: int | None = None  # of head_params; None: all
    windows: tuple[int, ...] = ()  # the window of each sliding-window layer (`sliding_windows`)

    @classmethod
    def of(cls, model) -> ModelShape:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        n, head = matmul_params(model), head_params(model)
        trainable, trainable_head = trainable_matmul_params(model)
        full = (trainable, trainable_head) == (n, head)
        return cls(n, config.num_hidden_layers, heads, head_dim, head, None if full else trainable,
                   None if full else trainable_head, sliding_windows(config))  # fmt: skip

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """The distinct windows, in the order `batch_counts` counts them."""
        return tuple(sorted(set(self.windows)))

    def flops(
        self, tokens: int, sum_sq_lengths: int, scored: int | None = None, windowed: tuple[int, ...] = ()
    ) -> tuple[int, int]:
        """``(dense, attention)`` model FLOPs, forward and backward, of ``tokens`` real tokens in sequences whose
        squared lengths sum to ``sum_sq_lengths``, ``scored`` of them through the LM head (default: all), and
        ``windowed`` the same sum under each of `window_sizes` (`batch_counts`; the module docstring has the
        formula)."""
        scored = tokens if scored is None else scored
        n, head = self.matmul_params, self.head_params
        n_t = n if self.trainable_params is None else self.trainable_params
        head_t = head if self.trainable_head_params is None else self.trainable_head_params
        dense = (4 * (n - head) + 2 * (n_t - head_t)) * tokens + (4 * head + 2 * head_t) * scored
        if len(windowed) != len(self.window_sizes):
            raise ValueError(f"the model has sliding windows {self.window_sizes}: their sums are needed")
        by_window = dict(zip(self.window_sizes, windowed))
        keys = (self.layers - len(self.windows)) * sum_sq_lengths + sum(by_window[w] for w in self.windows)
        attention = 6 * self.heads * self.head_dim * keys
        return dense, attention


def windowed_keys(length: int, window: int | None) -> int:
    """The sum of ``2 * min(p + 1, window) - 1`` over the positions of one sequence: ``length^2`` under full
    attention, and past the window each position adds ``2 * window - 1``."""
    if window is None or length <= window:
        return length * length
    return window * window + (length - window) * (2 * window - 1)


def batch_counts(
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    inputs_embeds=None,
    labels=None,
    shift_labels=None,
    windows: tuple[int, ...] = (),
):
    """``[real tokens, sum of squared sequence lengths, tokens scored, *the same sum under each window]`` of one
    batch: an int64 tensor on the batch's device, computed without reading anything back to the host (so
    counting every micro-batch costs no sync). Tokens scored are the targets the loss reads: ``shift_labels``
    not -100, else ``labels[..., 1:]`` not -100 (transformers shifts them), else every real token.

    A sequence of L tokens has positions 0..L-1, and the sum of ``2p + 1`` over them is L^2 (the keys its
    queries attend to, counted as the formula counts them): so the squares are a sum over tokens, and under a
    sliding window w the sum of ``2 * min(p + 1, w) - 1``. With an ``attention_mask`` (a padded batch) a
    token's position is the count of real tokens before it in its row; without one, ``position_ids`` (a
    padding-free row: each packed sequence restarts at 0; padding to ``pad_to_multiple_of`` counts as sequences
    of one token); with neither, every row is one sequence."""
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask.to(torch.int64)
        seen = mask.cumsum(-1)  # p + 1 at a real token
        sums = [(mask * (2 * (seen if w is None else seen.clamp(max=w)) - 1)).sum() for w in (None, *windows)]
        counts = torch.stack([mask.sum(), *sums])
    elif position_ids is not None:
        seen = position_ids.to(torch.int64) + 1
        sums = [(2 * (seen if w is None else seen.clamp(max=w)) - 1).sum() for w in (None, *windows)]
        counts = torch.stack([torch.ones_like(seen).sum(), *sums])
    else:
        shaped = input_ids if input_ids is not None else inputs_embeds
        rows, length = shaped.shape[:2]
        sums = [rows * windowed_keys(length, w) for w in (None, *windows)]
        counts = torch.tensor([rows * length, *sums], dtype=torch.int64, device=shaped.device)
    if shift_labels is not None:
        scored = (shift_labels != -100).sum().to(counts.device, torch.int64)
    elif labels is not None:
        scored = (labels[..., 1:] != -100).sum().to(counts.device, torch.int64)
    else:
        scored = counts[0]
    return torch.cat([counts[:2], scored.reshape(1), counts[2:]])


def device_name(device) -> str:
    """The CUDA device's name (what `peak_tflops` matches), or the device type and the machine (``cpu (x86_64)``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine() or 'unknown'})"


def _rounded(x: float) -> float:
    return float(f"{x:.4g}")


@dataclass
class Interval:
    """The steps between two training logs (or the last log and the end), summed over every rank."""

    first_step: int
    last_step: int
    tokens: int
    sum_sq_lengths: int
    seconds: float
    scored: int
    windowed: tuple[int, ...] = ()  # sum_sq_lengths under each of the model's window sizes


class ThroughputCallback(TrainerCallback):
    """Adds ``tokens_per_second``, ``tflops`` and ``mfu`` (where the peak is known) to every training log line,
    and leaves the run's `summary` after training. `attach` it to the trainer, ahead of the reporters.

    Time is training time: from one step's end to the next, data loading included; the evaluations and
    checkpoint saves in between are left out, and so is this callback's own reduction. The device is
    synchronised at the steps where an interval ends (a log, an evaluation, a save, the last step), so the time
    of an interval is the device's, not the host's."""

    def __init__(self, warmup_steps: int = 1, peak: float | None = None):
        # the first steps of a run (compilation, allocator, caches) are not its rate
        self.warmup_steps = warmup_steps
        self.peak = peak  # dense bf16 TFLOP/s per device; None: by the device's name (CUDA only)
        self.in_bf16 = True  # set at the start of training: bf16 autocast, or bf16 weights
        self.shape: ModelShape | None = None
        self.device = None
        self.device_name = ""
        self.world = 1
        self.intervals: list[Interval] = []
        self.summary: dict | None = None
        self._hook = None
        self._counts = None  # [tokens, sum of squared lengths] of the forwards since the last log, this rank
        self._start_step: int | None = None
        self._first_step: int | None = None
        self._seconds = 0.0
        self._running_since = 0.0

    def attach(self, trainer) -> ThroughputCallback:
        """Add it to ``trainer`` right after ``DefaultFlowCallback``: the Trainer hands the same ``logs`` dict to
        each callback in turn, so the reporters (TensorBoard, W&B, the printed line) see its keys only if it
        comes before them; and it reads the flow callback's decisions (``control.should_log``, ...) at a step's
        end, so it comes after that one."""
        callbacks = trainer.callback_handler.callbacks
        callbacks.insert(1 if callbacks and isinstance(callbacks[0], DefaultFlowCallback) else 0, self)
        return self

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.shape = ModelShape.of(model)
        self.device = args.device
        self.device_name = device_name(self.device)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # The peaks are bf16's: a run in fp32 (or fp16) measured against them would read as a poor bf16 run.
        self.in_bf16 = bool(args.bf16) or next(model.parameters()).dtype == torch.bfloat16
        if self.peak is None and self.device.type == "cuda" and self.in_bf16:
            self.peak = peak_tflops(self.device_name)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.intervals, self.summary, self._counts = [], None, None
        self._start_step = self._first_step = None
        self._seconds = 0.0
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._running_since = time.perf_counter()

    def _count(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation, or a forward without gradients (a metrics-only pass): not a training step's work
        names = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "shift_labels")
        batch = {k: kwargs.get(k) for k in names}
        if batch["input_ids"] is None and args:
            batch["input_ids"] = args[0]  # a causal LM's first positional argument
        if batch["input_ids"] is None and batch["inputs_embeds"] is None:
            return
        counts = batch_counts(**batch, windows=self.shape.window_sizes)
        self._counts = counts if self._counts is None else self._counts + counts.to(self._counts.device)

    def on_step_end(self, args, state, control, **kwargs):
        if (
            control.should_log
            or control.should_evaluate
            or control.should_save
            or control.should_training_stop
        ):
            self._synchronize()
        now = time.perf_counter()
        self._seconds += now - self._running_since
        self._running_since = now
        if self._start_step is None:
            self._start_step = state.global_step
        if self._first_step is None:
            self._first_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._first_step is None:
            return  # an evaluation's log, or the end-of-training summary: no steps of its own
        interval = self._close(state.global_step)
        values = self.rates(
            interval.tokens, interval.sum_sq_lengths, interval.seconds, interval.scored, interval.windowed
        )
        values = {k: _rounded(v) for k, v in values.items() if k in ("tokens_per_second", "tflops", "mfu")}
        logs.update(values)
        last = state.log_history[-1] if state.log_history else {}
        if last.get("step") == state.global_step and "loss" in last:  # the Trainer's copy of this log
            last.update(values)
        self._running_since = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs):
        self._running_since = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        self._running_since = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self._first_step is not None:  # steps after the last log
            self._close(state.global_step)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.summary = self._summarize()

    # ------------------------------------------------------------------ arithmetic

    def rates(
        self,
        tokens: int,
        sum_sq_lengths: int,
        seconds: float,
        scored: int | None = None,
        windowed: tuple[int, ...] = (),
    ) -> dict:
        """Tokens/s of the whole job, and TFLOP/s and MFU per device, of ``tokens`` (``scored`` of them through the
        LM head; default all) over ``seconds`` on every rank."""
        dense, attention = self.shape.flops(tokens, sum_sq_lengths, scored, windowed)
        tflops = (dense + attention) / seconds / self.world / 1e12 if seconds > 0 else 0.0
        return {
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "tokens_per_second_per_device": tokens / seconds / self.world if seconds > 0 else 0.0,
            "tflops": tflops,
            **({"mfu": tflops / self.peak} if self.peak else {}),
            "flops_dense": dense,
            "flops_attention": attention,
        }

    def _synchronize(self) -> None:
        if self.device is not None and self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _reduced(self, local, op: str = "sum") -> list[int]:
        """``local`` (an int64 tensor) reduced over every rank, as ints; every rank calls it at the same point."""
        # NCCL reduces CUDA tensors, gloo CPU ones: the rank's own device either way
        local = local.to(self.device)
        if self.world > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return [int(x) for x in local.tolist()]

    def _close(self, step: int) -> Interval:
        """The interval that ends at ``step``, summed over the ranks, recorded; the next one starts empty."""
        size = 3 + len(self.shape.window_sizes)
        local = self._counts if self._counts is not None else torch.zeros(size, dtype=torch.int64)
        tokens, sum_sq, scored, *windowed = self._reduced(local)
        interval = Interval(self._first_step, step, tokens, sum_sq, self._seconds, scored, tuple(windowed))
        self.intervals.append(interval)
        self._counts, self._first_step, self._seconds = None, None, 0.0
        return interval

    def _summarize(self) -> dict | None:
        """The rate over the steps after warm-up (all of them when no interval starts after it): total tokens and
        FLOPs over total time, i.e. the time-weighted mean of the steps."""
        if not self.intervals:
            return None
        after = [i for i in self.intervals if i.first_step >= self._start_step + self.warmup_steps]
        measured = after or self.intervals
        tokens = sum(i.tokens for i in measured)
        sum_sq = sum(i.sum_sq_lengths for i in measured)
        scored = sum(i.scored for i in measured)
        seconds = sum(i.seconds for i in measured)
        windowed = tuple(sum(column) for column in zip(*(i.windowed for i in measured)))
        rates = self.rates(tokens, sum_sq, seconds, scored, windowed)
        peak_memory = None
        if self.device.type == "cuda":
            (peak_memory,) = self._reduced(
                torch.tensor([torch.cuda.max_memory_allocated(self.device)]), op="max"
            )
        return {
            "device": self.device_name,
            "world_size": self.world,
            "steps": [measured[0].first_step, measured[-1].last_step],
            "warmup_steps": measured[0].first_step - self._start_step,
            "tokens": tokens,
            "tokens_scored": scored,
            "seconds": round(seconds, 6),
            "tokens_per_second": _rounded(rates["tokens_per_second"]),
            "tokens_per_second_per_device": _rounded(rates["tokens_per_second_per_device"]),
            "tflops_per_device": _rounded(rates["tflops"]),
            "peak_tflops_per_device": self.peak,
            "bf16": self.in_bf16,
            "mfu": _rounded(rates["mfu"]) if "mfu" in rates else None,
            "flops_dense": rates["flops_dense"],
            "flops_attention": rates["flops_attention"],
            "matmul_params": self.shape.matmul_params,
            "head_params": self.shape.head_params,
            "trainable_params": self.shape.trainable_params,
            "trainable_head_params": self.shape.trainable_head_params,
            "sliding_window_layers": len(self.shape.windows),
            "peak_memory_gib": round(peak_memory / 2**30, 2) if peak_memory is not None else None,
            "formula": "((4*(N-H) + 2*(Nt-Ht))*T + (4*H + 2*Ht)*S + 6*heads*head_dim*sum over layers of sum(L_i^2), "
            "windowed in sliding-window layers) / seconds / devices; MFU = that / peak; Nt, Ht: the trainable N, H",
        }


def why_no_mfu(summary: dict) -> str:
    """Why a run's `ThroughputCallback.summary` has no MFU: no bf16 peak is known for its device, or it did
    not train in bf16 (the peaks known are bf16's)."""
    if peak_tflops(summary["device"]) is None:
        return f"no dense bf16 peak known for {summary['device']}"
    return "not trained in bf16, and the peaks known are bf16's"


def summary_line(summary: dict) -> str:
    """`ThroughputCallback.summary` as one line (``metachunk train`` prints it at the end)."""
    first, last = summary["steps"]
    warm = summary["warmup_steps"]
    mfu = (
        f"MFU {summary['mfu']:.1%} of {summary['peak_tflops_per_device']:g} TFLOP/s"
        if summary.get("mfu") is not None
        else f"MFU n/a ({why_no_mfu(summary)})"
    )
    memory = (
        f"; peak memory {summary['peak_memory_gib']} GiB"
        if summary.get("peak_memory_gib") is not None
        else ""
    )
    return (
        f"throughput over steps {first}-{last}"
        + (f" (after {warm} warm-up step{'s' if warm != 1 else ''})" if warm else "")
        + f": {summary['tokens_per_second']:,.1f} tokens/s, {summary['tflops_per_device']:.4g} TFLOP/s per device on "
        f"{summary['world_size']} x {summary['device']}, {mfu}{memory}"
    )
