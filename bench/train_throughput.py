"""SFT training throughput: padded batches against packed / padding-free ones, side by side.

Issue requirement: "training tokens/s for padded vs packed (and/or padding-free) SFT on a realistic
length mix; peak memory for both; target >= 1.5x tokens/s."

Rows: shaped like the summary SFT set (``metachunk data build-sft summary``; ``demo_out/sft/summary``
holds only a few rows, too few for a length distribution, so its rows are not used). Each row is
the student summary prompt (the template is read from the demo set's ``build_report.json``, a copy
below if it is missing) filled with one CRUD news article as the document context
(``data:crud-news/news.jsonl``, 1,200 articles of 291-1,181 characters) and a chunk of it
(a run of whole sentences from a random one on, at least 178 characters: the demo's chunk merge
length), and a short completion (the chunk's first clause, <= 24 characters). Token lengths are
measured with the ``smollm2`` tokenizer's chat template, the tokenizer the demo set was built with;
they are printed next to the demo set's own (prompt p50 ~1,880 vs the demo's 2,043 on its 3 rows).
Seeded: every run draws the same rows.

Model: by default a random Qwen2 (``--hidden 512 --layers 2``, 8 heads, 2 KV heads, MLP 2,048,
vocabulary 8,192: 11.8M parameters, fp32, sdpa), not the 135M smollm2 preset, which on one CPU core
would take about 20 minutes for the default 20 rows in 4 modes, far beyond the 5-minute budget. The rows are tokenized once, in the parent, into TRL's
processed form (``input_ids`` + ``completion_mask``), the smollm2 token ids folded into the small
vocabulary (``id % 8192``): the lengths are the real ones, and the LM head, which TRL scores at every
position on CPU (its compact "labels only" path needs Triton), stays a small part of the step as in a
real model (with all 49,152 entries the head was 25M of 31M parameters and training ~4x slower).
``--model smollm2`` runs the real preset on the unfolded ids (slow).

Modes, each in its own child process (so that its peak RSS is its own), one epoch over the same
rows, same seed (the same shuffled order), TRL's SFTTrainer with completion-only loss:

* ``padded``: ``per_device_train_batch_size`` B (``--batch``, default 4) rows, right-padded to the
  longest; the baseline.
* ``padding_free``: the same B rows per step, flattened into one row (``padding_free: true``,
  ``max_length: null``): exactly the same steps, rows and tokens as ``padded``.
* ``packed``: ``packing: true`` (TRL's bfd) into sequences of ``--pack-length`` (4,096) tokens, one
  per micro-batch, ``gradient_accumulation_steps`` = ``--pack-accum`` (2), so an optimizer step sees
  about as many tokens as a padded one (~2 x 4,096 vs ~4 x 1,935 real).
* ``unpadded``: batch 1 x gradient accumulation B: the same rows per optimizer step as ``padded``
  (and the same gradient: the loss is normalised over the step's completion tokens), no padding,
  no mask (plain causal attention). The CPU baseline that needs neither packing nor padding.

tokens/s counts real tokens (not padding) of every optimizer step but the first (warm-up: optimizer
state allocation, first-call setup), over the wall time of those steps (forward, backward, optimizer).
Peak memory: ``ru_maxrss`` of the child after training, next to its RSS just before ``train()``
(model, optimizer not yet built, dataset tokenized), so ``peak - base`` is what training itself
took: gradients, AdamW state, activations and the attention masks.

The figures: docs/performance.md (Measured numbers). The >= 1.5x target is not met, and cannot be
with these rows on a CPU: they are long and their lengths narrow (p10-p90 ~1,570-2,360 tokens), so
the padded batches of 4 computed only 1.16x the real tokens: the most that removing padding can buy
where time is ~linear in the tokens computed. And with sdpa
(and eager), a padding-free row is attended densely under a block-diagonal mask: PyTorch's kernels
compute the masked blocks, so attention costs (tokens in the flattened row)^2, not the sum of each
row's square: 4 rows flattened (padding_free) are ~2.5x the attention of the padded batch, a packed
4,096-token sequence ~1.5x that of its two rows in a padded batch. The padded batch pays a dense mask too
(padding), the unpadded batch of 1 does not (plain causal: the kernel skips the upper triangle), so on
CPU batch 1 with gradient accumulation (``recipes/train/cpu_smoke.yaml``) is the fastest and leanest.
The varlen flash-attention kernels (GPU, ``attn_implementation: flash_attention_2``) skip the masked
blocks: that is where packing pays (``bench/train_mfu_gpu.py``, on a GPU). On CPU,
``flex_attention``, whose block mask would skip them too, runs forward but has no backward in PyTorch
2.13 ("FlexAttention does not support backward on CPU"), so the training config refuses it with
``use_cpu``. Even with a kernel that skipped every masked block, removing the padding of these rows
could buy about the 1.16x computed-token ratio plus the padded batch's dense-mask attention, which
``unpadded`` (1.22x) already shows.

    metachunk data fetch crud-news                          # once: the CRUD articles
    python bench/train_throughput.py                        # ~3.5 minutes on 1 core
    python bench/train_throughput.py --rows 12 --modes padded,packed
    python bench/train_throughput.py --model smollm2 --rows 8 --batch 2   # the real 135M preset (slow)

Results: ``bench_out/train_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402

DEMO = ROOT / "demo_out" / "sft" / "summary"
MIB = 2**20
MODES = ("padded", "padding_free", "packed", "unpadded")

# The student summary prompt (zh), as the demo set's build_report.json records it; used when that file is missing.
STUDENT_SUMMARY_ZH = (
    "<<<system>>>\n你负责为文本块撰写一句话摘要，从整篇文档的角度说明其内容。只输出这一句摘要。\n<<<user>>>\n"
    "下面的文本块是从一篇文档中切分出来的。请仅依据给出的文档上下文，写出一句摘要：概括文本块的核心内容，并交代它"
    "所需的文档层面的背景（涉及的人物或事物、时间和地点、与文档其他部分的关系）。用中文作答，只输出这一句摘要。"
    "\n\n文档上下文：\n{context}\n\n文本块：\n{chunk}"
)


# ---------------------------------------------------------------------------------------------- rows


def student_template() -> tuple[str, str, str]:
    """(system, user template, where it came from)."""
    text, source = STUDENT_SUMMARY_ZH, "built-in copy"
    report = DEMO / "build_report.json"
    if report.is_file():
        prompts = json.loads(report.read_text(encoding="utf-8")).get("prompts") or []
        found = [
            p["text"] for p in prompts if p.get("role") == "student" and "{context}" in p.get("text", "")
        ]
        if found:
            text, source = found[0], str(report.relative_to(ROOT))
    system, user = text.split("<<<user>>>\n", 1)
    return system.replace("<<<system>>>\n", "").strip(), user, source


def build_rows(n: int, seed: int, chunk_chars: int = 178, completion_chars: int = 24) -> list[dict]:
    system, user, _ = student_template()
    with resolve("data:crud-news/news.jsonl").open(encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    rng = random.Random(seed)
    rows = []
    for doc in rng.sample(docs, n) if n <= len(docs) else rng.choices(docs, k=n):
        sents = [s for s in re.split(r"(?<=[。！？])", doc) if s.strip()]
        i = rng.randrange(len(sents))
        chunk = sents[i]
        while len(chunk) < chunk_chars and i + 1 < len(sents):
            i += 1
            chunk += sents[i]
        completion = re.split(r"[，。！？]", chunk.strip())[0][:completion_chars] + "。"
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user.format(context=doc, chunk=chunk)},
                ],
                "completion": [{"role": "assistant", "content": completion}],
            }
        )
    return rows


def tokenize(rows: list[dict], tokenizer, vocab: int | None) -> list[dict]:
    """TRL's processed form (``input_ids`` + ``completion_mask``), rendered as TRL renders a conversational
    prompt-completion row (chat template; the prompt with the generation prompt). With ``vocab``, the token ids
    are folded into ``range(vocab)`` for a small random model: the lengths are what matters here."""
    out = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        full = list(full["input_ids"] if hasattr(full, "keys") else full)
        assert full[: len(prompt)] == prompt
        ids = [i % vocab for i in full] if vocab else full
        out.append({"input_ids": ids, "completion_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    return out


def pct(values, q: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# --------------------------------------------------------------------------------------------- child


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mode_config(mode: str, args) -> dict:
    if mode == "padded":
        return {"per_device_train_batch_size": args.batch, "max_length": 8192}
    if mode == "padding_free":
        return {"per_device_train_batch_size": args.batch, "padding_free": True, "max_length": None}
    if mode == "packed":
        return {"per_device_train_batch_size": 1, "gradient_accumulation_steps": args.pack_accum, "packing": True,
                "max_length": args.pack_length}  # fmt: skip
    if mode == "unpadded":
        return {
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": args.batch,
            "max_length": 8192,
        }
    raise ValueError(mode)


def child(args) -> None:
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from metachunk.models import attention_of

    tmp = Path(args.tmp)
    rows = load_from_disk(str(tmp / "rows"))
    model_dir = (tmp / "model") if args.model == "tiny" else args.model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=str(tmp / f"out_{args.child}"), use_cpu=True, report_to="none", save_strategy="no",
        eval_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-5, num_train_epochs=1,
        seed=0, dataloader_num_workers=0, completion_only_loss=True, **mode_config(args.child, args),
        activation_checkpointing=True,  # TRL's default (the figures' setting), under transformers' current name
    )  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer)

    micro = []  # per micro-batch: (real tokens, computed tokens, loss tokens, attention row length)
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        ids = batch["input_ids"]
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else int(ids.numel())
        micro.append((real, int(ids.numel()), int((batch["labels"][:, 1:] != -100).sum()), int(ids.shape[1])))
        return batch

    trainer.data_collator = counting_collator
    step_end: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_end.append(time.perf_counter())

    trainer.add_callback(StepTimes())
    rss_base = current_rss()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    accum = config.gradient_accumulation_steps
    steps = len(step_end)
    first = [m for i, m in enumerate(micro) if i // accum == 0]
    rest = [m for i, m in enumerate(micro) if i // accum >= 1]
    timed = step_end[-1] - step_end[0] if steps > 1 else float("nan")
    print(
        json.dumps(
            {
                "mode": args.child,
                "config": {k: v for k, v in mode_config(args.child, args).items()},
                "attn_implementation": attention_of(model),
                "steps": steps,
                "micro_batches": len(micro),
                "sequences": len(trainer.train_dataset),
                "rows": sum(map(len, trainer.train_dataset["seq_lengths"]))
                if "seq_lengths" in trainer.train_dataset.column_names
                else len(trainer.train_dataset),
                "real_tokens": sum(m[0] for m in micro),
                "computed_tokens": sum(m[1] for m in micro),
                "loss_tokens": sum(m[2] for m in micro),
                "longest_row": max(m[3] for m in micro),
                "timed_steps": steps - 1,
                "timed_real_tokens": sum(m[0] for m in rest),
                "timed_computed_tokens": sum(m[1] for m in rest),
                "first_step_real_tokens": sum(m[0] for m in first),
                "timed_s": timed,
                "tokens_per_s": sum(m[0] for m in rest) / timed if steps > 1 else None,
                "train_wall_s": wall,
                "rss_base": rss_base,
                "peak": peak,
            }
        ),
        flush=True,
    )


# -------------------------------------------------------------------------------------------- parent


def write_model(args, tmp: Path) -> tuple[str, int]:
    """A random Qwen2 (vocabulary ``--vocab``) with the smollm2 tokenizer files (TRL reads the pad token) into
    tmp/model."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from metachunk.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(str(resolve("smollm2")))
    if args.model != "tiny":
        return str(resolve(args.model)), 0
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    return str(tmp / "model"), sum(p.numel() for p in model.parameters())


def run_child(args, mode: str, tmp: Path, model_dir: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--tmp", str(tmp), "--model", args.model,
           "--model-dir", model_dir, "--batch", str(args.batch), "--pack-length", str(args.pack_length),
           "--pack-accum", str(args.pack_accum)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"child {mode} failed with status {proc.returncode}")
    res = json.loads(lines[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20, help="rows (one epoch per mode; default 20)")
    ap.add_argument("--batch", type=int, default=4, help="padded rows per step (default 4)")
    ap.add_argument("--pack-length", type=int, default=4096, help="packed sequence length (default 4096)")
    ap.add_argument(
        "--pack-accum", type=int, default=2, help="packed sequences per optimizer step (default 2)"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--model", default="tiny", help="tiny (random Qwen2, default) or a preset / HF dir")
    ap.add_argument("--hidden", type=int, default=512, help="tiny model: hidden size (heads = hidden / 64)")
    ap.add_argument("--layers", type=int, default=2, help="tiny model: layers")
    ap.add_argument("--intermediate", type=int, default=2048, help="tiny model: MLP size")
    ap.add_argument(
        "--vocab", type=int, default=8192, help="tiny model: vocabulary (token ids folded into it)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=1.5, help="tokens/s ratio packed / padded aimed at")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "train_throughput.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0

    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}")
    from datasets import Dataset
    from transformers import AutoTokenizer

    from metachunk.models import resolve

    tmp = Path(tempfile.mkdtemp(prefix="train_throughput_"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolve("smollm2")))
        rows = tokenize(
            build_rows(args.rows, args.seed), tokenizer, args.vocab if args.model == "tiny" else None
        )
        Dataset.from_list(rows).save_to_disk(str(tmp / "rows"))
        model_dir, params = write_model(args, tmp)
        comps = [sum(r["completion_mask"]) for r in rows]
        totals = [len(r["input_ids"]) for r in rows]
        prompts = [t - c for t, c in zip(totals, comps)]
        _, _, source = student_template()
        print(
            f"SFT training throughput, {args.rows} summary-shaped rows (CRUD articles, prompt from {source}), "
            f"smollm2 tokenizer; model {args.model}"
            + (
                f" (random Qwen2, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, "
                f"{params / 1e6:.1f}M params)"
                if params
                else ""
            )
            + f"; fp32, sdpa, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, one process per mode",
            flush=True,
        )
        print(
            f"  row tokens: prompt p10/p50/p90 {pct(prompts, 10)}/{pct(prompts, 50)}/{pct(prompts, 90)}, completion "
            f"p50 {pct(comps, 50)}, total min/p50/max {min(totals)}/{pct(totals, 50)}/{max(totals)}, mean "
            f"{sum(totals) / len(totals):.0f}",
            flush=True,
        )
        demo = DEMO / "build_report.json"
        if demo.is_file():
            tl = json.loads(demo.read_text(encoding="utf-8")).get("token_lengths", {})
            if "prompt" in tl:
                print(
                    f"  demo set ({sum(json.loads(demo.read_text())['rows'].values())} rows, {tl.get('tokenizer')}): "
                    f"prompt min/p50/max {tl['prompt']['min']}/{tl['prompt']['p50']}/{tl['prompt']['max']}, completion "
                    f"p50 {tl['completion'].get('p50')}",
                    flush=True,
                )
        results = {}
        for mode in modes:
            res = run_child(args, mode, tmp, model_dir)
            results[mode] = res
            print(
                f"  {mode:>12}: {res['steps']} steps ({res['micro_batches']} micro-batches, {res['rows']} rows), "
                f"{res['real_tokens']:,} real / {res['computed_tokens']:,} computed tokens, longest row "
                f"{res['longest_row']:,}; {res['tokens_per_s']:.0f} tokens/s over steps 2-{res['steps']}; peak "
                f"{res['peak'] / MIB:.0f} MiB (base {res['rss_base'] / MIB:.0f}); {res['process_s']:.0f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = results.get("padded")
    print()
    print(f"{'mode':>12} {'tokens/s':>9} {'x padded':>8} {'steps':>5} {'real tok':>9} {'computed':>9} "
          f"{'loss tok':>8} {'peak MiB':>8} {'base MiB':>8} {'peak-base':>9}")  # fmt: skip
    for mode, r in results.items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(
            f"{mode:>12} {r['tokens_per_s']:>9.0f} {ratio:>8.2f} {r['steps']:>5} {r['real_tokens']:>9,} "
            f"{r['computed_tokens']:>9,} {r['loss_tokens']:>8,} {r['peak'] / MIB:>8.0f} {r['rss_base'] / MIB:>8.0f} "
            f"{(r['peak'] - r['rss_base']) / MIB:>9.0f}"
        )
    summary = {}
    if base:
        ceiling = base["timed_computed_tokens"] / base["timed_real_tokens"]
        summary["padding_ceiling"] = ceiling
        print(
            f"\npadded batches of {args.batch}: {ceiling:.2f}x computed / real tokens in the timed steps: the most "
            "that removing padding can buy where time is linear in the tokens computed"
        )
        for mode in ("packed", "padding_free", "unpadded"):
            if mode in results:
                ratio = results[mode]["tokens_per_s"] / base["tokens_per_s"]
                summary[f"{mode}_vs_padded"] = ratio
                peak_ratio = (results[mode]["peak"] - results[mode]["rss_base"]) / max(
                    base["peak"] - base["rss_base"], 1
                )
                print(
                    f"{mode} / padded: {ratio:.2f}x tokens/s, {peak_ratio:.2f}x training memory (peak - base)"
                    + (
                        f"; target >= {args.target:g}x: {'met' if ratio >= args.target else 'NOT met'}"
                        if mode == "packed"
                        else ""
                    )
                )
    result = {
        "bench": "train_throughput",
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "tmp", "model_dir")},
        "params": params,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "row_tokens": {"prompt": prompts, "completion": comps},
        "summary": summary,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(f"[{out}]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"train_throughput: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
