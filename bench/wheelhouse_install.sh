#!/usr/bin/env bash
# A rehearsal of an offline GPU node's install, on this machine: a fresh venv stands in for the node (its own
# torch and nothing of ours), `make wheelhouse` builds the folder for that venv's Python from its freeze, and
# the install runs as on a node that reaches nothing: pip with no index, no config, no find-links but the
# folder. Then bench/gpu_train_check.sh --dry-run, ZeRO-2 only, launches the 3B recipe from the clone's root
# through `deepspeed --module metachunk.train` with that install (a tiny model on CPU), on a training set built
# here as bench/gpu_carry.sh builds the carried one; and bench/gpu_check.sh --dry-run, every step, with it.
# It needs the network once (the wheels); the suite runs the wheelhouse's dry run instead (tests/test_wheelhouse.py).
#
#   bash bench/wheelhouse_install.sh            # NODE (default bench_out/wheelhouse_node) is replaced
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
NODE=${NODE:-bench_out/wheelhouse_node}
TORCH=${TORCH:-$(grep -E '^torch==' constraints.txt)}
rm -rf "$NODE" && mkdir -p "$NODE"
NODE=$(cd "$NODE" && pwd)

echo "== the node: a venv with $TORCH and pip's own setuptools, nothing else"
python3 -m venv "$NODE/venv"
"$NODE/venv/bin/pip" install -q "$TORCH" 'setuptools>=70.1' wheel
"$NODE/venv/bin/pip" list --format=freeze > "$NODE/node-freeze.txt"
node_python=$("$NODE/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

echo "== the wheelhouse for Python $node_python, less what the node has"
started=$SECONDS
"$PY" tools/wheelhouse.py --dest "$NODE/wheelhouse" --python-version "$node_python" --node-freeze "$NODE/node-freeze.txt" \
  | grep -v '^  skip '
echo "   built in $((SECONDS - started)) s: $(ls "$NODE/wheelhouse" | wc -l) files, $(du -sh "$NODE/wheelhouse" | cut -f1)"

echo "== the offline install: no index, no pip config, only the folder"
started=$SECONDS
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
  https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
  "$NODE/venv/bin/pip" install -q --no-index --find-links "$NODE/wheelhouse" --no-build-isolation 'metachunk[train]'
echo "   installed in $((SECONDS - started)) s"
"$NODE/venv/bin/python" -P -c 'import metachunk, metachunk.chunking, trl, deepspeed; print("   metachunk", metachunk.__version__, "trl", trl.__version__, "deepspeed", deepspeed.__version__)'

echo "== without a carried training set, the check stops at once: the node has no distill extra to build one"
if PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/check" bash bench/gpu_train_check.sh --dry-run; then
  echo "wheelhouse_install: the check went on without a training set" >&2; exit 1
fi

echo "== the 3B recipe's ZeRO-2 launch from the clone's root, with that install (CPU, tiny model), on a set built here"
"$PY" -P bench/random_model.py --shape tiny --out "$NODE/tokenizer" --device cpu > /dev/null
"$PY" -P bench/sft_build.py --sizes 24 --tokenizer "$NODE/tokenizer" --max-tokens 4096 --dataset-out "$NODE/sft" > "$NODE/sft.log"
PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/check" GPU_TRAIN_DATASET="$NODE/sft" GPU_TRAIN_STEPS=zero2 \
  OMP_NUM_THREADS=1 bash bench/gpu_train_check.sh --dry-run

echo "== bench/gpu_check.sh --dry-run with that install: the engine's GPU steps need nothing beyond metachunk[train]"
PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/gpu_check" OMP_NUM_THREADS=1 bash bench/gpu_check.sh --dry-run
