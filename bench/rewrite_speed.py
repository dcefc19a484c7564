"""A trained rewriter at work: ``metachunk chunk --rewrite`` against plain batched ``model.generate``.

The trained student at work: an exported student loaded into the chunker rewrites a corpus's chunks, batched
on the device, and its generated tokens per second are compared with what a user gets from the
same model and the same prompts with plain batched ``generate``.

* **students**: `metachunk.chunking.students.ChunkStudents.apply`, what ``metachunk chunk
  --rewrite MODEL`` runs on every group of chunked documents: the training prompt of every chunk,
  prompts of similar length batched and padded on the left, each chunk's own budget of new tokens,
  its rows per batch the device's default (``--batch-size`` to force one).
* **plain**: the same prompt ids in input order, in batches of ``--plain-batch-size``, left-padded by
  the tokenizer, ``model.generate(max_new_tokens=...)`` greedy, each batch up to its largest budget,
  as a user would write it.

Both count the new tokens up to each row's stop token or budget, over the generation time, not the
model load. The students' time also holds building and encoding the prompts, as the chunker does; the
plain pass gets them encoded. Each is warmed on one full batch first; ``--rounds`` alternates which
runs first and keeps each one's best. PASS: students >= 0.8x plain in tokens/s (``--target``).

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

from metachunk.artifacts import InputError, write_json
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
    p.add_argument(
        "--rounds", type=int, default=1, help="timed rounds, alternating which runs first; best kept"
    )
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

    model, tok = student.model, student.tokenizer
    tok.padding_side = "left"
    config = copy.deepcopy(student.generation)
    stop = student.stop_ids

    def plain(ids, budgets) -> int:
        """Plain batched ``generate`` over ``ids``: the new tokens up to each row's stop or budget."""
        tokens = 0
        with torch.inference_mode():
            for first in range(0, len(ids), args.plain_batch_size):
                rows = ids[first : first + args.plain_batch_size]
                padded = tok.pad({"input_ids": rows}, return_tensors="pt").to(model.device)
                config.max_new_tokens = max(budgets[first : first + len(rows)])
                out = model.generate(**padded, generation_config=config)
                for k, row in enumerate(out[:, padded["input_ids"].shape[1] :].tolist()):
                    row = row[: budgets[first + k]]
                    tokens += next((i for i, t in enumerate(row) if t in stop), len(row))
        return tokens

    def ours() -> int:
        student.new_tokens, student.seconds = 0, 0.0
        students.apply(docs)
        return student.new_tokens

    # warm-up, one full batch each: first-call setup (cuBLAS, oneDNN) and the first large shapes are neither
    # method's
    student.generate(prompts[: student.batch_size], budgets[: student.batch_size])
    plain(ids[: args.plain_batch_size], budgets[: args.plain_batch_size])
    # rounds alternate which runs first, so neither always finds the other's warm caches; each keeps its best
    timed = {"students": [], "plain": []}
    order = (("students", ours), ("plain", lambda: plain(ids, budgets)))
    for r in range(args.rounds):
        for name, run in order if r % 2 == 0 else order[::-1]:
            sync()
            started = time.perf_counter()
            tokens = run()
            sync()
            timed[name].append((time.perf_counter() - started, tokens))
    (ours_s, ours_tokens), (plain_s, plain_tokens) = min(timed["students"]), min(timed["plain"])

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
                  "plain_tokens": plain_tokens, "plain_s": plain_s, "ratio": ratio, "pass": ok,
                  "rounds": {k: [{"s": t, "tokens": n} for t, n in v] for k, v in timed.items()}}  # fmt: skip
        write_json(Path(args.out), result)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:
        print(f"rewrite_speed: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
