"""A randomly initialised Qwen2 model folder, for speed benchmarks where no weights are at hand.

Speed does not need trained weights: ``bench/ppl_speed.py``, ``bench/msp_speed.py`` and the
training benches time the same matmuls on a random model of the right shape. The shapes are
Qwen2(.5)'s, each with a 151,936-entry vocabulary, the one the GPU engine figures were measured with (Qwen2-0.5B's, 1.5B's and
2.5-3B's; Qwen2-7B's real one is 152,064), since the LM head is the costly part for PPL:

- ``qwen2-0.5b``: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4,864, tied embeddings;
- ``qwen2-1.5b``: hidden 1,536, 28 layers, 12 heads, 2 KV heads, MLP 8,960, tied;
- ``qwen2.5-3b``: hidden 2,048, 36 layers, 16 heads, 2 KV heads, MLP 11,008, tied;
- ``qwen2-7b``: hidden 3,584, 28 layers, 28 heads, 4 KV heads, MLP 18,944, untied;
- ``tiny``: the test suite's 2-layer model.

The tokenizer is the test suite's offline Qwen2-style BPE (``tests/tiny_model.py``, trained only on
text this repository holds, so it is the same on every machine): it uses the first 1,536 ids. The
weights are built on the GPU in bf16 when there is one (``--device``, ``--dtype``), which takes
seconds where a 7B fp32 init on a CPU takes minutes.

    python bench/random_model.py --shape qwen2-1.5b --out bench_out/qwen2-1.5b-random
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # (shape, tied embeddings)
    "qwen2-0.5b": (dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2), True),
    "qwen2-1.5b": (dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2), True),
    "qwen2.5-3b": (dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=2), True),
    "qwen2-7b": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4), False),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "tiny"], default="qwen2-0.5b")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    args = ap.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out}: already there")
        return
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import TINY_SHAPE, build_random_qwen2

    if args.shape == "tiny":
        build_random_qwen2(args.out, TINY_SHAPE, seed=args.seed, device=device, dtype=dtype)
    else:
        shape, tie = SHAPES[args.shape]
        build_random_qwen2(
            args.out, shape, seed=args.seed, vocab_size=151_936, device=device, dtype=dtype, tie=tie
        )
    print(f"{args.out}: random {args.shape} Qwen2 ({dtype}, built on {device})")


if __name__ == "__main__":
    main()
