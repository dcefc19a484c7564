"""The Emma experiment's wall time (issue target: at most 20 minutes on the 2-core dev machine).

Runs ``recipes/experiments/emma.yaml`` as it is (five chunkers on the whole book, retrieval over the
30 GutenQA questions, BC/CS on chapters I-VIII) through ``metachunk run``, in a child process,
with every path the recipe writes moved under a fresh ``--out`` directory, so nothing is cached
and ``runs/`` is left alone. Prints each stage's seconds (from the run's ``state.json``), the
total against the 20-minute target, and whether ``compare.json``'s numbers equal those of an
earlier run given with ``--against`` (the recipe reruns to the same results). Writes
``OUT/experiment_time.json``.

    python bench/experiment_time.py                                   # about 14 minutes on a CPU with AMX
    python bench/experiment_time.py --against runs/experiments/emma/compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from metachunk.artifacts import write_json

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 20 * 60


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "experiments" / "emma.yaml")
    p.add_argument("--out", type=Path, help="a fresh folder (default: bench_out/experiment_time/<unix time>)")
    p.add_argument("--against", type=Path, help="an earlier run's compare.json: are the numbers the same?")
    args = p.parse_args()

    out = (args.out or ROOT / "bench_out" / "experiment_time" / str(int(time.time()))).resolve()
    if out.exists() and any(out.iterdir()):
        p.error(f"{out} is not empty: give a fresh --out (a rerun there would be all cached)")
    out.mkdir(parents=True, exist_ok=True)
    text = args.recipe.read_text(encoding="utf-8").replace("runs/experiments/emma", str(out))
    recipe = out / "recipe.yaml"
    recipe.write_text(text, encoding="utf-8")

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "metachunk.cli", "run", str(recipe)], cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"metachunk run exited with {done.returncode}")

    stages = {
        name: s["seconds"]
        for name, s in json.loads((out / "run" / "state.json").read_text())["stages"].items()
    }
    print(f"\n{'stage':<20} {'seconds':>9}")
    for name, seconds in stages.items():
        print(f"{name:<20} {seconds:>9.1f}")
    print(f"{'stages':<20} {sum(stages.values()):>9.1f}")
    print(f"{'wall':<20} {wall:>9.1f}  ({wall / 60:.1f} min; target {TARGET_S / 60:.0f} min: "
          f"{'met' if wall <= TARGET_S else 'NOT met'})")  # fmt: skip

    same = None
    if args.against:
        ours = json.loads((out / "compare.json").read_text())["metrics"]
        theirs = json.loads(args.against.read_text())["metrics"]
        same = ours == theirs
        print(f"compare.json metrics equal {args.against}: {same}")
    result = {"recipe": str(args.recipe), "stages_s": stages, "wall_s": round(wall, 1), "target_s": TARGET_S,
              "met": wall <= TARGET_S, "same_as": str(args.against) if args.against else None, "same": same,
              "threads": os.environ.get("OMP_NUM_THREADS"), "cpu": platform.processor() or platform.machine(),
              "cpus": os.cpu_count()}  # fmt: skip
    write_json((out / "experiment_time.json"), result)


if __name__ == "__main__":
    main()
