"""PPL scoring speed and memory: the engine against the two straightforward ways, side by side.

Three ways to get the per-token NLL that PPL chunking needs, on the same documents and model:

* ``engine``: :func:`metachunk.engine.scoring.token_nll`: batched windows of several documents, the LM
  head and log-softmax applied in slices, only the target log-probs gathered.
* ``loop``: one forward per sentence over the KV cache of the preceding text, the literal reading
  of the paper's Eq. 1 (:func:`metachunk.engine.scoring.token_nll_incremental`).
* ``plain``: one forward per document with full fp32 logits and a full log-softmax.
* ``plain-batched``: the batched transformers pass a user would write (:func:`plain_batched`),
  timed from the raw text (tokenize + score); its FLOP rate counts the scoring time only, and so
  does its ratio to an ``engine`` row (which starts from tokenized text); ``chunk`` is compared
  with its whole time. It sums NLL over its own tokenization, so it has no sentence PPL to compare
  (dPPL and F1 are blank).
* ``chunk``: the whole ``metachunk chunk --method ppl`` command, the engine's measure on a GPU (:func:`chunk_worker`).

Every method but ``chunk`` scores one document untimed first (first-call setup, weights paged in).

Documents: ``data:gutenqa-emma/paragraphs.jsonl`` (``--corpus emma``) or ``data:crud-news/news.jsonl``
(``--corpus crud``).

Each runs in a fresh child process, so its peak RSS is its own (VmHWM, reset after the model loaded), next to the RSS
right after the model loaded. The parent prints wall and CPU seconds, speed ratios, peak memory,
and the agreement of the chunk boundaries (F1 of the boundary sets at the same θ) with the loop.

Issue targets (CPU, this 2-core machine):
* smollm2 on 20 Emma chapters: engine >= 2x faster than the loop at boundary F1 >= 0.98.
* gemma3-270m on 50 CRUD articles: engine <= 40 s (>= 3x the plain one-pass), and peak RSS
  <= RSS after loading the model + 0.5 GB.
GPU (H200): engine >= 10x the loop; run with ``--device cuda`` and a 0.5B-class model dir.

    python bench/ppl_speed.py                                   # smollm2, 20 Emma chapters
    python bench/ppl_speed.py --model gemma3-270m --corpus crud --docs 50   # after metachunk data fetch crud-news

**Roofline, per dtype** (``--methods engine-fp32,engine-bf16,engine``): ``engine`` runs ``--dtype auto``
(what ``metachunk chunk`` does with no flag; the line says what auto picked and why), the other two
force a dtype. Each engine's rate is the FLOPs of an exact pass over its documents (2 x the
parameters a token meets, LM head included, per token, plus attention: 4 x layers x heads x head
dim x the keys each token attends to, within the window in a sliding-window layer) over its wall
time, as a share of this machine's best GEMM rate in the same dtype (the best of square and
model-shaped ``torch.matmul`` timings on the run's device, in a child process with the same
threads: one GEMM on all of them and, on CPU, one per thread side by side, as the engine's streams
run). ``streams`` is how many batches the engine ran side by side. Boundary F1 is against
``engine-fp32`` when it runs (the exact path), else against the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from metachunk.artifacts import InputError, read_run_log, write_json  # noqa: E402
from metachunk.named_data import resolve  # noqa: E402

CORPUS = {"emma": "data:gutenqa-emma/paragraphs.jsonl", "crud": "data:crud-news/news.jsonl"}


def load_docs(corpus: str, n: int) -> list[str]:
    if corpus == "crud":
        with resolve(CORPUS["crud"]).open(encoding="utf-8") as f:
            return [json.loads(line)["text"] for _, line in zip(range(n), f)]
    chapters: dict[str, list[str]] = {}
    with resolve(CORPUS["emma"]).open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["chapter"] not in chapters and len(chapters) == n:
                break
            chapters.setdefault(row["chapter"], []).append(row["text"])
    return ["\n\n".join(p) for p in chapters.values()]


def status_mb(field: str) -> float | None:
    """A memory line of /proc/self/status in MB (VmRSS: now; VmHWM: peak since start or reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None


def rss_mb() -> float:
    return status_mb("VmRSS") or float("nan")


def peak_rss_mb() -> float:
    """The peak RSS since the process started or since the last reset (see worker)."""
    return status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def plain_nll(model, ids: list[int]) -> np.ndarray:
    """One forward, full fp32 logits for every position, full log-softmax: the naive one-pass."""
    import torch

    with torch.inference_mode():
        x = torch.as_tensor([ids], device=next(model.parameters()).device)
        logits = model(input_ids=x).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll = -logp.gather(1, x[0, 1:, None]).squeeze(1)
    return np.concatenate([[np.nan], nll.cpu().numpy()]).astype(np.float32)


def plain_batched(
    model,
    tok,
    docs: list[str],
    window: int = 4096,
    stride: int = 2048,
    budget: int = 65536,
    head_rows: int = 8192,
) -> tuple[list[float], dict]:
    """The batched pass a user would write (``plain-batched``), timed apart from the engine: the
    documents tokenized in one call without special tokens; one window up to ``window`` tokens, longer
    ones in windows of ``window`` every ``stride`` tokens, each token scored once with at least
    ``window - stride`` tokens of context (a window's first ``window - stride`` targets are context
    only, except in the first window); windows sorted by length and batched up to ``budget`` padded
    tokens, right-padded under an attention mask; ``model.model`` for the hidden states, the LM head
    on the scored positions in ``head_rows``-row chunks, in float32, into ``F.cross_entropy``. The
    targets are the inputs shifted by one under a mask, built with tensor ops, as a user who cares
    about speed writes them: a Python loop over every token would bill seconds to the baseline that
    are not the model's. Returns each document's summed NLL and the counts."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    t0 = time.perf_counter()
    # one batched call: the fast tokenizer's own threads
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    tokenize_s = time.perf_counter() - t0
    windows = []  # (doc, start, end, first target)
    for k, x in enumerate(ids):
        start = 0
        while True:
            end = min(start + window, len(x))
            windows.append((k, start, end, start + (window - stride if start else 1)))
            if end == len(x):
                break
            start += stride
    windows.sort(key=lambda w: w[2] - w[1], reverse=True)
    batches, batch = [], []
    for w in windows:  # longest first: the first window of a batch sets its padded length
        if batch and (len(batch) + 1) * (batch[0][2] - batch[0][1]) > budget:
            batches.append(batch)
            batch = []
        batch.append(w)
    batches.append(batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    body, head = model.model, model.get_output_embeddings()
    nll = torch.zeros(len(docs), dtype=torch.float64, device=device)
    processed = scored = 0
    with torch.inference_mode():
        for batch in batches:
            width = batch[0][2] - batch[0][1]
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            # labels[r, c]: the token predicted at position c (the input at c + 1), or -100 where
            # position c scores nothing (context only, the window's last position, padding)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            lengths = torch.tensor([b - a for _, a, b, _ in batch])
            owners = torch.tensor([k for k, *_ in batch])
            for r, (k, a, b, first) in enumerate(batch):
                x[r, : b - a] = torch.tensor(ids[k][a:b])
                labels[r, first - 1 - a : b - 1 - a] = x[r, first - a : b - a]
            processed += int(lengths.sum())
            mask = (torch.arange(width) < lengths[:, None]).long()
            hidden = body(input_ids=x.to(device), attention_mask=mask.to(device)).last_hidden_state
            keep = (labels != -100).to(device)
            picked, targets = hidden[keep], labels.to(device)[keep]
            owner = owners.to(device)[:, None].expand(-1, width)[keep]
            scored += len(targets)
            for c in range(0, len(targets), head_rows):
                logits = head(picked[c : c + head_rows]).float()
                losses = F.cross_entropy(logits, targets[c : c + head_rows], reduction="none")
                nll.index_add_(0, owner[c : c + head_rows], losses.double())
    return nll.tolist(), {"tokenize_s": tokenize_s, "processed": processed, "scored": scored,
                          "batches": len(batches), "windows": len(windows),
                          "doc_tokens": [len(x) for x in ids]}  # fmt: skip


def plain_flops(model, processed: int, scored: int) -> float:
    """The plain-pass FLOP count, for every method alike: 2 x (matmul parameters without the input embedding or
    the head) x tokens processed + 2 x (head parameters) x tokens scored; a tied head counts once.
    Attention is not counted."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embed.numel()
    if head is not embed:  # `is`, not data_ptr(): a model on the meta device has no data
        body -= head.numel()
    return 2.0 * body * processed + 2.0 * head.numel() * scored


def window_counts(lengths: list[int], max_context: int) -> dict:
    """Tokens the engine's window plan (`plan_windows`) processes, context recomputed included, and the
    tokens it scores (all but each document's first): `plain_flops`'s inputs for the engine and chunk."""
    from metachunk.engine.scoring import plan_windows

    processed = sum(w.end - w.start for n in lengths for w in plan_windows(n, max_context))
    return {"processed": processed, "scored": sum(max(n - 1, 0) for n in lengths)}


def reset_peak_rss() -> None:
    """Reset the peak RSS (VmHWM) to the RSS now: Linux resets the high-water mark on "5"."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the peak then includes the load


def worker(args) -> None:
    import torch
    from metachunk.chunking.ppl import tokenize_sentences
    from metachunk.chunking.sentences import split_sentences

    from metachunk.engine import kernels
    from metachunk.engine.scoring import default_streams, token_nll, token_nll_incremental
    from metachunk.models import load_causal_lm

    docs = load_docs(args.corpus, args.docs)
    # "engine-bf16": the same engine with bf16 weights (AMX / tensor cores); logits are still
    # normalised in fp32. Shows what reduced precision buys and what it costs in boundary F1.
    # "loop-bf16": the reference loop with the same bf16 weights, so the engine's own gain is
    # measured apart from what the dtype buys.
    dtype = {"engine-bf16": "bfloat16", "loop-bf16": "bfloat16", "engine-fp32": "float32"}.get(
        args.worker, args.dtype
    )
    if args.worker == "gemm":
        return gemm_worker(args)
    if args.worker == "plain-batched":
        return plain_batched_worker(args, docs)
    if args.worker == "chunk":
        return chunk_worker(args, docs)
    model, tok = load_causal_lm(args.model, device=args.device, dtype=dtype)
    sentences = [split_sentences(d, args.lang) for d in docs]
    tokenized = [tokenize_sentences(tok, d, s) for d, s in zip(docs, sentences)]
    head_dtype = torch.bfloat16 if args.worker == "engine-bf16head" else None

    def score(docs_tokenized):
        if args.worker.startswith("engine"):
            return token_nll(model, [ids for ids, _ in docs_tokenized], max_context=args.max_context,
                             max_batch_size=args.batch_size, head_dtype=head_dtype,
                             long_context=args.long_context, streams=args.streams)  # fmt: skip
        if args.worker.startswith("loop"):
            return [
                # the start ids (Gemma's <bos>) first, as the engine reads them: the spans begin after them
                token_nll_incremental(model, [ids[: spans[0][0]], *(ids[a:b] for a, b in spans)])
                for ids, spans in docs_tokenized
            ]
        return [plain_nll(model, ids) for ids, _ in docs_tokenized]

    # Weights are memory-mapped and page in on first use, and the first call sets up oneDNN / cuBLAS:
    # every method scores one document untimed first (as plain-batched does), so that "RSS after
    # load" counts the whole model and no method is billed its first-call setup.
    cuda = bool(args.device and args.device.startswith("cuda"))
    score(tokenized[:1])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    load_rss = rss_mb()
    # The peak to report is the scoring's, not the load's: loading fp32 safetensors into bf16
    # briefly holds both copies (+1 GB for Gemma).
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    cpu0, t0 = time.process_time(), time.perf_counter()
    nll = score(tokenized)
    sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = peak_rss_mb()
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    np.savez(args.out, *nll)
    lengths = [len(ids) for ids, _ in tokenized]
    result = {"wall_s": wall, "cpu_s": cpu, "load_rss_mb": load_rss, "peak_rss_mb": peak, "peak_gpu_mb": peak_gpu,
              "tokens": sum(lengths), "sentences": sum(len(s) for s in sentences),
              "spans": [spans for _, spans in tokenized], "dtype": getattr(model, "metachunk_dtype", {}),
              "streams": (args.streams or default_streams(next(model.parameters()).device)
                          if args.worker.startswith("engine") else 1),
              "flops": exact_pass_flops(model, lengths, args.max_context),
              "issue_flops": plain_flops(model, **window_counts(lengths, args.max_context)),
              "shapes": model_shapes(model),
              "kernels": kernels.status()}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps(result))


def plain_batched_worker(args, docs: list[str]) -> None:
    """``plain-batched``: transformers' own model, SDPA attention, in the dtype ``--dtype`` names, with
    ``auto`` read as the engine reads it (``pick_dtype``: bf16 on a GPU, as the plain pass), timed
    from the raw text: tokenize + score. Both sides are warmed alike (one document) and their peak
    memory counted from after the warm-up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metachunk.models import default_device, pick_dtype, resolve

    device = args.device or default_device()
    name, why = pick_dtype(args.dtype, device)
    path = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, name), attn_implementation="sdpa")
    model = model.to(device).eval()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    plain_batched(model, tok, docs[:1])  # first-call setup (cuBLAS, oneDNN) is not the method's
    sync()
    load_rss = rss_mb()
    reset_peak_rss()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    cpu0, t0 = time.process_time(), time.perf_counter()
    nll, counts = plain_batched(model, tok, docs)
    sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    np.savez(args.out, *[np.array([v], dtype=np.float64) for v in nll])
    result = {"wall_s": wall, "cpu_s": cpu, "load_rss_mb": load_rss, "peak_rss_mb": peak_rss_mb(),
              "peak_gpu_mb": peak_gpu, "tokens": counts["processed"], "sentences": 0, "spans": None,
              "dtype": {"dtype": name, "why": why}, "streams": 1,
              # the table's rate: an exact pass over the same documents, as for the engine's rows
              "flops": exact_pass_flops(model, counts["doc_tokens"], args.max_context),
              "issue_flops": plain_flops(model, counts["processed"], counts["scored"]),  # its own windows
              "plain": {k: v for k, v in counts.items() if k != "doc_tokens"},
              "shapes": model_shapes(model)}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps(result))


def chunk_worker(args, docs: list[str]) -> None:
    """``chunk``: the whole ``metachunk chunk --method ppl`` command on the documents, as a user runs
    it (reading, splitting, tokenizing, scoring, deciding, writing; on a GPU the reading ahead and
    writing behind of chunking/overlap.py), timed as its run log's seconds minus its model load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from metachunk.cli import main as cli
    from metachunk.models import load_tokenizer, resolve

    folder = Path(args.out + ".run")
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(k), "text": d}, ensure_ascii=False) + "\n"
                              for k, d in enumerate(docs)), encoding="utf-8")  # fmt: skip
    argv = ["chunk", str(corpus), "-o", str(folder / "chunks.jsonl"), "--method", "ppl", "--model", args.model,
            "--lang", args.lang, "--dtype", args.dtype, "--max-context", str(args.max_context), "--overwrite"]  # fmt: skip
    for flag, value in (
        ("--device", args.device),
        ("--batch-size", args.batch_size),
        ("--streams", args.streams),
    ):
        if value is not None:
            argv += [flag, str(value)]
    cpu0 = time.process_time()
    if cli(argv) != 0:
        raise SystemExit("ppl_speed: metachunk chunk failed")
    cpu = time.process_time() - cpu0
    summary = json.loads((folder / "chunks.meta.json").read_text())["summary"]  # what it made
    run = read_run_log(folder / "chunks.jsonl")[-1]  # how it ran: seconds, the model's load, dtype, kernels
    report = (run.get("workers_report") or [{}])[0]
    # For the token and FLOP counts only: the tokenizer, and the model's shape on the meta device (no
    # weights: a 7B in float32 on the CPU would cost 30 GB and most of a GPU step's time limit).
    tok = load_tokenizer(args.model)
    lengths = [len(x) for x in tok(docs, add_special_tokens=False)["input_ids"]]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve(args.model)))
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    np.savez(args.out)
    result = {"wall_s": run["seconds"] - run["model_load_seconds"], "cpu_s": cpu,
              "load_rss_mb": 0.0, "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu, "tokens": sum(lengths),
              "sentences": 0, "spans": None, "dtype": report.get("dtype", {}), "streams": 1,
              "flops": exact_pass_flops(model, lengths, args.max_context), "shapes": model_shapes(model),
              "issue_flops": plain_flops(model, **window_counts(lengths, args.max_context)),
              "chunk_summary": summary, "kernels": report.get("scoring", {}).get("kernels", {})}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps(result))


def model_shapes(model) -> dict:
    c = model.config
    c = getattr(c, "text_config", None) or c
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    return {"hidden": c.hidden_size, "intermediate": c.intermediate_size, "vocab": c.vocab_size,
            "layers": c.num_hidden_layers, "attention_width": c.num_attention_heads * head_dim,
            "windows": [window if kind == "sliding_attention" and window else None for kind in layer_types]}  # fmt: skip


def run_worker(cmd: list[str], name: str, err: str) -> None:
    """One worker process. Its stderr (warnings, progress bars) goes to ``err``, and its tail is shown
    where the worker fails: on a GPU machine lent for minutes the traceback is the diagnosis."""
    with open(err, "w", encoding="utf-8") as f:
        code = subprocess.run(cmd, stderr=f).returncode
    if code:
        tail = Path(err).read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"ppl_speed: the {name} worker failed (exit {code}); its stderr: {err}")


def exact_pass_flops(model, lengths: list[int], max_context: int) -> float:
    """FLOPs of one exact pass over documents of ``lengths`` tokens: every token meets every weight
    matrix once (2 FLOPs per parameter, the input embedding excluded: a lookup; the LM head included),
    plus attention's QK^T and AV, 2 FLOPs each per query width (heads x head dim) per key it
    attends to: its context, at most ``max_context`` and, in a sliding-window layer, the window."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters()) - embed.numel()
    if head is embed:  # tied: the head's matmul still runs once per token (`is`: meta tensors have no data)
        params += head.numel()
    shapes = model_shapes(model)
    flops = 0.0
    for n in lengths:
        flops += 2.0 * params * n
        for window in shapes["windows"]:
            span = min(max_context, window or max_context)
            flops += 4.0 * shapes["attention_width"] * keys_attended(n, span)
    return flops


def keys_attended(n: int, span: int) -> int:
    """``sum(min(t + 1, span) for t in range(n))``: the keys each of ``n`` tokens attends to, causal,
    at most ``span`` back; in closed form (a loop over a corpus's 1.5M tokens per layer takes minutes)."""
    ramp = min(n, span)
    return ramp * (ramp + 1) // 2 + (n - ramp) * span


def gemm_worker(args) -> None:
    """The best ``torch.matmul`` rate (GFLOP/s) of the run's device in each dtype, over square shapes and
    the model's own (tokens x hidden @ hidden x intermediate, tokens x hidden @ hidden x vocab)."""
    import torch

    from metachunk.models import default_device

    device = torch.device(args.device or default_device())
    # CUDA launches are asynchronous: time between synchronisations, or the rate counts queued calls.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    shapes = json.loads(args.shapes)
    m = 512
    # The head's shapes too: its tile (metachunk.engine.scoring.DEFAULT_HEAD_ROWS x DEFAULT_VOCAB_BLOCK)
    # and a small one; AMX runs them faster than any square shape (leaving them out would flatter
    # the ratio).
    hidden, vocab = shapes["hidden"], shapes["vocab"]
    cases = [(1024, 1024, 1024), (2048, 2048, 2048), (m, hidden, shapes["intermediate"]),
             (m, shapes["intermediate"], hidden), (m, hidden, min(vocab, 32768)),
             (128, hidden, min(vocab, 4096)), (1024, hidden, min(vocab, 8192))]  # fmt: skip
    if device.type == "cuda":  # a GPU reaches its peak only on shapes that fill every multiprocessor
        cases += [(4096, 4096, 4096), (8192, 8192, 8192)]
    # One GEMM on all threads, and (on CPU) one per thread side by side, as the engine's streams
    # run: the best of either is the machine's rate, so streams cannot flatter the ratio.
    threads = torch.get_num_threads()
    lanes = [1] + ([threads] if device.type == "cpu" and threads > 1 else [])
    out = {}
    for name in args.gemm_dtypes.split(","):
        dtype = getattr(torch, name)
        # Twice each: a CPU's clock and its neighbours vary by several percent from second to second,
        # and the ratio is to the best this machine can do.
        out[name] = max(
            gemm_rate(a, b, c, dtype, device, sync, n) for a, b, c in cases for n in lanes for _ in range(2)
        )
    if device.type == "cuda" and "bfloat16" in out:  # the FLOP rate's denominator: an 8192^3 bf16 matmul
        out["issue_bfloat16"] = issue_gemm_rate(device)
    Path(args.out + ".json").write_text(json.dumps(out))


def issue_gemm_rate(device) -> float:
    """GFLOP/s of an 8192^3 bf16 ``torch.matmul``: 10 products after 3 warm-ups, timed with CUDA events
    (the GEMM probe)."""
    import torch

    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.matmul(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(10):
        torch.matmul(x, w)
    end.record()
    end.synchronize()
    return 2.0 * n**3 * 10 / (start.elapsed_time(end) / 1000) / 1e9


def gemm_rate(a: int, b: int, c: int, dtype, device, sync, lanes: int = 1) -> float:
    """GFLOP/s of ``(a x b) @ (b x c)`` repeated for a second; with ``lanes`` > 1, that many
    threads side by side, each on its own operands with one torch thread, their FLOPs summed."""
    import threading

    import torch

    threads, flops = torch.get_num_threads(), [0.0] * lanes

    def lane(k: int) -> None:
        if lanes > 1:
            torch.set_num_threads(1)
        try:
            x = torch.randn(a, b, dtype=dtype, device=device)
            w = torch.randn(b, c, dtype=dtype, device=device)
            for _ in range(2):
                x @ w
            sync()
        except BaseException:
            barrier.abort()  # the other lanes stop waiting for this one
            raise
        barrier.wait()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            x @ w
            reps += 1
            if reps % 8 == 0:
                sync()
        sync()
        flops[k] = 2.0 * a * b * c * reps / (time.perf_counter() - t0)

    barrier = threading.Barrier(lanes)
    if lanes == 1:
        lane(0)
    else:
        workers = [threading.Thread(target=lane, args=(k,)) for k in range(lanes)]
        try:
            for t in workers:
                t.start()
            for t in workers:
                t.join()
        finally:
            torch.set_num_threads(threads)
    return sum(flops) / 1e9


def f1(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    tp = len(a & b)
    return 2 * tp / (len(a) + len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--corpus", choices=["emma", "crud"], default="emma")
    p.add_argument("--docs", type=int, default=20, help="Emma chapters or CRUD articles")
    p.add_argument("--lang", default=None, help="default: en for emma, zh for crud")
    p.add_argument(
        "--methods",
        default="engine,loop,plain",
        help="any of engine (--dtype, default auto), engine-fp32, engine-bf16, engine-bf16head, loop, loop-bf16, "
        "plain, plain-batched (the batched transformers pass a user would write: tokenize + score), "
        "chunk (the whole `metachunk chunk --method ppl` command, less its model load)",
    )
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--gemm-dtypes", default="float32,bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--threshold", type=float, nargs="+", default=[0.0, 0.5], help="θ values for boundary F1")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--long-context", default="sliding-window", choices=["kv-trim", "sliding-window"])
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="engine rows per batch (default: the engine's, for the device)",
    )
    p.add_argument(
        "--streams", type=int, default=None, help="engine: batches side by side (default: token_nll's)"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--summary",
        default=None,
        help="where the summary JSON goes (default bench_out/ppl_speed_MODEL_CORPUSDOCS.json)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.lang = args.lang or ("zh" if args.corpus == "crud" else "en")
    if args.worker:
        return worker(args)
    resolve(CORPUS[args.corpus])  # a missing dataset stops here, before the first worker

    from metachunk.chunking.ppl import ppl_boundaries, sentence_ppl

    methods = args.methods.split(",")
    results, tmp = {}, tempfile.mkdtemp(prefix="ppl_speed_")
    for m in methods:
        out = os.path.join(tmp, m)
        cmd = [sys.executable, __file__, "--worker", m, "--out", out] + [
            x for k, v in vars(args).items() if k not in ("worker", "out", "threshold", "methods") and v is not None
            for x in (f"--{k.replace('_', '-')}", str(v))
        ]  # fmt: skip
        print(f"[{m}] running ...", flush=True)
        run_worker(cmd, m, out + ".err")
        res = json.loads(Path(out + ".json").read_text())
        arrays = np.load(out + ".npz")
        spans = res.pop("spans")
        # plain-batched sums each document's NLL over its own tokenization: no sentence PPL to compare
        res["ppl"] = (
            None if spans is None else [sentence_ppl(arrays[f"arr_{i}"], s) for i, s in enumerate(spans)]
        )
        results[m] = res
        print(
            f"[{m}] {res['wall_s']:.1f} s wall, {res['cpu_s']:.1f} s cpu, peak RSS {res['peak_rss_mb']:.0f} MB",
            flush=True,
        )

    engines = [m for m in results if m.startswith("engine") or m in ("plain-batched", "chunk")]
    gemm = {}
    if engines:  # this machine's best GEMM rate per dtype, measured beside the runs
        out = os.path.join(tmp, "gemm")
        cmd = [sys.executable, __file__, "--worker", "gemm", "--out", out,
               "--shapes", json.dumps(results[engines[0]]["shapes"]),
               # only the engines' dtypes: an emulated bf16 GEMM (a CPU without it) takes minutes
               "--gemm-dtypes", ",".join(sorted({results[m]["dtype"].get("dtype", "float32") for m in engines}))]  # fmt: skip
        if args.device:
            cmd += ["--device", args.device]
        run_worker(cmd, "gemm", out + ".err")
        gemm = json.loads(Path(out + ".json").read_text())
    compared = [m for m in methods if results[m]["ppl"] is not None]
    ref = (
        "engine-fp32"
        if "engine-fp32" in results
        else "loop"
        if "loop" in results
        else (compared or methods)[0]
    )
    any_res = next(iter(results.values()))
    print(f"\nmodel={args.model} corpus={args.corpus} docs={args.docs} tokens={any_res['tokens']} "
          f"sentences={any_res['sentences']} max_context={args.max_context} device={args.device or 'auto'} dtype={args.dtype}")  # fmt: skip
    header = f"{'method':<16} {'dtype':<9} {'streams':>7} {'wall s':>8} {'cpu s':>8} {'tok/s':>8} {'load MB':>8} {'peak MB':>8} {'+MB':>6} {'max|dPPL|':>10} {'GFLOP/s':>8} {'roofline':>8} " + " ".join(f"{'F1@' + str(t):>7}" for t in args.threshold)  # fmt: skip
    print(header + "\n" + "-" * len(header))
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")}, "methods": {}}
    for m, r in results.items():
        comparable = r["ppl"] is not None and results[ref]["ppl"] is not None
        dppl = float("nan") if not comparable else max(
            float(np.nanmax(np.abs(a - b))) if len(a) else 0.0 for a, b in zip(r["ppl"], results[ref]["ppl"])
        )  # fmt: skip
        f1s = []
        for t in args.threshold:
            if not comparable:
                f1s.append(float("nan"))
                continue
            mine = {(d, i) for d, ppl in enumerate(r["ppl"]) for i in ppl_boundaries(ppl, t)}
            theirs = {(d, i) for d, ppl in enumerate(results[ref]["ppl"]) for i in ppl_boundaries(ppl, t)}
            f1s.append(f1(mine, theirs))
        extra = r["peak_rss_mb"] - r["load_rss_mb"]
        dtype = r.get("dtype", {}).get("dtype", "?")
        rate = r["flops"] / (r["wall_s"] - r.get("plain", {}).get("tokenize_s", 0.0)) / 1e9
        roof = rate / gemm[dtype] if m in engines and dtype in gemm else float("nan")
        print(f"{m:<16} {dtype:<9} {r['streams']:>7} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['tokens'] / r['wall_s']:>8.0f} {r['load_rss_mb']:>8.0f} "
              f"{r['peak_rss_mb']:>8.0f} {extra:>6.0f} {dppl:>10.2e} {rate:>8.1f} {roof:>8.2f} " + " ".join(f"{x:>7.4f}" for x in f1s))  # fmt: skip
        summary["methods"][m] = {k: v for k, v in r.items() if k != "ppl"} | {"boundary_f1_vs_" + ref: dict(zip(map(str, args.threshold), f1s)), "max_abs_ppl_diff": dppl, "gflops": rate, "roofline": roof}  # fmt: skip
    if gemm:
        rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in gemm.items())
        print(f"best GEMM on {args.device or 'this machine'}: {rates}")
        summary["best_gemm_gflops"] = gemm
    # The FLOP-rate measure, alike for every method: its FLOP count (`plain_flops`: no attention, the head on
    # scored tokens only) over the same seconds as the table's, against its 8192^3 bf16 GEMM on a GPU
    # (`issue_gemm_rate`), else the best GEMM of the method's dtype.
    for m in ("engine", "chunk", "plain-batched"):
        r = results.get(m)
        if r is None or "issue_flops" not in r:
            continue
        dtype = r.get("dtype", {}).get("dtype", "?")
        probe = (dtype == "bfloat16" and gemm.get("issue_bfloat16")) or gemm.get(dtype)
        rate = r["issue_flops"] / (r["wall_s"] - r.get("plain", {}).get("tokenize_s", 0.0)) / 1e9
        fraction = rate / probe if probe else float("nan")
        print(
            f"{m}: plain-pass count {r['issue_flops'] / 1e12:.2f} TFLOP, {rate:.0f} GFLOP/s = {fraction:.2f} of the GEMM"
        )
        summary["methods"][m] |= {"issue_gflops": rate, "issue_gemm_fraction": fraction}
    if "engine" in results:
        picked = results["engine"].get("dtype", {})
        print(f"--dtype auto picked {picked.get('dtype')} ({picked.get('why')})")
        summary["auto"] = picked
        if "engine-fp32" in results:
            x = results["engine-fp32"]["wall_s"] / results["engine"]["wall_s"]
            print(f"auto vs the float32 engine: {x:.2f}x wall")
            summary["auto_speedup_vs_fp32_engine"] = x
    for name in ("engine", "chunk", "engine-fp32", "engine-bf16head", "engine-bf16"):
        if name not in results:
            continue
        e = results[name]
        for other in ("loop", "loop-bf16", "plain", "plain-batched"):
            if other in results:
                o = results[other]
                # Like for like: the engine rows start from tokenized text, so plain-batched's own
                # tokenizing comes off its clock; `chunk` starts from the raw text, as plain-batched does.
                untimed = o.get("plain", {}).get("tokenize_s", 0.0) if name != "chunk" else 0.0
                wall, cpu = (o["wall_s"] - untimed) / e["wall_s"], o["cpu_s"] / e["cpu_s"]
                basis = " (plain-batched's scoring only: both from tokenized text)" if untimed else ""
                print(f"{name} vs {other}: {wall:.2f}x wall, {cpu:.2f}x cpu{basis}")
                summary[f"{name}_speedup_vs_{other}"] = {"wall": wall, "cpu": cpu}
        print(f"{name} peak RSS - RSS after load: {e['peak_rss_mb'] - e['load_rss_mb']:.0f} MB")
    name = f"ppl_speed_{args.model.replace('/', '_')}_{args.corpus}{args.docs}.json"
    path = Path(args.summary) if args.summary else ROOT / "bench_out" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    try:
        main()
    except InputError as e:  # a named dataset that is not here: the fetch command to run
        print(f"ppl_speed: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as the CLI
