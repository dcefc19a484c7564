"""One entry point for every chunking method: config in, chunked documents out.

``metachunk chunk`` and every later stage that chunks (dataset sampling; evaluation reads the chunk
command's output) go through [`Chunker`][metachunk.chunking.pipeline.Chunker], so each method is configured, loaded and run the same way everywhere:
ppl, msp, fixed, sentence, semantic, moc (`metachunk.chunking.moc`) and lumber (`metachunk.chunking.lumber`,
which asks a teacher through `metachunk.teacher`).

[`ChunkConfig`][metachunk.chunking.pipeline.ChunkConfig] holds the settings every method shares, plus one block per concern that
needs more: ``students:`` (--rewrite/--summarize), ``moc:`` and ``lumber:``. A block's fields also
work flat, as the recipe keys and flags they always had (``--router``, ``--moc-window-chars``,
``lumber_tokens:``; [`metachunk.config.block`][metachunk.config.block]), and a run's manifest records them flat.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from metachunk.chunking.baselines import fixed_chunks, minilm_embedder, semantic_chunks, sentence_chunks
from metachunk.chunking.lumber import LumberChunker, LumberOptions
from metachunk.chunking.merge import add_sentence_overlap, merge_chunks
from metachunk.chunking.moc import MocChunker, MocOptions
from metachunk.chunking.msp import PROMPT_VARIANTS, MarginScorer, load_msp_prompt, msp_decisions
from metachunk.chunking.ppl import CPU_ROWS, ppl_boundaries, score_tokenized, tokenize_documents
from metachunk.chunking.sentences import detect_lang, split_sentences
from metachunk.chunking.types import Chunk, Sentence, chunks_from_boundaries

from metachunk.config import block, check_choices, check_types, option
from metachunk.sources import FORMATS as INPUT_FORMATS
from metachunk.sources import BadRows

METHODS = ("ppl", "msp", "fixed", "sentence", "semantic", "moc", "lumber")
LM_METHODS = ("ppl", "msp")


@dataclass
class StudentOptions:
    """``students:`` (flat: ``--rewrite``, ``--summarize``, ``--student-*``): trained students that
    add fields to every chunk (`metachunk.chunking.students`)."""

    rewrite: str | None = option(
        None,
        "rewriter (local HF dir, e.g. from `metachunk export`, a Hub id ORG/NAME[@REV], or a preset): add "
        "'rewritten', the chunk "
        "rewritten to stand on its own, to every chunk",
        flat="rewrite",
    )
    summarize: str | None = option(
        None,
        "summarizer (local HF dir, a Hub id ORG/NAME[@REV], or a preset): add 'summary', one sentence on the "
        "chunk from the "
        "document's perspective, to every chunk",
        flat="summarize",
    )
    context: str = option(
        "document",
        "--rewrite/--summarize: context given with each chunk, as in the distill run the students "
        "learnt from: the document around the chunk, or its --student-top-k most similar chunks (--embedder)",
        choices=["document", "related"],
    )
    context_chars: int = option(
        8000, "--rewrite/--summarize: longest context in characters (distill's max_context_chars)"
    )
    top_k: int = option(
        4, "--student-context related: how many of the document's other chunks (distill's context_top_k)"
    )
    rewrite_max_new_tokens: int | None = option(
        None,
        "--rewrite: most new tokens per chunk; default 1.5 x the chunk's tokens + 32, at most 1024",
        flat="rewrite_max_new_tokens",
    )
    summary_max_new_tokens: int = option(
        256, "--summarize: most new tokens per chunk", flat="summary_max_new_tokens"
    )
    sample: bool = option(
        False,
        "--rewrite/--summarize: decode with the models' own generation_config (sampling if it says so) "
        "instead of greedy",
    )


# Documents per Chunker call on a GPU (ChunkConfig.documents_per_call): their text stays in memory.
GPU_DOCUMENTS_PER_CALL = 1024
# Groups read ahead of a GPU and written behind it (ChunkConfig.prefetch_depth): one in the queue
# while the next is prepared hides the CPU's work, and a second absorbs one slow group.
GPU_PREFETCH = 2


MAX_SHARDS = 99_999


@dataclass
class ChunkConfig:
    """The settings every chunker takes: the options of ``metachunk chunk``, one field per flag
    (``--target-len`` is ``target_len``) and per recipe key, checked when the config is made. The
    ``settings`` of [`TextChunker`][metachunk.chunking.api.TextChunker] are its fields; ``students``, ``moc`` and
    ``lumber`` are the blocks [`StudentOptions`][metachunk.chunking.pipeline.StudentOptions],
    [`MocOptions`][metachunk.chunking.moc.MocOptions] and
    [`LumberOptions`][metachunk.chunking.lumber.LumberOptions]. The fields about files, shards and
    workers (``input``, ``output``, ``shards``, ``engine``, ...) matter to a corpus run of the CLI
    only."""

    input: Path = option(
        None,
        "the corpus: .jsonl (lines with 'text' and optional 'id'), .jsonl.gz, .parquet, a .txt file (one "
        "document), a folder of such shards, or a folder written by datasets' save_to_disk",
        positional=True,
    )
    output: Path = option(
        None,
        "FILE.jsonl: one line per document, written at the end; DIR (DIR/, an existing folder, or a name "
        "without a suffix; other suffixes are refused as ambiguous): a dataset folder of shards (train-00000-of-000NN.jsonl) and manifest.json, written shard by shard and resumed on rerun",
        short="-o",
    )
    input_format: str = option(
        "auto",
        "how to read the input: by file suffix (auto), or 'lines': one document per line of plain text, "
        "id FILE:LINE (how the raw CRUD corpus ships)",
        choices=list(INPUT_FORMATS),
    )
    text_field: str = option("text", "the input's field (column) holding the document text")
    id_field: str = option("id", "the input's field holding the document id; without one, the line number")
    bad_rows: BadRows = block(BadRows, "what a bad input row does", prefix="")
    output_format: str = option(
        "jsonl",
        "-o DIR: shard format; both load with datasets.load_dataset(FORMAT, data_dir=DIR)",
        choices=["jsonl", "parquet"],
    )
    shards: int | None = option(
        None,
        "-o DIR: number of shards, fixed up front; shard i holds a contiguous range of input positions, "
        "whatever the workers; default one per 256 documents",
    )
    workers: int | None = option(
        None,
        "-o DIR: worker processes, each with its own model; default one per visible GPU on GPU, 1 on CPU",
        runtime=True,
    )
    threads_per_worker: int | None = option(
        None,
        "-o DIR: torch threads per worker (and the CPUs a Ray actor asks for); default torch's",
        runtime=True,
    )
    engine: str = option(
        "local",
        "-o DIR: local (worker processes on this machine; under torchrun each rank takes shards i with "
        "i %% world_size == rank) or ray (a Ray Data map_batches stage over an actor pool; pip install "
        "'metachunk[ray]')",
        choices=["local", "ray"],
        runtime=True,
    )
    ray_address: str | None = option(
        None, "--engine ray: the cluster to join (ray.init(address=...)); default a local Ray", runtime=True
    )
    overwrite: bool = option(
        False,
        "-o DIR: start again when DIR holds another run's shards (changed config, model or input); a complete"
        " DIR is kept until the new run is complete",
        runtime=True,
    )
    method: str = option("ppl", "chunking method", choices=METHODS)
    model: str = option(
        "smollm2",
        "model preset (see `metachunk models list`), a local HF model dir or a Hub id, for ppl/msp and token lengths",
    )
    lang: str = option(
        "auto",
        "document language; auto detects it per document (and per paragraph when splitting)",
        choices=["zh", "en", "auto"],
    )
    threshold: float | None = option(
        None,
        "θ. ppl: minimum PPL drop (nats) at a boundary, default 0.5, or 0 with --target-len (the paper's "
        "'comb.' setting); msp: merge when margin > θ, default 0; semantic: breakpoint percentile, default 95",
    )
    dynamic_threshold: bool = option(False, "msp: θ starts at 0 and follows the running mean of past margins")
    threshold_window: int | None = option(
        None, "msp with --dynamic-threshold: average only the last k margins"
    )
    msp_mode: str = option(
        "pair",
        "msp: sentence1 is the previous sentence (pair, batched) or the chunk so far (accumulated)",
        choices=["pair", "accumulated"],
    )
    msp_prompt: str = option(
        "table6",
        "msp: prompt of the paper's Table 6, the finer-grained Table 7, or Table 6 as the authors' code "
        "sends it (released: the sentences written into the options)",
        choices=list(PROMPT_VARIANTS),
    )
    target_len: int | None = option(
        None, "L: merge meta-chunks up to this length (dynamic merging); required by fixed and sentence"
    )
    len_unit: str | None = option(
        None,
        "unit of L: char (default for zh), word (default for en) or token (model tokenizer)",
        choices=["char", "word", "token"],
    )
    overlap: bool = option(
        False, "ppl/msp: the boundary sentence also starts the next chunk (PPL overlap, Appendix D)"
    )
    max_context: int = option(
        4096, "ppl: tokens of context per window; older text is dropped, each token keeps >= half of it"
    )
    batch_size: int | None = option(
        None,
        "sequences per forward pass (default: 8 on CPU; ppl and msp on a GPU: what its free memory holds)",
    )
    streams: int | None = option(
        None,
        "ppl: forward batches run side by side, in threads that share the model and split the torch "
        "threads evenly; default on CPU the most streams, up to 8, that split the torch threads evenly "
        "(2 torch threads: 2 streams of 1 thread; 12: 6 streams of 2; faster than one batch on all threads), 1 on GPU. Which batch runs in which stream is fixed by the plan, so a rerun gives the same output",
        runtime=True,
    )
    attn_implementation: str = option(
        "auto",
        "ppl/msp: the model's attention (transformers' attn_implementation); auto: metachunk's on CPU, "
        "flash_attention_2 on a GPU where flash-attn is installed, else sdpa. With flash_attention_2 or "
        "flex_attention, ppl packs windows end to end without padding",
        runtime=True,
    )
    prefetch: int | None = option(
        None,
        "groups of documents read, split and tokenized ahead of the model in a thread, and merged and "
        "written behind it in another (chunking/overlap.py); 0 runs them in turn. Default 2 on a GPU, 0 on "
        "CPU, where the threads would take the model's cores. The output is the same bytes either way",
        runtime=True,
    )
    emit_sentences: bool = option(False, "also write per-sentence spans and the score used for the decision")
    plot: Path | None = option(
        None, "write one PNG per document (score profile with boundaries) into this dir"
    )
    max_sentence_chars: int = option(
        1500,
        "a sentence longer than this is split at whitespace (or, with none, between graphemes) so nothing is dropped",
    )
    embedder: str = option(
        "minilm",
        "sentence-transformers preset or local dir: semantic's sentence embeddings, and the students' "
        "--student-context related",
    )
    device: str | None = option(None, "torch device; default cuda when available, else cpu", runtime=True)
    dtype: str = option(
        "auto",
        "model weights dtype; auto = bfloat16 on a GPU and on a CPU that computes it natively (AMX or "
        "AVX-512 BF16 flags: faster where the matrix products dominate; docs/performance.md), "
        "float32 elsewhere; float32 is exact (equals the per-sentence reference within 1e-4); the run's "
        "line in its run log (OUTPUT.runs.jsonl, a folder's runs.jsonl) records what was picked and why",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    long_context: str = option(
        "sliding-window",
        "ppl, documents over --max-context: sliding-window (recomputed windows, any model) or kv-trim "
        "(blocks against a KV cache trimmed to the recent half window + 4 attention-sink tokens; each "
        "token run once; plain-cache models only)",
        choices=["sliding-window", "kv-trim"],
    )
    head_dtype: str = option(
        "auto",
        "ppl: dtype of the LM-head matmul alone; bfloat16 is faster on CPUs with AMX (target logit stays "
        "exact fp32, only the normaliser is approximate), auto = the model's dtype",
        choices=["auto", "float32", "bfloat16"],
    )
    mean_chunk_chars: float | None = option(
        None,
        "equal-length runs (the papers compare chunkers at one average chunk length): search --target-len so "
        "that the run's mean chunk length lands within --mean-chunk-chars-tolerance of this many characters. "
        "The input is segmented once and held in memory (an evaluation set, not a corpus)",
    )
    mean_chunk_chars_of: Path | None = option(
        None,
        "--mean-chunk-chars from another chunk run: its OUTPUT.jsonl (the mean in OUTPUT.meta.json)",
    )
    mean_chunk_chars_tolerance: float = option(
        0.05,
        "relative tolerance of --mean-chunk-chars; a run that cannot reach it is still written, and its "
        ".meta.json says how far it landed",
    )
    students: StudentOptions = block(
        StudentOptions,
        "the trained students applied to every chunk (chunking/students.py)",
        prefix="student_",
    )
    moc: MocOptions = block(MocOptions, "--method moc: router and experts (chunking/moc.py)", prefix="moc_")
    lumber: LumberOptions = block(
        LumberOptions,
        "--method lumber: the teacher that finds the cuts (chunking/lumber.py)",
        prefix="lumber_",
    )

    def documents_per_call(self) -> int:
        """How many documents a corpus run hands the chunker at once (scored together): four
        batches' worth on CPU, at least 16; on a GPU ``GPU_DOCUMENTS_PER_CALL``, so that its
        memory-sized batches fill (a batch there holds ~100K tokens, a few hundred articles)."""
        from metachunk.models import default_device

        if str(self.device or default_device()).startswith("cuda"):
            return GPU_DOCUMENTS_PER_CALL
        return max((self.batch_size or CPU_ROWS) * 4, 16)

    def prefetch_depth(self) -> int:
        """``prefetch``, or its default for the device (2 on a GPU, 0 on CPU)."""
        from metachunk.models import default_device

        if self.prefetch is not None:
            return self.prefetch
        return GPU_PREFETCH if str(self.device or default_device()).startswith("cuda") else 0

    def __post_init__(self):
        check_types(self)
        check_choices(self)
        if self.prefetch is not None and self.prefetch < 0:
            raise ValueError(f"--prefetch must be >= 0, got {self.prefetch}")
        for name in ("shards", "workers", "threads_per_worker"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.shards is not None and self.shards > MAX_SHARDS:  # train-NNNNN-of-NNNNN
            raise ValueError(
                f"--shards must be at most {MAX_SHARDS:,} (shard names have five digits), got {self.shards}"
            )
        if self.method in ("fixed", "sentence") and self.target_len is None and not self.fits_length:
            raise ValueError(f"--method {self.method} needs --target-len (or --mean-chunk-chars)")
        if self.overlap and self.method not in LM_METHODS:
            raise ValueError(
                "--overlap is PPL overlap (the boundary sentence joins both chunks); use it with ppl or msp"
            )
        if self.method == "fixed" and self.len_unit == "token":
            raise ValueError("--method fixed counts characters or words, not tokens")
        st = self.students
        sizes = {
            name: getattr(self, name)
            for name in (
                "target_len",
                "max_context",
                "batch_size",
                "streams",
                "max_sentence_chars",
                "threshold_window",
            )
        }
        sizes.update(student_context_chars=st.context_chars, student_top_k=st.top_k,
                     rewrite_max_new_tokens=st.rewrite_max_new_tokens,
                     summary_max_new_tokens=st.summary_max_new_tokens)  # fmt: skip
        for name, value in sizes.items():
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_context < 16:
            raise ValueError(f"--max-context must be >= 16, got {self.max_context}")
        if self.threshold is not None and self.threshold != self.threshold:  # nan: no boundary ever compares
            raise ValueError("--threshold must be a number, got nan")
        if self.method == "semantic" and self.threshold is not None and not 0 <= self.threshold <= 100:
            raise ValueError(
                f"--threshold is a percentile for --method semantic: 0 to 100, got {self.threshold}"
            )
        if self.mean_chunk_chars is not None or self.mean_chunk_chars_of is not None:
            if self.mean_chunk_chars is not None and self.mean_chunk_chars_of is not None:
                raise ValueError("give --mean-chunk-chars or --mean-chunk-chars-of, not both")
            if self.mean_chunk_chars is not None and not 0 < self.mean_chunk_chars < math.inf:  # NaN too
                raise ValueError(
                    f"--mean-chunk-chars must be a finite number > 0, got {self.mean_chunk_chars}"
                )
            if not 0 < self.mean_chunk_chars_tolerance < 1:
                raise ValueError("--mean-chunk-chars-tolerance must be in (0, 1)")
        if self.method == "lumber":  # each method's options check themselves
            self.lumber.check()
        if self.method == "moc":
            self.moc.check()

    @property
    def fits_length(self) -> bool:
        """The run searches its own ``target_len`` (``--mean-chunk-chars``)."""
        return self.mean_chunk_chars is not None or self.mean_chunk_chars_of is not None

    @property
    def effective_threshold(self) -> float:
        if self.threshold is not None:
            return self.threshold
        if self.method in ("ppl", "moc"):  # moc: its PPL fallback
            return 0.0 if self.target_len or self.fits_length else 0.5
        return 95.0 if self.method == "semantic" else 0.0


def goal_mean_chars(cfg: ChunkConfig) -> float | None:
    """The mean chunk length a run must reach: ``--mean-chunk-chars``, or the one another run reached
    (``--mean-chunk-chars-of``: its ``.meta.json``); None when the run has no such goal."""
    import json

    from metachunk.artifacts import InputError

    if cfg.mean_chunk_chars_of is None:
        return cfg.mean_chunk_chars
    meta = Path(cfg.mean_chunk_chars_of).with_suffix(".meta.json")
    try:
        goal = float(json.loads(meta.read_text(encoding="utf-8"))["summary"]["mean_chunk_chars"])
    except FileNotFoundError:
        raise InputError(meta, "no such file (--mean-chunk-chars-of names a chunk run's output)") from None
    except (ValueError, KeyError, TypeError):
        raise InputError(meta, "field 'summary.mean_chunk_chars': missing or not a number") from None
    if not 0 < goal < math.inf:  # a run that made no chunks has mean 0: no length to match
        raise InputError(meta, f"field 'summary.mean_chunk_chars': {goal} is no length to match")
    return goal


def fit_target_len(chunker: Chunker, docs: Sequence[ChunkedDocument], goal: float, tolerance: float) -> dict:
    """The ``target_len`` whose chunks average closest to ``goal`` characters over ``docs``.

    The mean chunk length grows with ``target_len``, so: double an upper bound until the mean passes
    the goal, then bisect. Each try is one [`Chunker.assemble`][metachunk.chunking.pipeline.Chunker.assemble] of every document (no model call).
    Returns ``{goal, tolerance, target_len, mean_chunk_chars, within_tolerance, tries}``."""
    tried: dict[int, float] = {}

    def mean(target: int) -> float:
        if target not in tried:
            chunks = [c for d in docs for c in chunker.assemble(d, target)]
            tried[target] = sum(len(c.text) for c in chunks) / len(chunks) if chunks else 0.0
        return tried[target]

    lo, hi = 1, max(1, round(goal / 4))  # goal / 4: below the goal in characters, words or tokens
    while mean(hi) < goal and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1 and abs(mean(hi) - goal) > tolerance * goal / 4:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mean(mid) < goal else (lo, mid)
    best = min(tried, key=lambda t: (abs(tried[t] - goal), t))
    return {"goal": round(goal, 1), "tolerance": tolerance, "target_len": best,
            "mean_chunk_chars": round(tried[best], 1),
            "within_tolerance": abs(tried[best] - goal) <= tolerance * goal, "tries": len(tried)}  # fmt: skip


@dataclass
class ChunkedDocument:
    """One document as a [`Chunker`][metachunk.chunking.pipeline.Chunker] leaves it: its ``id``,
    ``text`` and ``lang``, its ``chunks``, and what the method decided on the way: ``sentences``
    (with their scores, where the method has one), ``boundaries`` (the sentences that end a
    meta-chunk), ``thresholds`` (msp: the threshold at each decision) and ``spans`` (moc: the
    experts' chunks, before merging)."""

    id: str
    text: str
    lang: str
    chunks: list[Chunk]
    sentences: list[Sentence] = field(default_factory=list)  # with .score when the method has one
    boundaries: list[int] = field(default_factory=list)  # sentence indices where a meta-chunk ends
    thresholds: list[float | None] | None = None  # msp: θ used at each sentence's decision
    spans: list[Chunk] = field(default_factory=list)  # moc: the experts' chunks, before merging

    def to_json(self, method: str, emit_sentences: bool) -> dict:
        """The document's line of ``metachunk chunk``'s output: its id, the method and its chunks, and
        with ``emit_sentences`` each sentence's span and score."""
        record = {"id": self.id, "method": method, "chunks": [c.to_json() for c in self.chunks]}
        if emit_sentences:
            record["sentences"] = [{"start": s.start, "end": s.end, "score": s.score} for s in self.sentences]
        return record


@dataclass
class PreparedDocuments:
    """Documents read, split into sentences and, for ppl, tokenized: what
    [`Chunker.prepare`][metachunk.chunking.pipeline.Chunker.prepare] returns and
    [`Chunker.decide`][metachunk.chunking.pipeline.Chunker.decide] takes. ``docs``: the documents,
    with their language and (but for fixed) their sentences, and no chunks yet; ``tokenized`` (ppl):
    each document's token ids and its sentences' token spans."""

    docs: list[ChunkedDocument]
    tokenized: list[tuple[list[int], list[tuple[int, int]]]] | None = None


def _with_scores(sentences: Sequence[Sentence], scores: Sequence[float | None]) -> list[Sentence]:
    def clean(x):
        return None if x is None or x != x else float(x)  # NaN (unscored) -> None in JSON

    return [Sentence(s.start, s.end, clean(x)) for s, x in zip(sentences, scores)]


class Chunker:
    """Loads what the configured method needs once, then chunks batches of documents.

    Every method is run the same way: [`chunk`][metachunk.chunking.pipeline.Chunker.chunk] each batch, [`close`][metachunk.chunking.pipeline.Chunker.close] at the end, then
    `prompt_sha256`, `manifest` (the method's part of the run's line in its run log) and
    `summary_lines` (for the terminal). A method that shows its own progress bar
    (`own_progress`: lumber, in characters with the teacher's requests and cost) takes the
    run's size as ``total_chars``; the caller then shows none.
    """

    def __init__(
        self,
        cfg: ChunkConfig,
        *,
        total_chars: int | None = None,
        progress: bool = True,
        lazy_model: bool = False,
    ):
        self.cfg = cfg
        self._model = self.tokenizer = self._embed = None
        self._load = None  # ppl, msp: what loads the model (at once, or with `lazy_model` at `load_model`)
        self.lazy_load_seconds = 0.0  # the seconds `load_model` took, where it loaded after __init__
        self._owner, self._local = threading.current_thread(), threading.local()
        self._scorers: dict[str, MarginScorer] = {}
        self.moc = self.lumber = None
        if cfg.method == "moc":
            self.moc = MocChunker(
                cfg.moc,
                fallback_threshold=cfg.effective_threshold,
                max_context=cfg.max_context,
                batch_size=cfg.batch_size or CPU_ROWS,
                device=cfg.device,
                dtype=cfg.dtype,
            )
        if cfg.method == "lumber":  # the teacher's cuts; its store and pool stay open until close()
            self.lumber = LumberChunker(
                cfg.lumber, output=cfg.output, total_chars=total_chars, progress=progress
            )
        if cfg.method in LM_METHODS:
            from transformers import AutoTokenizer

            from metachunk.models import load_causal_lm_model, resolve

            def load():
                model = load_causal_lm_model(
                    cfg.model, device=cfg.device, dtype=cfg.dtype, attn_implementation=cfg.attn_implementation
                )
                if cfg.method == "ppl":  # on a GPU its head compiles a kernel: while loading, not in a batch
                    import torch

                    from metachunk.engine.scoring import warm_up_head

                    warm_up_head(model, None if cfg.head_dtype == "auto" else getattr(torch, cfg.head_dtype))
                return model

            # The tokenizer now, for `prepare`. With `lazy_model` the weights load at `load_model`: a
            # corpus run that reads ahead calls it once its thread ahead prepares the first group
            # (chunking/overlap.py), so the two overlap, and the load stays in the calling thread (where
            # a SIGTERM interrupts it, and transformers cancels its loading pool).
            self.tokenizer = AutoTokenizer.from_pretrained(resolve(cfg.model))
            self._load = load
            if not lazy_model:
                self._model = load()
        elif cfg.len_unit == "token" and cfg.method != "lumber":  # lumber estimates its own tokens
            from transformers import AutoTokenizer

            from metachunk.models import resolve

            self.tokenizer = AutoTokenizer.from_pretrained(resolve(cfg.model))
        if cfg.method == "semantic":
            self._embed = minilm_embedder(cfg.embedder, device=cfg.device)

    @property
    def model(self):
        """The method's language model (ppl, msp), or None; with ``lazy_model``, loaded on first use
        if `load_model` has not loaded it."""
        self.load_model()
        return self._model

    def load_model(self) -> None:
        """Load the method's model now if it is not loaded (``lazy_model``), in the calling thread;
        its seconds go to ``lazy_load_seconds``."""
        if self._model is None and self._load is not None:
            started = time.perf_counter()
            self._model = self._load()
            self.lazy_load_seconds = time.perf_counter() - started

    @property
    def own_progress(self) -> bool:
        return self.lumber is not None

    @property
    def prompt_sha256(self) -> dict[str, str]:
        shas = {s.prompt.name: s.prompt.sha256 for s in self._scorers.values()}
        for method in (self.moc, self.lumber):
            if method is not None:
                shas.update(method.prompt_sha256)
        return shas

    def manifest(self) -> dict:
        """The method's own block of the run's line in its run log: ``moc`` (router/experts, retries, PPL
        fallbacks, recovery counts), ``lumber`` (teacher, answer store, windows, requests sent /
        from the store, fallbacks, cost), or for ppl and msp the weights' ``dtype`` (and ppl's
        ``scoring``: streams, kernels, attention); nothing for the rest."""
        if self.moc is not None:
            return {"moc": self.moc.manifest()}
        if self.lumber is not None:
            return {"lumber": self.lumber.manifest()}
        if self.model is None:
            return {}
        # ppl, msp: the weights' dtype, and why (--dtype auto picks it)
        out = {"dtype": dict(getattr(self.model, "metachunk_dtype", {"dtype": str(self.model.dtype)}))}
        if self.cfg.method == "ppl":  # how the scorer ran: its streams, and the C kernels it built or not
            from metachunk.engine import kernels
            from metachunk.engine.scoring import default_streams, packs_windows
            from metachunk.models import attention_of

            streams = self.cfg.streams or default_streams(next(self.model.parameters()).device)
            out["scoring"] = {
                "streams": streams,
                "kernels": kernels.status(),
                "attention": attention_of(self.model),
                "packed_windows": packs_windows(self.model),
            }
        return out

    def summary_lines(self) -> list[str]:
        return [m.summary_line() for m in (self.moc, self.lumber) if m is not None]

    def close(self) -> None:
        """Releases what outlives a batch (lumber: the teacher pool, the answer store, its bar)."""
        if self.lumber is not None:
            self.lumber.close()

    def _scorer(self, lang: str) -> MarginScorer:
        if lang not in self._scorers:
            self._scorers[lang] = MarginScorer(
                self.model, self.tokenizer, load_msp_prompt(self.cfg.msp_prompt, lang)
            )
        return self._scorers[lang]

    def thread_tokenizer(self):
        """The tokenizer for the calling thread. transformers sets truncation and padding on the
        shared Rust tokenizer at every call, which an encoding running in another thread refuses
        ("Already borrowed", huggingface/transformers#47085), so a thread other than the one that
        loaded it encodes with its own copy (a corpus run reads ahead and writes behind in threads)."""
        if self.tokenizer is None or threading.current_thread() is self._owner:
            return self.tokenizer
        if getattr(self._local, "tokenizer", None) is None:
            self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return self._local.tokenizer

    def unit(self, lang: str) -> str:
        return self.cfg.len_unit or ("char" if lang == "zh" else "word")

    def chunk(self, ids: Sequence[str], texts: Sequence[str]) -> list[ChunkedDocument]:
        """Each document cut and merged to ``target_len``: [`segment`][metachunk.chunking.pipeline.Chunker.segment], then [`assemble`][metachunk.chunking.pipeline.Chunker.assemble]."""
        out = self.segment(ids, texts)
        for d in out:
            d.chunks = self.assemble(d, self.cfg.target_len)
        return out

    def segment(self, ids: Sequence[str], texts: Sequence[str]) -> list[ChunkedDocument]:
        """The method's decisions for each document (its sentences, boundaries or the model's own
        spans), before any merging: the costly part, done once per document.
        [`prepare`][metachunk.chunking.pipeline.Chunker.prepare], then
        [`decide`][metachunk.chunking.pipeline.Chunker.decide]."""
        return self.decide(self.prepare(ids, texts))

    def prepare(self, ids: Sequence[str], texts: Sequence[str]) -> PreparedDocuments:
        """What needs no model: each document's language and sentences, and for ppl its tokens. A
        corpus run calls it in a thread of its own, ahead of the model (`metachunk.chunking.overlap`)."""
        cfg = self.cfg
        langs = [detect_lang(t) if cfg.lang == "auto" else cfg.lang for t in texts]
        # fixed cuts ignore sentences: splitting them (most of its time) only for what shows them
        split = cfg.method != "fixed" or cfg.emit_sentences or cfg.plot
        sentences = [
            split_sentences(t, cfg.lang, max_chars=cfg.max_sentence_chars) if split else [] for t in texts
        ]
        docs = [ChunkedDocument(i, t, lang, [], s) for i, t, lang, s in zip(ids, texts, langs, sentences)]
        tokenized = (
            tokenize_documents(self.thread_tokenizer(), texts, sentences) if cfg.method == "ppl" else None
        )
        return PreparedDocuments(docs, tokenized)

    def decide(self, prepared: PreparedDocuments) -> list[ChunkedDocument]:
        """The method's decisions for documents from [`prepare`][metachunk.chunking.pipeline.Chunker.prepare]:
        the model's (or the teacher's) work."""
        cfg, out = self.cfg, prepared.docs
        texts = [d.text for d in out]
        langs = [d.lang for d in out]
        sentences = [d.sentences for d in out]
        theta = cfg.effective_threshold

        if cfg.method == "ppl":
            import torch  # imported here: `metachunk --help` must not pay for it

            head_dtype = None if cfg.head_dtype == "auto" else getattr(torch, cfg.head_dtype)
            scores = score_tokenized(
                self.model,
                prepared.tokenized,
                cfg.max_context,
                cfg.batch_size,
                head_dtype=head_dtype,
                long_context=cfg.long_context,
                streams=cfg.streams,
            )
            for d, ppl in zip(out, scores):
                d.sentences = _with_scores(d.sentences, ppl)
                d.boundaries = ppl_boundaries(ppl, theta)
        elif cfg.method == "msp":
            for lang in sorted(set(langs)):  # one prompt language per batch
                idx = [k for k, lang_k in enumerate(langs) if lang_k == lang]
                results = msp_decisions(
                    self._scorer(lang),
                    [texts[k] for k in idx],
                    [sentences[k] for k in idx],
                    mode=cfg.msp_mode,
                    threshold=theta,
                    dynamic=cfg.dynamic_threshold,
                    window=cfg.threshold_window,
                    batch_size=cfg.batch_size,  # default: the scorer's, sized for the device
                )
                for k, res in zip(idx, results):
                    out[k].sentences = _with_scores(out[k].sentences, res.margins)
                    out[k].boundaries, out[k].thresholds = res.boundaries, res.thresholds
        elif cfg.method == "moc":
            for d, spans in zip(out, self.moc.chunk_documents(texts, langs, sentences)):
                d.spans = [Chunk.span(d.text, a, b) for a, b in spans]
                index_by_end = {s.end: i for i, s in enumerate(d.sentences)}
                d.boundaries = [index_by_end[c.end] for c in d.spans[:-1] if c.end in index_by_end]
        elif cfg.method == "lumber":
            for d, boundaries in zip(out, self.lumber.chunk_documents(texts, langs, sentences)):
                d.boundaries = boundaries
        elif cfg.method == "semantic":
            for d in out:
                chunks, distances = semantic_chunks(d.text, d.sentences, self._embed, percentile=theta)
                d.sentences = _with_scores(d.sentences, [None, *distances])
                index_by_end = {s.end: i for i, s in enumerate(d.sentences)}
                d.boundaries = [index_by_end[c.end] for c in chunks[:-1]]

        return out

    def assemble(self, d: ChunkedDocument, target_len: int | None) -> list[Chunk]:
        """A segmented document's chunks at length ``target_len``: cheap, and pure (the document is
        not changed), so a run can try several lengths (``--mean-chunk-chars``)."""
        cfg, unit = self.cfg, self.unit(d.lang)
        if cfg.method == "fixed":
            return fixed_chunks(d.text, target_len, unit)
        if cfg.method == "sentence":
            return sentence_chunks(d.text, d.sentences, target_len, unit, self.thread_tokenizer())
        chunks = d.spans if cfg.method == "moc" else chunks_from_boundaries(d.text, d.sentences, d.boundaries)
        if target_len:
            chunks = merge_chunks(d.text, chunks, target_len, unit, self.thread_tokenizer())
        if cfg.overlap:
            chunks = add_sentence_overlap(d.text, chunks, d.sentences)
        return chunks
