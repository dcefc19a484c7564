#!/usr/bin/env bash
# What the GPU checks (bench/gpu_check.sh, bench/gpu_train_check.sh) carry to an offline GPU node, built here,
# where the network is, into one ignored folder (default bench_out/gpu_carry):
#   wheelhouse/        `make wheelhouse` for the node's Python and platform, less what the node already has
#                      (NODE_FREEZE: its `pip list --format=freeze`; default bench/h200_image_packages.txt with
#                      UNVERSIONED=keep, until a check's node-freeze.txt replaces it), with small spares of
#                      what the node keeps at another or an unknown version
#   data/crud-news/    the CRUD articles the GPU steps chunk (METACHUNK_DATA there): the node cannot fetch them
#   sft/               the training set of bench/gpu_train_check.sh (GPU_TRAIN_DATASET there): 2,000 synthetic
#                      records of CRUD-like lengths, built as a user's set is, on a machine with the distill
#                      extra (`data build-sft` needs it; a training node has only the train extra)
# The tokenizer needs no carrying: the checks build it from text in this repository, the same everywhere,
# and the set here is tokenized with it.
# The device machine takes the working tree plus what is carried, 64 MiB in all; this script adds them up
# and stops (exit 1) if they do not fit. It ends by printing the device command for each check.
#
#   bash bench/gpu_carry.sh
#   NODE_FREEZE=node-freeze.txt UNVERSIONED=fetch bash bench/gpu_carry.sh   # after a first run on the node
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
CARRY=${GPU_CARRY:-bench_out/gpu_carry}
NODE_FREEZE=${NODE_FREEZE:-bench/h200_image_packages.txt}
UNVERSIONED=${UNVERSIONED:-keep}
LIMIT=$((64 * 1024 * 1024))

git check-ignore -q "$CARRY" || { echo "gpu_carry: $CARRY is not ignored by git; it would travel twice" >&2; exit 2; }
if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  echo "gpu_carry: note: uncommitted changes; the wheel is built from the working tree" >&2
fi
mkdir -p "$CARRY"
"$PY" tools/wheelhouse.py --dest "$CARRY/wheelhouse" --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --extras train --node-freeze "$NODE_FREEZE" --unversioned "$UNVERSIONED" | grep -v '^  skip '

"$PY" -P -m metachunk.cli data fetch crud-news  # nothing is downloaded where METACHUNK_DATA or the cache has it
news=$("$PY" -P -c 'from metachunk.named_data import resolve; print(resolve("data:crud-news/news.jsonl"))')
rm -rf "$CARRY/data" && mkdir -p "$CARRY/data"
cp -rL "$(dirname "$news")" "$CARRY/data/crud-news"

# The training set, with the random models' tokenizer (the same BPE at every shape): a tiny model holds it.
# Built once and kept (seeded, so a rebuild gives the same rows): delete $CARRY/sft to rebuild it.
if [[ ! -f $CARRY/sft/build_report.json ]]; then
  "$PY" -P bench/random_model.py --shape tiny --out bench_out/gpu_carry_tokenizer --device cpu > /dev/null
  "$PY" -P bench/sft_build.py --sizes 2000 --tokenizer bench_out/gpu_carry_tokenizer --max-length 4096 \
    --dataset-out "$CARRY/sft" > bench_out/gpu_carry_sft.log
fi

# What travels: tracked files, untracked files git does not ignore, and the carried folder.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carried=$(du -sb "$CARRY" | cut -f1)
total=$((tree + carried))
awk -v t="$tree" -v c="$carried" -v d="$CARRY" 'BEGIN {
  printf "gpu_carry: working tree %.1f MiB + %s %.1f MiB = %.1f MiB of the 64 MiB a device call takes\n",
         t / 2^20, d, c / 2^20, (t + c) / 2^20 }'
if (( total > LIMIT )); then
  echo "gpu_carry: over the limit: give a freeze with more of the node's packages, or carry less" >&2
  exit 1
fi

# PYTHON absolute: the deepspeed launcher the install puts beside it is found there. GPU_CHECK_BUDGET: a
# device command is killed at 600 s; each step gets at most what is left of 570 (bench/steps.sh).
env="PYTHON=\$(command -v python3) GPU_CHECK_WHEELHOUSE=$CARRY/wheelhouse METACHUNK_DATA=\$PWD/$CARRY/data GPU_CHECK_RESULTS=\$OUT GPU_CHECK_BUDGET=570"
train="GPU_TRAIN_DATASET=$CARRY/sft"
cat <<EOF
Device commands, in the order the issues ask (kind: nvidia-h200, the GPU the issues measure on: an H100's 78 GiB
may not hold zero2_no_recompute; carry: ["$CARRY"]; a command runs at most 10 minutes, so each names a share of
the steps, and a step that would pass the command's budget is cut or skipped and said so; a slot of 15 minutes,
start-up included, fits one or two):
  $env $train GPU_CHECK_STEP_TIMEOUT=200 GPU_TRAIN_STEPS=zero2_packed,zero2_packed_no_recompute,zero2 bash bench/gpu_train_check.sh
  $env GPU_CHECK_STEP_TIMEOUT=240 GPU_CHECK_STEPS=ppl_speed,msp_speed,plain_vs_engine_qwen2-0.5b,plain_vs_engine_qwen2-1.5b,engine_profile bash bench/gpu_check.sh
  $env $train GPU_CHECK_STEP_TIMEOUT=200 GPU_TRAIN_STEPS=zero3,zero2_no_recompute,accelerate bash bench/gpu_train_check.sh
  $env $train GPU_CHECK_STEP_TIMEOUT=330 GPU_TRAIN_STEPS=resume,export,rewrite_speed bash bench/gpu_train_check.sh
  $env $train GPU_CHECK_STEP_TIMEOUT=400 GPU_TRAIN_STEPS=zero2_padded,zero2_fusedadam bash bench/gpu_train_check.sh
  $env GPU_CHECK_STEP_TIMEOUT=300 GPU_CHECK_STEPS=plain_vs_engine_qwen2-7b,scoring_parity bash bench/gpu_check.sh
Each command starts from what the machine holds (a bare machine rebuilds the models, datasets and runs):
export and rewrite_speed need resume in the same command; resume is three launches (whole, killed,
resumed), and zero2_fusedadam compiles DeepSpeed's FusedAdam first. Left out of gpu_check.sh: its
rewrite_speed (a random student; the training check's rewrites with the export), train_mfu (a standalone
probe; the 3B recipe's MFU is the trainer's own callback, in the zero2 runs: packed first) and chunk_1_workers,chunk_2_workers
(1 against 2 workers' shards on one GPU; add them to a command with time to spare).
What comes back (\$OUT): summary.txt, node-freeze.txt (the next NODE_FREEZE), node.txt, reports.tar.gz.
EOF
