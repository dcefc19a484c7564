"""metachunk beside chonkie: the same texts chunked by both, at one mean chunk length, then retrieval.

The same *Emma* chapters (GutenQA, English) and CRUD news articles (Chinese) are chunked by
chonkie's own chunkers (``import chonkie``) and by metachunk's (its public Python API), every one
brought to the same corpus-wide mean chunk length in characters (default 600 for *Emma*, the
papers' 178 for CRUD; within ``--tolerance``, 5%). Then ``metachunk eval qa`` retrieves over each
chunker's chunks and ``metachunk eval compare`` puts them side by side with bootstrap intervals.

* **Chunkers.** chonkie 1.7: ``TokenChunker``, ``SentenceChunker``, ``RecursiveChunker`` (all with
  ``tokenizer="character"``, so sizes are characters), ``SemanticChunker`` and ``LateChunker``
  (embeddings: metachunk's local MiniLM, the ``minilm`` preset, as a sentence-transformers model;
  sizes in MiniLM tokens), ``SlumberChunker`` (its LLM: metachunk's preset served by llama.cpp on
  loopback, ``metachunk.local_teacher``, through chonkie's ``OpenAIGenie``), and the ones that need
  the Hub or an API (``NeuralChunker``, ``TeraflopAIChunker``): each is tried and, where it cannot
  run offline, the reason is recorded. metachunk: ``FixedChunker``, ``SentenceChunker``,
  ``SemanticChunker`` (MiniLM, breakpoints at the 50th percentile, as ``recipes/experiments``),
  ``PPLChunker`` and ``MSPChunker`` (SmolLM2-135M for *Emma*, Gemma-3-270m for CRUD; MSP in pair
  mode under the dynamic threshold, as the experiment recipes).
* **Equal length.** chonkie: ``chunk_size`` is searched (doubling, then bisection) over full runs;
  SemanticChunker's natural segment length is set by ``threshold``, so it is searched first (with
  ``chunk_size`` as a loose cap, embeddings cached across the tries), then ``chunk_size``;
  LateChunker's search reruns only its recursive split (its boundaries), SlumberChunker's a few
  full runs (``--slumber-tries``). metachunk: each document is segmented once and
  ``metachunk.chunking.pipeline.fit_target_len`` bisects ``target_len`` over the cheap merge step,
  as ``metachunk chunk --mean-chunk-chars`` does.
* **Measured** for each chunker, in its own child process (``--one NAME --corpus C``): model load,
  the timed chunking of the whole corpus at the chosen size (after the search; docs/s and
  characters/s), peak RSS (``ru_maxrss`` of the child from ``os.wait4``; SlumberChunker's llama.cpp
  server separately, its ``VmHWM``), the mean chunk length reached, the number of chunks, and
  whether the output is lossless: every chunk's text is ``doc[start:end]`` and the chunks tile the
  document (contiguous, from 0 to its end).
* **Retrieval.** Each chunker's chunks are written in ``metachunk chunk``'s format (JSONL +
  ``.meta.json``), then ``metachunk eval qa`` as ``make demo`` runs it for *Emma* (GutenQA,
  ``--questions answerable``, MiniLM top 8) and as ``recipes/experiments/crud.yaml`` for CRUD (the
  QA matching of ``metachunk data prepare-crud``), and ``metachunk eval compare`` over the runs.

The *Emma* documents are made by ``metachunk data passages`` with the demo's settings (one
document per chapter, ``--groups 0:N``); the CRUD documents are the first ``--crud-docs`` of the
QA-matched test articles ``data prepare-crud`` writes. The inputs are the named datasets
``data:gutenqa-emma/...`` (ships with metachunk) and ``data:crud-news/...`` (``metachunk data fetch
crud-news`` once). Everything goes under ``--out``
(``bench_out/chonkie_compare/``): ``chonkie_compare.json`` and ``.md`` (the table and the metrics),
``chunks/``, ``eval/`` (each run, ``compare_*.md``/``.json``/PNGs) and ``results/`` (each child's).

    python bench/chonkie_compare.py                               # Emma I-VI + 30 CRUD articles
    python bench/chonkie_compare.py --emma-chapters 1 --crud-docs 3 --chunkers chonkie-token,metachunk-fixed
    python bench/chonkie_compare.py --corpora emma --no-eval
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

from metachunk.artifacts import append_run_log, write_bytes, write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench_out" / "chonkie_compare"
MIB = 2**20

CHONKIE = [
    "chonkie-token", "chonkie-sentence", "chonkie-recursive", "chonkie-semantic", "chonkie-late",
    "chonkie-slumber", "chonkie-neural", "chonkie-teraflopai",
]  # fmt: skip
METACHUNK = ["metachunk-fixed", "metachunk-sentence", "metachunk-semantic", "metachunk-ppl", "metachunk-msp"]
CHUNKERS = CHONKIE + METACHUNK
# SlumberChunker asks its LLM once per chunk, one call after another: opt-in (--chunkers ...,chonkie-slumber).
OPT_IN = {
    "chonkie-slumber": "opt-in: one sequential LLM call per chunk (a few seconds each with a 135M-270M model "
    "on 2 cores), over this bench's time budget; run it with --chunkers chonkie-slumber on a few documents",
}
DEFAULT_CHUNKERS = [c for c in CHUNKERS if c not in OPT_IN]
CORPORA = {  # the model of metachunk's LM chunkers (and SlumberChunker's LLM), the language, the goal
    "emma": {"model": "smollm2", "lang": "en", "goal": 600.0},
    "crud": {"model": "gemma3-270m", "lang": "zh", "goal": 178.0},
}
# chonkie's language recipes (`from_recipe(lang="zh")`) are downloaded from the Hub (chonkie-ai/recipes):
# offline, Chinese gets these hand-written equivalents (sentence ends; then the recursive levels).
ZH_SENTENCE_DELIMS = ["。", "！", "？", "\n"]
ZH_PAUSES = ["；", "，", "、", "：", "“", "”", "（", "）"]
QA_CUTOFFS = ["1", "3", "5", "8"]
PAIRS = [("chonkie-token", "metachunk-fixed"), ("chonkie-sentence", "metachunk-sentence"),
         ("chonkie-semantic", "metachunk-semantic")]  # fmt: skip
PAIR_METRICS = ["hits@1", "hits@3", "hits@8", "mrr@8"]
METRICS = ["avg_chunk_chars", "n_chunks", "n_questions", "hits@1", "hits@3", "hits@5", "hits@8", "mrr@8"]


# ---- the child: one chunker on one corpus ----------------------------------------------------------


def read_docs(path: Path) -> tuple[list[str], list[str]]:
    ids, texts = [], []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            ids.append(str(row["id"]))
            texts.append(row["text"])
    return ids, texts


def lossless(texts: list[str], outputs: list[list[tuple[str, int, int]]]) -> dict:
    """Whether every chunk is ``doc[start:end]`` and the chunks tile each document."""
    bad_text = gaps = overlaps = bad_docs = 0
    for doc, chunks in zip(texts, outputs):
        ok = True
        pos = 0
        for text, start, end in chunks:
            if doc[start:end] != text:
                bad_text += 1
                ok = False
            if start > pos:
                gaps += 1
                ok = False
            elif start < pos:
                overlaps += 1
                ok = False
            pos = end
        if pos != len(doc) or (not chunks and doc):
            gaps += 1
            ok = False
        bad_docs += not ok
    return {"lossless": bad_docs == 0, "docs_not_tiled": bad_docs, "chunks_not_slices": bad_text,
            "gaps": gaps, "overlaps": overlaps}  # fmt: skip


def mean_len(outputs: list[list[tuple[str, int, int]]]) -> float:
    lengths = [len(c[0]) for chunks in outputs for c in chunks]
    return sum(lengths) / len(lengths) if lengths else 0.0


def search_int(mean_of, goal: float, tol: float, start: int, max_tries: int = 40) -> tuple[int, list]:
    """The integer size whose mean chunk length is closest to ``goal``: from ``start``, double or
    halve until the goal is bracketed, then bisect (the mean grows with the size)."""
    tried: dict[int, float] = {}

    def m(p: int) -> float:
        if p not in tried:
            tried[p] = mean_of(p)
        return tried[p]

    p = max(1, int(start))
    if m(p) < goal:
        lo, hi = p, p * 2
        while m(hi) < goal and hi < 1 << 20 and len(tried) < max_tries:
            lo, hi = hi, hi * 2
    else:
        lo, hi = max(1, p // 2), p
        while lo > 1 and m(lo) >= goal and len(tried) < max_tries:
            lo, hi = max(1, lo // 2), lo
    while hi - lo > 1 and abs(m(hi) - goal) > tol * goal / 4 and len(tried) < max_tries:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if m(mid) < goal else (lo, mid)
    best = min(tried, key=lambda t: (abs(tried[t] - goal), t))
    return best, [[k, round(v, 1)] for k, v in tried.items()]


def search_float_decreasing(
    mean_of, goal: float, tol: float, lo: float, hi: float, tries: int
) -> tuple[float, list]:
    """A float knob whose mean chunk length falls as it grows (chonkie's semantic ``threshold``)."""
    tried: dict[float, float] = {}
    for x in (lo, hi):
        tried[x] = mean_of(x)
    a, b = lo, hi  # mean(a) >= goal >= mean(b), when bracketed
    if tried[lo] >= goal >= tried[hi]:
        while len(tried) < tries:
            mid = round((a + b) / 2, 4)
            tried[mid] = mean_of(mid)
            if abs(tried[mid] - goal) <= tol * goal / 4:
                break
            a, b = (mid, b) if tried[mid] >= goal else (a, mid)
    best = min(tried, key=lambda t: abs(tried[t] - goal))
    return best, [[k, round(v, 1)] for k, v in tried.items()]


def timed(run) -> tuple[object, float, int]:
    """``(output of the first run, median seconds, runs)``: a run under half a second is repeated
    (up to 1 s or 20 runs) so that its time is not a timer's noise."""
    times, out = [], None
    while True:
        t = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t)
        out = result if out is None else out
        if times[0] >= 0.5 or sum(times) >= 1.0 or len(times) >= 20:
            break
    return out, sorted(times)[len(times) // 2], len(times)


def chonkie_outputs(chunker, texts: list[str]) -> list[list[tuple[str, int, int]]]:
    return [[(c.text, c.start_index, c.end_index) for c in chunker.chunk(t)] for t in texts]


def vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def pick_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    # On a CPU without AMX, bf16 runs slower than fp32.
    return "bfloat16" if "amx_bf16" in flags else "float32"


def chonkie_embeddings():
    """MiniLM (metachunk's ``minilm`` preset, a local sentence-transformers folder) as chonkie's
    ``SentenceTransformerEmbeddings``, with an optional cache the size search turns on."""
    from chonkie.embeddings import SentenceTransformerEmbeddings
    from sentence_transformers import SentenceTransformer

    from metachunk.models import resolve

    class CachedEmbeddings(SentenceTransformerEmbeddings):
        cache: dict | None = None

        def embed_batch(self, texts):
            if self.cache is None:
                return super().embed_batch(texts)
            missing = [t for t in dict.fromkeys(texts) if t not in self.cache]
            if missing:
                self.cache.update(zip(missing, super().embed_batch(missing)))
            return [self.cache[t] for t in texts]

    return CachedEmbeddings(SentenceTransformer(str(resolve("minilm")), device="cpu"))


def zh_rules(lang: str):
    from chonkie.types import RecursiveLevel, RecursiveRules

    if lang != "zh":
        return RecursiveRules()
    return RecursiveRules(levels=[
        RecursiveLevel(delimiters=["\n\n", "\r\n", "\n", "\r"]),
        RecursiveLevel(delimiters=["。", "！", "？"]),
        RecursiveLevel(delimiters=ZH_PAUSES),
        RecursiveLevel(),
    ])  # fmt: skip


def run_chonkie(name: str, corpus: dict, texts: list[str], goal: float, tol: float, args) -> dict:
    """Load, search the size, then one timed run at it; returns the result with ``outputs``."""
    import chonkie

    lang = corpus["lang"]
    res: dict = {"params": {}}
    sentence_delims = {"delim": ZH_SENTENCE_DELIMS} if lang == "zh" else {}
    extra: dict = {}

    if name in ("chonkie-neural", "chonkie-teraflopai"):
        t = time.perf_counter()
        try:
            chunker = chonkie.NeuralChunker() if name == "chonkie-neural" else chonkie.TeraflopAIChunker()
        except Exception as e:  # recorded, not raised
            cause = e.__cause__ or e.__context__
            res.update(status="unavailable", error=f"{type(e).__name__}: {str(e)[:300]}",
                       cause=f"{type(cause).__name__}: {str(cause)[:300]}" if cause else None,
                       load_s=round(time.perf_counter() - t, 2))  # fmt: skip
            res["reason"] = (
                "NeuralChunker's models are token classifiers on the Hub (mirth/chonky_*, default "
                "mirth/chonky_distilbert_base_uncased_1): not cached here and the Hub is offline; no local "
                "model is trained for the task"
                if name == "chonkie-neural"
                else "TeraflopAIChunker calls the TeraflopAI API (package teraflopai, not installed, and a "
                "network service)"
            )
            return res
        raise SystemExit(f"{name}: loaded offline, which this bench does not expect: {chunker!r}")

    server = None
    t0 = time.perf_counter()
    if name == "chonkie-token":
        chunker = chonkie.TokenChunker(tokenizer="character", chunk_size=int(goal))
    elif name == "chonkie-sentence":
        chunker = chonkie.SentenceChunker(tokenizer="character", chunk_size=int(goal), **sentence_delims)
    elif name == "chonkie-recursive":
        chunker = chonkie.RecursiveChunker(tokenizer="character", chunk_size=int(goal), rules=zh_rules(lang))
    elif name in ("chonkie-semantic", "chonkie-late"):
        emb = chonkie_embeddings()
        if name == "chonkie-semantic":
            chunker = chonkie.SemanticChunker(embedding_model=emb, chunk_size=512, **sentence_delims)
        else:
            chunker = chonkie.LateChunker(embedding_model=emb, chunk_size=128, rules=zh_rules(lang))
    elif name == "chonkie-slumber":
        from chonkie.genie import OpenAIGenie

        from metachunk.local_teacher import LocalTeacher

        class LocalGenie(OpenAIGenie):
            """chonkie's OpenAI genie on the local llama.cpp server, greedy. ``generate_json`` asks for
            the schema as llama.cpp takes it (``json_object`` + ``schema``: decoded under a grammar);
            the stock one sends OpenAI's ``json_schema``, which llama-cpp-python's server refuses."""

            calls = 0

            def generate_json(self, prompt: str, schema) -> dict:
                LocalGenie.calls += 1
                r = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.slumber_max_tokens, temperature=0.0,
                    response_format={"type": "json_object", "schema": schema.model_json_schema()},
                )  # fmt: skip
                return json.loads(r.choices[0].message.content or "")

        t0 = time.perf_counter()
        server = LocalTeacher(corpus["model"], threads=os.cpu_count(), backend="llama.cpp").start()
        genie = LocalGenie(model=server.model, base_url=server.base_url, api_key="local")
        # candidate_size: chonkie's default of 128 tokens, in characters (~4 per token in English, ~1 in Chinese)
        candidate = 512 if lang == "en" else 128
        chunker = chonkie.SlumberChunker(genie=genie, tokenizer="character", chunk_size=int(goal * 2),
                                         candidate_size=candidate, rules=zh_rules(lang), extract_mode="json",
                                         verbose=False)  # fmt: skip
        extra["llm"] = (
            f"{corpus['model']} ({server.describe()}), greedy, JSON under a grammar, "
            f"max_tokens {args.slumber_max_tokens}, candidate_size {candidate} chars"
        )
    else:
        raise SystemExit(f"unknown chunker {name}")
    load_s = time.perf_counter() - t0

    # ---- the size search
    t = time.perf_counter()
    timed_run = None
    if name in ("chonkie-token", "chonkie-sentence", "chonkie-recursive"):

        def mean_of(p):
            chunker.chunk_size = p
            return mean_len(chonkie_outputs(chunker, texts))

        best, history = search_int(mean_of, goal, tol, int(goal))
        chunker.chunk_size = best
        res["params"] = {"chunk_size": best, "tokenizer": "character"}
    elif name == "chonkie-late":

        def mean_of(p):  # the boundaries alone: LateChunker's recursive split, with the embedder's tokenizer
            split = chonkie.RecursiveChunker(tokenizer=chunker.tokenizer, chunk_size=p, rules=chunker.rules,
                                             min_characters_per_chunk=chunker.min_characters_per_chunk)  # fmt: skip
            return mean_len([[(c.text, c.start_index, c.end_index) for c in split.chunk(x)] for x in texts])

        best, history = search_int(mean_of, goal, tol, int(goal / 4))
        chunker.chunk_size = best
        res["params"] = {"chunk_size": best, "tokenizer": "MiniLM (tokens)"}
    elif name == "chonkie-semantic":
        emb.cache = {}
        n_tok = sum(emb.count_tokens_batch(texts)) or 1
        chars_per_token = sum(map(len, texts)) / n_tok
        cap = max(8, int(3 * goal / chars_per_token))  # loose: segments are cut by threshold, not by size

        def by_threshold(x):
            chunker.threshold, chunker.chunk_size = x, cap
            return mean_len(chonkie_outputs(chunker, texts))

        threshold, history = search_float_decreasing(by_threshold, goal, tol, 0.05, 0.95, args.semantic_tries)
        history = [["threshold", k, v] for k, v in history]
        chunker.threshold = threshold
        fit = dict((k, v) for _, k, v in history)[threshold]
        if abs(fit - goal) > tol * goal:  # then the cap: chunk_size

            def by_size(p):
                chunker.chunk_size = p
                return mean_len(chonkie_outputs(chunker, texts))

            size, more = search_int(by_size, goal, tol, int(goal / chars_per_token))
            history += [["chunk_size", k, v] for k, v in more]
            chunker.chunk_size = size
        emb.cache = None
        res["params"] = {"threshold": chunker.threshold, "chunk_size": chunker.chunk_size,
                         "tokenizer": "MiniLM (tokens)", "chars_per_token": round(chars_per_token, 2)}  # fmt: skip
    elif name == "chonkie-slumber":  # each try a full run (the LLM's answers): a few, by proportion
        history, size, best = [], int(goal * 2), None
        for _ in range(args.slumber_tries):
            chunker.chunk_size = size
            calls0, ts = LocalGenie.calls, time.perf_counter()
            outs = chonkie_outputs(chunker, texts)
            seconds, m = time.perf_counter() - ts, mean_len(outs)
            history.append([size, round(m, 1)])
            if best is None or abs(m - goal) < abs(best[1] - goal):
                best = (size, m, outs, seconds, LocalGenie.calls - calls0)
            if abs(m - goal) <= tol * goal or m <= 0:
                break
            size = max(2, round(size * goal / m))
            if any(size == h[0] for h in history):
                break
        chunker.chunk_size = best[0]
        timed_run = (best[2], best[3])  # the chosen try's own full run is the timed one
        res["params"] = {"chunk_size": best[0], "tokenizer": "character", "llm_calls": best[4]}
    search_s = time.perf_counter() - t

    # ---- the timed run at the chosen size
    runs = 1
    if timed_run is None:
        outputs, chunk_s, runs = timed(lambda: chonkie_outputs(chunker, texts))
    else:
        outputs, chunk_s = timed_run
    if server is not None:
        extra["server_peak_rss_mib"] = vm_hwm_mib(server.process.pid)
        server.stop()
    # chonkie's defaults, as a user would first try them (after the timings: their imports are not charged)
    if name in ("chonkie-semantic", "chonkie-late"):
        try:
            (chonkie.SemanticChunker if name == "chonkie-semantic" else chonkie.LateChunker)()
            extra["default_model"] = "loaded"
        except Exception as e:  # recorded, not raised
            extra["default_model"] = f"cannot load offline: {type(e).__name__}: {str(e)[:200]}"
    if name == "chonkie-slumber":
        try:
            chonkie.SlumberChunker()
            extra["default_genie"] = "loaded"
        except Exception as e:  # recorded, not raised
            extra["default_genie"] = f"cannot run offline: {type(e).__name__}: {str(e)[:200]}"
    res.update(status="ok", load_s=round(load_s, 2), search_s=round(search_s - (chunk_s if timed_run else 0), 2),
               chunk_s=chunk_s, timed_runs=runs, search_history=history, outputs=outputs, **extra)  # fmt: skip
    return res


def run_metachunk(
    name: str, corpus: dict, ids: list[str], texts: list[str], goal: float, tol: float, args
) -> dict:
    from metachunk.chunking.pipeline import ChunkConfig, Chunker, fit_target_len

    # The pipeline the public chunkers wrap (metachunk.PPLChunker etc. build the same ChunkConfig), used
    # directly for its two halves: segment (costly, once) and assemble (cheap, once per size tried).
    lang, model, dtype = corpus["lang"], corpus["model"], pick_dtype(args.dtype)
    t0 = time.perf_counter()
    if name == "metachunk-fixed":
        method, params = "fixed", {}
    elif name == "metachunk-sentence":
        method, params = "sentence", {}
    elif name == "metachunk-semantic":
        method, params = "semantic", {"embedder": "minilm", "threshold": 50}
    elif name == "metachunk-ppl":
        method, params = "ppl", {"model": model, "dtype": dtype}
        if lang == "en":  # recipes/experiments/emma.yaml's settings
            params.update(max_context=1024, long_context="kv-trim")
    elif name == "metachunk-msp":
        method, params = (
            "msp",
            {"model": model, "dtype": dtype, "msp_mode": "pair", "dynamic_threshold": True},
        )
    else:
        raise SystemExit(f"unknown chunker {name}")
    config = ChunkConfig(method=method, target_len=int(goal), len_unit="char", lang=lang, **params)
    inner = Chunker(config, progress=False)
    load_s = time.perf_counter() - t0
    group = config.documents_per_call()  # as TextChunker.chunk_batch groups them

    def segment():
        segmented = []
        for k in range(0, len(texts), group):
            segmented += inner.segment(ids[k : k + group], texts[k : k + group])
        return segmented

    t = time.perf_counter()
    segmented = segment()  # the costly part, once: the size search reuses it
    segment_s = time.perf_counter() - t
    t = time.perf_counter()
    fit = fit_target_len(inner, segmented, goal, tol)
    search_s = time.perf_counter() - t
    target = fit["target_len"]

    def assemble(docs):
        return [[(c.text, c.start, c.end) for c in inner.assemble(d, target)] for d in docs]

    t = time.perf_counter()
    outputs = assemble(segmented)
    chunk_s, runs = segment_s + time.perf_counter() - t, 1
    if chunk_s < 0.5:  # cheap (fixed, sentence): the whole chunking again, repeated, for a steady time
        outputs, chunk_s, runs = timed(lambda: assemble(segment()))
    params["target_len"] = target
    inner.close()
    return {"status": "ok", "params": params, "load_s": round(load_s, 2), "search_s": round(search_s, 3),
            "chunk_s": chunk_s, "segment_s": round(segment_s, 3), "timed_runs": runs,
            "search_history": {"tries": fit["tries"]}, "outputs": outputs}  # fmt: skip


def child(args) -> None:
    import resource

    t = time.perf_counter()
    corpus = CORPORA[args.corpus]
    goal = args.goal or corpus["goal"]
    ids, texts = read_docs(args.docs)
    if args.one.startswith("chonkie-"):
        import chonkie  # noqa: F401  (timed apart: its import)

        import_s = time.perf_counter() - t
        res = run_chonkie(args.one, corpus, texts, goal, args.tolerance, args)
    else:
        import metachunk  # noqa: F401  (timed apart)

        import_s = time.perf_counter() - t
        res = run_metachunk(args.one, corpus, ids, texts, goal, args.tolerance, args)
    res.update(name=args.one, corpus=args.corpus, goal=goal, tolerance=args.tolerance, import_s=round(import_s, 2),
               docs=len(texts), chars=sum(map(len, texts)))  # fmt: skip
    outputs = res.pop("outputs", None)
    if outputs is not None:
        n = sum(map(len, outputs))
        mean = mean_len(outputs)
        res.update(n_chunks=n, mean_chunk_chars=round(mean, 1), within_tolerance=abs(mean - goal) <= args.tolerance * goal,
                   docs_per_s=round(len(texts) / res["chunk_s"], 3) if res["chunk_s"] else None,
                   kchars_per_s=round(res["chars"] / 1000 / res["chunk_s"], 1) if res["chunk_s"] else None,
                   **lossless(texts, outputs))  # fmt: skip
        write_chunks(Path(args.chunks_out), args.one, ids, outputs, res)
    res["self_peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write_chunks(path: Path, method: str, ids: list[str], outputs, res: dict) -> None:
    """``metachunk chunk``'s output: one ``{schema_version, id, method, chunks}`` line per document,
    ``FILE.meta.json`` with ``summary.mean_chunk_chars``, and the seconds in ``FILE.runs.jsonl``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc_id, chunks in zip(ids, outputs):
            row = {"schema_version": 1, "id": doc_id, "method": method,
                   "chunks": [{"text": x, "start": s, "end": e} for x, s, e in chunks]}  # fmt: skip
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    meta = {"schema_version": 1, "command": "bench/chonkie_compare.py", "method": method, "params": res["params"],
            "summary": {"documents": len(ids), "chunks": res["n_chunks"], "mean_chunk_chars": res["mean_chunk_chars"]}}  # fmt: skip
    path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    append_run_log(path, {"seconds": res["chunk_s"], "model_load_seconds": res["load_s"]})


# ---- the parent: inputs, one child per chunker, eval, the table ----------------------------------


def cli(*words: str) -> None:
    cmd = [sys.executable, "-m", "metachunk.cli", *map(str, words)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        sys.exit(f"chonkie_compare: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def child_env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def make_inputs(args, out: Path) -> dict[str, Path]:
    docs: dict[str, Path] = {}
    inputs = out / "inputs"
    if "emma" in args.corpora:  # the demo's emma_eval stage, with --emma-chapters chapters
        docs["emma"] = inputs / "emma.jsonl"
        cli("data", "passages", "--input", "data:gutenqa-emma/paragraphs.jsonl", "--out", docs["emma"],
            "--group-field", "chapter", "--groups", f"0:{args.emma_chapters}")  # fmt: skip
    if "crud" in args.corpora:  # the QA-matched test articles (recipes/experiments/crud.yaml), the first N
        crud_data = out / "crud_data"
        if not (crud_data / "qa_matches.jsonl").is_file():
            cli("data", "prepare-crud", "--news", "data:crud-news/news.jsonl",
                "--qa", "data:crud-news/questanswer_1doc.json", "--out", crud_data)  # fmt: skip
        docs["crud"] = inputs / "crud.jsonl"
        lines = (
            (crud_data / "test_documents.jsonl").read_text(encoding="utf-8").splitlines()[: args.crud_docs]
        )
        docs["crud"].parent.mkdir(parents=True, exist_ok=True)
        docs["crud"].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return docs


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit_s: float) -> float:
    """Before a child starts: wait (up to ``limit_s``) until the rest of the machine uses under a
    third of a core, so that no other heavy job shares the timing. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        b0 = busy_cpu_s()
        time.sleep(2.0)
        if (busy_cpu_s() - b0) / 2.0 < 0.33:
            break
        print("chonkie_compare: another job is using the CPU; waiting", file=sys.stderr, flush=True)
        time.sleep(10.0)
    return round(time.monotonic() - started, 1)


def run_child(args, name: str, corpus: str, docs: Path, out: Path) -> dict:
    """One chunker in its own process. Its timing is kept only when the rest of the machine stayed
    (nearly) idle meanwhile: CPU time used outside the child over 10% of the machine's reruns it,
    up to ``--contention-retries`` times (the last try is kept and flagged)."""
    for attempt in range(args.contention_retries + 1):
        waited = wait_for_quiet(args.quiet_wait)
        res = run_child_once(args, name, corpus, docs, out)
        res["waited_for_quiet_s"] = waited
        share = res.get("foreign_cpu_share", 0.0)
        if res.get("status") != "ok" or share <= 0.10 or res.get("chunk_s", 0) < 1.0:
            break  # (a run of under a second is not worth repeating: its time is a median of repeats)
        print(f"chonkie_compare: {name}: {share:.0%} of the machine went to other processes; "
              f"{'running it again' if attempt < args.contention_retries else 'kept, flagged'}",
              file=sys.stderr, flush=True)  # fmt: skip
    res["attempts"] = attempt + 1
    res["contended"] = res.get("foreign_cpu_share", 0.0) > 0.10
    return res


def run_child_once(args, name: str, corpus: str, docs: Path, out: Path) -> dict:
    result = out / "results" / corpus / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--corpus", corpus, "--docs", str(docs),
           "--tolerance", str(args.tolerance), "--dtype", args.dtype,
           "--slumber-tries", str(args.slumber_tries), "--slumber-max-tokens", str(args.slumber_max_tokens),
           "--semantic-tries", str(args.semantic_tries),
           "--chunks-out", str(out / "chunks" / corpus / f"{name}.jsonl"), "--result", str(result)]  # fmt: skip
    goal = getattr(args, f"{corpus}_chars")
    cmd += ["--goal", str(goal)]
    log = out / "logs" / corpus / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started, busy0 = time.perf_counter(), busy_cpu_s()
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True
        )
        try:
            _, status, usage = wait4_timeout(proc, args.child_timeout)
        except TimeoutError:
            os.killpg(proc.pid, 9)
            proc.wait()
            return {"name": name, "corpus": corpus, "status": "error",
                    "error": f"timed out after {args.child_timeout}s"}  # fmt: skip
    wall = time.perf_counter() - started
    # CPU the machine spent outside this child (and what it reaped) while it ran
    foreign = max(0.0, busy_cpu_s() - busy0 - usage.ru_utime - usage.ru_stime)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not result.is_file():
        tail = log.read_text(errors="replace")[-1500:]
        return {
            "name": name,
            "corpus": corpus,
            "status": "error",
            "error": f"exit {code}: {tail}",
            "wall_s": wall,
        }
    res = json.loads(result.read_text(encoding="utf-8"))
    res["wall_s"] = round(wall, 2)
    res["child_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
    res["foreign_cpu_s"] = round(foreign, 1)
    res["foreign_cpu_share"] = round(foreign / (wall * (os.cpu_count() or 1)), 3)
    res["peak_rss_mib"] = round(usage.ru_maxrss / 1024, 1)  # KiB on Linux; the child and what it reaped
    return res


def wait4_timeout(proc, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.2)


def run_eval(args, corpus: str, results: list[dict], out: Path) -> dict:
    """``eval qa`` per chunker (within the length tolerance), then ``eval compare`` over them."""
    runs, labels, skipped, seconds = [], [], {}, {}
    for r in results:
        if r.get("status") != "ok":
            continue
        if not r["within_tolerance"]:
            skipped[r["name"]] = (
                f"mean {r['mean_chunk_chars']} chars, not within {args.tolerance:.0%} of {r['goal']}"
            )
            continue
        run_dir = (
            out
            / "eval"
            / corpus
            / r["name"]
            / ("qa" if args.retriever == "dense" else f"qa_{args.retriever}")
        )
        chunks = out / "chunks" / corpus / f"{r['name']}.jsonl"
        if corpus == "emma":  # as the demo's qa stages
            qa = ["--qa", "data:gutenqa-emma/questions.jsonl", "--qa-format", "gutenqa", "--lang", "en"]
        else:  # as recipes/experiments/crud.yaml's
            qa = ["--qa", out / "crud_data" / "qa_matches.jsonl", "--qa-format", "crud", "--lang", "zh",
                  "--crud-status", "matched+ambiguous"]  # fmt: skip
        t = time.perf_counter()
        cli("eval", "qa", "--chunks", chunks, *qa, "--top-k", "8", "--questions", "answerable",
            "--cutoffs", *QA_CUTOFFS, "--retriever", args.retriever, "--out", run_dir, "--no-progress")  # fmt: skip
        seconds[r["name"]] = round(time.perf_counter() - t, 1)
        runs.append(run_dir)
        labels.append(r["name"])
    if not runs:
        return {"skipped": skipped}
    suffix = "" if args.retriever == "dense" else f"_{args.retriever}"
    report = out / "eval" / f"compare_{corpus}{suffix}.md"
    baseline = args.baseline if args.baseline in labels else labels[0]
    t = time.perf_counter()
    cli("eval", "compare", *runs, "--labels", *labels, "--metrics", *METRICS, "--baseline", baseline,
        "--out", report)  # fmt: skip
    seconds["compare"] = round(time.perf_counter() - t, 1)
    pairs = {}  # each chonkie chunker against metachunk's of the same kind, item by item
    for a, b in PAIRS:
        if a in labels and b in labels:
            pair_report = out / "eval" / f"compare_{corpus}{suffix}_{a}_vs_{b}.md"
            cli("eval", "compare", runs[labels.index(a)], runs[labels.index(b)], "--labels", a, b,
                "--metrics", *METRICS, "--baseline", a, "--no-plots", "--out", pair_report)  # fmt: skip
            diffs = json.loads(pair_report.with_suffix(".json").read_text())["statistics"]["differences"]
            pairs[f"{b} vs {a}"] = {m: diffs[m][b] for m in PAIR_METRICS if m in diffs}
    return {"report": str(report), "compare": json.loads(report.with_suffix(".json").read_text()),
            "baseline": baseline, "pairs": pairs, "skipped": skipped, "seconds": seconds}  # fmt: skip


def pairs_table(pairs: dict) -> str:
    """``pairs``: ``{"METACHUNK vs CHONKIE": {metric: eval compare's difference of METACHUNK from
    the CHONKIE baseline}}``, one row each: metachunk's chunker minus chonkie's."""
    lines = ["| difference (metachunk minus chonkie) | " + " | ".join(PAIR_METRICS) + " |",
             "|---|" + "---|" * len(PAIR_METRICS)]  # fmt: skip
    for name, diffs in pairs.items():
        ours, theirs = name.split(" vs ")
        cells = []
        for m in PAIR_METRICS:
            d = diffs.get(m)
            if not d or d.get("interval") is None:
                cells.append("–")
                continue
            lo, hi = d["interval"]
            cells.append(
                f"{d['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" **resolved**" if d["resolved"] else "")
            )
        lines.append(f"| {ours} − {theirs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt(x, nd=1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)


def table(results: list[dict]) -> str:
    head = ("| chunker | size parameter | mean chars | chunks | import s | load s | chunk s | docs/s | kchars/s | "
            "peak RSS MiB | lossless |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in results:
        if r.get("status") != "ok":
            why = r.get("reason") or r.get("error", "")
            why = " ".join(why.split()) if r.get("reason") else (why.strip().splitlines() or [""])[-1]
            lines.append(f"| {r['name']} | {r.get('status')}: {why[:160]} |" + "  |" * 9)
            continue
        params = ", ".join(
            f"{k} {v}" for k, v in r["params"].items() if k in ("chunk_size", "threshold", "target_len")
        )
        mean = f"{r['mean_chunk_chars']:.1f}" + ("" if r["within_tolerance"] else " (off)")
        busy = " (contended)" if r.get("contended") else ""
        rss = fmt(r.get("peak_rss_mib"))
        if r.get("server_peak_rss_mib"):
            rss += f" + server {fmt(r['server_peak_rss_mib'])}"
        ll = "yes" if r["lossless"] else (
            f"no ({r['docs_not_tiled']} docs: {r['chunks_not_slices']} non-slices, {r['gaps']} gaps, "
            f"{r['overlaps']} overlaps)")  # fmt: skip
        lines.append(f"| {r['name']} | {params} | {mean} | {r['n_chunks']} | {fmt(r['import_s'], 2)} | {fmt(r['load_s'], 2)} | "
                     f"{fmt(r['chunk_s'], 3)}{busy} | {fmt(r['docs_per_s'], 2)} | {fmt(r['kchars_per_s'])} | {rss} | {ll} |")  # fmt: skip
    return "\n".join(lines)


def machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), ""
        )
    except OSError:
        pass
    import chonkie

    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "chonkie": chonkie.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def parent(args) -> None:
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.eval_only:  # the chunks of an earlier run, evaluated again
        report = json.loads((out / "chonkie_compare.json").read_text(encoding="utf-8"))
        report["eval_command"] = " ".join(["python", "bench/chonkie_compare.py", *sys.argv[1:]])
        for corpus, entry in report["corpora"].items():
            if corpus in args.eval_corpora:  # each retriever's evaluation kept beside the others
                entry["eval" if args.retriever == "dense" else f"eval_{args.retriever}"] = run_eval(
                    args, corpus, entry["results"], out
                )
        write_report(report, out, report["wall_s"])
        return
    chunkers = args.chunkers.split(",") if args.chunkers else DEFAULT_CHUNKERS
    t = time.perf_counter()
    docs = make_inputs(args, out)
    report = {"machine": machine(), "command": " ".join(["python", "bench/chonkie_compare.py", *sys.argv[1:]]),
              "dtype": pick_dtype(args.dtype), "inputs_s": round(time.perf_counter() - t, 1),
              "not_run": {c: OPT_IN.get(c, "not in --chunkers") for c in CHUNKERS if c not in chunkers},
              "corpora": {}}  # fmt: skip
    for corpus, path in docs.items():
        results = []
        for name in chunkers:
            r = run_child(args, name, corpus, path, out)
            results.append(r)
            brief = (f"{r.get('mean_chunk_chars')} chars, {r.get('n_chunks')} chunks, {r.get('chunk_s')} s, "
                     f"{r.get('peak_rss_mib')} MiB, lossless {r.get('lossless')}") if r.get("status") == "ok" else (
                     r.get("reason") or r.get("error", ""))[:300]  # fmt: skip
            print(f"[{corpus}] {name}: {r.get('status')}: {brief}", file=sys.stderr, flush=True)
        entry = {
            "goal": getattr(args, f"{corpus}_chars"),
            "documents": sum(1 for _ in open(path)),
            "results": results,
        }
        if not args.no_eval and corpus in args.eval_corpora:
            entry["eval" if args.retriever == "dense" else f"eval_{args.retriever}"] = run_eval(
                args, corpus, results, out
            )
        report["corpora"][corpus] = entry
    write_report(report, out, round(time.perf_counter() - started, 1))


def write_report(report: dict, out: Path, wall_s: float) -> None:
    """``chonkie_compare.json`` and ``chonkie_compare.md`` (printed too)."""
    report["wall_s"] = wall_s
    m = report["machine"]
    md = [f"# metachunk beside chonkie ({m['date']}, {m['cpu']}, {m['cores']} cores)", ""]
    for corpus, entry in report["corpora"].items():
        md += [f"## {corpus}: goal {entry['goal']} chars, {entry['documents']} documents", "",
               table(entry["results"]), ""]  # fmt: skip
        for key in [k for k in entry if k.startswith("eval")]:  # eval (dense), eval_bm25, eval_hybrid
            ev = entry[key]
            md += [f"### Retriever: {key.removeprefix('eval_') if key != 'eval' else 'dense (MiniLM)'}", ""]
            if ev.get("report"):
                md += [Path(ev["report"]).read_text(encoding="utf-8"), ""]
            if ev.get("pairs"):
                md += ["**chonkie against metachunk, kind for kind** (paired bootstrap over the same questions):",
                       "", pairs_table(ev["pairs"]), ""]  # fmt: skip
            for name, why in ev.get("skipped", {}).items():
                md.append(f"- not evaluated: {name}: {why}")
    for name, why in report["not_run"].items():
        md.append(f"- not run: {name}: {why}")
    write_json(out / "chonkie_compare.json", report)
    md.append(f"\nWall time: {wall_s} s. Command: `{report['command']}`")
    write_bytes(out / "chonkie_compare.md", ("\n".join(md) + "\n").encode("utf-8"))
    print("\n".join(md))
    print(f"\n{out / 'chonkie_compare.json'}, {out / 'chonkie_compare.md'}: {wall_s} s", file=sys.stderr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--emma-chapters", type=int, default=6, help="Emma's first N chapters, one document each (demo: 6)"
    )
    p.add_argument("--crud-docs", type=int, default=30, help="the first N QA-matched CRUD test articles")
    p.add_argument("--corpora", default="emma,crud", help="emma, crud or both")
    p.add_argument(
        "--chunkers",
        default=None,
        help=f"comma-separated from {','.join(CHUNKERS)}; default all but {','.join(OPT_IN)}",
    )
    p.add_argument("--emma-chars", type=float, default=600.0, help="the mean chunk length for Emma")
    p.add_argument(
        "--crud-chars", type=float, default=178.0, help="the mean chunk length for CRUD (the papers')"
    )
    p.add_argument(
        "--tolerance", type=float, default=0.05, help="relative tolerance of the mean chunk length"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="metachunk's LM dtype: auto (bfloat16 on a GPU or a CPU with native bf16, AMX or AVX-512 BF16; else float32)",
    )
    p.add_argument(
        "--slumber-tries", type=int, default=2, help="SlumberChunker: full runs to search chunk_size"
    )
    p.add_argument("--slumber-max-tokens", type=int, default=16, help="SlumberChunker: answer tokens")
    p.add_argument("--semantic-tries", type=int, default=12, help="chonkie SemanticChunker: threshold tries")
    p.add_argument("--no-eval", action="store_true", help="chunk only: no eval qa / compare")
    p.add_argument("--eval-only", action="store_true", help="evaluate the chunks of the run in --out again")
    p.add_argument("--eval-corpora", default="emma,crud", help="the corpora to run eval qa on")
    p.add_argument("--baseline", default="chonkie-token", help="eval compare's paired baseline")
    p.add_argument("--retriever", default="dense", choices=["dense", "bm25", "hybrid"],
                   help="eval qa's retriever (with --eval-only: the same chunks under BM25 or hybrid)")  # fmt: skip
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per chunker")
    p.add_argument(
        "--quiet-wait", type=float, default=900, help="seconds to wait for other jobs before a chunker"
    )
    p.add_argument(
        "--contention-retries",
        type=int,
        default=2,
        help="reruns of a chunker timed while other jobs used the CPU",
    )
    p.add_argument("--out", default=str(OUT), help="output folder")
    # the child's own flags
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--docs", help=argparse.SUPPRESS)
    p.add_argument("--goal", type=float, help=argparse.SUPPRESS)
    p.add_argument("--chunks-out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [c for c in (args.chunkers or "").split(",") if c and c not in CHUNKERS]
    if unknown:
        p.error(f"unknown chunkers {unknown}; known: {', '.join(CHUNKERS)}")  # exit status 2
    args.corpora = [c for c in args.corpora.split(",") if c]
    args.eval_corpora = [c for c in args.eval_corpora.split(",") if c]
    if args.one:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
