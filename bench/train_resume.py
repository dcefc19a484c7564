"""Fault and resume of a training launch: kill -9 mid-run, rerun with ``--resume_from_checkpoint latest``,
and compare the loss curve with an uninterrupted run of the same command.

    python bench/train_resume.py --out DIR --kill-after-step 10 -- \\
        deepspeed --num_gpus 1 --module metachunk.train --config recipes/train/rewriter_qwen2.5-3b.yaml \\
        --model_name_or_path MODEL --dataset_name DATASET --max_steps 30 --save_steps 10 --logging_steps 1

The command after ``--`` is any launcher of ``metachunk.train`` (``deepspeed``, ``accelerate launch``,
``python -m``); this script adds ``--output_dir`` (``DIR/whole``, ``DIR/killed``) and, for the rerun,
``--resume_from_checkpoint latest``. The command must save a checkpoint before its last step
(``--save_steps``) and log every step (``--logging_steps 1``), so that every step's loss can be compared.

1. ``whole``: the command, uninterrupted: the reference curve.
2. ``killed``: the same command, in a session of its own; once ``checkpoint-K`` (K = ``--kill-after-step``) has
   its ``trainer_state.json`` (the Trainer writes it last), the whole process group (the launcher and its
   ranks) gets SIGKILL: no handler runs, as when a node is lost.
3. the rerun of ``killed`` with ``--resume_from_checkpoint latest``.

Passes when the rerun reports resuming at step K or later (``metachunk.train``'s "resuming from ... at
step N"), its ``train_log.json`` holds every step from 1 to the last exactly once (no step counted twice,
the history before the kill carried over), and after the resume:

* the weights and optimizer came back: each loss is within ``--rel`` of the uninterrupted run's at the same
  step, and the uninterrupted curve has moved by at least 10x ``--rel`` since step 1 (else a rerun that
  restored nothing would pass too: give the command a learning rate that moves it, e.g. 1e-3);
* the scheduler came back: the same learning rate at every step;
* the data's position came back: the same tokens per step (TRL's ``num_tokens``, exact integers), so the
  same batches in the same order.

The default 0.02 is bf16 noise: the same batches and weights, but GPU
reductions whose order may differ between runs; on CPU in float32 the losses agree to ~1e-6
(``tests/test_train.py``). Writes ``DIR/train_resume.json`` and ``DIR/train_resume.png`` (both curves)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from metachunk.artifacts import new_figure, write_figure, write_json


def logged(out: Path, key: str) -> dict[int, float]:
    """Step -> ``key`` (``loss``, ``learning_rate``, ``num_tokens``) of the training log entries of a finished
    run's ``train_log.json``."""
    entries = json.loads((out / "train_log.json").read_text())
    return {e["step"]: e[key] for e in entries if "loss" in e and key in e}


def losses(out: Path) -> dict[int, float]:
    """Step -> training loss from a finished run's ``train_log.json``."""
    return logged(out, "loss")


def step_tokens(num_tokens: dict[int, float], steps: list[int]) -> dict[int, float]:
    """The tokens each of ``steps`` trained on, from TRL's running ``num_tokens``: the difference with the
    step before. Only for steps whose previous step ran in the same process: TRL's running count starts
    again at 0 in a resumed run."""
    return {s: num_tokens[s] - num_tokens[s - 1] for s in steps if s in num_tokens and s - 1 in num_tokens}


def run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)


def kill_after_checkpoint(cmd: list[str], out: Path, step: int, log: Path, timeout: float) -> float:
    """Start ``cmd`` in its own session, SIGKILL its process group once ``checkpoint-{step}`` is complete;
    returns the seconds it ran."""
    from metachunk.train.sft import whole_checkpoint

    marker = out / f"checkpoint-{step}" / "trainer_state.json"
    started = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not whole_checkpoint(marker.parent):
                if proc.poll() is not None:
                    sys.exit(
                        f"train_resume: the run ended (exit {proc.returncode}) before {marker}; see {log}"
                    )
                if time.monotonic() - started > timeout:
                    sys.exit(f"train_resume: no {marker} within {timeout:.0f} s; see {log}")
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, as when a node is lost
            proc.wait()
    if (out / "train_log.json").exists():
        sys.exit(f"train_resume: {out / 'train_log.json'} exists: the run finished before the kill")
    return time.monotonic() - started


def plot(reference: dict[int, float], resumed: dict[int, float], resumed_at: int, path: Path) -> None:
    fig, ax = new_figure(figsize=(7, 4))
    ax.plot(list(reference), list(reference.values()), label="uninterrupted", lw=2, alpha=0.6)
    ax.plot(list(resumed), list(resumed.values()), "o", ms=3, label="killed, then resumed")
    ax.axvline(resumed_at, color="grey", ls="--", lw=1, label=f"kill -9, resumed at step {resumed_at}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    write_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A step's time limit (`timeout`) sends SIGTERM, whose default action skips `finally`: the run started in a
    # session of its own would go on training on the GPU beside the next steps. As an exit, the kill runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if "--" not in argv:
        print(
            "usage: train_resume.py --out DIR [--kill-after-step K] [--rel R] -- LAUNCH COMMAND ...",
            file=sys.stderr,
        )
        sys.exit(2)
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--kill-after-step", type=int, default=10, help="kill once this step's checkpoint is saved"
    )
    ap.add_argument("--rel", type=float, default=0.02, help="relative loss tolerance after the resume")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the checkpoint")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    args.out.mkdir(parents=True, exist_ok=True)

    whole, killed = args.out / "whole", args.out / "killed"
    for run_dir in (whole, killed):  # an earlier attempt's checkpoints would end the kill phase at once
        shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    done = run([*cmd, "--output_dir", str(whole)], args.out / "whole.log")
    if done.returncode != 0:
        sys.exit(
            f"train_resume: the uninterrupted run failed (exit {done.returncode}); see {args.out / 'whole.log'}"
        )
    whole_s = time.monotonic() - t0
    reference = losses(whole)
    if args.kill_after_step >= max(reference):
        sys.exit(
            f"train_resume: --kill-after-step {args.kill_after_step} is not before the last step {max(reference)}"
        )

    ran_s = kill_after_checkpoint(
        [*cmd, "--output_dir", str(killed)],
        killed,
        args.kill_after_step,
        args.out / "killed.log",
        args.timeout,
    )
    t0 = time.monotonic()
    log = args.out / "resumed.log"
    done = run([*cmd, "--output_dir", str(killed), "--resume_from_checkpoint", "latest"], log)
    if done.returncode != 0:
        sys.exit(f"train_resume: the resumed run failed (exit {done.returncode}); see {log}")
    resumed_s = time.monotonic() - t0
    found = re.search(r"resuming from \S+checkpoint-\d+ at step (\d+)", log.read_text())
    if not found:
        sys.exit(f"train_resume: the rerun did not say it resumed; see {log}")
    resumed_at = int(found.group(1))

    steps_logged = [e["step"] for e in json.loads((killed / "train_log.json").read_text()) if "loss" in e]
    resumed = losses(killed)
    after = [s for s in reference if s > resumed_at]
    deviation = {s: abs(resumed[s] - reference[s]) / abs(reference[s]) for s in after if s in resumed}
    worst = max(deviation.values(), default=0.0)
    # The losses can only tell a resume that restored the weights from one that restored nothing if the
    # uninterrupted curve has moved, since step 1, by well over the tolerance.
    first = reference[min(reference)]
    moved = max((abs(reference[s] - first) / abs(first) for s in after), default=0.0)
    # The scheduler's state: the same learning rate at every step after the resume.
    lr_ref, lr_resumed = logged(whole, "learning_rate"), logged(killed, "learning_rate")
    # The data's position: the same batches, told by the tokens each step trained on (exact integers).
    both = [s for s in after if s - 1 > resumed_at]
    tokens_ref = step_tokens(logged(whole, "num_tokens"), both)
    tokens_resumed = step_tokens(logged(killed, "num_tokens"), both)
    checks = {
        "resumed at the checkpoint or later": resumed_at >= args.kill_after_step,
        "every step logged once": steps_logged == list(range(1, max(reference) + 1)),
        f"the uninterrupted curve moved >= 10x {args.rel:g} since step 1 (moved {moved:.3g})": moved
        >= 10 * args.rel,
        f"losses after the resume within {args.rel:g}": len(deviation) == len(after) and worst <= args.rel,
        "the same learning rate at every step after the resume": bool(after)
        and all(s in lr_resumed and lr_resumed[s] == lr_ref.get(s) for s in after),
        "the same tokens per step after the resume (the data's position)": bool(tokens_ref)
        and tokens_resumed == tokens_ref,
    }
    plot(reference, resumed, resumed_at, args.out / "train_resume.png")
    result = {
        "command": cmd,
        "kill_after_step": args.kill_after_step,
        "resumed_at": resumed_at,
        "steps": max(reference),
        "max_rel_loss_deviation_after_resume": worst,
        "reference_moved_since_step_1": moved,
        "tokens_per_step_after_resume": {"uninterrupted": tokens_ref, "resumed": tokens_resumed},
        "rel_tolerance": args.rel,
        "seconds": {"whole": round(whole_s, 1), "killed": round(ran_s, 1), "resumed": round(resumed_s, 1)},
        "checks": checks,
        "pass": all(checks.values()),
    }
    write_json((args.out / "train_resume.json"), result)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print(
        f"kill -9 after checkpoint-{args.kill_after_step}, resumed at step {resumed_at} of {max(reference)}; "
        f"max relative loss deviation after the resume {worst:.2e}; wrote {args.out / 'train_resume.png'}"
    )
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
