#!/usr/bin/env bash
# The training figures on one GPU, as one prepared script for a 15-minute device slot, in the order a slot
# should spend its time (GPU_CHECK_STEP_TIMEOUT bounds each step):
#   1. the wheelhouse install (GPU_CHECK_WHEELHOUSE), then the 3B recipe under ZeRO-2 with packing (bfd
#      sequences of PACK_LEN tokens), with the recipe's recomputation and, on a GPU of >= 120 GiB, without;
#      then as shipped (padding-free rows, flex attention): `deepspeed --num_gpus 1 --module metachunk.train
#      --config recipes/train/rewriter_qwen2.5-3b.yaml` on a random Qwen2.5-3B-shaped model; the trainer's
#      own callback prints tokens/s, TFLOP/s and MFU (target >= 40% under ZeRO-2 with packing)
#   2. under ZeRO-3 (--deepspeed recipes/deepspeed/zero3.json), then ZeRO-2 without activation recomputation
#      (the recipe's is sized for 80 GB; GPU only)
#   3. kill -9 and --resume_from_checkpoint latest on the Qwen2-0.5B shape at lr 1e-3 (bench/train_resume.py):
#      the loss curve continues, no step counted twice, the same learning rate and tokens per step
#   4. the 3B recipe under `accelerate launch --config_file recipes/accelerate/zero2.yaml`
#   5. ZeRO-2 padded (sdpa): the other batch layout
#   6. ZeRO-2 with DeepSpeed's FusedAdam instead of torch's fused AdamW (GPU only)
#   7. `metachunk export` of step 3's run, and bench/rewrite_speed.py with the export as the student
#      (target >= 0.8x plain batched generate)
# Steps by name (GPU_TRAIN_STEPS=zero2,zero3,zero2_no_recompute,resume,accelerate,zero2_packed,zero2_packed_no_recompute,zero2_padded,zero2_fusedadam,export,
# rewrite_speed; default all) split the list over several slots: a device command runs at most 10 minutes, and
# the whole list is estimated at ~14 (not measured). With the same GPU_CHECK_DIR, the models and the dataset are reused.
# Each training step runs few optimizer steps of a smaller batch than the recipe's 96 rows
# (--gradient_accumulation_steps 4: 12 rows), enough for the rate after warm-up; the rate per token does
# not depend on the accumulation.
#
#   GPU_CHECK_WHEELHOUSE=dist/wheelhouse GPU_TRAIN_DATASET=DIR bash bench/gpu_train_check.sh   # on the GPU node
#   bash bench/gpu_train_check.sh --dry-run   # anywhere: the same launches on CPU (DeepSpeed over gloo), tiny sizes
#
# GPU_TRAIN_DATASET: a `metachunk data build-sft` folder to train on (bench/gpu_carry.sh builds one to carry).
# Without it the script builds one from synthetic records of CRUD-like lengths (bench/sft_build.py
# --dataset-out, ~700-character documents) with the model's tokenizer, where the distill extra is installed. Models are random weights built on the device (bench/random_model.py): speed does not need
# trained ones. Every step's log goes to GPU_CHECK_DIR (default bench_out/gpu_train_check), the summary to
# summary.txt; GPU_CHECK_RESULTS, where set (the device machine's $OUT), gets the few small files worth bringing
# back after each step (bench/steps.sh: publish).
#
# The launches run from the checkout's root, as a user types them (recipes/ named relative to it); with the
# package installed from the wheelhouse, the checkout's metachunk/ still finds its stages there
# (metachunk/__init__.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo "$ROOT/.venv/bin/python" || command -v python3 )}
WORK=${GPU_CHECK_DIR:-bench_out/gpu_train_check}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
export HF_HUB_OFFLINE=1
CHECK_STEPS=${GPU_TRAIN_STEPS:-}
SUMMARY="$WORK/summary.txt"
source bench/steps.sh
start_check
BIN=$(dirname "$PY")

RECIPE=recipes/train/rewriter_qwen2.5-3b.yaml
DS=recipes/deepspeed
if [[ $DRY == 1 ]]; then
  BIG=tiny; SMALL=tiny
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  # CPU: float32 all through, gloo, sdpa (flex attention has no CPU backward), no recomputation
  DEVICE_ARGS=(--use_cpu true --bf16 false --dtype float32 --ddp_backend gloo --attn_implementation sdpa
               --activation_checkpointing false)
  TRAIN_STEPS=4; LOG_STEPS=2; RESUME_STEPS=6; KILL_AFTER=2; RESUME_REL=1e-4
  DATA_RECORDS=24; MAX_LEN=4096; PACK_LEN=4096; ACCUM=1
  # the dry run checks the plumbing: at these sizes the timings are noise, so no speed target
  REWRITE_ARGS=(--device cpu --corpus emma --docs 3 --max-new-tokens 8 --plain-batch-size 8 --target 0)
else
  BIG=qwen2.5-3b; SMALL=qwen2-0.5b
  DEVICE_ARGS=()
  # Padding-free micro-batches change length every step: flex attention must stay one dynamic graph. A run
  # that hits torch's recompile limit falls back to eager for that frame and its MFU is not the recipe's;
  # the reasons go into each step's log, and the summary names a step that hit the limit.
  export TORCH_LOGS=recompiles
  TRAIN_STEPS=12; LOG_STEPS=4; RESUME_STEPS=12; KILL_AFTER=6; RESUME_REL=0.02
  # PACK_LEN: the packed run's sequences hold about the 3 rows of zero2's padding-free micro-batch (the carried
  # set's rows are 3,200-4,200 tokens: sequences of 4,096 would hold one row each, and pack nothing)
  DATA_RECORDS=2000; MAX_LEN=4096; PACK_LEN=12288; ACCUM=4
  REWRITE_ARGS=(--device cuda --corpus crud --docs 100 --max-new-tokens 64)
fi
DATASET=${GPU_TRAIN_DATASET:-$WORK/sft}
# `data build-sft` needs the distill extra, which a training node installed from the wheelhouse lacks: say so
# before the slot is spent (bench/gpu_carry.sh builds the set where it is, for GPU_TRAIN_DATASET).
if [[ -z "${GPU_TRAIN_DATASET:-}" && ! -f $DATASET/build_report.json ]] && ! "$PY" -P -c "import datasketch" 2>/dev/null; then
  echo "$(basename "$0"): no GPU_TRAIN_DATASET, and $PY cannot build one (datasketch: the distill extra);" \
       "build it where that is installed (bash bench/gpu_carry.sh) and carry it" >&2
  exit 2
fi
BIG_MODEL=$WORK/random-$BIG
SMALL_MODEL=$WORK/random-$SMALL
# A random model is built only for the steps a command names (the 3B is ~6 GB to write): the 3B for the recipe's
# launches, and for its tokenizer where the set is built here; the small shape for the resume (export and
# rewrite_speed read the resume's checkpoint).
wants_any() { local s; for s; do wanted "$s" && return 0; done; return 1; }
if [[ ! -f $BIG_MODEL/config.json ]] && { [[ -z "${GPU_TRAIN_DATASET:-}" && ! -f $DATASET/build_report.json ]] ||
     wants_any zero2 zero3 zero2_no_recompute accelerate zero2_packed zero2_packed_no_recompute zero2_padded zero2_fusedadam; }; then
  step "random_$BIG" "$PY" -P "$ROOT/bench/random_model.py" --shape "$BIG" --out "$BIG_MODEL"
fi
[[ -f $SMALL_MODEL/config.json ]] || ! wanted resume ||
  step "random_$SMALL" "$PY" -P "$ROOT/bench/random_model.py" --shape "$SMALL" --out "$SMALL_MODEL"
[[ -n "${GPU_TRAIN_DATASET:-}" || -f $DATASET/build_report.json ]] || step sft_dataset "$PY" -P "$ROOT/bench/sft_build.py" \
  --sizes "$DATA_RECORDS" --tokenizer "$BIG_MODEL" --max-length "$MAX_LEN" --dataset-out "$DATASET"

# What every run shares: the data, a short run, no evaluation or checkpoints unless asked, the device's settings.
COMMON=(--dataset_name "$DATASET" --max_steps "$TRAIN_STEPS" --gradient_accumulation_steps "$ACCUM"
        --logging_steps "$LOG_STEPS" --eval_strategy no --save_strategy no --report_to none "${DEVICE_ARGS[@]}")
# Each launch has its own rendezvous port, GPU_TRAIN_PORT_BASE + 1..9 (default 29500 + 1..9): two checks on one
# machine (the test suite's dry run beside another) set different bases.
PORT_BASE=${GPU_TRAIN_PORT_BASE:-29500}
train() {  # train NAME PORT_OFFSET LAUNCHER... : a launch of metachunk.train on the 3B recipe (each on its own port)
  local name=$1 port=$((PORT_BASE + $2)); shift 2
  local launcher=("$@")
  launcher=("${launcher[@]//@PORT@/$port}")
  step "$name" "${launcher[@]}" --config "$RECIPE" --model_name_or_path "$BIG_MODEL" "${COMMON[@]}" --output_dir "$WORK/$name"
}
# `deepspeed`, the launcher a user types (beside the interpreter, or on PATH); the dry run calls the module the
# script runs, deepspeed.launcher.runner, as the tests do
launcher=$([[ -x $BIN/deepspeed ]] && echo "$BIN/deepspeed" || command -v deepspeed)
if [[ $DRY == 1 || -z $launcher ]]; then
  deepspeed=("$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port @PORT@ --module metachunk.train)
else
  deepspeed=("$launcher" --num_gpus 1 --master_port @PORT@ --module metachunk.train)
fi

skip() {  # skip NAME WHY: a step this device cannot run, said in the summary instead of failing after its launch
  wanted "$1" || return 0
  echo "== $1: skipped: $2" | tee -a "$SUMMARY"
}

# The GPU's memory decides which runs without recomputation fit (GPU only: the dry run never recomputes).
gib=0
[[ $DRY == 0 ]] && gib=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)' 2>/dev/null || echo 0)
# ZeRO-2 with packing first, the layout the 3B recipe's MFU target names (bfd sequences of PACK_LEN tokens).
train zero2_packed 5 "${deepspeed[@]}" --deepspeed "$DS/zero2.json" \
  --packing true --max_length "$PACK_LEN" --per_device_train_batch_size 1
# Packed and without recomputation, on a GPU that holds the activations: the layout the MFU target names
# (ZeRO-2 with packing) at the rate the recipe's recomputation caps (it adds a third forward pass, ~3/4 of
# the hardware's rate at most; the callback counts model FLOPs, not the recomputed ones).
if [[ $DRY == 0 ]]; then
  if (( gib >= 120 )); then
    train zero2_packed_no_recompute 9 "${deepspeed[@]}" --deepspeed "$DS/zero2.json" \
      --packing true --max_length "$PACK_LEN" --per_device_train_batch_size 1 --activation_checkpointing false
  else
    skip zero2_packed_no_recompute "the GPU has ${gib} GiB; the 3B without recomputation needs ~110 GB"
  fi
fi
train zero2 1 "${deepspeed[@]}" --deepspeed "$DS/zero2.json"
train zero3 2 "${deepspeed[@]}" --deepspeed "$DS/zero3.json"
# The recipe recomputes activations (sized for an 80 GB GPU); a 141 GB one may hold them: the same run without
# recomputation, its rate and peak memory beside zero2's (GPU only: the dry run never recomputes). By the
# recipe's estimate, ~49 GB of states and ~49 GB of activations: on a smaller GPU it could only run out of memory.
if [[ $DRY == 0 ]]; then
  if (( gib >= 120 )); then
    train zero2_no_recompute 8 "${deepspeed[@]}" --deepspeed "$DS/zero2.json" --activation_checkpointing false
  else
    skip zero2_no_recompute "the GPU has ${gib} GiB; the 3B's states and activations need ~98 GB without recomputation"
  fi
fi

step resume "$PY" -P "$ROOT/bench/train_resume.py" --out "$WORK/resume" --kill-after-step "$KILL_AFTER" --rel "$RESUME_REL" -- \
  "${deepspeed[@]//@PORT@/$((PORT_BASE + 3))}" --config "$RECIPE" --deepspeed "$DS/zero2.json" \
  --model_name_or_path "$SMALL_MODEL" --dataset_name "$DATASET" --max_steps "$RESUME_STEPS" --gradient_accumulation_steps "$ACCUM" \
  --logging_steps 1 --eval_strategy no --save_strategy steps --save_steps "$KILL_AFTER" --save_total_limit 1 \
  --learning_rate 1e-3 --report_to none "${DEVICE_ARGS[@]}"

train accelerate 4 "$PY" -m accelerate.commands.launch --config_file recipes/accelerate/zero2.yaml --num_processes 1 \
  --main_process_port @PORT@ -m metachunk.train --deepspeed "$DS/zero2.json"

train zero2_padded 6 "${deepspeed[@]}" --deepspeed "$DS/zero2.json" \
  --padding_free false --max_length "$MAX_LEN" --attn_implementation sdpa

# DeepSpeed's FusedAdam against the recipe's torch fused AdamW: the same ZeRO-2 config with an optimizer block
# (DeepSpeed then builds its own optimizer, a CUDA op compiled on first use with the node's nvcc: without one
# DeepSpeed raises MissingCUDAException after the launch). GPU only: on CPU it would compile DeepSpeed's CPU op
# for minutes and say nothing about a GPU.
nvcc_found() {
  "$PY" -c 'import os, sys; from torch.utils.cpp_extension import CUDA_HOME as h
sys.exit(not (h and os.path.exists(os.path.join(h, "bin", "nvcc"))))' 2>/dev/null
}
if [[ $DRY == 0 ]] && ! nvcc_found; then
  skip zero2_fusedadam "no nvcc under torch's CUDA_HOME to compile DeepSpeed's FusedAdam"
elif [[ $DRY == 0 ]]; then
  "$PY" -P - "$DS/zero2.json" "$WORK/zero2_fusedadam.json" <<'PYEOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
json.dump(config, open(sys.argv[2], "w"), indent=2)
PYEOF
  train zero2_fusedadam 7 "${deepspeed[@]}" --deepspeed "$WORK/zero2_fusedadam.json"
fi

step export "$PY" -P -m metachunk.cli export --checkpoint "$WORK/resume/whole" --out "$WORK/export"
step rewrite_speed "$PY" -P "$ROOT/bench/rewrite_speed.py" --model "$WORK/export" --out "$WORK/rewrite_speed.json" "${REWRITE_ARGS[@]}"

"$PY" -P - "$WORK" "$DATASET" "$RECIPE" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
import yaml
out, dataset, recipe = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
print("== throughput, as each run's trainer measured it (metachunk_run.json):")
for name in ("zero2", "zero2_no_recompute", "zero3", "accelerate", "zero2_packed", "zero2_packed_no_recompute", "zero2_padded",
             "zero2_fusedadam", "resume/whole"):
    facts = out / name / "metachunk_run.json"
    if not facts.exists():
        print(f"   {name}: no run record")  # not run (GPU_TRAIN_STEPS, the dry run), or it failed: see its log
        continue
    t = json.loads(facts.read_text()).get("throughput") or {}
    mfu = f"MFU {t['mfu']:.1%}" if t.get("mfu") is not None else "MFU n/a"
    per_step = t["seconds"] / max(1, t["steps"][1] - t["steps"][0] + 1)
    print(f"   {name}: {t['tokens_per_second']:,.0f} tokens/s, {t['tflops_per_device']:.4g} TFLOP/s, {mfu}, "
          f"{per_step:.2f} s/step, peak memory {t.get('peak_memory_gib')} GiB on {t['device']}")

# What a 20,000-row rewriter set costs at the shipped recipe's measured rate (zero2): rows x epochs x the mean
# row of the set trained here (prompt + completion, in its tokenizer) / tokens per second. 2 x A800 is the
# same arithmetic at the same MFU against A800's dense bf16 peak (312 TFLOP/s each): an extrapolation.
facts = out / "zero2" / "metachunk_run.json"
report = dataset / "build_report.json"
if facts.exists() and report.exists():
    t = json.loads(facts.read_text()).get("throughput") or {}
    lengths = json.loads(report.read_text())["token_lengths"]
    row = lengths["prompt"]["mean"] + lengths["completion"]["mean"]
    epochs = yaml.safe_load(recipe.read_text()).get("num_train_epochs", 1)
    tokens = 20_000 * epochs * row
    hours = tokens / t["tokens_per_second"] / 3600
    print(f"== a 20,000-row rewriter set, {epochs} epochs of {row:,.0f}-token rows (mean here, {lengths['tokenizer']}): "
          f"{hours:.3g} hours on {t['world_size']} x {t['device']} at zero2's rate")
    if t.get("mfu") is not None:
        a800_rate = 2 * t["tokens_per_second_per_device"] * 312 / t["peak_tflops_per_device"]  # tokens/s
        a800 = tokens / a800_rate / 3600
        print(f"   on 2 x A800 at the same MFU ({t['mfu']:.1%}): {a800:.3g} hours ({2 * a800:.3g} GPU-hours)")
PYEOF
for log in "$WORK"/*.log; do
  [[ -f $log ]] && grep -q "recompile_limit" "$log" &&
    echo "== $(basename "$log" .log): hit torch's recompile limit (its rate is not the compiled recipe's); see $log" | tee -a "$SUMMARY"
done
echo "summary: $SUMMARY"
exit $status
