"""A randomly initialised Qwen2 model folder, for speed benchmarks where no weights are at hand.

Speed does not need trained weights: ``bench/ppl_speed.py`` and ``bench/msp_speed.py`` time the same
matmuls on a random model of the right shape. ``--shape qwen2-0.5b`` is Qwen2(.5)-0.5B (hidden
896, 24 layers, 14 heads, 2 KV heads, MLP 4,864, vocabulary 151,936, tied embeddings); ``tiny``
is the test suite's 2-layer model. The tokenizer is the test suite's offline Qwen2-style BPE
(``tests/tiny_model.py``): it uses the first 1,536 ids of the vocabulary, which leaves the LM head
(the costly part for PPL) at full size.

    python bench/random_model.py --shape qwen2-0.5b --out bench_out/qwen2-0.5b-random
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["qwen2-0.5b", "tiny"], default="qwen2-0.5b")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out}: already there")
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import TINY_SHAPE, build_random_qwen2

    if args.shape == "tiny":
        build_random_qwen2(args.out, TINY_SHAPE, seed=args.seed)
    else:  # Qwen2(.5)-0.5B: its vocabulary too, for the LM head's cost
        build_random_qwen2(args.out, QWEN2_05B, seed=args.seed, vocab_size=151_936)
    print(f"{args.out}: random {args.shape} Qwen2")


if __name__ == "__main__":
    main()
