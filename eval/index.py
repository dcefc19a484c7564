"""The chunks to retrieve from, and their embedded Milvus index (a file DB, no server).

Chunks come from ``metachunk chunk`` output (one JSONL row per document: ``{id, method, chunks:
[{text, start, end, rewritten?, summary?}]}``). What gets embedded is chosen by ``index_text``:

* ``chunk``: the chunk's text;
* ``rewritten``: the student's rewrite (``chunk --rewrite``), or the chunk's text where a chunk
  has none;
* ``summary+chunk``: the summary (``chunk --summarize``), a blank line, then the chunk's text;
* ``summary+rewritten``: the summary, a blank line, then the rewrite (the chunk's text where it has
  none): Meta-Chunking's full semantic completion (Table 2's "Meta-Chunking" row; ``rewritten`` and
  ``summary+chunk`` are its "w/o Summary" and "w/o Rewriting" rows). The paper summarises the
  rewritten chunk; the summary student reads the original chunk, as it was trained to.

The index lives in ``INDEX_DIR/index.db`` (a Milvus Lite database). One collection per index key,
the sha256 of (the chunks file's bytes, the embedder's fingerprint (and, for a local folder, its
resolved path), ``index_text``, the schema version, and for a lexical index its retriever, analyzer,
analyzer mode, k1 and b), so a rerun, or
another eval run on the same chunks, reuses the index; any edit of the chunks file, another
embedder, another indexed text or other BM25 settings gives a new collection.

Three retrievers (``RETRIEVERS``): ``dense`` (the embedder's vectors), ``bm25`` (Milvus's full-text
search: a ``BM25`` function from the indexed text, a ``VARCHAR`` field, into a sparse field with a
``SPARSE_INVERTED_INDEX``; `Lexical` picks the analyzer, ``jieba`` for Chinese in a mode you
name, ``standard`` for English, and for jieba a ``stop`` filter of every punctuation mark, which
jieba keeps as a word), and ``hybrid`` (both in one collection, each route searched, the two
lists fused here by reciprocal rank with a stated tie-break: `rrf_fuse`). Only a lexical index stores the indexed text, in a field of at most
``LEXICAL_MAX_BYTES``: a longer chunk is refused, never cut (`check_lexical_lengths`). Milvus
Lite's BM25 (pymilvus 3.0 / milvus-lite 3.2) scores with k1 = 1.5 and b = 0.75 whatever
``bm25_k1``/``bm25_b`` the index names (`Lexical`), IDF ``ln((N - df + 0.5) / (df + 0.5) + 1)``, and statistics per segment: one
collection built in one insert and flush here is one segment. A collection is built
under a temporary name and renamed when complete, so an interrupted build is never reused (its
leftover is dropped by the next build). Vectors are unit-normalised and searched exactly (FLAT,
inner product = cosine). Milvus stores only ids, document ids and chunk indices: the texts are read
from the chunks file, so no length limit applies to them. A Milvus Lite file is opened by one
process at a time: runs sharing an ``--index-dir`` must not run at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from metachunk.chunking.shards import chunk_rows

from metachunk.artifacts import AtomicWriter, InputError, check_unicode, json_sha256
from metachunk.sources import MAX_ROW_BYTES, Rejects, refuse_or_skip

INDEX_TEXTS = ("chunk", "rewritten", "summary+chunk", "summary+rewritten")
# The chunk fields each indexed text is made from (``chunk --rewrite`` / ``--summarize`` add them).
INDEX_FIELDS = {"chunk": (), "rewritten": ("rewritten",), "summary+chunk": ("summary",),
                "summary+rewritten": ("summary", "rewritten")}  # fmt: skip
RETRIEVERS = ("dense", "bm25", "hybrid")
# Milvus's largest VARCHAR (bytes): a lexical index keeps each chunk's indexed text in one.
LEXICAL_MAX_BYTES = 65_535
INDEX_SCHEMA = 1
DB_NAME = "index.db"
MANIFEST = "index.collections.json"


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    id: int  # position in the chunks file (document order, then chunk order)
    doc_id: str
    chunk_index: int
    start: int
    end: int
    text: str
    indexed_text: str


def indexed_text(chunk: dict, mode: str) -> tuple[str, bool]:
    """``(text to embed, whether the chunk lacked the field the mode asks for)``."""
    if mode == "chunk":
        return chunk["text"], False
    if mode == "rewritten":
        rewritten = chunk.get("rewritten")
        return (
            (rewritten, False) if isinstance(rewritten, str) and rewritten.strip() else (chunk["text"], True)
        )
    if mode in ("summary+chunk", "summary+rewritten"):
        body, lacking = indexed_text(chunk, "chunk" if mode == "summary+chunk" else "rewritten")
        summary = chunk.get("summary")
        if isinstance(summary, str) and summary.strip():
            return f"{summary.strip()}\n\n{body}", lacking
        return body, True
    raise ValueError(f"unknown index_text {mode!r}; have {', '.join(INDEX_TEXTS)}")


def read_chunks(path: Path, mode: str = "chunk", rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES
                ) -> tuple[list[ChunkRecord], dict[str, str], int]:  # fmt: skip
    """``(chunks, documents, n_lacking)``: every chunk of the file, the documents rebuilt from their
    chunks (chunk texts at their offsets: ``metachunk chunk``'s tile it; a gap stays NUL), and how
    many chunks lacked the field ``mode`` asks for. A bad record is an error, or with ``rejects``
    (``--on-bad-row skip``) left out whole."""
    chunks: list[ChunkRecord] = []
    docs: dict[str, str] = {}
    lacking = 0
    # a .jsonl file, or a chunk dataset folder's shards
    for where, number, row in chunk_rows(path, rejects, max_row_bytes):
        try:
            doc_id, records, text, missing = _document_chunks(where, number, row, mode, docs)
        except InputError as e:
            refuse_or_skip(rejects, e, json.dumps(row, ensure_ascii=False))
            continue
        for i, (start, end, chunk_text, shown) in enumerate(records):
            chunks.append(ChunkRecord(len(chunks), doc_id, i, start, end, chunk_text, shown))
        docs[doc_id] = text
        lacking += missing
    if not chunks:
        raise InputError(path, "no chunks in the output")
    return chunks, docs, lacking


def _document_chunks(where: Path, number: int, row: dict, mode: str, docs: dict):
    """``(doc id, [(start, end, text, indexed text)], document, n lacking)`` of one chunks record."""
    try:
        doc_id, rows = str(row["id"]), row["chunks"]
        if not isinstance(rows, list):
            raise TypeError("'chunks' is not a list")
    except (KeyError, TypeError) as e:
        raise InputError(where, f"expected a chunks record with 'id' and 'chunks' ({e})", number) from None
    if doc_id in docs:
        raise InputError(where, f"duplicate document id {doc_id!r}", number)
    buffer: list[str] = []
    records, lacking = [], 0
    for i, c in enumerate(rows):
        try:
            text, start, end = c["text"], c["start"], c["end"]
            if not isinstance(text, str):
                raise TypeError("'text' is not a string")
            if not all(
                type(x) is int for x in (start, end)
            ):  # "0" or 0.5 is no offset: distill refuses them too
                raise TypeError(f"'start' and 'end' must be ints, got {start!r} and {end!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(where, f"chunks[{i}] needs text, start and end ({e})", number) from None
        check_unicode(where, number, f"chunks[{i}].text", text)
        if end - start != len(text):
            raise InputError(where, f"chunks[{i}]: {end} - {start} != len(text) {len(text)}", number)
        # The document is rebuilt from its chunks. They may overlap (`chunk --overlap`) where their texts agree;
        # a gap (a chunker that drops the whitespace between chunks) is text no chunk holds, left as NUL, which
        # no evidence matches.
        if start < 0:
            raise InputError(
                where, f"chunks[{i}] starts at {start}: an offset into the document is >= 0", number
            )
        if len(buffer) < end:
            buffer.extend("\0" * (end - len(buffer)))
        if any(known not in ("\0", new) for known, new in zip(buffer[start:end], text)):
            raise InputError(where, f"chunks[{i}]: its text differs from a chunk it overlaps", number)
        shown, missing = indexed_text(c, mode)
        lacking += missing
        records.append((start, end, text, shown))
        buffer[start:end] = text
    return doc_id, records, "".join(buffer), lacking


def chunks_sha256(path: Path) -> str:
    """The content hash of a chunks file, or of a chunk dataset folder's shards in order (their
    bytes end to end, as if one file)."""
    path = Path(path)
    digest = hashlib.sha256()
    for file in sorted(path.glob("train-*-of-*.*")) if path.is_dir() else [path]:
        with file.open("rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Lexical:
    """A BM25 index's settings: the analyzer (``jieba``, with its ``mode``: ``exact`` is jieba's
    ``cut``, ``search`` its finer ``cut_for_search``; or ``standard``: ``\\w+``, lower-cased) and
    BM25's ``k1`` and ``b``. Milvus Lite runs only these two analyzers, and of the filters only
    ``stop`` (its ``milvus_lite/analyzer/factory.py``); Milvus's ``{"type": "chinese"}`` raises. It
    also scores with k1 = 1.5 and b = 0.75 whatever the index's ``bm25_k1`` and ``bm25_b`` say
    (measured: ``tests/test_eval_bm25.py``), so those are the values here; the index still names
    them, for a Milvus server, and the cache key holds them."""

    analyzer: str
    mode: str | None = None
    k1: float = 1.5
    b: float = 0.75

    @classmethod
    def for_lang(cls, lang: str, jieba_mode: str = "exact") -> Lexical:
        return cls("jieba", jieba_mode) if lang == "zh" else cls("standard")

    def analyzer_params(self) -> dict:
        if self.analyzer == "jieba":
            # jieba keeps each punctuation mark as a word: a question's final "？", rare in news text, had
            # a high IDF and pulled the few chunks holding one to the top (the standard analyzer's \w+ drops them)
            return {"tokenizer": {"type": "jieba", "mode": self.mode or "exact"},
                    "filter": [{"type": "stop", "stop_words": punctuation_words()}]}  # fmt: skip
        return {"tokenizer": self.analyzer}

    def key(self) -> dict:
        stop = {"stop": "punctuation"} if self.analyzer == "jieba" else {}
        return {"analyzer": self.analyzer, "mode": self.mode, "k1": self.k1, "b": self.b, **stop}


@functools.cache
def punctuation_words() -> list[str]:
    """Every Unicode punctuation mark (categories P*), and the runs of ASCII marks jieba keeps as one
    word ("...", "----", "__", up to 8 of a mark, and "?!"): the stop words of a jieba BM25 index."""
    marks = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)).startswith("P")]
    runs = [mark * n for mark in ".-_=*~#!?" for n in range(2, 9)]
    return marks + runs + ["?!", "!?"]


def rrf_fuse(routes: Sequence[Sequence[int]], k: int, limit: int) -> list[tuple[int, float]]:
    """``[(id, score), ...]`` best first, at most ``limit``: reciprocal-rank fusion of ranked id lists,
    ``sum(1 / (k + rank))`` over the routes that found an id, rank from 1, as Milvus's ``RRFRanker``
    (https://milvus.io/docs/rrf-ranker.md). Ties are common (one route's r-th beside the other's r-th)
    and Milvus Lite broke them by insertion order, which moved Hits@8 by 0.03 on CRUD: here the better
    best rank in any one route wins, then the smaller id."""
    score: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranked in routes:
        for rank, i in enumerate(ranked, start=1):
            score[i] = score.get(i, 0.0) + 1.0 / (k + rank)
            best[i] = min(best.get(i, rank), rank)
    order = sorted(score, key=lambda i: (-score[i], best[i], i))
    return [(i, score[i]) for i in order[:limit]]


def index_key(chunks_sha256: str, embedder: str | None, mode: str, retriever: str = "dense",
              lexical: Lexical | None = None) -> str:  # fmt: skip
    keyed = {"chunks_sha256": chunks_sha256, "embedder": embedder, "index_text": mode, "schema": INDEX_SCHEMA}
    if retriever != "dense":  # the lexical retrievers' settings
        keyed.update(retriever=retriever, **lexical.key())
    return json_sha256(keyed)


def check_lexical_lengths(chunks: Sequence[ChunkRecord], path: Path) -> None:
    """A lexical index stores each chunk's indexed text: one longer than ``LEXICAL_MAX_BYTES`` is
    refused with the chunk it is, never cut."""
    for c in chunks:
        size = len(c.indexed_text.encode("utf-8"))
        if size > LEXICAL_MAX_BYTES:
            raise InputError(path, f"document {c.doc_id!r}, chunk {c.chunk_index}: {size:,} bytes to index, more "
                             f"than the {LEXICAL_MAX_BYTES:,} a BM25 index's text field holds; nothing is cut: "
                             "use --retriever dense, or chunk smaller")  # fmt: skip


def collection_name(key: str) -> str:
    return f"chunks_{key[:32]}"


def embed(
    model,
    texts: Sequence[str],
    batch_size: int = 64,
    progress: bool = True,
    desc: str = "embed",
    prefix: str = "",
):
    """Unit-normalised float32 embeddings, one row per text, with a progress bar."""
    import numpy as np

    from metachunk.progress import bar as progress_bar

    dim = _dimension(model)
    out = np.zeros((len(texts), dim), dtype=np.float32)
    # Longest first: batches of similar length pad little; the rows go back to their places.
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    with progress_bar(total=len(texts), unit="text", desc=desc, enabled=progress) as bar:
        for a in range(0, len(order), batch_size):
            rows = order[a : a + batch_size]
            vectors = model.encode(
                [prefix + texts[i] for i in rows],
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            out[rows] = vectors
            bar.update(len(rows))
    return out


def _dimension(model) -> int:
    get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(get())


class ChunkIndex:
    """One Milvus Lite database holding any number of chunk collections."""

    def __init__(self, index_dir: Path):
        from pymilvus import MilvusClient

        self.dir = Path(index_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / DB_NAME
        self.client = MilvusClient(str(self.path))

    def has(self, name: str, rows: int) -> bool:
        if not self.client.has_collection(name):
            return False
        count = int(self.client.get_collection_stats(name).get("row_count", -1))
        return count == rows

    def build(self, name: str, chunks: Sequence[ChunkRecord], vectors, info: dict, batch: int = 2048,
              lexical: Lexical | None = None) -> None:  # fmt: skip
        """Create collection ``name`` from ``vectors`` (one row per chunk; None: no dense field)
        and, with ``lexical``, a BM25 index over each chunk's indexed text; atomic by renaming.
        Call `check_lexical_lengths` first: Milvus refuses a longer text."""
        from pymilvus import DataType, Function, FunctionType, MilvusClient

        client, tmp = self.client, f"tmp_{name}"
        for stale in (tmp, name):
            if client.has_collection(stale):
                client.drop_collection(stale)
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        if vectors is not None:
            schema.add_field("vector", DataType.FLOAT_VECTOR, dim=int(vectors.shape[1]))
        schema.add_field("doc_id", DataType.VARCHAR, max_length=4096)
        schema.add_field("chunk_index", DataType.INT64)
        params = client.prepare_index_params()
        if vectors is not None:
            params.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        if lexical is not None:
            # Milvus full-text search (https://milvus.io/docs/full-text-search.md): the BM25 function
            # turns the analysed text into a sparse vector; the index scores it with k1 and b.
            schema.add_field("text", DataType.VARCHAR, max_length=LEXICAL_MAX_BYTES, enable_analyzer=True,
                             analyzer_params=lexical.analyzer_params())  # fmt: skip
            schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
            schema.add_function(Function(name="bm25", function_type=FunctionType.BM25, input_field_names=["text"],
                                         output_field_names=["sparse"]))  # fmt: skip
            params.add_index(field_name="sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                             params={"bm25_k1": lexical.k1, "bm25_b": lexical.b})  # fmt: skip
        # pymilvus asks the server for a timestamp on create; Milvus Lite does not implement that call
        # and its in-process gRPC server logs a traceback at ERROR, although the create succeeds.
        grpc_log = logging.getLogger("grpc._server")
        level = grpc_log.level
        grpc_log.setLevel(logging.CRITICAL)
        try:
            client.create_collection(tmp, schema=schema, index_params=params)
        finally:
            grpc_log.setLevel(level)
        for a in range(0, len(chunks), batch):
            client.insert(
                tmp,
                [
                    {
                        "id": c.id,
                        **({"vector": vectors[c.id].tolist()} if vectors is not None else {}),
                        **({"text": c.indexed_text} if lexical is not None else {}),
                        "doc_id": c.doc_id[:4096],
                        "chunk_index": c.chunk_index,
                    }
                    for c in chunks[a : a + batch]
                ],
            )
        client.flush(tmp)
        client.rename_collection(tmp, name)
        dim = None if vectors is None else int(vectors.shape[1])
        self._note(name, {**info, "rows": len(chunks), "dim": dim, "built": time.time()})

    def _note(self, name: str, info: dict) -> None:
        """A human-readable list of the collections and what each holds (not read by the code)."""
        path = self.dir / MANIFEST
        try:
            notes = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            notes = {}
        notes[name] = info
        with AtomicWriter(path) as f:
            f.write(json.dumps(notes, ensure_ascii=False, indent=1) + "\n")

    def search(
        self, name: str, vectors, limit: int, batch: int = 64, on_batch: Callable[[int], object] | None = None
    ) -> list[list[tuple[int, float]]]:
        """Per query vector, ``[(chunk id, cosine), ...]`` best first."""
        self.client.load_collection(name)
        out: list[list[tuple[int, float]]] = []
        for a in range(0, len(vectors), batch):
            rows = vectors[a : a + batch]
            results = self.client.search(
                name,
                data=[v.tolist() for v in rows],
                anns_field="vector",  # a hybrid collection has a sparse field too
                limit=limit,
                output_fields=[],
                search_params={"metric_type": "IP"},
            )
            for hits in results:
                out.append([(int(h["id"]), float(h["distance"])) for h in hits])
            if on_batch:
                on_batch(len(rows))
        return out

    def search_text(
        self,
        name: str,
        texts: Sequence[str],
        limit: int,
        batch: int = 64,
        on_batch: Callable[[int], object] | None = None,
    ) -> list[list[tuple[int, float]]]:
        """Per query text, ``[(chunk id, BM25 score), ...]`` best first (full-text search)."""
        self.client.load_collection(name)
        out: list[list[tuple[int, float]]] = []
        for a in range(0, len(texts), batch):
            rows = list(texts[a : a + batch])
            results = self.client.search(name, data=rows, anns_field="sparse", limit=limit, output_fields=[],
                                         search_params={"metric_type": "BM25"})  # fmt: skip
            # Milvus Lite returns the score negated (smaller is better: milvus_lite/index/sparse_inverted.py),
            # Milvus the score itself; a BM25 score is never negative, so its size is the score.
            out += [[(int(h["id"]), abs(float(h["distance"]))) for h in hits] for hits in results]
            if on_batch:
                on_batch(len(rows))
        return out

    def search_hybrid(self, name: str, vectors, texts: Sequence[str], limit: int, fetch: int, rrf_k: int,
                      batch: int = 64, on_batch: Callable[[int], object] | None = None) -> list[list[tuple[int, float]]]:  # fmt: skip
        """Per query, ``[(chunk id, RRF score), ...]`` best first: the dense and the BM25 route each
        fetch ``fetch`` chunks, fused by `rrf_fuse` with ``rrf_k``."""
        dense = self.search(name, vectors, fetch, batch)
        lexical = self.search_text(name, texts, fetch, batch, on_batch)
        return [
            rrf_fuse([[i for i, _ in d], [i for i, _ in t]], rrf_k, limit)
            for d, t in zip(dense, lexical, strict=True)
        ]

    def close(self) -> None:
        self.client.close()
