"""Chunk-quality speed: batched conditional perplexities vs one forward pass per chunk pair.

Boundary Clarity and Chunk Stickiness (``metachunk eval chunk-quality``) need ``ppl(q)`` of every
chunk and ``ppl(q|d)`` of up to ``N (N - 1)`` ordered chunk pairs. Compared, on the same pairs of
real Emma chunks and the same model:

* **pair-by-pair**: one forward pass over ``d + q`` per pair (and one over each chunk alone),
  :func:`metachunk.engine.scoring.token_nll` on that one sequence: what a literal loop does.
* **kv B=b**: :func:`metachunk.eval.chunk_quality.mean_nll_matrix` as ``eval chunk-quality`` runs it: each
  context ``d`` runs once and its KV cache is reused by the ``q`` read after it, up to ``b`` of
  them per forward pass (right-padded; :func:`metachunk.engine.scoring.continuation_nll`).

Chunks: the first ``--paragraphs`` paragraphs of *Emma* joined with blank lines, split into
sentences and packed to at most ``--target-words`` words (:func:`metachunk.chunking.baselines.sentence_chunks`,
the LlamaIndex-style baseline); the first ``--chunks`` chunks form one document. Pairs: as ``eval chunk-quality --max-pairs``
picks them (every adjacent pair, then the nearest others up to the cap).

Timing is fair on a shared machine: the work is cut into blocks (all chunks alone, then the
pairs of ``--block`` contexts at a time) and every block is run by all variants back to back in
a rotating order, so a change in load hits all of them alike; a variant's time is its sum over
blocks. Then the matrices of both paths are compared: the largest ``|Δ mean NLL|``, and BC, CS_c
and CS_i (both conventions at ``--k``) computed from each. No wall-time assertion: the ratio is
printed. Results: ``bench_out/eval_speed.json``.

    python bench/eval_speed.py                       # smollm2, 40 chunks, 128 nearest pairs, B = 1, 8
    python bench/eval_speed.py --max-pairs 0 --chunks 20 --batch-sizes 1 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from metachunk.artifacts import InputError, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402


def emma_chunks(paragraphs: int, target_words: int, n: int) -> list[str]:
    from metachunk.chunking.baselines import sentence_chunks
    from metachunk.chunking.sentences import split_sentences

    texts = []
    with resolve("data:gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        for _, line in zip(range(paragraphs), f):
            texts.append(json.loads(line)["text"])
    doc = "\n\n".join(texts)
    chunks = [c.text for c in sentence_chunks(doc, split_sentences(doc, "en"), target_words, "word")]
    if len(chunks) < n:
        raise SystemExit(f"only {len(chunks)} chunks from {paragraphs} paragraphs; raise --paragraphs")
    return chunks[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--paragraphs", type=int, default=120)
    p.add_argument("--target-words", type=int, default=64)
    p.add_argument("--max-pairs", type=int, default=128, help="0 = all N(N-1)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block", type=int, default=8, help="contexts per timing block")
    p.add_argument("--k", type=float, default=0.8)
    p.add_argument("--device", default=None)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import numpy as np
    import torch
    from metachunk.eval import chunk_quality as cq

    from metachunk.models import load_causal_lm

    texts = emma_chunks(args.paragraphs, args.target_words, args.chunks)
    model, tokenizer = load_causal_lm(args.model, device=args.device)
    pairs = cq.select_pairs(len(texts), args.max_pairs)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    contexts = sorted({i for i, _ in pairs})
    blocks = [("alone", [])] + [
        (f"ctx {a}-{a + args.block - 1}", [pq for pq in pairs if a <= pq[0] < a + args.block])
        for a in range(0, len(texts), args.block)
        if any(a <= i < a + args.block for i in contexts)
    ]
    variants = ["pair-by-pair"] + [f"kv B={b}" for b in args.batch_sizes]

    def run(variant: str, block_pairs, alone: bool):
        batched = variant != "pair-by-pair"
        b = int(variant.split("=")[1]) if batched else 1
        return cq.mean_nll_matrix(model, tokenizer, texts, block_pairs, batched=batched, batch_size=b,
                                  score_alone=alone)  # fmt: skip

    print(f"[warm-up] {args.model}, {len(texts)} chunks ({sum(lengths)} tokens, mean {np.mean(lengths):.0f}), "
          f"{len(pairs)} of {len(texts) * (len(texts) - 1)} pairs, {len(blocks)} blocks", flush=True)  # fmt: skip
    for v in variants:
        run(v, pairs[:2], False)

    wall = {v: 0.0 for v in variants}
    cpu = {v: 0.0 for v in variants}
    alone = {v: None for v in variants}
    cond = {v: np.full((len(texts), len(texts)), np.nan) for v in variants}
    for n, (name, block_pairs) in enumerate(blocks):
        order = variants[n % len(variants) :] + variants[: n % len(variants)]
        line = []
        for v in order:
            t0, c0 = time.perf_counter(), time.process_time()
            a, c, _ = run(v, block_pairs, name == "alone")
            wall[v] += time.perf_counter() - t0
            cpu[v] += time.process_time() - c0
            if name == "alone":
                alone[v] = a
            else:
                for i, j in block_pairs:
                    cond[v][i, j] = c[i, j]
            line.append(f"{v} {time.perf_counter() - t0:.1f}s")
        print(f"  block {name:<10} ({len(block_pairs):>3} pairs): " + ", ".join(line), flush=True)

    scored_tokens = sum(lengths) + sum(lengths[j] for _, j in pairs)
    ref = variants[0]
    print(f"\nmodel={args.model} device={next(model.parameters()).device} threads={torch.get_num_threads()} "
          f"chunks={len(texts)} pairs={len(pairs)} scored q tokens={scored_tokens}")  # fmt: skip
    header = f"{'variant':<14} {'wall s':>8} {'cpu s':>8} {'q tok/s':>8} {'speed-up':>9}"
    print(header + "\n" + "-" * len(header))
    for v in variants:
        print(
            f"{v:<14} {wall[v]:>8.1f} {cpu[v]:>8.1f} {scored_tokens / wall[v]:>8.0f} {wall[ref] / wall[v]:>8.2f}x"
        )

    results = {"variants": {}}
    for v in variants[1:]:
        d_alone = float(np.nanmax(np.abs(alone[v] - alone[ref])))
        d_cond = float(np.nanmax(np.abs(cond[v] - cond[ref])))
        row = {"wall_s": wall[v], "cpu_s": cpu[v], "speedup_wall": wall[ref] / wall[v],
               "speedup_cpu": cpu[ref] / cpu[v], "max_abs_diff_nll_alone": d_alone, "max_abs_diff_nll_cond": d_cond}  # fmt: skip
        print(f"\n{v} vs {ref}: {wall[ref] / wall[v]:.2f}x wall, {cpu[ref] / cpu[v]:.2f}x cpu; "
              f"max |Δ mean NLL| alone {d_alone:.2e}, pairs {d_cond:.2e}")  # fmt: skip
        for conv in cq.CONVENTIONS:
            got = []
            for w in (v, ref):
                ua, uc = np.exp(alone[w]), np.exp(cond[w])
                got.append((float(np.nanmean(cq.boundary_clarity(ua, uc, conv))),
                            *cq.chunk_stickiness(ua, uc, args.k, conv, "complete"),
                            *cq.chunk_stickiness(ua, uc, args.k, conv, "incomplete")))  # fmt: skip
            (bc, csc, mc, csi, mi), (bc0, csc0, mc0, csi0, mi0) = got
            print(f"  {conv:<8} BC {bc:.6f} vs {bc0:.6f} (Δ {abs(bc - bc0):.1e}); CS_c {csc:.4f} vs {csc0:.4f} "
                  f"(m {mc}/{mc0}); CS_i {csi:.4f} vs {csi0:.4f} (m {mi}/{mi0})")  # fmt: skip
            row[conv] = {"bc": [bc, bc0], "cs_complete": [csc, csc0], "edges_complete": [mc, mc0],
                         "cs_incomplete": [csi, csi0], "edges_incomplete": [mi, mi0]}  # fmt: skip
        results["variants"][v] = row
    results.update({
        "model": args.model, "chunks": len(texts), "chunk_tokens": lengths, "pairs": len(pairs),
        "max_pairs": args.max_pairs, "k": args.k, "wall_s": wall, "cpu_s": cpu, "scored_q_tokens": scored_tokens,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS")},
        "date": time.strftime("%Y-%m-%d %H:%M"),
    })  # fmt: skip
    out = ROOT / "bench_out" / "eval_speed.json"
    out.parent.mkdir(exist_ok=True)
    write_json(out, results)
    print(f"wrote bench_out/{out.name}")


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"eval_speed: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
