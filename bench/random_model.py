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
SHAPES = {
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151_936,
    ),  # fmt: skip
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
    ),  # fmt: skip
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out}: already there")
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from tiny_model import ENDOFTEXT, IM_END, build_tokenizer
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    shape = dict(SHAPES[args.shape])
    shape["vocab_size"] = shape["vocab_size"] or len(tok)
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, dtype="float32")  # fmt: skip
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out)
    model.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: random {args.shape} ({n / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()
