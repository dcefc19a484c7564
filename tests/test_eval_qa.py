"""``metachunk eval qa``: relevance rules, rank metrics, the Milvus index, re-ranking, generation.

Most tests run the real pipeline (chunks file -> Milvus Lite index -> retrieval -> report) with a
*planted* embedder: a bag-of-words over a six-word vocabulary, so every cosine, every rank and so
every Hits/MRR/MAP value is known by hand. Real models appear in the integration tests (MiniLM,
SmolLM2 as PPL re-ranker and as local generator).
"""

from __future__ import annotations

import json
import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from metachunk.eval import qa
from metachunk.eval.index import ChunkIndex, ChunkRecord, collection_name, index_key, read_chunks
from metachunk.eval.retrieval import (
    NormalizedDoc,
    Question,
    aggregate,
    crud_needle_levels,
    find_evidence,
    load_questions,
    rank_metrics,
    relevant_chunks,
)
from support.data import data_file

from metachunk.artifacts import read_run_log

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------- planted data

VOCAB = ["apple", "banana", "cherry", "delta", "echo", "fig"]

# Two documents, each the concatenation of its chunks (offsets tile the text).
PLANTED = {
    "A": ["apple apple apple. ", "apple banana. ", "cherry cherry delta. ", "fig fig echo. "],
    "B": [
        "apple cherry cherry cherry. ",
        "fig banana banana. ",
        "fig fig delta delta delta delta delta. ",
        "echo echo echo. ",
    ],
}
# Cosines with a one-word query (bag of words, unit vectors):
#   "apple":  A0 1.000, A1 0.707, B0 0.316            -> relevant A1 at rank 2
#   "cherry": B0 0.949, A2 0.894                       -> relevant B0 at rank 1
#   "fig":    A3 0.894, B1 0.447, B2 0.371             -> relevant A3, B2 ("fig fig" twice): ranks 1, 3
#   "echo":   B3 1.000, A3 0.447                        -> no evidence in the corpus
QUESTIONS = [
    {"question": "Which apple?", "answer": "the apple one", "chunk_must_contain": "apple banana"},
    {
        "question": "Which cherry?",
        "answer": "the cherry one",
        "chunk_must_contain": "apple cherry cherry cherry",
    },
    {"question": "Which fig?", "answer": "the fig one", "chunk_must_contain": "fig fig"},
    {"question": "Which echo?", "answer": "nothing", "chunk_must_contain": "zebra crossing"},
]
# top_k = 3. Per question (hits@1, hits@2, hits@3, RR, AP@3):
#   apple (0, 1, 1, 1/2, 1/2); cherry (1, 1, 1, 1, 1); fig (1, 1, 1, 1, (1 + 2/3) / 2); echo all 0.
EXPECTED = {
    "hits@1": 2 / 4,
    "hits@2": 3 / 4,
    "hits@3": 3 / 4,
    "mrr@3": (0.5 + 1 + 1 + 0) / 4,
    "map@3": (0.5 + 1 + (1 + 2 / 3) / 2 + 0) / 4,
}


class PlantedEmbedder:
    """A bag-of-words "sentence embedder" with the SentenceTransformer calls eval qa makes."""

    max_seq_length = 256

    def __init__(self):
        self.embedded: list[str] = []

    @staticmethod
    def vector(text: str) -> np.ndarray:
        words = re.findall(r"[a-z]+", text.lower())
        v = np.array([words.count(w) for w in VOCAB], dtype=np.float32)
        return v / max(float(np.linalg.norm(v)), 1e-9)

    def encode(self, texts, **kwargs):
        self.embedded += list(texts)
        return np.stack([self.vector(t) for t in texts])

    def get_embedding_dimension(self) -> int:
        return len(VOCAB)

    def tokenizer(self, texts, add_special_tokens=False):
        return {"input_ids": [t.split() for t in texts]}


@pytest.fixture
def planted_embedder(monkeypatch):
    import metachunk.models

    embedder = PlantedEmbedder()
    real_resolve = metachunk.models.resolve
    monkeypatch.setattr(metachunk.models, "load_sentence_embedder", lambda name, device=None: embedder)
    # the embedder's name resolves to a fake path (part of the index key); other models stay real
    monkeypatch.setattr(
        metachunk.models, "resolve", lambda name: Path("/planted") if name == "minilm" else real_resolve(name)
    )
    return embedder


def write_chunks(path: Path, docs: dict[str, list[str]], extra: dict | None = None) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for doc_id, texts in docs.items():
            chunks, start = [], 0
            for i, t in enumerate(texts):
                chunk = {"text": t, "start": start, "end": start + len(t)}
                chunk.update((extra or {}).get((doc_id, i), {}))
                chunks.append(chunk)
                start += len(t)
            f.write(
                json.dumps({"schema_version": 1, "id": doc_id, "method": "fixed", "chunks": chunks}) + "\n"
            )
    return path


def write_questions(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def planted(tmp_path):
    return (
        write_chunks(tmp_path / "chunks.jsonl", PLANTED),
        write_questions(tmp_path / "questions.jsonl", QUESTIONS),
    )


def parse(argv: list[str]) -> qa.QAConfig:
    """Through the real ``metachunk eval qa`` parser."""
    from metachunk.cli import parse as cli_parse

    return cli_parse(["eval", "qa", *argv])[1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture
def qa_scores(monkeypatch):
    """``metachunk.eval.metrics.qa_scores`` wrapped to record its calls (a stand-in where that module is absent)."""
    calls = []
    try:
        from metachunk.eval.metrics import qa_scores as real
    except ImportError:
        real = None

    def scores(predictions, references, lang, bertscore_model="minilm", embedder="minilm", per_item=False):
        calls.append((list(predictions), list(references), lang))
        if real is not None:
            return real(predictions, references, lang, bertscore_model=bertscore_model, embedder=embedder,
                        per_item=per_item)  # fmt: skip
        same = [float(p.strip() == r.strip()) for p, r in zip(predictions, references)]
        means = {"f1": sum(same) / len(same), "bleu_avg": 0.0, "rouge_l": 0.0}
        return (means, [{"f1": x, "bleu_avg": 0.0, "rouge_l": 0.0} for x in same]) if per_item else means

    module = types.ModuleType("metachunk.eval.metrics")
    module.qa_scores = scores
    monkeypatch.setitem(sys.modules, "metachunk.eval.metrics", module)
    return calls


# ------------------------------------------------------------------------------- rank metrics


def test_rank_metrics_by_hand():
    m = rank_metrics([False, True, False, True], n_relevant=3, k=4)
    # DCG: GutenQA's, binary relevance, the first match only: 1 / log2(2 + 1)
    assert m == {
        "hits": 1.0,
        "mrr": 0.5,
        "map": pytest.approx((1 / 2 + 2 / 4) / 3),
        "dcg": pytest.approx(1 / 1.5849625),
    }
    assert rank_metrics([True], n_relevant=1, k=1)["dcg"] == 1.0
    assert rank_metrics([False, True], n_relevant=1, k=1) == {"hits": 0.0, "mrr": 0.0, "map": 0.0, "dcg": 0.0}
    assert rank_metrics([False, False], n_relevant=0, k=2)["map"] == 0.0
    # AP@k divides by min(R, k): 5 relevant chunks, 2 of them in a top 2
    assert rank_metrics([True, True], n_relevant=5, k=2)["map"] == 1.0
    m = aggregate([[True, False], [False, True]], [1, 1], hit_ks=[1, 2], score_ks=[2], prefix="x_")
    assert m == {"x_hits@1": 0.5, "x_hits@2": 1.0, "x_mrr@2": 0.75, "x_map@2": 0.75,
                 "x_dcg@2": pytest.approx((1 + 1 / 1.5849625) / 2)}  # fmt: skip


# ------------------------------------------------------------------------------- relevance


def _chunks_by_doc(doc_id: str, pieces: list[str]) -> tuple[str, dict]:
    text, spans, start = "".join(pieces), [], 0
    for i, p in enumerate(pieces):
        spans.append((i, start, start + len(p)))
        start += len(p)
    return text, {doc_id: spans}


def _relevant(question: Question, doc_id: str, pieces: list[str], min_share=0.5, rule="share") -> set[int]:
    text, by_doc = _chunks_by_doc(doc_id, pieces)
    evidence = find_evidence(question, {doc_id: NormalizedDoc(doc_id, text)}, fuzzy=True)
    return relevant_chunks(evidence, by_doc, min_share, rule)


def _gq(must: str) -> Question:
    return Question("q", "?", "!", [[must]])


def test_gutenqa_must_contain_inside_one_chunk():
    pieces = ["Alpha beta gamma. ", "The needle sits here whole. ", "Omega."]
    assert _relevant(_gq("needle sits here"), "d", pieces) == {1}


def test_gutenqa_must_contain_cut_in_two_or_three():
    # 70/30: the chunk holding most of it
    must = "0123456789"
    assert _relevant(_gq(must), "d", ["xx0123456", "789yy"]) == {0}
    # 50/50: both halves count
    assert _relevant(_gq(must), "d", ["xx01234", "56789yy"]) == {0, 1}
    # spread over three chunks, none with half: the largest share still counts
    must = "abcdefghij"
    assert _relevant(_gq(must), "d", ["xxabc", "defg", "hijyy"]) == {1}
    # min_share 0.3: each chunk holding >= 30%
    assert _relevant(_gq(must), "d", ["xxabc", "defg", "hijyy"], min_share=0.3) == {0, 1, 2}


def test_whole_relevance_is_gutenqas_a_cut_evidence_string_has_no_relevant_chunk():
    pieces = ["Alpha beta gamma. ", "The needle sits here whole. ", "Omega."]
    assert _relevant(_gq("needle sits here"), "d", pieces, rule="whole") == {1}
    assert _relevant(_gq("0123456789"), "d", ["xx0123456", "789yy"], rule="whole") == set()
    assert _relevant(_gq("0123456789"), "d", ["xx01234", "56789yy"], rule="whole") == set()
    # found through the normalisation map (curly quotes in the book, straight in GutenQA): still whole
    assert _relevant(
        _gq("'Yes,' said she"), "d", ["x. ", "\u2018Yes,\u2019 said she. ", "y"], rule="whole"
    ) == {1}


def test_gutenqa_normalised_and_fuzzy_matches():
    # curly quotes, NBSP and a paragraph break, as in the book vs GutenQA's straight quotes
    pieces = ["Intro. ", "It was the end of an old pencil,\u2014the part without any lead.\n\n\u201cThis was really his,\u201d said Harriet. ", "End."]  # fmt: skip
    must = "It was the end of an old pencil,\u2014the part without any lead. 'This was really his,' said Harriet."
    text, by_doc = _chunks_by_doc("d", pieces)
    evidence = find_evidence(_gq(must), {"d": NormalizedDoc("d", text)}, fuzzy=True)
    assert [e.how for e in evidence] == ["normalized"]
    assert relevant_chunks(evidence, by_doc, 0.5) == {1}
    # GutenQA trimmed narration out of a quote (question 28): only a fuzzy alignment finds it
    pieces = [
        "Intro. ",
        "\u201cHarriet!\u201d cried Emma, after a moment\u2019s pause\u2014\u201cWhat do you mean?\u2014Good Heaven! what "
        "do you mean?\u2014Mistake you!\u2014Am I to suppose then?\u2014\u201d\n\nShe could not speak another word.\u2014Her "
        "voice was lost; and she sat down, waiting in great terror till Harriet should answer. ",
        "End.",
    ]
    must = (
        "Harriet!\u2014What do you mean?\u2014Good Heaven! what do you mean?\u2014Mistake you!\u2014Am I to suppose "
        "then?\u2014She could not speak another word.\u2014Her voice was lost; and she sat down, waiting in great "
        "terror till Harriet should answer."
    )
    text, by_doc = _chunks_by_doc("d", pieces)
    evidence = find_evidence(_gq(must), {"d": NormalizedDoc("d", text)}, fuzzy=True)
    assert len(evidence) == 1 and evidence[0].how.startswith("fuzzy:")
    assert relevant_chunks(evidence, by_doc, 0.5) == {1}
    # absent: nothing relevant
    assert _relevant(_gq("a sentence that is nowhere in this text at all"), "d", pieces) == set()


def test_real_gutenqa_questions_are_all_located():
    """Every one of the 30 GutenQA questions for Emma is found in the book (4 need normalising, 1 fuzzy)."""
    chapters: dict[str, list[str]] = {}
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            chapters.setdefault(row["chapter"], []).append(row["text"])
    docs = {c: NormalizedDoc(c, "\n\n".join(p)) for c, p in chapters.items()}
    _, questions, _ = load_questions(data_file("gutenqa-emma/questions.jsonl"))
    hows = [find_evidence(q, docs, fuzzy=True) for q in questions]
    assert len(questions) == 30 and all(len(h) >= 1 for h in hows)
    kinds = [h[0].how.split(":")[0] for h in hows]
    assert (kinds.count("verbatim"), kinds.count("normalized"), kinds.count("fuzzy")) == (25, 4, 1)


def test_crud_needles_follow_the_answer():
    keys = ["陕西西安市", "500万元体育类电子消费券", "全市173家体育场馆"]
    assert crud_needle_levels("体育类电子消费券的总金额是多少？", "500万元", keys)[0] == [
        "500万元体育类电子消费券"
    ]
    # an answer that states nothing: the key strings the question names, then all of them
    levels = crud_needle_levels("哪个城市发放了500万元体育类电子消费券？", "无法推断", keys)
    assert levels == [["500万元体育类电子消费券"], keys]
    # an informative answer no key holds: the answer itself plus the keys in the question
    levels = crud_needle_levels("陕西西安市的场馆有多少家？", "很多家", keys)
    assert levels == [["很多家", "陕西西安市"], keys]


def test_crud_relevance_needs_the_matched_article(tmp_path):
    rows = [
        {"qa_id": "e1", "status": "matched", "doc_ids": ["news1"], "key_info": ["西安市", "500万元体育类电子消费券"],
         "questions": ["总金额是多少？", "哪个城市？"], "answers": ["500万元", "西安市"]},
        {"qa_id": "e2", "status": "unmatched", "doc_ids": [], "key_info": ["x"], "questions": ["?"], "answers": ["x"]},
        {"qa_id": "e3", "status": "ambiguous", "doc_ids": ["news1", "news2"], "key_info": ["场馆"],
         "questions": ["在哪里用？"], "answers": ["场馆"]},
        {"qa_id": "e4", "status": "matched", "doc_ids": ["news1"], "key_info": ["场馆"],
         "questions": ["a？", "b？"], "answers": ["场馆"]},  # answers skip a question: left out
    ]  # fmt: skip
    path = write_questions(tmp_path / "qa_matches.jsonl", rows)
    fmt, questions, skipped = load_questions(path)
    assert fmt == "crud" and [q.qid for q in questions] == ["e1#0", "e1#1", "e3#0"]
    assert skipped == {"crud_entries_unpaired": 1, "crud_questions_unpaired": 2}
    assert [q.qid for q in load_questions(path, "crud", ("matched",))[1]] == ["e1#0", "e1#1"]
    news1 = ["2023年，西安市发放", "500万元体育类电子消费券，", "可在全市场馆使用。"]
    news2 = ["另一篇：500万元体育类电子消费券也在别处。"]
    text1, by1 = _chunks_by_doc("news1", news1)
    text2, by2 = _chunks_by_doc("news2", news2)
    by2 = {"news2": [(10 + i, a, b) for i, a, b in by2["news2"]]}
    docs = {"news1": NormalizedDoc("news1", text1), "news2": NormalizedDoc("news2", text2)}
    chunks = {**by1, **by2}

    def rel(q):
        return relevant_chunks(find_evidence(q, docs, fuzzy=False), chunks, 0.5)

    assert rel(questions[0]) == {1}  # the key holding "500万元", in news1 only (news2 is not the evidence)
    assert rel(questions[1]) == {0}
    assert rel(questions[2]) == {2}  # ambiguous: any of its articles


@pytest.mark.parametrize(
    "change, said",
    [
        ({"qa_id": "e1"}, "field 'qa_id': 'e1' is a duplicate of line 1"),
        ({"key_info": [None, "x"]}, "field 'key_info': item 0 must be a string, got None"),
        ({"questions": [1]}, "field 'questions': item 0 must be a string, got 1"),
    ],
)
def test_a_crud_entry_asked_twice_or_with_a_non_string_item_is_named(tmp_path, change, said):
    """A repeated qa_id was asked and counted twice (eval compare then collapsed it by id: its own
    table and its paired difference disagreed); a null key became the evidence string "None"."""
    from metachunk.artifacts import InputError

    row = {"qa_id": "e1", "status": "matched", "doc_ids": ["news1"], "key_info": ["西安市"],
           "questions": ["哪个城市？"], "answers": ["西安市"]}  # fmt: skip
    path = write_questions(tmp_path / "qa_matches.jsonl", [row, {**row, "qa_id": "e2", **change}])
    with pytest.raises(InputError, match=re.escape(said)) as e:
        load_questions(path, "crud")
    assert "qa_matches.jsonl:2" in str(e.value)


# ------------------------------------------------------------------------------- index


def _records(n: int) -> list[ChunkRecord]:
    return [ChunkRecord(i, f"d{i % 3}", i // 3, 0, 1, f"t{i}", f"t{i}") for i in range(n)]


def test_milvus_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(40, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[[3, 17, 29]] + 0.05 * rng.normal(size=(3, 16)).astype(np.float32)
    name = collection_name(index_key("a" * 64, "/models/e", "chunk"))
    index = ChunkIndex(tmp_path)
    assert not index.has(name, 40)
    index.build(name, _records(40), vectors, {"note": "test"})
    assert index.has(name, 40) and not index.has(name, 41)
    first = index.search(name, queries, 5)
    index.close()
    assert [hits[0][0] for hits in first] == [3, 17, 29]
    expected = np.argsort(-(queries @ vectors.T), axis=1)[:, :5]
    assert [[cid for cid, _ in hits] for hits in first] == expected.tolist()

    reopened = ChunkIndex(tmp_path)  # a new client on the same file
    try:
        assert reopened.has(name, 40)
        again = reopened.search(name, queries, 5)
        assert [[c for c, _ in h] for h in again] == [[c for c, _ in h] for h in first]
        assert np.allclose([[s for _, s in h] for h in again], [[s for _, s in h] for h in first], atol=1e-6)
        assert reopened.client.list_collections() == [name]  # the temporary build name is gone
    finally:
        reopened.close()
    assert json.loads((tmp_path / "index.collections.json").read_text())[name]["rows"] == 40


def test_index_key_changes_with_each_input():
    keys = {
        index_key("a" * 64, "/m/minilm", "chunk"),
        index_key("b" * 64, "/m/minilm", "chunk"),
        index_key("a" * 64, "/m/bge", "chunk"),
        index_key("a" * 64, "/m/minilm", "summary+chunk"),
    }
    assert len(keys) == 4


def test_read_chunks_index_text_modes(tmp_path):
    extra = {("A", 0): {"summary": "Sum.", "rewritten": "Apple, rewritten."}, ("A", 1): {"summary": " "}}
    path = write_chunks(tmp_path / "c.jsonl", {"A": PLANTED["A"]}, extra)
    chunks, docs, lacking = read_chunks(path, "summary+chunk")
    assert docs["A"] == "".join(PLANTED["A"]) and lacking == 3
    assert (
        chunks[0].indexed_text == "Sum.\n\napple apple apple. " and chunks[1].indexed_text == chunks[1].text
    )
    chunks, _, lacking = read_chunks(path, "rewritten")
    assert chunks[0].indexed_text == "Apple, rewritten." and lacking == 3
    # both students' fields: a chunk lacking either counts as lacking; the rewrite replaces the text
    chunks, _, lacking = read_chunks(path, "summary+rewritten")
    assert chunks[0].indexed_text == "Sum.\n\nApple, rewritten." and lacking == 3
    assert chunks[1].indexed_text == chunks[1].text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "chunks": [{"text": "ab", "start": 0, "end": 5}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: chunks\[0\]"):
        read_chunks(bad)
    bad.write_text('{"id": "x", "chunks": [{"text": "ab", "start": "0", "end": 2}]}\n')  # a string offset
    with pytest.raises(
        ValueError,
        match=r"bad.jsonl:1: chunks\[0\] needs text, start and end \('start' and 'end' must be ints",
    ):
        read_chunks(bad)


@pytest.mark.parametrize(
    "chunks, error, document",
    [
        ([("abc", -3), ("xyz", 10)], r"chunks\[0\] starts at -3: an offset into the document is >= 0", None),
        ([("abc", 0), ("xy", 2)], r"chunks\[1\]: its text differs from a chunk it overlaps", None),
        ([("abc", 0), ("cde", 2)], None, "abcde"),  # `chunk --overlap`: the overlap agrees
        ([("abc", 0), ("xyz", 5)], None, "abc\0\0xyz"),  # a chunker that drops whitespace: the gap is unknown
    ],
)
def test_the_document_is_rebuilt_from_chunks_that_agree(tmp_path, chunks, error, document):
    """A negative offset, or an overlap whose texts differ, would make up text to search for evidence in."""
    path = tmp_path / "c.jsonl"
    rows = [{"text": t, "start": s, "end": s + len(t)} for t, s in chunks]
    path.write_text(json.dumps({"id": "x", "chunks": rows}) + "\n")
    if error is None:
        assert read_chunks(path)[1] == {"x": document}
    else:
        with pytest.raises(ValueError, match=r"c.jsonl:1: " + error):
            read_chunks(path)


# ------------------------------------------------------------------------------- the command


def test_planted_corpus_metrics_through_the_cli(planted, planted_embedder, tmp_path, capsys):
    chunks, questions = planted
    out = tmp_path / "run"
    cfg = parse(
        ["--chunks", str(chunks), "--qa", str(questions), "--top-k", "3", "--out", str(out), "--no-progress"]
    )
    assert qa.run(cfg).exit == 0
    # one question's evidence is in no chunked document: said, as it counts as a miss in every mean
    assert "1 of 4 questions have no evidence in these chunks' documents" in capsys.readouterr().err
    doc = json.loads((out / "metrics.json").read_text())
    m = doc["metrics"]
    for name, value in EXPECTED.items():
        assert m[name] == pytest.approx(value), name
    assert m["n_questions"] == 4 and m["n_answerable"] == 3 and m["n_chunks"] == 8
    assert m["avg_chunk_chars"] == pytest.approx(sum(len(t) for d in PLANTED.values() for t in d) / 8)
    assert doc["details"]["qa_format"] == "gutenqa" and read_run_log(out)[-1]["index_built"] is True
    assert "| hits@3 | 0.7500 |" in (out / "report.md").read_text()
    assert m["dcg@3"] == pytest.approx((1 / math.log2(3) + 1 + 1 + 0) / 4)
    # every planted string sits whole in one chunk: GutenQA's rule gives the same figures
    whole = qa.evaluate(parse(["--chunks", str(chunks), "--qa", str(questions), "--top-k", "3", "--out",
                               str(tmp_path / "whole"), "--no-progress", "--relevance", "whole"]))  # fmt: skip
    assert {k: whole["metrics"][k] for k in EXPECTED} == {k: m[k] for k in EXPECTED}
    assert whole["details"]["relevance"].startswith(
        "a chunk is relevant when it holds an evidence span whole"
    )

    rows = read_jsonl(out / "retrieval.jsonl")
    assert [r["qid"] for r in rows] == ["gutenqa-0", "gutenqa-1", "gutenqa-2", "gutenqa-3"]
    assert set(rows[0]) == {"qid", "question", "answer", "lang", "relevant_any", "hits", "reranked"}
    assert set(rows[0]["hits"][0]) == {"rank", "doc_id", "chunk_index", "start", "end", "text", "indexed_text", "score", "relevant"}  # fmt: skip
    apple = rows[0]["hits"]
    assert [(h["doc_id"], h["chunk_index"], h["relevant"]) for h in apple] == [("A", 0, False), ("A", 1, True), ("B", 0, False)]  # fmt: skip
    assert [h["score"] for h in apple] == pytest.approx([1.0, 1 / math.sqrt(2), 1 / math.sqrt(10)], abs=1e-5)
    assert [h["rank"] for h in apple] == [1, 2, 3] and apple[1]["text"] == "apple banana. "
    fig = rows[2]["hits"]
    assert [(h["doc_id"], h["chunk_index"], h["relevant"]) for h in fig] == [("A", 3, True), ("B", 1, False), ("B", 2, True)]  # fmt: skip
    assert rows[3]["relevant_any"] is False and rows[0]["reranked"] is None and rows[0]["lang"] == "en"
    assert not (out / "answers.jsonl").exists()

    # only the questions with evidence in the corpus
    cfg = parse(["--chunks", str(chunks), "--qa", str(questions), "--top-k", "3", "--out", str(tmp_path / "ans"),
                 "--questions", "answerable", "--no-progress"])  # fmt: skip
    m = qa.evaluate(cfg)["metrics"]
    assert m["n_questions"] == 3 and m["hits@1"] == pytest.approx(2 / 3)
    assert m["mrr@3"] == pytest.approx(2.5 / 3) and m["map@3"] == pytest.approx((0.5 + 1 + 5 / 6) / 3)


def test_index_is_reused_until_the_chunks_change(planted, planted_embedder, tmp_path):
    chunks, questions = planted
    shared = tmp_path / "index"

    def run(out: str, path: Path = chunks, mode: str = "chunk") -> dict:
        argv = ["--chunks", str(path), "--qa", str(questions), "--out", str(tmp_path / out), "--index-dir", str(shared),
                "--top-k", "3", "--no-progress", "--index-text", mode]  # fmt: skip
        return qa.evaluate(parse(argv))

    def built(out: str) -> bool:
        return read_run_log(tmp_path / out)[-1]["index_built"]

    first = run("one")
    assert built("one") and len(planted_embedder.embedded) == 8 + 4
    second = run("two")
    assert not built("two") and len(planted_embedder.embedded) == 8 + 4 + 4  # questions only
    assert second["details"]["index"]["collection"] == first["details"]["index"]["collection"]
    assert read_jsonl(tmp_path / "one" / "retrieval.jsonl") == read_jsonl(
        tmp_path / "two" / "retrieval.jsonl"
    )

    changed = dict(PLANTED, B=[*PLANTED["B"][:3], "echo echo echo echo. "])
    other = write_chunks(tmp_path / "changed.jsonl", changed)
    third = run("three", other)
    assert built("three")
    assert third["details"]["index"]["collection"] != first["details"]["index"]["collection"]
    summaries = write_chunks(tmp_path / "sum.jsonl", PLANTED, {("A", 1): {"summary": "banana banana"}})
    run("four", summaries, "summary+chunk")
    assert built("four")
    hit = read_jsonl(tmp_path / "four" / "retrieval.jsonl")[0]["hits"][1]
    assert hit["indexed_text"] == "banana banana\n\napple banana. " and hit["text"] == "apple banana. "
    with pytest.raises(ValueError, match="no chunk has a 'rewritten' field"):
        run("five", chunks, "rewritten")
    with pytest.raises(ValueError, match=r"no chunk has a 'summary' and a 'rewritten' field \(make them with "
                       r"`metachunk chunk --summarize MODEL --rewrite MODEL`\)"):  # fmt: skip
        run("six", chunks, "summary+rewritten")
    index = ChunkIndex(shared)
    try:
        assert len(index.client.list_collections()) == 3
    finally:
        index.close()


def test_bad_inputs_are_input_errors(planted, tmp_path):
    chunks, questions = planted
    raw = tmp_path / "questanswer_1doc.json"
    raw.write_text('{"x": {"key_info": [], "question": [], "answers": []}}')
    with pytest.raises(ValueError, match="prepare-crud"):
        qa.evaluate(qa.QAConfig(chunks=chunks, qa=raw, out=tmp_path / "o"))
    with pytest.raises(ValueError, match="not both"):
        qa.QAConfig(
            chunks=chunks, qa=questions, out=tmp_path, generator="http://h:1/v1:m", generator_model="smollm2"
        )
    with pytest.raises(ValueError, match="needs --reranker"):
        qa.QAConfig(chunks=chunks, qa=questions, out=tmp_path, rerank="cross-encoder")
    with pytest.raises(ValueError, match="'cutoffs': 10 is deeper than the 5 chunks retrieved"):
        qa.QAConfig(chunks=chunks, qa=questions, out=tmp_path, top_k=5, cutoffs=[8, 10])  # they were dropped
    qa.QAConfig(chunks=chunks, qa=questions, out=tmp_path, top_k=5, cutoffs=[8], rerank="ppl", reranker="x")
    with pytest.raises(ValueError, match="--max-cost needs a price for the endpoint's model 'm'"):
        qa.QAConfig(chunks=chunks, qa=questions, out=tmp_path, generator="http://h:1/v1:m", max_cost=1.0)


def test_parse_generator():
    from metachunk.eval.generate import parse_generator

    assert parse_generator("http://127.0.0.1:8000/v1:Qwen/Qwen2-7B-Instruct") == ("http://127.0.0.1:8000/v1", "Qwen/Qwen2-7B-Instruct")  # fmt: skip
    assert parse_generator("https://api.example.com/v1:qwen2:7b") == (
        "https://api.example.com/v1",
        "qwen2:7b",
    )
    for bad in ("127.0.0.1:8000/v1:m", "http://127.0.0.1:8000:m", "http://h/v1"):
        with pytest.raises(ValueError):
            parse_generator(bad)


def test_recipes_parse():
    from metachunk.config import load_yaml

    recipes = sorted((ROOT / "recipes" / "eval").glob("qa_*.yaml"))
    assert {p.name for p in recipes} >= {"qa_emma.yaml", "qa_crud.yaml"}
    for recipe in recipes:
        cfg = qa.QAConfig(**load_yaml(qa.QAConfig, recipe))
        assert cfg.top_k == 8 and cfg.generating


# ------------------------------------------------------------------------------- re-ranking


def test_ppl_scores_match_a_plain_forward_pass(tiny_model_dir):
    import torch
    from metachunk.eval.rerank import ppl_pair_ids, ppl_scores

    from metachunk.models import load_causal_lm

    model, tok = load_causal_lm(str(tiny_model_dir), device="cpu")
    queries = [("Who has the key?", ["The gardener has the key.", "Rain fell all day long on the town."]),
               ("Why?", ["Because.", "x" * 50])]  # fmt: skip
    scores = ppl_scores(model, tok, queries, "en", max_passage_tokens=16)
    for (question, passages), got in zip(queries, scores):
        for passage, score in zip(passages, got):
            ids, first = ppl_pair_ids(tok, passage, question, "en", 16)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            nll = torch.nn.functional.cross_entropy(logits[first - 1 : -1], torch.tensor(ids[first:]))
            # float32 sums in another order in the batched pass: a few parts in 1e5
            assert score == pytest.approx(-float(nll), abs=1e-4, rel=5e-5)
    assert len(ppl_pair_ids(tok, "x" * 200, "q", "en", 16)[0]) < 16 + 30  # long passages keep their head


def test_cross_encoder_rerank_follows_its_scores(planted, planted_embedder, tmp_path, monkeypatch):
    """A tiny random BERT cross-encoder: the reranked order is the order of its own scores."""
    import metachunk.eval.rerank

    from metachunk.models import ModelNotFoundError, preset_dir

    try:
        tokenizer_dir = preset_dir("minilm")  # a BERT tokenizer to build the tiny cross-encoder with
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    ce_dir = tmp_path / "tiny-ce"
    bert = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, num_labels=1)  # fmt: skip
    BertForSequenceClassification(bert).save_pretrained(ce_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(ce_dir)
    model = CrossEncoder(str(ce_dir), device="cpu")
    # `resolve` is the planted one in this test: hand the loaded model over directly
    monkeypatch.setattr(metachunk.eval.rerank, "load_cross_encoder", lambda name, device=None: model)
    chunks, questions = planted
    out = tmp_path / "ce"
    cfg = parse(["--chunks", str(chunks), "--qa", str(questions), "--out", str(out), "--top-k", "3",
                 "--rerank", "cross-encoder", "--reranker", str(ce_dir), "--rerank-depth", "5", "--no-progress"])  # fmt: skip
    doc = qa.evaluate(cfg)
    rows = read_jsonl(out / "retrieval.jsonl")
    for row in rows:
        assert len(row["hits"]) == 5 and len(row["reranked"]) == 5
        pairs = [(row["question"], h["indexed_text"]) for h in row["hits"]]
        scores = model.predict(pairs)
        expected = sorted(range(5), key=lambda i: -scores[i])
        assert [(h["doc_id"], h["chunk_index"]) for h in row["reranked"]] == [
            (row["hits"][i]["doc_id"], row["hits"][i]["chunk_index"]) for i in expected
        ]
        assert [h["rank"] for h in row["reranked"]] == [1, 2, 3, 4, 5]
    m = doc["metrics"]
    assert {"hits@5", "mrr@5", "map@3", "reranked_hits@3", "reranked_mrr@5", "reranked_map@5"} <= set(m)
    assert doc["details"]["rerank"]["method"] == "cross-encoder"
    items = read_jsonl(out / "items.jsonl")  # what eval compare's intervals resample: the re-ranked ones too
    assert all({"hits@5", "reranked_hits@3", "reranked_mrr@5"} <= set(item) for item in items)
    assert sum(item["reranked_hits@3"] for item in items) / len(items) == pytest.approx(m["reranked_hits@3"])


def test_cross_encoder_scores_come_back_in_the_pairs_order_from_every_slice():
    import numpy as np
    from metachunk.eval.rerank import cross_encoder_scores

    class Scorer:  # a pair's score is its passage's length: the order is checkable
        def predict(self, pairs, batch_size, show_progress_bar, convert_to_numpy):
            assert len(pairs) <= 16 * batch_size and not show_progress_bar
            return np.array([[len(p)] for _, p in pairs], dtype=np.float32)

    queries = [(f"q{i}", ["x" * ((7 * i + j) % 23 + 1) for j in range(i % 4)]) for i in range(30)]
    scores = cross_encoder_scores(Scorer(), queries, batch_size=1)  # 45 pairs: three slices
    assert scores == [[float(len(p)) for p in passages] for _, passages in queries]


UMBRELLA = {
    "U": [
        "Umbrella umbrella umbrella sales rose in the spring, said the shopkeeper. ",
        "The weather was fine, the weather was warm, and the umbrella stayed home. ",
        "Mr. Pemberton ignored the weather and the weather forecasts: he always carried a bright yellow "
        "umbrella to church, and everyone admired its colour. ",
    ]
}


@pytest.mark.integration
def test_ppl_rerank_moves_the_answer_up(planted_embedder, tmp_path, monkeypatch):
    """Dense (planted bag of words) puts the answer second; SmolLM2's PPL re-rank puts it first."""
    import metachunk.models

    monkeypatch.setattr(sys.modules[__name__], "VOCAB", ["umbrella", "pemberton", "weather"])
    chunks = write_chunks(tmp_path / "u.jsonl", UMBRELLA)
    questions = write_questions(tmp_path / "q.jsonl", [{
        "question": "What colour is the umbrella of Mr. Pemberton?", "answer": "Yellow.",
        "chunk_must_contain": "bright yellow umbrella"}])  # fmt: skip
    try:
        cfg = parse(["--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "r"), "--top-k", "3",
                     "--rerank", "ppl", "--reranker", "smollm2", "--no-progress"])  # fmt: skip
        doc = qa.evaluate(cfg)
    except metachunk.models.ModelNotFoundError as e:
        pytest.skip(str(e))
    row = read_jsonl(tmp_path / "r" / "retrieval.jsonl")[0]
    assert [h["chunk_index"] for h in row["hits"]] == [0, 2, 1]
    assert row["reranked"][0]["chunk_index"] == 2 and row["reranked"][0]["relevant"]
    assert doc["metrics"]["mrr@3"] == 0.5 and doc["metrics"]["reranked_mrr@3"] == 1.0


# ------------------------------------------------------------------------------- generation


def test_endpoint_generator_answers_once(planted, planted_embedder, qa_scores, tmp_path):
    """Through the teacher client to the loopback server; the rerun is answered from answers.sqlite."""
    from support.loopback_server import serve_in_subprocess

    chunks, questions = planted
    replies = {r"Question: Which apple": "the apple one", r"Question: Which cherry": "a cherry"}
    out = tmp_path / "gen"
    with serve_in_subprocess(replies=replies) as server:
        argv = ["--chunks", str(chunks), "--qa", str(questions), "--out", str(out), "--top-k", "2",
                "--generator", f"{server.base_url}:rag-model", "--limit", "2", "--no-progress",
                "--bertscore-model", "none", "--score-embedder", "none", "--max-new-tokens", "64"]  # fmt: skip
        first = qa.evaluate(parse(argv))
        assert server.stats()["requests"] == 2
        metrics = (out / "metrics.json").read_bytes()
        second = qa.evaluate(parse(argv))
        assert server.stats()["requests"] == 2  # nothing sent again
    first_run, second_run = read_run_log(out)  # how each went; metrics.json is the same bytes
    assert (
        first_run["generation"]["requests_sent"] == 2 and second_run["generation"]["answers_from_store"] == 2
    )
    assert (out / "metrics.json").read_bytes() == metrics and second == first
    answers = read_jsonl(out / "answers.jsonl")
    assert [a["prediction"] for a in answers] == ["the apple one", "a cherry"]
    assert [a["reference"] for a in answers] == ["the apple one", "the cherry one"]
    assert answers[0]["context"] == [["A", 0], ["A", 1]] and "cached" not in answers[1]  # no per-run field
    sampling = first["details"]["generation"]["sampling"]
    assert sampling == {"temperature": 0.1, "top_p": 0.9, "max_tokens": 64}
    assert len(first["details"]["generation"]["prompt_sha256"]) == 64
    assert qa_scores[0] == (["the apple one", "a cherry"], ["the apple one", "the cherry one"], "en")
    assert first["metrics"]["answers_failed"] == 0 and "f1" in first["metrics"]
    assert (out / "answers.sqlite").is_file()
    items = read_jsonl(out / "items.jsonl")  # each question's answer scores beside its retrieval ones
    assert len(items) == 2 and all("f1" in i and "rouge_l" in i and "hits@1" in i for i in items)
    assert abs(sum(i["f1"] for i in items) / 2 - first["metrics"]["f1"]) < 1e-9


def test_endpoint_generator_stops_at_max_cost_by_the_recipes_prices(planted, planted_embedder, tmp_path):
    """The endpoint's price comes from the recipe's ``prices:``; at $1 a token the first request's
    worst case is past a $0.5 cap, so nothing is sent and every answer stays pending."""
    from support.loopback_server import serve_in_subprocess

    chunks, questions = planted
    recipe = tmp_path / "qa.yaml"
    recipe.write_text("prices:\n  rag-model: {input: 1000000, output: 1000000}\n")
    with serve_in_subprocess(replies={}) as server:
        argv = ["--config", str(recipe), "--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "o"),
                "--generator", f"{server.base_url}:rag-model", "--limit", "2", "--no-progress", "--max-cost", "0.5",
                "--bertscore-model", "none", "--score-embedder", "none", "--max-new-tokens", "8"]  # fmt: skip
        doc = qa.evaluate(parse(argv))
        assert server.stats()["requests"] == 0
    assert doc["details"]["generation"]["stopped"] == "budget"
    assert {a["status"] for a in read_jsonl(tmp_path / "o" / "answers.jsonl")} == {"pending"}


def test_an_endpoint_url_with_a_password_in_its_environment_variable_is_refused_unsent(
    planted, planted_embedder, tmp_path, monkeypatch, capsys
):
    """A teacher block's ``base_url_env`` holding ``user:password@host`` is refused as ``base_url`` is (the
    client sends its key as a bearer token): exit 2, the variable named, the password nowhere, nothing sent."""
    from support.loopback_server import serve_in_subprocess

    from metachunk.cli import main

    chunks, questions = planted
    recipe = tmp_path / "qa.yaml"
    recipe.write_text("generator_teacher: {model: rag-model, base_url_env: RAG_URL}\n")
    with serve_in_subprocess(replies={}) as server:
        monkeypatch.setenv("RAG_URL", server.base_url.replace("://", "://rag:hunter2-password@"))
        argv = ["eval", "qa", "--config", str(recipe), "--chunks", str(chunks), "--qa", str(questions), "--out",
                str(tmp_path / "o"), "--limit", "1", "--no-progress", "--bertscore-model", "none",
                "--score-embedder", "none", "--max-new-tokens", "8"]  # fmt: skip
        code = main(argv)
        assert server.stats()["requests"] == 0
    err = capsys.readouterr().err
    assert (
        code == 2 and "RAG_URL holds credentials" in err and "hunter2" not in err and "Traceback" not in err
    )


@pytest.mark.integration
def test_local_generator_smollm2(planted, planted_embedder, qa_scores, tmp_path):
    chunks, questions = planted
    out = tmp_path / "local"
    argv = ["--chunks", str(chunks), "--qa", str(questions), "--out", str(out), "--top-k", "2", "--limit", "2",
            "--generator-model", "smollm2", "--max-new-tokens", "12", "--no-progress",
            "--bertscore-model", "none", "--score-embedder", "none"]  # fmt: skip
    try:
        doc = qa.evaluate(parse(argv))
    except Exception as e:
        from metachunk.models import ModelNotFoundError

        if isinstance(e, ModelNotFoundError):
            pytest.skip(str(e))
        raise
    answers = read_jsonl(out / "answers.jsonl")
    assert len(answers) == 2 and all(a["prediction"] for a in answers)
    assert all(0 < a["usage"]["completion_tokens"] <= 12 for a in answers)
    gen = doc["details"]["generation"]
    assert gen["kind"] == "local" and gen["sampling"]["top_k"] == 5 and gen["sampling"]["temperature"] == 0.1
    assert qa_scores and doc["metrics"]["avg_answer_tokens"] > 0


@pytest.mark.integration
def test_real_minilm_finds_the_planted_answer(planted, tmp_path):
    chunks, questions = planted
    doc = qa.evaluate(parse(["--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "m"),
                             "--top-k", "3", "--no-progress"]))  # fmt: skip
    assert doc["metrics"]["n_chunks"] == 8 and doc["metrics"]["avg_chunk_tokens"] > 0
    row = read_jsonl(tmp_path / "m" / "retrieval.jsonl")[1]
    assert row["hits"][0]["text"].startswith("apple cherry")  # "Which cherry?" -> the cherriest chunk
    assert doc["details"]["index"]["embedder_unknown_tokens"] == 0.0  # MiniLM reads English


@pytest.mark.integration
def test_a_model_that_does_not_read_the_language_is_named(tmp_path, capsys, tiny_model_dir):
    """MiniLM's English WordPiece vocabulary reads most of a Chinese text as [UNK]: its embeddings (dense
    retrieval, embedding similarity, BERTScore) follow that token, and eval qa says so and records the share.
    A byte-level tokenizer (Qwen2's) has no unknown token."""
    from transformers import AutoTokenizer

    from metachunk.models import UNREAD_SHARE, ModelNotFoundError, preset_dir, unknown_token_share

    try:
        minilm = AutoTokenizer.from_pretrained(str(preset_dir("minilm")))
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    zh = ["西安发放体育消费券，市民可在指定场馆使用。", "上海车展今天开幕，多家车企发布新车型。"]
    assert unknown_token_share(minilm, zh) > 0.5 > UNREAD_SHARE
    assert unknown_token_share(minilm, ["Emma Woodhouse, handsome, clever, and rich."]) == 0.0
    assert unknown_token_share(AutoTokenizer.from_pretrained(str(tiny_model_dir)), zh) == 0.0

    chunks = write_chunks(tmp_path / "zh.jsonl", {"A": zh})
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "上海车展什么时候开幕？", "answer": "今天",
                                     "chunk_must_contain": "上海车展今天开幕"}, ensure_ascii=False) + "\n")  # fmt: skip
    doc = qa.evaluate(parse(["--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "m"),
                             "--top-k", "1", "--no-progress"]))  # fmt: skip
    assert doc["details"]["index"]["embedder_unknown_tokens"] > 0.5
    assert "minilm (--embedder) reads" in capsys.readouterr().err


def test_bad_chunk_records_and_question_rows_are_skipped_on_request(planted, planted_embedder, tmp_path):
    """``--on-bad-row skip`` (tests/test_bad_rows.py has the other commands): the retrieval over the
    good rows is the one they give alone; the bad rows are in OUT.rejects.jsonl; exit status 6."""
    chunks, questions = planted
    bad_chunks = tmp_path / "bad_chunks.jsonl"
    bad_chunks.write_text(chunks.read_text() + '{"id": "C", "chunks": [{"text": "abc", "start": 0, "end": 2}]}\n'
                          + json.dumps({"id": "A", "chunks": []}) + "\n")  # fmt: skip
    bad_questions = tmp_path / "bad_questions.jsonl"
    lines = questions.read_text().splitlines(keepends=True)
    # the first row is bad too: the format is told from the first good one
    bad_questions.write_text("".join(['{"question": "no evidence field"}\n', *lines, "[]\n"]))
    common = ["--top-k", "3", "--no-progress"]
    good = parse(["--chunks", str(chunks), "--qa", str(questions), "--out", str(tmp_path / "good"), *common])
    assert qa.run(good).exit == 0
    mixed = parse(["--chunks", str(bad_chunks), "--qa", str(bad_questions), "--out", str(tmp_path / "mixed"),
                   "--on-bad-row", "skip", *common])  # fmt: skip
    result = qa.run(mixed)
    assert result.exit == 6 and result.rejects["rows"] == 4
    for name in ("retrieval.jsonl", "items.jsonl"):
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "good" / name).read_bytes(), name
    rejects = read_jsonl(tmp_path / "mixed.rejects.jsonl")
    assert [(Path(r["file"]).name, r["line"]) for r in rejects] == [
        ("bad_chunks.jsonl", 3), ("bad_chunks.jsonl", 4), ("bad_questions.jsonl", 1), ("bad_questions.jsonl", 6)]  # fmt: skip
    assert "duplicate document id 'A'" in rejects[1]["reason"]
    assert json.loads((tmp_path / "mixed" / "metrics.json").read_text())["details"]["rejects"]["rows"] == 4
    strict = parse(
        ["--chunks", str(bad_chunks), "--qa", str(questions), "--out", str(tmp_path / "strict"), *common]
    )
    with pytest.raises(Exception, match=r"bad_chunks\.jsonl:3"):
        qa.run(strict)
