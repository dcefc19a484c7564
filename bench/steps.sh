# Sourced by the GPU checks (bench/gpu_check.sh, bench/gpu_train_check.sh): the node's install from a
# wheelhouse, the import check, and `step`, which runs one step, keeps its log and notes the result.
# Expects PY, OUT and SUMMARY to be set (CHECK_STEPS optionally); sets `status` to 1 when a step fails.

# What the node has before anything is installed: its `pip list --format=freeze` is the NODE_FREEZE of the
# next `make wheelhouse` (the folder then holds only what the node lacks), beside its Python and devices.
record_node() {
  "$PY" -m pip list --format=freeze > "$OUT/node-freeze.txt" 2>/dev/null || true
  { "$PY" -c 'import platform, sys; print(f"python {platform.python_version()} on {platform.machine()} ({sys.platform})")'
    command -v nvidia-smi > /dev/null && nvidia-smi -L; } > "$OUT/node.txt" 2>&1 || true
}

# An offline GPU node installs as a user's does, from a folder of wheels carried in (`make wheelhouse`,
# docs/install.md) into the environment that has its own CUDA torch:
#   GPU_CHECK_WHEELHOUSE=dist/wheelhouse bash bench/gpu_check.sh
install_from_wheelhouse() {
  [[ -n "${GPU_CHECK_WHEELHOUSE:-}" ]] || return 0
  echo "== install: $PY -m pip install --no-index --find-links $GPU_CHECK_WHEELHOUSE --no-build-isolation 'metachunk[train]'"
  if ! "$PY" -m pip install --no-index --find-links "$GPU_CHECK_WHEELHOUSE" --no-build-isolation 'metachunk[train]'; then
    echo "$(basename "$0"): the install from $GPU_CHECK_WHEELHOUSE failed" >&2
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

# A check's start: the node recorded, the package installed (from a wheelhouse if named) and importable,
# an empty summary.
start_check() {
  record_node
  install_from_wheelhouse
  require_package
  : > "$SUMMARY"
}

# CHECK_STEPS (a script sets it from its own variable) names the steps to run, comma-separated: a device command
# is cut at 10 minutes, so a check can be split over several. Unset: every step. The builds a step needs
# (random_*, sft_dataset) always run, and skip themselves when their output is already in OUT.
wanted() {
  [[ -z "${CHECK_STEPS:-}" || $1 == random_* || $1 == sft_dataset || ",$CHECK_STEPS," == *",$1,"* ]]
}

status=0
step() {  # step NAME COMMAND...: run, keep the log, note the result
  local name=$1; shift
  wanted "$name" || return 0
  echo "== $name: $*" | tee -a "$SUMMARY"
  local started=$SECONDS
  if timeout --kill-after=10 "${GPU_CHECK_STEP_TIMEOUT:-0}" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - started)) s" | tee -a "$SUMMARY"
  else
    echo "   FAILED (exit $?) in $((SECONDS - started)) s; see $OUT/$name.log" | tee -a "$SUMMARY"
    status=1
  fi
  grep -E "x |x\)|MFU|speed-up|tokens/s|PASS|FAIL|identical|workers" "$OUT/$name.log" | tail -8 | sed 's/^/   /' | tee -a "$SUMMARY"
}
