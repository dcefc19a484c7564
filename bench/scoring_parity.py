"""The GPU's scoring plan against the CPU reference, and a rerun against itself.

Two checks of the engine's output stability, on the same documents:

* **fp32 parity.** `metachunk.engine.scoring.token_nll` in float32 on ``--device`` with that
  device's plan (its batch budget, packed rows where the attention reads them, its head tiles)
  against float32 on CPU with the CPU's plan. PASS: every token's NLL within ``--tolerance``
  (1e-3 nats) of the CPU's.
* **Rerun.** The device's default dtype (bf16 on a GPU), scored twice with the same plan: the same
  bytes.

    python bench/scoring_parity.py --model DIR --device cuda --docs 30        # on the GPU machine
    python bench/scoring_parity.py --model DIR --device cpu --gpu-plan --docs 4  # anywhere: the GPU's
                                                                                  # plan, run on CPU

``--gpu-plan`` runs the GPU's plan on CPU (a 131,072-token budget, packed rows through flex
attention, 8,192-row head tiles), so the dry run checks the plan itself where there is no GPU. The
tiles' vocabulary width is not part of it: ``head_tile`` picks that by device (32,768 on a GPU,
8,192 on CPU), so only the GPU run covers the wide tiles.
The documents are the first ``--docs`` CRUD articles (``data:crud-news/news.jsonl``) or, with
``--corpus emma``, Emma paragraphs, which ship with the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from metachunk.artifacts import InputError, write_json
from metachunk.named_data import resolve

CORPUS = {"emma": "data:gutenqa-emma/paragraphs.jsonl", "crud": "data:crud-news/news.jsonl"}


def max_nll_diff(got: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """The largest |NLL difference| over every token, or infinity where a token is scored on one
    side only: `token_nll` leaves NaN where it scores nothing, and ``nanmax`` alone would count
    a token a plan skipped as agreeing."""
    worst = 0.0
    for a, b in zip(got, reference, strict=True):
        if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
            return float("inf")
        if not np.isnan(a).all():
            worst = max(worst, float(np.nanmax(np.abs(a - b))))
    return worst


def load_texts(corpus: str, n: int) -> list[str]:
    with resolve(CORPUS[corpus]).open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--corpus", choices=sorted(CORPUS), default="crud")
    p.add_argument("--docs", type=int, default=30)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest |NLL difference| in nats")
    p.add_argument(
        "--gpu-plan", action="store_true", help="run the GPU's plan on --device (for a CPU dry run)"
    )
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args()

    import torch

    from metachunk.engine import scoring
    from metachunk.models import attention_of, load_causal_lm

    texts = load_texts(args.corpus, args.docs)
    ref_model, tok = load_causal_lm(args.model, device="cpu", dtype="float32")
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    started = time.perf_counter()
    reference = scoring.token_nll(ref_model, ids, max_context=args.max_context)
    cpu_s = time.perf_counter() - started
    del ref_model

    attention = "flex_attention" if args.gpu_plan else "auto"
    plan = {}
    if args.gpu_plan:
        plan = {"batch_tokens": scoring.GPU_BATCH_TOKENS_MAX, "max_batch_size": 1024,
                "head_rows": scoring.GPU_HEAD_ROWS}  # fmt: skip

    def score(dtype: str, fixed: dict | None = None) -> tuple[list[np.ndarray], float, dict]:
        model, _ = load_causal_lm(args.model, device=args.device, dtype=dtype, attn_implementation=attention)
        # The device's own budget comes from its free memory, which moves with what the last load left in
        # torch's cache: read once, and the rerun gets the same plan.
        run_plan = plan or fixed or dict(zip(("batch_tokens", "max_batch_size"),
                                             scoring.batch_budget(model, args.max_context, model.device)))  # fmt: skip
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        started = time.perf_counter()
        nll = scoring.token_nll(model, ids, max_context=args.max_context, **run_plan)
        sync()
        how = {"attention": attention_of(model), "packed": scoring.packs_windows(model),
               "dtype": str(model.dtype), "plan": run_plan}  # fmt: skip
        return nll, time.perf_counter() - started, how

    fp32, fp32_s, fp32_how = score("float32")
    worst = max_nll_diff(fp32, reference)
    first, _, how = score("auto")
    second, _, _ = score("auto", fixed=how["plan"])
    same = all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    tokens = sum(len(x) for x in ids)
    ok = worst <= args.tolerance and same
    print(f"{len(texts)} documents, {tokens} tokens; CPU fp32 {cpu_s:.1f} s, {args.device} fp32 {fp32_s:.1f} s "
          f"({fp32_how['attention']}, packed {fp32_how['packed']})")  # fmt: skip
    print(
        f"fp32 on {args.device} against the CPU reference: max |dNLL| {worst:.2e} (tolerance {args.tolerance:g})"
    )
    print(f"rerun in {how['dtype']} with the same plan: {'identical' if same else 'DIFFERENT'} bytes")
    print("PASS" if ok else "FAIL")
    if args.out:
        result = {"documents": len(texts), "tokens": tokens, "max_abs_nll_diff_fp32": worst,
                  "tolerance": args.tolerance, "rerun_identical": same, "fp32": fp32_how, "rerun": how,
                  "cpu_fp32_s": cpu_s, "device_fp32_s": fp32_s, "pass": ok}  # fmt: skip
        write_json(Path(args.out), result)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:
        print(f"scoring_parity: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
