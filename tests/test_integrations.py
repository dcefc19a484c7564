"""metachunk's chunkers inside LangChain, LlamaIndex and chonkie, against the real packages from
PyPI (``metachunk[langchain,llamaindex,chonkie]``, pinned in constraints.txt)."""

from __future__ import annotations

import asyncio
import doctest
import importlib

import pytest

import metachunk

EN = (
    "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence. "
    "She had lived nearly twenty-one years in the world with very little to distress or vex her.\n\n"
    "She was the youngest of the two daughters of a most affectionate, indulgent father."
)
ZH = "今天天气很好。我们去公园散步。公园里有很多人。孩子们在草地上玩耍。老人们在树下下棋。"
# The same sentence again and again: a text search for a chunk finds the wrong copy.
REPEATED = "Emma smiled. " * 12


@pytest.fixture(scope="module")
def sentences():
    return metachunk.SentenceChunker(target_len=40, len_unit="char")


@pytest.mark.parametrize("module", ["langchain_splitter", "llama_index_parser", "chonkie_chunker"])
def test_the_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"metachunk.integrations.{module}"))
    assert result.attempted >= 4 and result.failed == 0


def test_langchain_documents_keep_their_start_index(sentences, tiny_model_dir):
    from langchain_core.documents import Document
    from langchain_text_splitters import TextSplitter

    from metachunk.integrations.langchain_splitter import MetachunkTextSplitter

    ppl = metachunk.PPLChunker(str(tiny_model_dir), target_len=120, len_unit="char")
    for chunker in (sentences, ppl):
        splitter = MetachunkTextSplitter(chunker)
        assert isinstance(splitter, TextSplitter)
        docs = splitter.create_documents([EN, ZH, REPEATED, "   "], metadatas=[{"k": i} for i in range(4)])
        texts = [EN, ZH, REPEATED, "   "]
        for d in docs:
            text = texts[d.metadata["k"]]
            start = d.metadata["start_index"]
            assert text[start : start + len(d.page_content)] == d.page_content and d.page_content.strip()
        assert [d.page_content for d in docs if d.metadata["k"] == 0] == splitter.split_text(EN)
        # split_documents (what a LangChain loader pipeline calls) goes through create_documents
        again = splitter.split_documents([Document(page_content=REPEATED, metadata={"source": "r"})])
        starts = [d.metadata["start_index"] for d in again]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)


def test_llama_index_nodes_carry_exact_spans_and_relationships(sentences):
    from llama_index.core import Document
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.schema import NodeRelationship

    from metachunk.integrations.llama_index_parser import MetachunkNodeParser

    parser = MetachunkNodeParser.from_chunker(sentences)
    docs = [Document(text=t, metadata={"name": n}) for n, t in (("en", EN), ("zh", ZH), ("rep", REPEATED))]
    nodes = IngestionPipeline(transformations=[parser]).run(documents=docs)
    by_doc = {d.doc_id: d for d in docs}
    for node in nodes:
        doc = by_doc[node.ref_doc_id]
        assert doc.text[node.start_char_idx : node.end_char_idx] == node.text
        assert node.metadata["name"] == doc.metadata["name"]
        assert node.relationships[NodeRelationship.SOURCE].node_id == doc.doc_id
    rep = [n for n in nodes if n.ref_doc_id == docs[2].doc_id]
    assert len(rep) > 2 and [n.start_char_idx for n in rep] == sorted({n.start_char_idx for n in rep})
    assert "".join(n.text for n in rep) == REPEATED  # the chunks tile the text
    middle = rep[1]
    assert middle.relationships[NodeRelationship.PREVIOUS].node_id == rep[0].node_id
    assert middle.relationships[NodeRelationship.NEXT].node_id == rep[2].node_id
    spans = lambda ns: [(n.ref_doc_id, n.start_char_idx, n.end_char_idx, n.text) for n in ns]  # noqa: E731
    assert spans(asyncio.run(parser.acall(docs))) == spans(nodes)  # the async entry point, the same spans


def test_a_chonkie_chunker_in_chonkies_interface(sentences):
    from chonkie import BaseChunker
    from chonkie.types import Chunk

    from metachunk.integrations.chonkie_chunker import MetachunkChonkieChunker

    chunker = MetachunkChonkieChunker(sentences)
    assert isinstance(chunker, BaseChunker)
    one = chunker(EN)
    assert all(isinstance(c, Chunk) and EN[c.start_index : c.end_index] == c.text for c in one)
    assert [c.token_count for c in one] == [len(c.text) for c in one]  # the character tokenizer
    batch = chunker([EN, ZH, REPEATED], show_progress=False)
    # the batch path's offsets are metachunk's own, also where a text search would find the wrong copy
    assert [[(c.text, c.start_index, c.end_index) for c in cs] for cs in batch] == [
        [(c.text, c.start, c.end) for c in sentences(t)] for t in (EN, ZH, REPEATED)
    ]
    assert "".join(c.text for c in batch[2]) == REPEATED


def test_a_llama_index_parser_says_its_chunker_in_its_cache_key_and_survives_pickling(sentences):
    """An IngestionPipeline's cache keys each step by its to_dict(): without the chunker in it, any two
    parsers read alike, and a cached run gave one parser's nodes for another's. Its workers pickle the
    parser, which had dropped the chunker (num_workers=2 raised AttributeError)."""
    import pickle

    from metachunk.integrations.llama_index_parser import MetachunkNodeParser

    a = MetachunkNodeParser.from_chunker(sentences)
    b = MetachunkNodeParser.from_chunker(metachunk.FixedChunker(500))
    assert a.to_dict() != b.to_dict() and "SentenceChunker" in str(a.to_dict())
    twin = pickle.loads(pickle.dumps(a))
    assert [n.text for n in twin.get_nodes_from_documents([_doc(EN)])] == [
        n.text for n in a.get_nodes_from_documents([_doc(EN)])
    ]
    with pytest.raises(ValueError, match="needs a chunker"):
        MetachunkNodeParser()


def _doc(text: str):
    from llama_index.core import Document

    return Document(text=text)


def test_langchain_metadatas_must_match_the_texts(sentences):
    from metachunk.integrations.langchain_splitter import MetachunkTextSplitter

    splitter = MetachunkTextSplitter(sentences, chunk_overlap=0)  # LangChain's own argument, ignored
    with pytest.raises(ValueError, match="metadatas: 1 for 2 texts"):
        splitter.create_documents([EN, ZH], [{"k": 0}])


@pytest.mark.parametrize(
    "module, framework, extra",
    [("langchain_splitter", "langchain_text_splitters", "langchain"), ("llama_index_parser", "llama_index.core.node_parser", "llamaindex"),
     ("chonkie_chunker", "chonkie", "chonkie")],
)  # fmt: skip
def test_an_adapter_without_its_framework_names_the_extra(monkeypatch, module, framework, extra):
    import sys

    monkeypatch.setitem(sys.modules, framework, None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, f"metachunk.integrations.{module}", raising=False)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'metachunk\[{extra}\]'"):
        importlib.import_module(f"metachunk.integrations.{module}")
