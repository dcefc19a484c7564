"""A trained rewriter at work: ``metachunk chunk --rewrite`` against plain batched ``model.generate``.

Issue 48's item 6: an exported student loaded into the chunker rewrites a corpus's chunks, batched
on the device, and its generated tokens per second are compared with what a user gets from the
same model and the same prompts with plain batched ``generate``.

* **students**: `metachunk.chunking.students.ChunkStudents.apply`, what ``metachunk chunk
  --rewrite MODEL`` runs on every group of chunked documents: the training prompt of every chunk,
  prompts of similar length batched and padded on the left, each chunk's own budget of new tokens,
  its rows per batch the device's default (``--batch-size`` to force one).
* **plain**: the same prompt ids in input order, in batches of ``--plain-batch-size``, left-padded by
  the tokenizer, ``model.generate(max_new_tokens=...)`` greedy, each batch up to its largest budget,
  as a user would write it.

Both count the new tokens up to each row's stop token or budget, over the generation time (the
prompts built, not the model load). PASS: students >= 0.8x plain in tokens/s (``--target``).

    python bench/rewrite_speed.py --model runs/export/rewriter --device cuda --docs 100
    python bench/rewrite_speed.py --model DIR --device cpu --docs 2 --max-new-tokens 8   # a dry run

The chunks are the first ``--docs`` CRUD articles (``--corpus crud``) or Emma paragraphs (``emma``,
which ship with the package) cut by ``--method sentence`` to ``--target-len`` characters. A random
model never says its stop token, so ``--max-new-tokens`` caps every budget for a bounded run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from metachunk.artifacts import InputError
from metachunk.named_data import resolve

CORPUS = {"emma": "data:gutenqa-emma/paragraphs.jsonl", "crud": "data:crud-news/news.jsonl"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", required=True, help="a student folder (`metachunk export`): chat template, safetensors"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--corpus", choices=sorted(CORPUS), default="crud")
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--target-len", type=int, default=400, help="characters per chunk (zh) / words (en)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="caps every chunk's budget")
    p.add_argument(
        "--batch-size", type=int, default=None, help="students' rows per batch (default: the device's)"
    )
    p.add_argument("--plain-batch-size", type=int, default=64)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args()

    import torch
    from metachunk.chunking.pipeline import ChunkConfig, Chunker
    from metachunk.chunking.students import ChunkStudents, chunk_prompts, load_student_prompt

    from metachunk.models import default_device

    device = args.device or default_device()
    lang = "zh" if args.corpus == "crud" else "en"
    with resolve(CORPUS[args.corpus]).open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(args.docs), f)]
    chunker = Chunker(ChunkConfig(method="sentence", target_len=args.target_len, lang=lang), progress=False)
    docs = chunker.chunk([str(k) for k in range(len(texts))], texts)
    students = ChunkStudents({"rewrite": args.model}, device=device, dtype=args.dtype,
                             batch_size=args.batch_size, progress=False)  # fmt: skip
    student = students.students["rewrite"]
    if args.max_new_tokens:
        student.fixed_max_new_tokens = args.max_new_tokens
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    # the plain pass's prompts: the same messages as the chunker builds, the same budgets
    spec = students.context
    prompts, budgets = [], []
    for d in docs:
        geometry = [(c.start, c.end) for c in d.chunks if c.text.strip()]
        prompts += chunk_prompts("rewrite", d.lang, d.text, geometry, spec)
        budgets += [student.max_new_tokens(d.text[a:b]) for a, b in geometry]
    load_student_prompt("rewrite", lang)
    ids = [student.encode(m) for m in prompts]

    # warm-up: first-call setup (cuBLAS, oneDNN) is neither method's
    student.generate(prompts[:1], budgets[:1])
    student.new_tokens, student.seconds = 0, 0.0
    sync()
    started = time.perf_counter()
    students.apply(docs)
    sync()
    ours_s, ours_tokens = time.perf_counter() - started, student.new_tokens

    model, tok = student.model, student.tokenizer
    tok.padding_side = "left"
    config = copy.deepcopy(student.generation)
    stop = student.stop_ids
    plain_tokens = 0
    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(ids), args.plain_batch_size):
            rows = ids[first : first + args.plain_batch_size]
            padded = tok.pad({"input_ids": rows}, return_tensors="pt").to(model.device)
            config.max_new_tokens = max(budgets[first : first + len(rows)])
            out = model.generate(**padded, generation_config=config)
            for k, row in enumerate(out[:, padded["input_ids"].shape[1] :].tolist()):
                row = row[: budgets[first + k]]
                end = next((i for i, t in enumerate(row) if t in stop), len(row))
                plain_tokens += end
    sync()
    plain_s = time.perf_counter() - started

    ours_rate, plain_rate = ours_tokens / ours_s, plain_tokens / plain_s
    ratio = ours_rate / plain_rate
    ok = ratio >= args.target
    print(f"{len(docs)} documents, {len(prompts)} chunks to rewrite, on {device} ({student.model.dtype})")
    print(f"students (metachunk chunk --rewrite, {student.batch_size} rows a batch): {ours_tokens} new tokens "
          f"in {ours_s:.1f} s = {ours_rate:.0f} tokens/s")  # fmt: skip
    print(f"plain batched generate ({args.plain_batch_size} a batch): {plain_tokens} new tokens in {plain_s:.1f} s "
          f"= {plain_rate:.0f} tokens/s")  # fmt: skip
    print(f"students / plain: {ratio:.2f}x tokens/s (target >= {args.target:g}x): {'PASS' if ok else 'FAIL'}")
    if args.out:
        result = {"device": device, "chunks": len(prompts), "students_rows": student.batch_size,
                  "students_tokens": ours_tokens, "students_s": ours_s, "plain_batch_size": args.plain_batch_size,
                  "plain_tokens": plain_tokens, "plain_s": plain_s, "ratio": ratio, "pass": ok}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:
        sys.exit(f"rewrite_speed: {e}")
