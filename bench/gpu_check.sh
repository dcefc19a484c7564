#!/usr/bin/env bash
# The GPU figures, as one prepared script, sized for a 15-minute device slot (GPU_CHECK_STEP_TIMEOUT bounds each step):
#   1. bench/ppl_speed.py --device cuda     PPL engine vs the per-sentence loop (target >= 10x)
#   2. bench/msp_speed.py --device cuda     MSP batched pairs vs one call per pair at the 1.5B shape,
#                                           GPU-sized batches (target >= 5x), decisions compared in fp32
#                                           (a random model's bf16 margins sit at bf16's noise)
#   3. bench/train_mfu_gpu.py               training MFU, Qwen2.5-0.5B shape (target >= 40%)
#   4. metachunk chunk -o DIR on one GPU    1 worker, then 2 workers sharing it; same shards
#   5. bench/ppl_speed.py --methods engine,chunk,plain-batched at the 0.5B, 1.5B and 7B shapes, on the
#      1,200 CRUD articles: the engine's scoring and the whole `metachunk chunk` command (less its
#      model load) against the batched transformers pass a user would write (tokenize + score), each
#      with its FLOP rate against the GEMM measured in the same run
#   6. bench/ppl_profile.py                 (engine_profile) where the engine's scoring time goes at 0.5B, from a
#                                           torch.profiler trace: GPU busy share, launches, gaps; a verdict on
#                                           whether launches cost (CUDA graphs) or host work between batches
#   7. bench/scoring_parity.py              fp32 on the GPU within 1e-3 nats of the CPU reference, and
#                                           a bf16 rerun with the same plan byte-identical
#   8. bench/rewrite_speed.py               `chunk --rewrite`'s batched students against plain batched
#                                           `generate`, generated tokens/s (target >= 0.8x)
# Steps 1, 4, 6 and 7 use a random-initialised Qwen2-0.5B-shaped model (bench/random_model.py) unless
# GPU_CHECK_MODEL names a model dir, step 2 the 1.5B shape: speed does not need trained weights.
# Step 8 rewrites with GPU_CHECK_STUDENT (an exported student, e.g. `metachunk export` of a GPU
# training run), else the same random model.
#
#   bash bench/gpu_check.sh            # on the GPU machine
#   bash bench/gpu_check.sh --dry-run  # anywhere: the same steps on CPU, tiny sizes (the test suite runs it)
#
# Every step's output goes to GPU_CHECK_DIR (default bench_out/gpu_check: models of many GB, logs, reports) and
# the summary to its summary.txt. GPU_CHECK_RESULTS, where set (the device machine's $OUT), gets after each step
# the few small files worth bringing back (bench/steps.sh: publish).
# GPU_CHECK_STEP_TIMEOUT (seconds, default none) stops a step that hangs, so the rest still fit the slot.
# GPU_CHECK_STEPS (comma-separated step names, e.g. plain_vs_engine_qwen2-7b,msp_speed) runs only those, so
# the list can be split over device commands, each cut at 10 minutes (bench/steps.sh).
# A step that fails is reported and the others still run, so one bad step does not cost the whole
# device slot.
#
# Data: named datasets (metachunk/named_data.py). Steps 1 and 2 read data:gutenqa-emma/paragraphs.jsonl,
# which ships with the package; step 4 chunks the first 200 articles of data:crud-news/news.jsonl,
# which is fetched, not shipped. The GPU machine has no network, so `metachunk data fetch crud-news`
# cannot run there: carry a copy and point METACHUNK_DATA at it (a folder holding crud-news/), or a
# cache that has it (~/.cache/metachunk/data/crud-news). Without it the script stops at once, before
# any step, with the resolver's message. --dry-run chunks Emma's paragraphs instead, so it needs no
# fetched data and runs in a fresh clone.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
WORK=${GPU_CHECK_DIR:-bench_out/gpu_check}
mkdir -p "$WORK"
export HF_HUB_OFFLINE=1
CHECK_STEPS=${GPU_CHECK_STEPS:-}
SUMMARY="$WORK/summary.txt"
source bench/steps.sh
start_check

if [[ $DRY == 1 ]]; then
  DEVICE=cpu; SHAPE=tiny
  PPL_ARGS=(--docs 2 --methods engine,loop --max-context 512)
  MSP_ARGS=(--pairs 8 --batch-sizes 1,4 --headline-batch 4 --compare-pass-tokens 1024 --block 8 --reps 1 --check-dtype float32)
  MSP_SHAPE=tiny
  PARITY_ARGS=(--gpu-plan --corpus emma --docs 6 --max-context 512)
  # the dry run checks the plumbing: at these sizes the timings are noise, so no speed target
  REWRITE_ARGS=(--corpus emma --docs 3 --max-new-tokens 8 --plain-batch-size 8 --target 0)
  MFU_ARGS=(--tiny --device cpu --dtype float32)
  PLAIN_SHAPES=(tiny)
  PLAIN_ARGS=(--corpus emma --docs 2 --max-context 512)
  PROFILE_ARGS=(--corpus emma --docs 2 --max-context 512)
  CHUNK_DOCS=6
  CHUNK_CORPUS=data:gutenqa-emma/paragraphs.jsonl  # ships with the package: no fetch, no network
else
  DEVICE=cuda; SHAPE=qwen2-0.5b
  PPL_ARGS=(--docs 20 --methods engine,loop)
  MSP_ARGS=(--batch-sizes 1,8,64 --headline-batch 64 --compare-pass-tokens 0,4096 --block 64 --check-dtype float32)  # GPU_PASS_TOKENS (1,024) is an estimate: 0 and 4,096 beside it
  MSP_SHAPE=qwen2-1.5b
  PARITY_ARGS=(--corpus crud --docs 30)  # the CPU's fp32 reference: 200 articles would take minutes
  REWRITE_ARGS=(--corpus crud --docs 100 --max-new-tokens 64)
  MFU_ARGS=()
  PLAIN_SHAPES=(qwen2-0.5b qwen2-1.5b qwen2-7b)
  PLAIN_ARGS=(--corpus crud --docs 1200)
  PROFILE_ARGS=(--corpus crud --docs 1200)  # 12 batches of 131,072 tokens: 200 articles gave 3, and 2 gaps to judge
  CHUNK_DOCS=200
  CHUNK_CORPUS=data:crud-news/news.jsonl  # METACHUNK_DATA or the cache: the machine has no network
fi
# The chunk step's corpus, resolved before any step runs: a missing dataset costs seconds, not the slot.
if ! CHUNK_FILE=$("$PY" -P - "$CHUNK_CORPUS" <<'PYEOF'
import sys

from metachunk.artifacts import InputError
from metachunk.named_data import resolve

try:
    print(resolve(sys.argv[1]))
except InputError as e:
    sys.exit(f"gpu_check: {e} (offline: point METACHUNK_DATA at a copy)")
PYEOF
); then
  exit 2
fi
MODEL=${GPU_CHECK_MODEL:-$WORK/random-$SHAPE}
[[ -n "${GPU_CHECK_MODEL:-}" ]] || step random_model "$PY" bench/random_model.py --shape "$SHAPE" --out "$MODEL"

step ppl_speed "$PY" bench/ppl_speed.py --model "$MODEL" --device "$DEVICE" --summary "$WORK/ppl_speed.json" \
  "${PPL_ARGS[@]}"
MSP_MODEL=$MODEL
if [[ $MSP_SHAPE != "$SHAPE" ]]; then
  MSP_MODEL=$WORK/random-$MSP_SHAPE
  [[ -f $MSP_MODEL/config.json ]] || ! wanted msp_speed || step "random_$MSP_SHAPE" "$PY" bench/random_model.py --shape "$MSP_SHAPE" --out "$MSP_MODEL"
fi
step msp_speed "$PY" bench/msp_speed.py --model "$MSP_MODEL" --device "$DEVICE" --out "$WORK/msp_speed.json" "${MSP_ARGS[@]}"
step train_mfu "$PY" bench/train_mfu_gpu.py --out "$WORK/train_mfu.json" "${MFU_ARGS[@]}"

"$PY" -P - "$CHUNK_FILE" "$CHUNK_DOCS" "$WORK/corpus.jsonl" <<'PYEOF'
import json, sys
path, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
    for k, line in zip(range(n), f):
        row = json.loads(line)  # CRUD articles have ids; Emma's paragraphs are numbered
        o.write(json.dumps({"id": str(row.get("id", k)), "text": row["text"]}, ensure_ascii=False) + "\n")
PYEOF
for workers in 1 2; do
  step "chunk_${workers}_workers" "$PY" -P -m metachunk.cli chunk "$WORK/corpus.jsonl" -o "$WORK/chunks_w$workers" \
    --overwrite --method ppl --model "$MODEL" --device "$DEVICE" --workers "$workers" --shards 8
done
if ! wanted chunk_1_workers || ! wanted chunk_2_workers; then
  :  # not asked for (GPU_CHECK_STEPS): nothing to compare
elif [[ -f "$WORK/chunks_w1/manifest.json" && -f "$WORK/chunks_w2/manifest.json" ]]; then
  if cmp -s <(cat "$WORK"/chunks_w1/train-*) <(cat "$WORK"/chunks_w2/train-*); then
    echo "== chunk: 1 and 2 workers wrote identical shards" | tee -a "$SUMMARY"
  else
    echo "== chunk: 1 and 2 workers wrote DIFFERENT shards" | tee -a "$SUMMARY"; status=1
  fi
  "$PY" -P - "$WORK" <<'PYEOF' | tee -a "$SUMMARY"
import sys
from metachunk.artifacts import read_run_log
s = {w: read_run_log(f"{sys.argv[1]}/chunks_w{w}")[-1]["seconds"] for w in (1, 2)}
print(f"== chunk: 1 worker {s[1]} s, 2 workers on one device {s[2]} s: {s[1] / s[2]:.2f}x")
PYEOF
else
  echo "== chunk: a run wrote no manifest; nothing to compare" | tee -a "$SUMMARY"; status=1
fi
for shape in "${PLAIN_SHAPES[@]}"; do  # random weights built on the GPU in bf16 (seconds, even at 7B)
  dir=$WORK/random-$shape
  [[ $shape == "$SHAPE" && -n "${GPU_CHECK_MODEL:-}" ]] && dir=$MODEL
  [[ -f $dir/config.json ]] || ! wanted "plain_vs_engine_$shape" || step "random_$shape" "$PY" bench/random_model.py --shape "$shape" --out "$dir"
  step "plain_vs_engine_$shape" "$PY" bench/ppl_speed.py --model "$dir" --device "$DEVICE" \
    --methods engine,chunk,plain-batched --summary "$WORK/plain_vs_engine_$shape.json" "${PLAIN_ARGS[@]}"
done
step engine_profile "$PY" bench/ppl_profile.py --model "$MODEL" --device "$DEVICE" --out "$WORK/engine_profile.json" \
  "${PROFILE_ARGS[@]}"
step scoring_parity "$PY" bench/scoring_parity.py --model "$MODEL" --device "$DEVICE" \
  --out "$WORK/scoring_parity.json" "${PARITY_ARGS[@]}"
step rewrite_speed "$PY" bench/rewrite_speed.py --model "${GPU_CHECK_STUDENT:-$MODEL}" --device "$DEVICE" \
  --out "$WORK/rewrite_speed.json" "${REWRITE_ARGS[@]}"
echo "summary: $SUMMARY"
exit $status
