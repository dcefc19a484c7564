"""``metachunk eval qa``: retrieve chunks from an embedded Milvus index, optionally re-rank, answer, score.

```
metachunk eval qa --chunks CHUNKS.jsonl --qa QA --embedder PRESET_OR_DIR --top-k 8 \\
  [--rerank ppl|cross-encoder] [--generator BASE_URL:MODEL | --generator-model PRESET] --out DIR
```

1. **Chunks** (``metachunk chunk`` output) are embedded (``--index-text chunk|rewritten|summary+
   chunk``) into ``INDEX_DIR/index.db``, one collection per index key (the chunks file, the embedder,
   the indexed text and the retriever's settings: `metachunk.eval.index.index_key`), reused across runs.
2. **Questions** (GutenQA ``questions.jsonl`` or CRUD ``qa_matches.jsonl``) are located in the
   documents and each chunk is judged relevant or not (`metachunk.eval.retrieval` states the rules).
3. **Retrieval**: the ``top_k`` (or, with ``--rerank``, ``rerank_depth``) nearest chunks per
   question; Hits@k, MRR@k, MAP@k need no generator.
4. **Re-ranking** (Appendix E): ``ppl`` or ``cross-encoder`` reorders the retrieved top ``rerank_depth``
   (10); metrics are reported before (``hits@8``) and after (``reranked_hits@8``).
5. **Generation** (optional): the final ``top_k`` passages and the question in the versioned prompt
   ``eval/prompts/rag_answer.{lang}.txt``, answered by an endpoint (cached in ``answers.sqlite``)
   or a local model (`metachunk.eval.generate`); answers are scored by `metachunk.eval.metrics.qa_scores`.

Writes ``OUT/metrics.json`` + ``report.md`` (`metachunk.eval.report.write_run`), ``OUT/retrieval.jsonl``
(one row per question: ``qid, question, answer, lang, relevant_any, hits, reranked``),
``OUT/evidence.jsonl`` (where each question's evidence was found, and which chunks are relevant)
and, when generating, ``OUT/answers.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metachunk.eval.index import INDEX_FIELDS, INDEX_TEXTS, RETRIEVERS

from metachunk import config
from metachunk.artifacts import AtomicWriter, InputError, jsonl_line
from metachunk.command import Reads, Result
from metachunk.config import option
from metachunk.redaction import safe_url
from metachunk.sources import BadRows, finish_rejects
from metachunk.teacher import Price, TeacherConfig  # recipe blocks (no torch: cheap)

DEFAULT_PPL_RERANKER = {"en": "smollm2", "zh": "gemma3-270m"}


@dataclass
class QAConfig:
    chunks: Path = option(None, "chunks JSONL from `metachunk chunk` (one row per document)")
    qa: Path = option(
        None, "questions: GutenQA questions.jsonl, or qa_matches.jsonl from `metachunk data prepare-crud`"
    )
    out: Path = option(
        None, "run dir: metrics.json, report.md, retrieval.jsonl, evidence.jsonl, answers.jsonl, index.db"
    )
    qa_format: str = option(
        "auto", "QA file format; auto tells from its first row", choices=["auto", "gutenqa", "crud"]
    )
    lang: str = option(
        "auto",
        "question language (answer prompt, PPL re-rank statement, metrics); auto: en for GutenQA, zh for CRUD",
        choices=["auto", "en", "zh"],
    )
    questions: str = option(
        "all",
        "all questions, or only those whose evidence is in the chunked documents (others count as misses)",
        choices=["all", "answerable"],
    )
    limit: int | None = option(None, "only the first N questions (after --questions)")
    crud_status: str = option(
        "matched+ambiguous",
        "CRUD entries to ask: matched only, or also ambiguous",
        choices=["matched", "matched+ambiguous"],
    )
    relevance: str = option(
        "share",
        "when a chunk is relevant: share (it holds --min-share of an evidence string, or the largest share of it) "
        "or whole (it holds the string whole: GutenQA's and Meta-Chunking's rule)",
        choices=["share", "whole"],
    )
    min_share: float = option(
        0.5, "--relevance share: a chunk is relevant when it holds this share of an evidence string"
    )
    fuzzy_threshold: float = option(
        90.0, "GutenQA: rapidfuzz partial ratio needed to accept a must-contain string not found verbatim"
    )
    embedder: str = option("minilm", "sentence embedder: preset or local sentence-transformers dir")
    query_prefix: str = option(
        "", "text put before each question when embedding it (e.g. a BGE query instruction)"
    )
    embed_batch_size: int = option(64, "texts per embedding batch")
    index_dir: Path | None = option(
        None, "where index.db lives; share it between runs (not at once); default OUT"
    )
    index_text: str = option("chunk", "what is embedded for each chunk", choices=list(INDEX_TEXTS))
    retriever: str = option(
        "auto",
        "dense: the embedder; bm25: Milvus full-text search (jieba for zh, the standard analyzer for en, by "
        "--lang); hybrid: reciprocal-rank fusion of both; auto: bm25 for Chinese (the default embedder, "
        "MiniLM, reads no Chinese), dense otherwise",
        choices=["auto", *RETRIEVERS],
    )
    jieba_mode: str = option(
        "exact",
        "bm25 on Chinese: jieba's exact cut, or its finer cut for search",
        choices=["exact", "search"],
    )
    rrf_k: int = option(60, "hybrid: the k of reciprocal-rank fusion, sum of 1 / (k + rank)")
    fusion_limit: int = option(50, "hybrid: chunks each route fetches before fusion")
    top_k: int = option(8, "chunks retrieved per question and given to the generator (paper: 8 for CRUD)")
    cutoffs: list[int] | None = option(
        None,
        "k of Hits@k, MRR@k and MAP@k (e.g. 1 3 5 8); default Hits at 1, 2, 4, 6, 8, 10 up to top_k "
        "(with --rerank, up to rerank_depth), MRR and MAP at top_k (and at rerank_depth with --rerank)",
    )
    rerank: str = option(
        "none", "re-rank the top rerank_depth hits of any retriever", choices=["none", "ppl", "cross-encoder"]
    )
    rerank_depth: int = option(10, "how many of the top hits are re-ranked (Appendix E: 10)")
    reranker: str | None = option(
        None,
        "ppl: causal LM preset or dir (default smollm2 for en, gemma3-270m for zh); cross-encoder: a "
        "local sentence-transformers CrossEncoder dir (required)",
    )
    rerank_max_passage_tokens: int = option(512, "ppl re-rank: a longer passage keeps its first tokens")
    generator: str | None = option(
        None,
        "answer with an OpenAI-compatible endpoint: BASE_URL:MODEL (e.g. http://127.0.0.1:8000/v1:qwen2-7b)",
    )
    generator_model: str | None = option(None, "answer with a local causal LM: preset or HF model dir")
    generator_teacher: TeacherConfig | None = option(
        None,
        "YAML only: the endpoint's teacher block (base_url, model, api_key_env, concurrency, rpm, timeout, "
        "serve_preset...); --generator overrides its base_url and model; sampling comes from this config; "
        "unused when generator_model is given",
    )
    api_key_env: str | None = option(
        None,
        "endpoint without a generator_teacher block: environment variable holding the API key",
        runtime=True,
    )
    serve_preset: bool = option(
        False,
        "endpoint without a generator_teacher block (the block's serve_preset holds there): it is "
        "`metachunk teacher serve`, so send the served folder of the preset named as MODEL",
    )
    concurrency: int = option(
        8, "endpoint without a generator_teacher block: requests in flight", runtime=True
    )
    max_cost: float | None = option(
        None, "endpoint: stop before the answer store's total spend passes USD (needs the model's price)"
    )
    prices: dict[str, Price] | None = option(
        None, "YAML only: the endpoint's USD per 1M prompt/completion tokens, by model name"
    )
    cache: Path | None = option(None, "endpoint answer store (SQLite); default OUT/answers.sqlite")
    temperature: float = option(0.1, "sampling temperature (paper: 0.1); 0 = greedy")
    top_p: float = option(0.9, "nucleus sampling (paper: 0.9)")
    gen_top_k: int | None = option(
        5, "top-k sampling (paper: 5); local models, and endpoints with --endpoint-top-k"
    )
    endpoint_top_k: bool = option(
        False, "send gen_top_k to the endpoint (vLLM/SGLang accept it; OpenAI does not)"
    )
    max_new_tokens: int = option(1280, "answer length limit in tokens (paper: 1280)")
    seed: int = option(0, "local generation: sampling seed")
    batch_size: int = option(4, "local generation: prompts per batch")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda when available)", runtime=True)
    dtype: str = option(
        "auto",
        "local generator / ppl re-ranker dtype, as `chunk --dtype` (auto: bfloat16 on a GPU or a CPU with native "
        "bfloat16, else float32)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    bertscore_model: str = option("minilm", "BERTScore model for qa_scores, or none")
    score_embedder: str = option("minilm", "embedding-similarity model for qa_scores, or none")
    progress: bool = option(True, "progress bars", runtime=True)
    bad_rows: BadRows = config.block(BadRows, "what a bad chunks record or question row does", prefix="")

    def __post_init__(self):
        config.check_choices(self)
        for name in ("chunks", "qa", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field {name!r} is required")
        if self.generator and self.generator_model:
            raise ValueError(
                "give either 'generator' (an endpoint) or 'generator_model' (a local model), not both"
            )
        if self.generator:
            from metachunk.eval.generate import parse_generator

            parse_generator(self.generator)
        if self.rerank == "cross-encoder" and not self.reranker:
            raise ValueError("--rerank cross-encoder needs --reranker DIR (a local CrossEncoder)")
        for name in (
            "top_k",
            "rerank_depth",
            "embed_batch_size",
            "batch_size",
            "max_new_tokens",
            "concurrency",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"field {name!r} must be >= 1")
        if not 0 < self.min_share <= 1:
            raise ValueError("field 'min_share' must be in (0, 1]")
        config.check_number(self, "fuzzy_threshold", low=0.0, high=100.0)  # rapidfuzz scores 0-100
        if self.max_cost is not None and not self.max_cost >= 0:  # nan fails this too
            raise ValueError(f"field 'max_cost' must be a number of dollars >= 0, got {self.max_cost}")
        if self.cutoffs and min(self.cutoffs) < 1:
            raise ValueError(f"field 'cutoffs' must be ks >= 1, got {self.cutoffs}")
        depth = max(self.top_k, self.rerank_depth if self.rerank != "none" else 0)
        if self.cutoffs and max(self.cutoffs) > depth:  # no metric could be computed at it: it was dropped
            raise ValueError(
                f"field 'cutoffs': {max(self.cutoffs)} is deeper than the {depth} chunks retrieved "
                "(top_k, or rerank_depth with --rerank)"
            )
        if self.rrf_k < 1:
            raise ValueError(f"field 'rrf_k' must be >= 1, got {self.rrf_k}")
        if self.limit is not None and self.limit < 1:
            raise ValueError("field 'limit' must be >= 1")
        self.prices = self.prices or {}
        if self.max_cost is not None and self.generating and not self.generator_model:
            # checked here, before the index is built, not at the first answer
            model = teacher_config(self).model
            if model not in self.prices:
                raise ValueError(
                    f"--max-cost needs a price for the endpoint's model {model!r} under 'prices'"
                )
        if self.cache is None:
            self.cache = Path(self.out) / "answers.sqlite"
        if self.index_dir is None:
            self.index_dir = Path(self.out)

    @property
    def generating(self) -> bool:
        return bool(self.generator or self.generator_model or self.generator_teacher)


CONFIG = QAConfig


def _none(name: str | None) -> str | None:
    return None if name is None or name.lower() == "none" else name


# ------------------------------------------------------------------------------------------ run


# Figures of how a run went, not of what it measured: they go to OUT/runs.jsonl, so that metrics.json,
# which eval compare and `metachunk run` read, is the same for the same inputs.
RUN_FACTS = (
    "load_seconds",
    "seconds",
    "scoring_seconds",
    "requests_sent",
    "answers_from_store",
    "base_url",
    "cache",
)


def run(cfg: QAConfig) -> Result:
    from metachunk.eval.report import summary

    facts: dict = {}
    result = evaluate(cfg, facts)
    print_summary(result, facts, cfg)
    rejected = result["details"].get("rejects")
    return Result.with_rejects(summary(result["metrics"]), rejected)


def inputs(cfg: QAConfig) -> Reads:
    from metachunk.prompts import prompt_files

    generates = cfg.generating
    lang = question_lang(cfg.lang, cfg.qa_format)  # as far as the config says it: an auto retriever's pick
    retriever = resolved_retriever(cfg.retriever, lang) if lang else cfg.retriever
    models = [cfg.embedder if retriever != "bm25" else None, cfg.generator_model]
    if cfg.rerank != "none":
        models.append(cfg.reranker)
    if generates:
        models += [m for m in (cfg.bertscore_model, cfg.score_embedder) if m != "none"]
    return Reads.of(paths=[cfg.chunks, cfg.qa], models=models,
                    prompts=prompt_files("metachunk.eval") if generates else [])  # fmt: skip


def teachers(cfg: QAConfig) -> dict[str, str]:
    """The answer generator's model name, when it is a teacher block."""
    return {"generator": str(cfg.generator_teacher.model)} if cfg.generator_teacher else {}


def served(config: dict, teacher) -> dict:
    """The recipe with its ``generator_teacher`` block (if any) pointed at a served local teacher."""
    from metachunk.teacher import point_at

    if not config.get("generator_teacher"):
        return config
    return {**config, "generator_teacher": point_at(config["generator_teacher"], teacher)}


def outputs(cfg: QAConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]


def evaluate(cfg: QAConfig, facts: dict | None = None) -> dict:
    """The whole command, in its five steps (the module's docstring); returns the metrics.json object.
    ``facts``, given, is filled with how the run went: the line it appends to ``OUT/runs.jsonl``."""
    from metachunk.eval.retrieval import aggregate, cutoffs

    timings: dict[str, float] = {}
    facts = {} if facts is None else facts  # how this run went: its runs.jsonl line, not metrics.json
    started = time.perf_counter()
    asked = _read_inputs(cfg)
    t = time.perf_counter()
    judged = _judge(cfg, asked)
    timings["relevance"] = time.perf_counter() - t
    retrieved = _retrieve(cfg, asked, judged.questions, facts, timings)
    reranked_order: list[list[int]] | None = None
    rerank_info: dict = {}
    if cfg.rerank != "none":
        t = time.perf_counter()
        reranked_order, rerank_info = rerank(cfg, asked.lang, judged.questions, retrieved.found, asked.chunks)
        timings["rerank"] = time.perf_counter() - t
    ranked = _write_rows(cfg, asked, judged.questions, retrieved.found, reranked_order, rerank_info)

    # ---- metrics: sizes, then retrieval before and after re-ranking, overall and per question
    chunks, embedder = asked.chunks, retrieved.embedder
    lengths = [len(c.text) for c in chunks]
    tokens = _token_counts(embedder, [c.text for c in chunks])
    limit_tokens = retrieved.index["embedder_max_seq_length"]
    indexed_tokens = (
        _token_counts(embedder, [c.indexed_text for c in chunks]) if cfg.index_text != "chunk" else tokens
    )
    metrics: dict[str, float] = {
        "n_questions": len(judged.questions),
        "n_answerable": judged.answerable,  # evidence in the chunked documents
        "n_with_relevant_chunk": sum(
            1 for _, _, rel in judged.questions if rel
        ),  # under --relevance whole, fewer
        "n_chunks": len(chunks),
        "n_documents": len(asked.docs),
        "avg_chunk_chars": round(sum(lengths) / len(lengths), 2),
        # in the embedder's tokens: none without one (bm25)
        "avg_chunk_tokens": round(sum(tokens) / len(tokens), 2) if embedder is not None else None,
        "avg_indexed_chars": round(sum(len(c.indexed_text) for c in chunks) / len(chunks), 2),
        "chunks_truncated": sum(1 for n in indexed_tokens if limit_tokens and n + 2 > limit_tokens),
    }
    depth = retrieved.depth
    hit_ks = sorted(set(cfg.cutoffs)) if cfg.cutoffs else cutoffs(depth, cfg.top_k)  # none deeper: refused
    score_ks = hit_ks if cfg.cutoffs else sorted({cfg.top_k, depth})
    metrics.update(aggregate(ranked.flags_retrieved, ranked.n_relevant, hit_ks, score_ks))
    # the same metrics per question: what eval compare's bootstrap intervals resample
    # (a CRUD question carries its QA entry as its cluster: one entry's questions share an article)
    items = [{"id": q.qid, **({"cluster": q.source["qa_id"]} if "qa_id" in q.source else {}),
              **aggregate([flags], [n_rel], hit_ks, score_ks)}
             for (q, _, _), flags, n_rel in zip(judged.questions, ranked.flags_retrieved, ranked.n_relevant)]  # fmt: skip
    if reranked_order is not None:
        reranked_ks = (
            cutoffs(cfg.rerank_depth, cfg.top_k),
            sorted({min(cfg.top_k, cfg.rerank_depth), cfg.rerank_depth}),
        )
        metrics.update(aggregate(ranked.flags_reranked, ranked.n_relevant, *reranked_ks, prefix="reranked_"))
        for item, flags, n_rel in zip(items, ranked.flags_reranked, ranked.n_relevant, strict=True):
            item.update(
                aggregate([flags], [n_rel], *reranked_ks, prefix="reranked_")
            )  # compare's intervals too

    details: dict = {
        "qa_format": asked.fmt,
        "lang": asked.lang,
        "questions_in_file": judged.in_file,
        "questions_skipped": asked.skipped,
        **({"rejects": asked.rejected} if asked.rejected is not None else {}),
        "answerable_in_file": judged.answerable_in_file,
        "evidence_found_by": _count_how(ranked.evidence_rows),
        "relevance": (
            (
                "a chunk is relevant when it holds an evidence span whole"
                if cfg.relevance == "whole"
                else f"a chunk is relevant when it holds >= {cfg.min_share:.0%} of an evidence span, or the largest "
                "share of it"
            )
            + "; GutenQA evidence: chunk_must_contain (verbatim, normalised, or fuzzy); CRUD evidence: "
            "key strings of the answer inside the matched article(s) (see eval/retrieval.py)"
        ),
        "index": retrieved.index,
        "retrieval_depth": depth,
        "rerank": {k: v for k, v in rerank_info.items() if k not in ("scores", *RUN_FACTS)} or None,
    }

    # ---- generation
    if cfg.generating:
        t = time.perf_counter()
        gen_metrics, gen_details, per_question = generate_and_score(
            cfg, asked.lang, judged.questions, ranked.final_ids, chunks
        )
        metrics.update(gen_metrics)
        for item, scores in zip(items, per_question):  # the answer scores beside the retrieval ones
            item.update(scores)
        details["generation"] = {k: v for k, v in gen_details.items() if k not in RUN_FACTS}
        facts["generation"] = {k: v for k, v in gen_details.items() if k in RUN_FACTS}
        timings["generation_and_scoring"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - started
    facts["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    if rerank_info:
        facts["rerank"] = {k: v for k, v in rerank_info.items() if k in RUN_FACTS}
    from metachunk.eval.report import write_run

    return write_run(Path(cfg.out), "qa", cfg, metrics, details, items=items, run=facts)


@dataclass
class _Asked:
    """What a run reads, checked before any model loads."""

    chunks: list  # eval.index's chunk rows, a chunk's id its place in the list
    docs: dict[str, str]  # the chunked documents' texts, rebuilt from their chunks
    lacking: int  # chunks without the field --index-text names
    fmt: str  # "gutenqa" | "crud"
    questions: list
    skipped: int  # CRUD entries of another status
    rejected: dict | None  # bad rows left out (--on-bad-row skip)
    lang: str


def _read_inputs(cfg: QAConfig) -> _Asked:
    from metachunk.eval.index import read_chunks
    from metachunk.eval.retrieval import load_questions

    rejects = cfg.bad_rows.rejects(Path(cfg.out))
    chunks, docs, lacking = read_chunks(cfg.chunks, cfg.index_text, rejects, cfg.bad_rows.max_row_bytes)
    if cfg.index_text != "chunk" and lacking == len(chunks):
        fields = INDEX_FIELDS[cfg.index_text]
        flags = " ".join("--rewrite MODEL" if f == "rewritten" else "--summarize MODEL" for f in fields)
        raise InputError(
            cfg.chunks,
            f"--index-text {cfg.index_text}: no chunk has a {' and a '.join(map(repr, fields))} field "
            f"(make {'one' if len(fields) == 1 else 'them'} with `metachunk chunk {flags}`)",
        )
    statuses = ("matched",) if cfg.crud_status == "matched" else ("matched", "ambiguous")
    fmt, questions, skipped = load_questions(
        cfg.qa, cfg.qa_format, statuses, rejects, cfg.bad_rows.max_row_bytes
    )
    rejected = finish_rejects(rejects, "eval qa")
    if not questions:
        raise InputError(cfg.qa, "no questions to ask (CRUD: no matched entries?)")
    lang = question_lang(cfg.lang, fmt)
    if cfg.generating:
        from metachunk.eval.generate import load_rag_prompt

        load_rag_prompt(lang)  # a broken prompt file fails before anything loads
    return _Asked(chunks, docs, lacking, fmt, questions, skipped, rejected, lang)


@dataclass
class _Judged:
    questions: list[tuple]  # those asked: (question, its evidence, the ids of the chunks relevant to it)
    in_file: int
    answerable_in_file: int  # with evidence in the chunked documents
    answerable: int  # of those asked


def _judge(cfg: QAConfig, asked: _Asked) -> _Judged:
    """Where each question's evidence is, which chunks are relevant to it, and which questions are asked."""
    from metachunk.eval.retrieval import NormalizedDoc, find_evidence, relevant_chunks

    docs = asked.docs
    normalized: dict[str, NormalizedDoc] = {}

    def docs_for(q) -> dict[str, NormalizedDoc]:
        wanted = docs.keys() if q.doc_ids is None else [d for d in q.doc_ids if d in docs]
        for d in wanted:
            if d not in normalized:
                normalized[d] = NormalizedDoc(d, docs[d])
        return {d: normalized[d] for d in wanted}

    chunks_by_doc: dict[str, list[tuple[int, int, int]]] = {}
    for c in asked.chunks:
        chunks_by_doc.setdefault(c.doc_id, []).append((c.id, c.start, c.end))
    judged = []
    for q in asked.questions:
        evidence = find_evidence(
            q, docs_for(q), fuzzy=asked.fmt == "gutenqa", fuzzy_threshold=cfg.fuzzy_threshold
        )
        judged.append((q, evidence, relevant_chunks(evidence, chunks_by_doc, cfg.min_share, cfg.relevance)))

    def answerable(evidence) -> bool:  # by where the evidence is, never by how a chunker cut it
        return any(ev.doc_id in chunks_by_doc for ev in evidence)

    n_all, n_answerable = len(judged), sum(1 for _, ev, _ in judged if answerable(ev))
    if cfg.questions == "all" and n_answerable < n_all:  # a subset of the corpus: the others are misses
        print(f"eval qa: {n_all - n_answerable} of {n_all} questions have no evidence in these chunks' documents "
              "and count as misses; --questions answerable asks only the others", file=sys.stderr)  # fmt: skip
    if cfg.questions == "answerable":
        judged = [j for j in judged if answerable(j[1])]
    if cfg.limit is not None:
        judged = judged[: cfg.limit]
    if not judged:
        raise InputError(cfg.qa, "no question has evidence in the chunked documents (--questions answerable)")
    return _Judged(judged, n_all, n_answerable, sum(1 for _, ev, _ in judged if answerable(ev)))


@dataclass
class _Retrieved:
    found: list[list[tuple[int, float]]]  # per question: (chunk id, score), best first, `depth` of them
    depth: int
    embedder: object | None  # the sentence embedder (dense and hybrid retrieval), else None
    index: dict  # metrics.json's details.index


def _retrieve(cfg: QAConfig, asked: _Asked, judged: list[tuple], facts: dict, timings: dict) -> _Retrieved:
    """The index (built once per index key, then reused) and each question's nearest chunks."""
    from metachunk.eval.index import (
        ChunkIndex,
        Lexical,
        check_lexical_lengths,
        chunks_sha256,
        collection_name,
        embed,
        index_key,
    )

    from metachunk.models import PRESETS, fingerprint, load_sentence_embedder, resolve
    from metachunk.progress import bar as progress_bar

    chunks = asked.chunks
    t = time.perf_counter()
    retriever = resolved_retriever(cfg.retriever, asked.lang)
    dense = retriever in ("dense", "hybrid")
    lexical = None if retriever == "dense" else Lexical.for_lang(asked.lang, cfg.jieba_mode)
    if lexical is not None:
        check_lexical_lengths(chunks, Path(cfg.chunks))  # a chunk too long to index is refused, never cut
        if lexical.analyzer == "standard":
            unsplit_share([c.indexed_text for c in chunks], asked.lang)
    # The embedder by what identifies its outputs (its config files, weight files sampled); a preset, whose
    # files its name fixes, not by where it lies (another venv or cache reuses the index), a local folder by
    # its place too (two fine-tunes of one model have the same configs and sizes).
    embedder_id = {"name": cfg.embedder, "sha256": fingerprint(cfg.embedder)["sha256"]} if dense else None
    if dense and cfg.embedder not in PRESETS:
        embedder_id["path"] = str(resolve(cfg.embedder).resolve())
    embedder = load_sentence_embedder(cfg.embedder, device=cfg.device) if dense else None
    question_texts = [q.question for q, _, _ in judged]
    unread = None
    if dense:
        texts = question_texts + [c.indexed_text for c in chunks]
        unread = unread_share(cfg.embedder, embedder.tokenizer, texts, "--embedder", "its dense retrieval")
    timings["embedder_load"] = time.perf_counter() - t
    embedder_key = embedder_id and ":".join(v for k, v in embedder_id.items() if k != "name")
    key = index_key(chunks_sha256(cfg.chunks), embedder_key, cfg.index_text, retriever, lexical)
    name = collection_name(key)
    depth = max(cfg.top_k, cfg.rerank_depth if cfg.rerank != "none" else 0)
    index = ChunkIndex(cfg.index_dir)
    try:
        t = time.perf_counter()
        built = not index.has(name, len(chunks))
        facts["index_built"] = built
        if built:
            vectors = None
            if dense:
                vectors = embed(
                    embedder,
                    [c.indexed_text for c in chunks],
                    cfg.embed_batch_size,
                    cfg.progress,
                    desc="embed chunks",
                )
            info = {"chunks": str(Path(cfg.chunks).resolve()), "embedder": embedder_id,
                    "index_text": cfg.index_text, "retriever": retriever,
                    **({"lexical": lexical.key()} if lexical else {}), "key": key}  # fmt: skip
            index.build(name, chunks, vectors, info, lexical=lexical)
        timings["index"] = time.perf_counter() - t

        t = time.perf_counter()
        query_vectors = None
        if dense:
            query_vectors = embed(
                embedder,
                question_texts,
                cfg.embed_batch_size,
                cfg.progress,
                "embed questions",
                cfg.query_prefix,
            )
        with progress_bar(total=len(judged), unit="q", desc="retrieve", enabled=cfg.progress) as bar:
            if retriever == "dense":
                found = index.search(name, query_vectors, depth, on_batch=bar.update)
            elif retriever == "bm25":
                found = index.search_text(name, question_texts, depth, on_batch=bar.update)
            else:
                found = index.search_hybrid(name, query_vectors, question_texts, depth, max(cfg.fusion_limit, depth),
                                            cfg.rrf_k, on_batch=bar.update)  # fmt: skip
        timings["retrieval"] = time.perf_counter() - t
    finally:
        index.close()
    details = {
        "db": str(Path(cfg.index_dir) / "index.db"),
        "collection": name,
        "key": key,
        "retriever": retriever,
        **({"lexical": lexical.key()} if lexical else {}),
        **({"rrf_k": cfg.rrf_k, "fusion_limit": cfg.fusion_limit} if retriever == "hybrid" else {}),
        "embedder": embedder_id,
        "embedder_unknown_tokens": unread,
        "index_text": cfg.index_text,
        "chunks_lacking_field": asked.lacking,
        "embedder_max_seq_length": int(getattr(embedder, "max_seq_length", 0) or 0),
    }
    return _Retrieved(found, depth, embedder, details)


@dataclass
class _Ranked:
    """Per question: its hits' relevance flags as retrieved and as re-ranked (top rerank_depth), how many
    chunks are relevant to it, the top_k chunk ids its answer is generated from; and evidence.jsonl's rows."""

    flags_retrieved: list[list[bool]]
    flags_reranked: list[list[bool]]
    n_relevant: list[int]
    final_ids: list[list[int]]
    evidence_rows: list[dict]


def _write_rows(
    cfg: QAConfig,
    asked: _Asked,
    judged: list[tuple],
    found: list,
    reranked_order: list[list[int]] | None,
    rerank_info: dict,
) -> _Ranked:
    """``OUT/retrieval.jsonl`` (each question's hits, re-ranked too) and ``OUT/evidence.jsonl``."""
    chunks = asked.chunks

    def hit_row(rank: int, cid: int, score: float, rel: set[int]) -> dict:
        c = chunks[cid]
        return {"rank": rank, "doc_id": c.doc_id, "chunk_index": c.chunk_index, "start": c.start, "end": c.end,
                "text": c.text, "indexed_text": c.indexed_text, "score": round(score, 6), "relevant": cid in rel}  # fmt: skip

    rows = []
    ranked = _Ranked([], [], [], [], [])
    for i, ((q, evidence, rel), hits) in enumerate(zip(judged, found)):
        row = {"qid": q.qid, "question": q.question, "answer": q.answer, "lang": asked.lang, "relevant_any": bool(rel),
               "hits": [hit_row(r, cid, s, rel) for r, (cid, s) in enumerate(hits, start=1)], "reranked": None}  # fmt: skip
        ranked.flags_retrieved.append([cid in rel for cid, _ in hits])
        ranked.n_relevant.append(len(rel))
        final = [cid for cid, _ in hits]
        if reranked_order is not None:
            top = hits[: cfg.rerank_depth]
            scores = rerank_info["scores"][i]
            row["reranked"] = [
                hit_row(r, top[j][0], scores[j], rel) for r, j in enumerate(reranked_order[i], start=1)
            ]
            final = [top[j][0] for j in reranked_order[i]] + [cid for cid, _ in hits[cfg.rerank_depth :]]
            ranked.flags_reranked.append([cid in rel for cid in final[: cfg.rerank_depth]])
        ranked.final_ids.append(final[: cfg.top_k])
        rows.append(row)
        ranked.evidence_rows.append({
            "qid": q.qid, "evidence": [dataclasses.asdict(e) for e in evidence],
            "relevant": sorted([chunks[c].doc_id, chunks[c].chunk_index] for c in rel), **q.source,
        })  # fmt: skip

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with AtomicWriter(out / "retrieval.jsonl") as f:
        f.writelines(jsonl_line(r) for r in rows)
    with AtomicWriter(out / "evidence.jsonl") as f:
        f.writelines(jsonl_line(r) for r in ranked.evidence_rows)
    return ranked


def _count_how(evidence_rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in evidence_rows:
        hows = {e["how"].split(":")[0] for e in row["evidence"]} or {"missing"}
        best = next(h for h in ("verbatim", "normalized", "fuzzy", "missing") if h in hows)
        counts[best] = counts.get(best, 0) + 1
    return counts


def question_lang(lang: str, qa_format: str) -> str | None:
    """``--lang``, or with auto the QA format's: CRUD is Chinese, GutenQA English (None: not known yet)."""
    return lang if lang != "auto" else {"crud": "zh", "gutenqa": "en"}.get(qa_format)


def resolved_retriever(retriever: str, lang: str) -> str:
    """``--retriever auto``: BM25 over jieba's words for Chinese, whose tokens the default embedder
    (MiniLM, an English WordPiece vocabulary) reads two in three as unknown (Hits@8 0.24 against
    BM25's 0.90 on CRUD); the embedder for every other language."""
    if retriever != "auto":
        return retriever
    return "bm25" if lang == "zh" else "dense"


def unsplit_share(texts: list[str], lang: str) -> float:
    """The share of ``texts``' letters that are CJK ideographs, said on stderr when it is large: the
    standard analyzer (``--lang en``) splits on ``\\w+``, so a Chinese clause is one token and BM25
    matches almost nothing (Hits@8 0.08 on CRUD), without an error."""
    letters = cjk = 0
    for text in texts:
        for ch in text:
            if ch.isalpha():
                letters += 1
                cjk += "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf"
    share = cjk / letters if letters else 0.0
    if share > 0.3:
        print(f"metachunk: eval qa: {share:.0%} of the chunks' letters are Chinese, but --lang {lang} indexes "
              "them with the standard analyzer, which splits on \\w+ (a Chinese clause is one word): pass "
              "--lang zh (jieba)", file=sys.stderr)  # fmt: skip
    return share


def _token_counts(embedder, texts: list[str]) -> list[int]:
    tok = getattr(embedder, "tokenizer", None)
    if tok is None:
        return [0] * len(texts)
    counts = []
    for a in range(0, len(texts), 512):
        counts += [len(ids) for ids in tok(texts[a : a + 512], add_special_tokens=False)["input_ids"]]
    return counts


# -------------------------------------------------------------------------------------- rerank


def rerank(cfg: QAConfig, lang: str, judged, found, chunks) -> tuple[list[list[int]], dict]:
    """Per question, the order of its retrieved top ``rerank_depth`` after re-ranking, and details."""
    from metachunk.eval.rerank import cross_encoder_scores, load_cross_encoder, order, ppl_scores

    queries = [
        (q.question, [chunks[cid].indexed_text for cid, _ in hits[: cfg.rerank_depth]])
        for (q, _, _), hits in zip(judged, found)
    ]
    t = time.perf_counter()
    if cfg.rerank == "ppl":
        from metachunk.models import load_causal_lm

        name = cfg.reranker or DEFAULT_PPL_RERANKER[lang]
        model, tokenizer = load_causal_lm(name, device=cfg.device, dtype=cfg.dtype)
        load = time.perf_counter() - t
        scores = ppl_scores(
            model, tokenizer, queries, lang, cfg.rerank_max_passage_tokens, progress=cfg.progress
        )
        info = {
            "method": "ppl",
            "model": name,
            "score": "- mean NLL (nats) of question + restrictive statement given the passage",
        }
    else:
        model = load_cross_encoder(cfg.reranker, device=cfg.device)
        load = time.perf_counter() - t
        scores = cross_encoder_scores(model, queries, progress=cfg.progress)
        info = {"method": "cross-encoder", "model": cfg.reranker, "score": "cross-encoder relevance score"}
    info.update(depth=cfg.rerank_depth, load_seconds=round(load, 2), seconds=round(time.perf_counter() - t - load, 2),
                pairs=sum(len(p) for _, p in queries), scores=scores)  # fmt: skip
    return [order(s) for s in scores], info


# ---------------------------------------------------------------------------------- generation


def teacher_config(cfg: QAConfig):
    """The endpoint's `TeacherConfig`: the YAML block (or defaults), ``--generator``'s URL and
    model on top, the run's sampling settings always."""
    from metachunk.eval.generate import parse_generator

    block = cfg.generator_teacher
    values = dataclasses.asdict(block) if block is not None else {
        "concurrency": cfg.concurrency, "api_key_env": cfg.api_key_env, "serve_preset": cfg.serve_preset,
    }  # fmt: skip
    if cfg.generator:
        base_url, model = parse_generator(cfg.generator)
        values.update(base_url=base_url, model=model, base_url_env=None)
    values.update(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                  max_tokens_limit=None)  # fmt: skip
    return TeacherConfig(**values)


def generate_and_score(cfg: QAConfig, lang: str, judged, final_ids, chunks) -> tuple[dict, dict, list[dict]]:
    """Answer every question from its retrieved chunks and score the answers: ``(metrics, details,
    per-question scores)``."""
    from metachunk.eval.generate import EndpointGenerator, LocalGenerator, load_rag_prompt, rag_messages

    prompt = load_rag_prompt(lang)
    prompts = [
        rag_messages(prompt, q.question, [chunks[cid].indexed_text for cid in ids])
        for (q, _, _), ids in zip(judged, final_ids)
    ]
    t = time.perf_counter()
    details: dict = {"prompt": f"eval/prompts/{prompt.name}.{lang}.txt", "prompt_sha256": prompt.sha256}
    if cfg.generator_model:
        local = LocalGenerator(
            cfg.generator_model, device=cfg.device, dtype=cfg.dtype, batch_size=cfg.batch_size,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.gen_top_k, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
        )  # fmt: skip
        answers = local.generate(prompts, progress=cfg.progress)
        details.update(kind="local", model=cfg.generator_model, load_seconds=round(local.load_seconds, 2),
                       sampling={"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.gen_top_k,
                                 "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed})  # fmt: skip
    else:
        teacher = teacher_config(cfg)
        extra = {"top_k": cfg.gen_top_k} if cfg.endpoint_top_k and cfg.gen_top_k else {}
        endpoint = EndpointGenerator(teacher, cfg.cache, cfg.max_cost, extra, cfg.prices)
        answers = endpoint.generate(prompts, prompt.sha256, progress=cfg.progress)
        details.update(kind="endpoint", model=teacher.model, base_url=safe_url(teacher.endpoint_url()), cache=str(cfg.cache),
                       requests_sent=endpoint.sent, answers_from_store=endpoint.cached, stopped=endpoint.stopped,
                       sampling={**teacher.generation_params(), "max_tokens": teacher.max_tokens, **extra})  # fmt: skip
    details["seconds"] = round(time.perf_counter() - t, 2)

    with AtomicWriter(Path(cfg.out) / "answers.jsonl") as f:
        for (q, _, _), ids, a in zip(judged, final_ids, answers):
            f.write(jsonl_line({
                "qid": q.qid, "question": q.question, "reference": q.answer, "prediction": a.text,
                "status": a.status, "reason": a.reason, "finish_reason": a.finish_reason,
                "usage": {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens},
                "context": [[chunks[c].doc_id, chunks[c].chunk_index] for c in ids], "prompt_sha256": prompt.sha256,
            }))  # fmt: skip

    from metachunk.eval.metrics import qa_scores

    t = time.perf_counter()
    references = [q.answer for q, _, _ in judged]
    details["scorers_unknown_tokens"] = {
        flag: unread_share(model, tokenizer_of(model), references, flag, "its scores")
        for flag, model in (
            ("--bertscore-model", cfg.bertscore_model),
            ("--score-embedder", cfg.score_embedder),
        )
        if model != "none"
    }
    scores, per_question = qa_scores(
        [a.text for a in answers],
        references,
        lang,
        bertscore_model=_none(cfg.bertscore_model),
        embedder=_none(cfg.score_embedder),
        per_item=True,
    )
    details["scoring_seconds"] = round(time.perf_counter() - t, 2)
    metrics = {k: float(v) for k, v in scores.items()}
    metrics["answers_failed"] = sum(1 for a in answers if a.status != "ok")
    metrics["answers_cut_at_max_tokens"] = sum(1 for a in answers if a.finish_reason == "length")
    metrics["avg_answer_tokens"] = round(sum(a.completion_tokens for a in answers) / len(answers), 2)
    return metrics, details, per_question


def tokenizer_of(model: str):
    """The tokenizer of a scoring model (a preset or a folder), or None where it has none to load."""
    from transformers import AutoTokenizer

    from metachunk.models import resolve

    try:
        return AutoTokenizer.from_pretrained(str(resolve(model)))
    except (OSError, ValueError):  # no tokenizer files: the scorer's own load says why
        return None


def unread_share(model: str, tokenizer, texts: list[str], flag: str, what: str) -> float | None:
    """The share of ``texts``' tokens ``model`` reads as unknown (`metachunk.models.unknown_token_share`;
    None without a tokenizer), said on stderr when it does not read them."""
    from metachunk.models import UNREAD_SHARE, unknown_token_share

    if tokenizer is None:
        return None
    share = round(unknown_token_share(tokenizer, texts), 4)
    if share > UNREAD_SHARE:
        print(f"metachunk: eval qa: {model} ({flag}) reads {share:.0%} of these texts' tokens as unknown: "
              f"{what} would follow its unknown token, not the text; name a model that reads the language", file=sys.stderr)  # fmt: skip
    return share


# ------------------------------------------------------------------------------------- summary


def print_summary(doc: dict, facts: dict, cfg: QAConfig, file=None) -> None:
    """What the run found (``doc``: its metrics.json) and how it went (``facts``: its runs.jsonl line)."""
    file = file or sys.stdout
    m, d = doc["metrics"], doc["details"]
    index = d["index"]
    print(f"eval qa: {m['n_questions']} questions ({m['n_answerable']} with evidence in the corpus), "
          f"{m['n_chunks']} chunks in {m['n_documents']} documents, avg {m['avg_chunk_chars']:.0f} chars"
          + (f" / {m['avg_chunk_tokens']:.0f} tokens" if m["avg_chunk_tokens"] is not None else ""), file=file)  # fmt: skip
    print(
        f"index: {index.get('retriever', 'dense')} {index['collection']} in {index['db']} "
        f"({'built' if facts['index_built'] else 'reused'})",
        file=file,
    )
    shown = [
        k
        for k in m
        if k.split("@")[0]
        in ("hits", "mrr", "map", "dcg", "reranked_hits", "reranked_mrr", "reranked_map", "reranked_dcg")
    ]
    print("  ".join(f"{k} {m[k]:.4f}" for k in shown), file=file)
    gen = [k for k in ("bleu_avg", "rouge_l", "bertscore_f1", "embedding_similarity", "f1") if k in m]
    if gen:
        print("  ".join(f"{k} {m[k]:.4f}" for k in gen), file=file)
    print(f"wrote {Path(cfg.out) / 'metrics.json'}, report.md, retrieval.jsonl", file=file)
    print(json.dumps(facts["timings_s"]), file=file)
