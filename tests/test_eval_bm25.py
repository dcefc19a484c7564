"""``eval qa --retriever bm25|hybrid`` on the real Milvus Lite (no mock): BM25 scores equal an
independent computation with Milvus Lite's own formula, Chinese goes through jieba and English
through the standard analyzer, hybrid is reciprocal-rank fusion of the two routes, a chunk too long
for the text field is refused, and the index is cached under a key holding every BM25 setting."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pymilvus")
jieba = pytest.importorskip("jieba")

from metachunk.eval import qa  # noqa: E402
from metachunk.eval.index import (  # noqa: E402
    LEXICAL_MAX_BYTES,
    ChunkIndex,
    ChunkRecord,
    Lexical,
    check_lexical_lengths,
    index_key,
    punctuation_words,
    rrf_fuse,
)

from metachunk.artifacts import InputError, read_run_log  # noqa: E402
from metachunk.cli import main  # noqa: E402

ZH = ["西安市发放500万元体育类电子消费券，全市173家体育场馆可以使用。", "今天北京天气晴朗，很多市民去公园散步。",
      "上海举办国际汽车展览会，新能源汽车成为焦点。", "体育场馆的消费券由市体育局统一发放。",
      "公园里的花开了，市民们纷纷拍照留念。"]  # fmt: skip
EN = ["The apple orchard was full of ripe red apples.", "Emma walked to Hartfield in the rain.",
      "Mr. Knightley read the letter twice.", "Apples and pears filled the basket.",
      "The rain stopped before noon."]  # fmt: skip


def records(texts: list[str]) -> list[ChunkRecord]:
    return [ChunkRecord(i, f"d{i}", 0, 0, len(t), t, t) for i, t in enumerate(texts)]


def bm25_by_hand(
    query: str, texts: list[str], tokenize, k1: float = 1.5, b: float = 0.75
) -> dict[int, float]:
    """Milvus Lite's BM25 (milvus_lite/index/sparse_inverted.py), computed independently:

        score(D, Q) = sum over distinct query terms t of
                      qtf(t) * IDF(t) * tf(t, D) * (k1 + 1) / (tf(t, D) + k1 * (1 - b + b * |D| / avgdl))
        IDF(t)      = ln((N - df(t) + 0.5) / (df(t) + 0.5) + 1)

    with N documents, df(t) the documents holding t, |D| a document's token count, avgdl their mean,
    and qtf(t) how often t occurs in the query. Documents sharing no term score nothing."""
    docs = [Counter(tokenize(t)) for t in texts]
    n, avgdl = len(docs), sum(sum(d.values()) for d in docs) / len(docs)
    scores = {}
    for i, d in enumerate(docs):
        score = 0.0
        for term, qtf in Counter(tokenize(query)).items():
            df = sum(1 for x in docs if term in x)
            if term in d:
                idf = math.log((n - df + 0.5) / (df + 0.5) + 1.0)
                tf, dl = d[term], sum(d.values())
                score += qtf * idf * tf * (k1 + 1.0) / (tf + k1 * (1.0 - b + b * dl / avgdl))
        if score > 0:
            scores[i] = score
    return scores


def jieba_exact(
    text: str,
) -> list[str]:  # the analyzer's own steps: cut, strip, lower, drop blanks and punctuation
    marks = set(punctuation_words())
    return [t.strip().lower() for t in jieba.cut(text) if t.strip() and t.strip() not in marks]


def standard(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@pytest.mark.parametrize(("texts", "queries", "lexical", "tokenize"), [
    (ZH, ["体育场馆消费券？", "公园 市民 散步", "汽车"], Lexical("jieba", "exact", 1.5, 0.75), jieba_exact),
    (EN, ["apples in the orchard", "rain at Hartfield", "letter"], Lexical("standard"), standard),
])  # fmt: skip
def test_bm25_scores_equal_the_formula(tmp_path, texts, queries, lexical, tokenize):
    index = ChunkIndex(tmp_path)
    try:
        index.build("c", records(texts), None, {}, lexical=lexical)  # one insert and flush: one segment
        found = index.search_text("c", queries, limit=len(texts))
    finally:
        index.close()
    assert len(found) == len(queries) and all(found)  # every query has hits: the loop below checks something
    for query, hits in zip(queries, found):
        expected = bm25_by_hand(query, texts, tokenize, lexical.k1, lexical.b)
        assert {cid for cid, _ in hits} == set(expected), query
        for cid, score in hits:
            assert score == pytest.approx(expected[cid], rel=1e-5), (query, cid)
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)


def test_a_question_mark_is_no_search_term_in_chinese(tmp_path):
    """jieba keeps "？" as a word, and almost every CRUD question ends in one while few news chunks hold
    one: its IDF pulled those few to the top (36 of 184 first places on CRUD, 30 of them wrong)."""
    texts = [*ZH, "你知道吗？体育馆今天开门吗？", "天气？公园？"]
    index = ChunkIndex(tmp_path)
    try:
        index.build("c", records(texts), None, {}, lexical=Lexical("jieba", "exact"))
        marks_only, question = index.search_text("c", ["？。！", "体育场馆消费券是多少？"], limit=len(texts))
    finally:
        index.close()
    assert marks_only == []  # no term left: nothing matches
    assert question[0][0] in (0, 3) and all(
        cid != 6 for cid, _ in question
    )  # the chunks about it, not the "？"s
    assert {"？", "。", "“", "》", "…", "!", "..."} <= set(punctuation_words())


def test_rrf_ties_go_to_the_best_single_rank_then_the_smaller_id():
    """One route's r-th and the other's r-th tie; Milvus Lite broke that by insertion order."""
    fused = rrf_fuse([[7, 3, 5], [9, 3, 1]], k=60, limit=10)
    assert [i for i, _ in fused] == [3, 7, 9, 1, 5]  # 3 in both; 7 and 9 both first once: smaller id first
    assert fused[0][1] == pytest.approx(2 / 62) and fused[1][1] == fused[2][1] == pytest.approx(1 / 61)
    assert rrf_fuse([[9, 3, 1], [7, 3, 5]], k=60, limit=10) == fused  # the routes' order does not matter
    assert len(rrf_fuse([[1, 2, 3], [4, 5, 6]], k=60, limit=4)) == 4


def test_hybrid_is_reciprocal_rank_fusion(tmp_path):
    import numpy as np

    texts = EN
    vectors = np.eye(5, 8, dtype=np.float32)  # chunk i points along axis i
    queries = ["apples in the orchard", "rain at Hartfield"]
    query_vectors = np.eye(5, 8, dtype=np.float32)[[3, 4]]  # dense prefers chunks 3 and 4
    index = ChunkIndex(tmp_path)
    try:
        index.build("h", records(texts), vectors, {}, lexical=Lexical("standard"))
        dense = index.search("h", query_vectors, 5)
        sparse = index.search_text("h", queries, 5)
        fused = index.search_hybrid("h", query_vectors, queries, limit=5, fetch=5, rrf_k=60)
    finally:
        index.close()
    assert len(dense) == len(sparse) == len(fused) == len(queries) and all(len(f) == 5 for f in fused)
    for d, s, f in zip(dense, sparse, fused):
        rrf = Counter()
        for route in (d, s):
            for rank, (cid, _) in enumerate(route, start=1):
                rrf[cid] += 1.0 / (60 + rank)
        assert [x for _, x in f] == sorted((x for _, x in f), reverse=True)
        assert sorted(rrf.values(), reverse=True)[: len(f)] == pytest.approx([x for _, x in f])
        for cid, score in f:
            assert score == pytest.approx(rrf[cid], rel=1e-6)


def write_chunks(path: Path, docs: dict[str, list[str]]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for doc_id, texts in docs.items():
            chunks, start = [], 0
            for t in texts:
                chunks.append({"text": t, "start": start, "end": start + len(t)})
                start += len(t)
            f.write(json.dumps({"schema_version": 1, "id": doc_id, "method": "fixed", "chunks": chunks},
                               ensure_ascii=False) + "\n")  # fmt: skip
    return path


def test_chinese_crud_questions_through_the_cli(tmp_path, capsys):
    chunks = write_chunks(tmp_path / "zh.jsonl", {"news1": ZH[:2], "news2": ZH[2:]})
    qa_rows = [{"qa_id": "e1", "status": "matched", "doc_ids": ["news1"], "key_info": ["500万元体育类电子消费券"],
                "questions": ["西安发放了多少体育类电子消费券？"], "answers": ["500万元"]},
               {"qa_id": "e2", "status": "matched", "doc_ids": ["news2"], "key_info": ["新能源汽车成为焦点"],
                "questions": ["上海汽车展览会的焦点是什么？"], "answers": ["新能源汽车"]}]  # fmt: skip
    questions = tmp_path / "qa_matches.jsonl"
    questions.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in qa_rows), encoding="utf-8")
    out = tmp_path / "run"
    argv = ["eval", "qa", "--chunks", str(chunks), "--qa", str(questions), "--out", str(out), "--top-k", "2",
            "--retriever", "bm25", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert doc["details"]["index"]["retriever"] == "bm25" and doc["details"]["index"]["embedder"] is None
    assert doc["details"]["index"]["lexical"] == {"analyzer": "jieba", "mode": "exact", "k1": 1.5, "b": 0.75,
                                                  "stop": "punctuation"}  # fmt: skip
    assert doc["metrics"]["avg_chunk_tokens"] is None  # no embedder, no tokens to count
    assert doc["metrics"]["hits@1"] == 1.0  # each question's own article first
    capsys.readouterr()
    assert main(argv) == 0  # the same settings: the index is reused
    assert read_run_log(out)[-1]["index_built"] is False
    assert main([*argv, "--jieba-mode", "search"]) == 0  # another analyzer mode: another index
    assert read_run_log(out)[-1]["index_built"] is True
    auto = [a for a in argv if a not in ("--retriever", "bm25")]  # the default, auto: bm25 for Chinese
    assert main(auto) == 0
    assert json.loads((out / "metrics.json").read_text())["details"]["index"]["retriever"] == "bm25"
    capsys.readouterr()
    assert main([*argv, "--lang", "en"]) == 0  # the standard analyzer on Chinese: said, not silent
    assert "pass --lang zh (jieba)" in capsys.readouterr().err


def test_english_gutenqa_questions_bm25_and_hybrid(tmp_path):
    chunks = write_chunks(tmp_path / "en.jsonl", {"emma": EN})
    questions = tmp_path / "questions.jsonl"
    rows = [{"question": "Where were the ripe apples?", "answer": "the orchard", "chunk_must_contain": "apple orchard"},
            {"question": "What did Knightley read?", "answer": "a letter", "chunk_must_contain": "read the letter"}]  # fmt: skip
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    for retriever in ("bm25", "hybrid"):
        out = tmp_path / retriever
        assert main(["eval", "qa", "--chunks", str(chunks), "--qa", str(questions), "--out", str(out), "--top-k", "3",
                     "--retriever", retriever, "--no-progress"]) == 0  # fmt: skip
        doc = json.loads((out / "metrics.json").read_text())
        assert doc["details"]["index"]["lexical"]["analyzer"] == "standard"
        assert doc["metrics"]["hits@3"] == 1.0, retriever
    assert json.loads((tmp_path / "hybrid" / "metrics.json").read_text())["details"]["index"]["rrf_k"] == 60


def test_a_chunk_too_long_for_the_text_field_is_refused(tmp_path, capsys):
    long = "雨" * (LEXICAL_MAX_BYTES // 3 + 1)  # 3 bytes a character in UTF-8
    with pytest.raises(InputError, match=r"document 'd1', chunk 0: 65,538 bytes .* nothing is cut"):
        check_lexical_lengths(records(["短。", long]), Path("c.jsonl"))
    chunks = write_chunks(tmp_path / "long.jsonl", {"a": ["短。", long]})
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "雨?", "answer": "雨", "chunk_must_contain": "雨雨"}) + "\n")
    assert main(["eval", "qa", "--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "o"),
                 "--retriever", "bm25", "--lang", "zh", "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert (
        "nothing is cut" in err and "Traceback" not in err and not (tmp_path / "o" / "metrics.json").exists()
    )


def test_the_index_key_holds_every_bm25_setting():
    base = index_key("sha", None, "chunk", "bm25", Lexical("jieba", "exact"))
    for other in (Lexical("jieba", "search"), Lexical("standard"), Lexical("jieba", "exact", k1=1.2),
                  Lexical("jieba", "exact", b=0.5)):  # fmt: skip
        assert index_key("sha", None, "chunk", "bm25", other) != base
    assert index_key("sha", "/m", "chunk", "hybrid", Lexical("jieba", "exact")) != base
    assert index_key("sha", "/m", "chunk") == index_key(
        "sha", "/m", "chunk", "dense", None
    )  # dense keys as before
    cfg = qa.QAConfig(chunks=Path("c"), qa=Path("q"), out=Path("o"), retriever="hybrid")
    assert (cfg.rrf_k, cfg.fusion_limit, cfg.jieba_mode) == (60, 50, "exact")


def test_milvus_lite_scores_with_its_own_k1_and_b(tmp_path):
    """Why ``Lexical`` keeps k1 = 1.5 and b = 0.75: Milvus Lite ignores the index's bm25_k1/bm25_b."""
    index = ChunkIndex(tmp_path)
    try:
        index.build("c", records(EN), None, {}, lexical=Lexical("standard", None, k1=1.2, b=0.6))
        ((cid, score), *_) = index.search_text("c", ["apples in the orchard"], 5)[0]
    finally:
        index.close()
    assert score == pytest.approx(bm25_by_hand("apples in the orchard", EN, standard)[cid], rel=1e-5)
