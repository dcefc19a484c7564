# Sourced by the GPU checks (bench/gpu_check.sh, bench/gpu_train_check.sh): the node's install from a
# wheelhouse, the import check, and `step`, which runs one step, keeps its log and notes the result.
# Expects PY, WORK (the check's folder) and SUMMARY to be set (CHECK_STEPS optionally); sets `status` to 1 when a step fails.

# What the node has before anything is installed: its `pip list --format=freeze` is the NODE_FREEZE of the
# next `make wheelhouse` (the folder then holds only what the node lacks), beside its Python and devices.
record_node() {
  "$PY" -m pip list --format=freeze > "$WORK/node-freeze.txt" 2>/dev/null || true
  { "$PY" -c 'import platform, sys; print(f"python {platform.python_version()} on {platform.machine()} ({sys.platform})")'
    command -v nvidia-smi > /dev/null && nvidia-smi -L; } > "$WORK/node.txt" 2>&1 || true
}

# An offline GPU node installs as a user's does, from a folder of wheels carried in (`make wheelhouse`,
# docs/install.md) into the environment that has its own CUDA torch:
#   GPU_CHECK_WHEELHOUSE=dist/wheelhouse bash bench/gpu_check.sh
# The folder's wheelhouse.json names what its sdists build with (setuptools, for DeepSpeed's) where it carries
# that: installed first, since --no-build-isolation builds with what the node has before pip starts.
install_from_wheelhouse() {
  [[ -n "${GPU_CHECK_WHEELHOUSE:-}" ]] || return 0
  local build
  build=$("$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get("build_requires", [])))' \
            "$GPU_CHECK_WHEELHOUSE/wheelhouse.json" 2>/dev/null || true)
  if [[ -n $build ]]; then
    echo "== install: $PY -m pip install --no-index --find-links $GPU_CHECK_WHEELHOUSE $build"
    if ! "$PY" -m pip install --no-index --find-links "$GPU_CHECK_WHEELHOUSE" $build; then
      echo "$(basename "$0"): the install of $build from $GPU_CHECK_WHEELHOUSE failed" >&2
      exit 2
    fi
  fi
  echo "== install: $PY -m pip install --no-index --find-links $GPU_CHECK_WHEELHOUSE --no-build-isolation 'metachunk[train]'"
  if ! "$PY" -m pip install --no-index --find-links "$GPU_CHECK_WHEELHOUSE" --no-build-isolation 'metachunk[train]'; then
    echo "$(basename "$0"): the install from $GPU_CHECK_WHEELHOUSE failed" >&2
    exit 2
  fi
  # A warm machine keeps the last command's install, and builds of one commit with local changes share a
  # version (setuptools-scm), so pip would keep that older copy: the carried wheel goes in again, alone.
  if ! "$PY" -m pip install --no-index --find-links "$GPU_CHECK_WHEELHOUSE" --no-deps --force-reinstall metachunk; then
    echo "$(basename "$0"): the reinstall of metachunk from $GPU_CHECK_WHEELHOUSE failed" >&2
    exit 2
  fi
}

# The package maps its top-level folders under metachunk. (pyproject's package-dir), so it must be
# installed (a wheel, or `pip install -e .`; `make install` does it). Python runs with -P in the checks so
# that the checkout's own metachunk/ folder, which has no metachunk.chunking, never shadows the install.
require_package() {
  if ! "$PY" -P -c "import metachunk.chunking" 2>/dev/null; then
    echo "$(basename "$0"): $PY cannot import metachunk.chunking; install the package first: $PY -m pip install -e ." >&2
    exit 2
  fi
}

# What comes back from the device machine is a few small files (at most 8, two folders down), and WORK holds
# models of many GB: GPU_CHECK_RESULTS, where set (the device machine's $OUT), gets the summary, the node's
# record and one tarball of every log, JSON report and PNG outside the model and checkpoint folders. It is
# refreshed after each step, so a command cut off at its time limit still brings back the steps it finished.
publish() {
  [[ -n "${GPU_CHECK_RESULTS:-}" ]] || return 0
  mkdir -p "$GPU_CHECK_RESULTS"
  local file
  for file in "$SUMMARY" "$WORK/node-freeze.txt" "$WORK/node.txt"; do
    [[ -f $file ]] && cp "$file" "$GPU_CHECK_RESULTS/"
  done
  (cd "$WORK" && find . \( -name 'random-*' -o -name 'checkpoint-*' -o -name export -o -name sft \) -prune -o \
     -type f \( -name '*.log' -o -name '*.json' -o -name '*.png' -o -name '*.txt' \) -size -4M -print0 |
   tar --null -czf "$GPU_CHECK_RESULTS/.reports.tar.gz.tmp" -T - 2>/dev/null) &&
    mv "$GPU_CHECK_RESULTS/.reports.tar.gz.tmp" "$GPU_CHECK_RESULTS/reports.tar.gz"
}

# A check's start: the node recorded, an empty summary, the results published on every way out, the package
# installed (from a wheelhouse if named) and importable.
start_check() {
  record_node
  : > "$SUMMARY"
  trap publish EXIT
  install_from_wheelhouse
  require_package
}

# CHECK_STEPS (a script sets it from its own variable) names the steps to run, comma-separated: a device command
# is cut at 10 minutes, so a check can be split over several. Unset: every step. The builds a step needs
# (random_*, sft_dataset) always run, and skip themselves when their output is already in WORK.
wanted() {
  [[ -z "${CHECK_STEPS:-}" || $1 == random_* || $1 == sft_dataset || ",$CHECK_STEPS," == *",$1,"* ]]
}

# GPU_CHECK_BUDGET (seconds, default none) is the whole command's: the device machine kills a command at its
# limit, losing the step it cuts and the publish after it, so a step gets at most what is left of the budget
# (less 20 s to publish), and one that would start with nothing left is reported as skipped. SECONDS counts
# from the script's start, the install included.
status=0
step() {  # step NAME COMMAND...: run, keep the log, note the result
  local name=$1; shift
  wanted "$name" || return 0
  echo "== $name: $*" | tee -a "$SUMMARY"
  local limit=${GPU_CHECK_STEP_TIMEOUT:-0}
  if [[ -n "${GPU_CHECK_BUDGET:-}" ]]; then
    local left=$((GPU_CHECK_BUDGET - SECONDS - 20))
    if (( left < 5 )); then
      echo "   SKIPPED: the command's budget (GPU_CHECK_BUDGET=$GPU_CHECK_BUDGET s) is spent" | tee -a "$SUMMARY"
      status=1
      publish
      return 0
    fi
    (( limit == 0 || left < limit )) && limit=$left
  fi
  local started=$SECONDS
  if timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - started)) s" | tee -a "$SUMMARY"
  else
    echo "   FAILED (exit $?) in $((SECONDS - started)) s; see $WORK/$name.log" | tee -a "$SUMMARY"
    status=1
  fi
  grep -E "x |x\)|MFU|speed-up|tokens/s|PASS|FAIL|identical|workers" "$WORK/$name.log" | tail -8 | sed 's/^/   /' | tee -a "$SUMMARY"
  publish
}
