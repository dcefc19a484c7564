#!/usr/bin/env bash
# A rehearsal of an offline GPU node's install, on this machine: a fresh venv stands in for the node (its own
# torch and nothing of ours), `make wheelhouse` builds the folder for that venv's Python from its freeze, and
# the install runs as the GPU checks run it (bench/steps.sh's install_from_wheelhouse), on a node that reaches
# nothing: pip with no index, no config, no find-links but the folder. Then bench/gpu_train_check.sh
# --dry-run, ZeRO-2 only, launches the 3B recipe from the clone's root through `deepspeed --module
# metachunk.train` with that install (a tiny model on CPU), on a training set built here as
# bench/gpu_carry.sh builds the carried one; and bench/gpu_check.sh --dry-run, every step, with it.
#
# With NODE_LIST (a package list, bench/h200_image_packages.txt), the venv stands for that image instead: the
# packages of the list that metachunk[train] needs, at the list's versions where it gives them and this Python
# has them, and STALE on top, versions older than the closure needs of packages the list names bare. The
# wheelhouse is built as bench/gpu_carry.sh builds the carried one (that list, UNVERSIONED=keep, spares, for this
# venv's Python), and the rehearsal checks that the install replaced exactly what it had to: the list's too
# old versions and STALE, from the folder, and nothing the node had at a version that does.
# It needs the network once (the wheels); the suite runs the wheelhouse's dry run instead (tests/test_wheelhouse.py).
#
#   bash bench/wheelhouse_install.sh            # NODE (default bench_out/wheelhouse_node) is replaced
#   NODE_LIST=bench/h200_image_packages.txt bash bench/wheelhouse_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
NODE=${NODE:-bench_out/wheelhouse_node}
TORCH=${TORCH:-$(grep -E '^torch==' constraints.txt)}
NODE_LIST=${NODE_LIST:-}
UNVERSIONED=${UNVERSIONED:-keep}
STALE=${STALE:-typing-extensions==4.12.2 idna==3.10 click==8.1.8}
rm -rf "$NODE" && mkdir -p "$NODE"
NODE=$(cd "$NODE" && pwd)

echo "== the node: a venv with $TORCH and pip's own setuptools${NODE_LIST:+, and what $NODE_LIST has}"
python3 -m venv "$NODE/venv"
"$NODE/venv/bin/pip" install -q "$TORCH" 'setuptools>=70.1' wheel
node_python=$("$NODE/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [[ -n $NODE_LIST ]]; then
  # The list's packages in metachunk[train]'s closure (what the dry run fetches over a version or leaves to them)
  "$PY" tools/wheelhouse.py --dry-run --python-version "$node_python" --node-freeze "$NODE_LIST" \
    --unversioned "$UNVERSIONED" > "$NODE/plan.txt"
  "$PY" - "$NODE_LIST" "$NODE/plan.txt" > "$NODE/image.txt" <<'PYEOF'
import re, sys
from pathlib import Path
sys.path.insert(0, "tools")
from wheelhouse import read_freeze  # the list read as the wheelhouse reads it
listed = read_freeze(Path(sys.argv[1]))
for line in open(sys.argv[2]):
    m = re.match(r"  (fetch|spare|skip) +([A-Za-z0-9._-]+?)(==\S+)? ", line)
    if m and m.group(2) in listed:
        print(f"{m.group(2)}=={listed[m.group(2)]}" if listed[m.group(2)] else m.group(2))
PYEOF
  # A version the list gives that this Python has no wheel of (numpy 2.5 is for 3.12 on) is left to pip
  while read -r req; do
    if [[ $req == *==* ]] && ! "$NODE/venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$NODE/probe" "$req" 2>/dev/null; then
      echo "   $req: no wheel for Python $node_python; the node gets pip's choice" >&2
      req=${req%%==*}
    fi
    echo "$req"
  done < "$NODE/image.txt" > "$NODE/image-here.txt"
  rm -rf "$NODE/probe"
  "$NODE/venv/bin/pip" install -q -r "$NODE/image-here.txt"
  # shellcheck disable=SC2086
  "$NODE/venv/bin/pip" install -q --no-deps $STALE 2>&1 | grep -v "dependency conflicts\|requires\|incompatible" || true
  echo "   $(wc -l < "$NODE/image-here.txt") packages of the list, then $STALE"
fi
"$NODE/venv/bin/pip" list --format=freeze > "$NODE/node-freeze.txt"

echo "== the wheelhouse for Python $node_python, less what the node has"
started=$SECONDS
if [[ -n $NODE_LIST ]]; then
  freeze=(--node-freeze "$NODE_LIST" --unversioned "$UNVERSIONED")
else
  freeze=(--node-freeze "$NODE/node-freeze.txt")
fi
"$PY" tools/wheelhouse.py --dest "$NODE/wheelhouse" --python-version "$node_python" "${freeze[@]}" \
  | grep -v '^  skip \|^  spare \|^  fetch '
echo "   built in $((SECONDS - started)) s: $(ls "$NODE/wheelhouse" | wc -l) files, $(du -sh "$NODE/wheelhouse" | cut -f1)"

echo "== the offline install as the GPU checks run it: no index, no pip config, only the folder"
started=$SECONDS
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
  https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
  PY="$NODE/venv/bin/python" GPU_CHECK_WHEELHOUSE="$NODE/wheelhouse" \
  bash -c 'source bench/steps.sh && install_from_wheelhouse' > "$NODE/install.log" 2>&1 ||
  { tail -20 "$NODE/install.log"; echo "wheelhouse_install: the install failed; see $NODE/install.log" >&2; exit 1; }
echo "   installed in $((SECONDS - started)) s"
"$NODE/venv/bin/python" -P -c 'import metachunk, metachunk.chunking, trl, deepspeed; print("   metachunk", metachunk.__version__, "trl", trl.__version__, "deepspeed", deepspeed.__version__)'
"$NODE/venv/bin/pip" list --format=freeze > "$NODE/node-freeze-after.txt"
if [[ -n $NODE_LIST ]]; then
  # What the install changed on the node: each change is a package the folder carries, and each package the
  # node had at a version that meets the closure is still there, unchanged.
  "$PY" - "$NODE/node-freeze.txt" "$NODE/node-freeze-after.txt" "$NODE/wheelhouse/wheelhouse.json" "$STALE" <<'PYEOF'
import json, re, sys
def freeze(path):
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, _, v in (l.strip().partition("==") for l in open(path)) if v}
before, after = freeze(sys.argv[1]), freeze(sys.argv[2])
packages = {p["name"]: p for p in json.load(open(sys.argv[3]))["packages"]}
carried = {n for n, p in packages.items() if p.get("file")}
changed = {n: (before[n], after[n]) for n in before if n in after and before[n] != after[n]}
print("   replaced on the node:", ", ".join(f"{n} {a} -> {b}" for n, (a, b) in sorted(changed.items())))
stray = sorted(set(changed) - carried)
stale = [re.sub(r"[-_.]+", "-", s.split("==")[0]).lower() for s in sys.argv[4].split()]
missed = [s for s in stale if s not in changed]
if stray or missed:
    sys.exit(f"wheelhouse_install: changed from outside the folder: {stray}; stale and not replaced: {missed}")
spares = [n for n, p in packages.items() if p["action"] == "spare" and p.get("file")]
print(f"   {len([n for n in spares if n in changed])} of {len(spares)} spares taken; the node kept its own of the rest")
PYEOF
fi

echo "== without a carried training set, the check stops at once: the node has no distill extra to build one"
if PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/check" bash bench/gpu_train_check.sh --dry-run; then
  echo "wheelhouse_install: the check went on without a training set" >&2; exit 1
fi

echo "== the 3B recipe's ZeRO-2 launch from the clone's root, with that install (CPU, tiny model), on a set built here"
"$PY" -P bench/random_model.py --shape tiny --out "$NODE/tokenizer" --device cpu > /dev/null
"$PY" -P bench/sft_build.py --sizes 24 --tokenizer "$NODE/tokenizer" --max-length 4096 --dataset-out "$NODE/sft" > "$NODE/sft.log"
PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/check" GPU_TRAIN_DATASET="$NODE/sft" GPU_TRAIN_STEPS=zero2 \
  OMP_NUM_THREADS=1 bash bench/gpu_train_check.sh --dry-run

echo "== bench/gpu_check.sh --dry-run with that install: the engine's GPU steps need nothing beyond metachunk[train]"
PYTHON="$NODE/venv/bin/python" GPU_CHECK_DIR="$NODE/gpu_check" OMP_NUM_THREADS=1 bash bench/gpu_check.sh --dry-run
