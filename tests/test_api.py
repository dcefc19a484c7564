"""The Python API (``from metachunk import PPLChunker, ...``): the same chunks as ``metachunk chunk``
with the same settings, lossless on every text the CLI takes, and the docstrings' examples run."""

from __future__ import annotations

import doctest
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metachunk
from metachunk.cli import main

EN = (
    "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence. "
    "She had lived nearly twenty-one years in the world with very little to distress or vex her.\n\n"
    "She was the youngest of the two daughters of a most affectionate, indulgent father. "
    "Her mother had died too long ago for her to have more than an indistinct remembrance of her caresses."
)
ZH = "今天天气很好。我们去公园散步。公园里有很多人。孩子们在草地上玩耍。老人们在树下下棋。"


def cli_chunks(tmp_path: Path, texts: list[str], *flags) -> list[list[dict]]:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n"
                           for i, t in enumerate(texts)), encoding="utf-8")  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(["chunk", str(src), "-o", str(out), *map(str, flags)]) == 0
    return [r["chunks"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())]


def as_dicts(chunks) -> list[dict]:
    return [c.to_json() for c in chunks]


def test_the_public_names_import_from_the_package():
    assert set(metachunk.__all__) <= set(dir(metachunk))
    for name in metachunk.__all__:
        assert getattr(metachunk, name).__module__ in ("metachunk.chunking.api", "metachunk.chunking.types")
    with pytest.raises(AttributeError):
        metachunk.NoSuchChunker  # noqa: B018


def test_the_docstring_examples_run(tiny_model_dir, tmp_path):
    """Every chunker's and student's example on the API page, with the tiny model as every model
    (router, experts and students too) and a loopback server as LumberChunker's teacher."""
    from metachunk.chunking import api
    from support.loopback_server import serve_in_subprocess

    with serve_in_subprocess(replies={r"Document:\nID 0: Emma": "Answer: ID 2"}) as server:
        names = {"model": str(tiny_model_dir), "teacher_model": "loopback-teacher", "teacher_url": server.base_url,
                 "answers": str(tmp_path / "answers.sqlite")}  # fmt: skip
        result = doctest.testmod(api, extraglobs=names, optionflags=doctest.ELLIPSIS)
    documented = [n for n in metachunk.__all__ if n not in ("Chunk", "TextChunker")]
    with_examples = [n for n in documented if ">>>" in (getattr(api, n).__doc__ or "")]
    assert with_examples == documented  # every chunker and both students show one
    assert result.attempted >= 30 and result.failed == 0


@pytest.mark.parametrize(
    ("cls", "kwargs", "flags"),
    [
        ("FixedChunker", {"target_len": 80, "len_unit": "char"}, ["--method", "fixed", "--target-len", 80,
                                                                  "--len-unit", "char"]),
        ("SentenceChunker", {"target_len": 120, "len_unit": "char"}, ["--method", "sentence", "--target-len", 120,
                                                                     "--len-unit", "char"]),
        ("PPLChunker", {"target_len": 150, "len_unit": "char"}, ["--method", "ppl", "--target-len", 150,
                                                                "--len-unit", "char"]),
        ("MSPChunker", {"target_len": 150, "len_unit": "char"}, ["--method", "msp", "--target-len", 150,
                                                                "--len-unit", "char"]),
    ],
)  # fmt: skip
def test_a_chunker_cuts_as_the_cli_does(tmp_path, tiny_model_dir, cls, kwargs, flags):
    model = {"model": str(tiny_model_dir)} if cls in ("PPLChunker", "MSPChunker") else {}
    chunker = getattr(metachunk, cls)(**model, **kwargs)
    texts = [EN, ZH, "", "   \n  "]
    expected = cli_chunks(tmp_path, texts, *flags, *(["--model", tiny_model_dir] if model else []))
    assert [as_dicts(chunker(t)) for t in texts] == expected
    assert [as_dicts(c) for c in chunker.chunk_batch(texts)] == expected


def test_blank_texts_are_lossless_and_a_lone_surrogate_is_a_value_error():
    chunker = metachunk.SentenceChunker(target_len=50, len_unit="char", lang="en")
    assert chunker("") == []
    assert [c.text for c in chunker("  \n\t ")] == ["  \n\t "]
    with pytest.raises(ValueError, match="lone surrogate"):
        chunker("Emma \ud800 Woodhouse.")
    with pytest.raises(TypeError, match="str"):
        chunker(b"bytes")
    with pytest.raises(
        ValueError, match="^target_len must be >= 1, got 0$"
    ):  # the CLI's check, named as here
        metachunk.SentenceChunker(target_len=0)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: metachunk.FixedChunker("10"), TypeError, "field 'target_len' must be int, got str ('10')"),
        (
            lambda: metachunk.FixedChunker(2.5, len_unit="char"),
            TypeError,
            "field 'target_len' must be int, got float",
        ),
        (lambda: metachunk.FixedChunker(True), TypeError, "field 'target_len' must be int, got bool"),
        (lambda: metachunk.FixedChunker(-5), ValueError, "target_len must be >= 1, got -5"),
        (
            lambda: metachunk.SentenceChunker(10, lang=None),
            TypeError,
            "field 'lang' must be one of zh, en, auto, got None",
        ),
        (lambda: metachunk.PPLChunker(None), TypeError, "field 'model' must be str, got None"),
        (lambda: metachunk.PPLChunker(5), TypeError, "field 'model' must be str, got int"),
        (
            lambda: metachunk.PPLChunker(threshold="high"),
            TypeError,
            "field 'threshold' must be float, got str",
        ),
        (
            lambda: metachunk.SemanticChunker(threshold=150),
            ValueError,
            "threshold is a percentile for method semantic",
        ),
        # MoC's options by their argument names, not the CLI's prefixed ones (moc_placeholder)
        (
            lambda: metachunk.MoCChunker("r", ["e"] * 4, placeholder="<gap>"),
            ValueError,
            "field 'placeholder' must be one of",
        ),
        (
            lambda: metachunk.MoCChunker("r", ["e"] * 4, window_chars=10),
            ValueError,
            "window_chars must be >= 64",
        ),
    ],
)
def test_bad_settings_are_refused_when_the_chunker_is_made_naming_the_argument(make, error, message):
    """Before any model loads: Python builds the config without a parser, so its types are checked too."""
    with pytest.raises(error) as e:
        make()
    assert type(e.value) is error and message in str(e.value)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"context_chars": -1}, "context_chars must be >= 1, got -1"),
        ({"context": "nope"}, "field 'context' must be one of document, related, got 'nope'"),
        ({"top_k": 0}, "top_k must be >= 1, got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ],
)
@pytest.mark.parametrize("student", ["Rewriter", "Summarizer"])
def test_a_students_bad_setting_is_named_as_its_argument(tiny_model_dir, settings, message, student):
    with pytest.raises(ValueError) as e:
        getattr(metachunk, student)(str(tiny_model_dir), **settings)
    assert str(e.value) == message


def test_a_torch_device_is_taken_as_its_name():
    import torch

    assert metachunk.FixedChunker(5, device=torch.device("cpu")).config.device == "cpu"


def test_one_text_and_several_are_not_confused():
    chunker = metachunk.FixedChunker(3, len_unit="char")
    with pytest.raises(TypeError, match="not a str"):  # a str is an iterable of one-character texts
        chunker.chunk_batch("abcdef")
    with pytest.raises(TypeError, match="chunk_batch takes several texts"):
        chunker(["abc", "def"])
    assert chunker.chunk_batch(("abc", "def")) == [chunker("abc"), chunker("def")]


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400),
    st.integers(min_value=1, max_value=3),
)
def test_every_chunk_is_a_slice_and_the_chunks_tile_the_text(piece, copies):
    text = piece * copies  # repeated text: a search for a chunk's text would find the wrong copy
    for chunker in (FIXED, SENTENCE):
        chunks = chunker(text)
        assert all(c.text == text[c.start : c.end] and c.end > c.start for c in chunks)
        assert [c.start for c in chunks] == [0, *(c.end for c in chunks[:-1])][: len(chunks)]
        assert "".join(c.text for c in chunks) == text


FIXED = metachunk.FixedChunker(target_len=40, len_unit="char")
SENTENCE = metachunk.SentenceChunker(target_len=60, len_unit="char")


def test_a_model_loads_once_per_object(tiny_model_dir, monkeypatch):
    from metachunk import models

    loads = []
    real = models.load_causal_lm_model
    monkeypatch.setattr(models, "load_causal_lm_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    chunker = metachunk.PPLChunker(str(tiny_model_dir), target_len=100, len_unit="char", lang="en")
    chunker(EN), chunker.chunk_batch([EN, EN]), chunker(EN)
    assert len(loads) == 1


def test_the_students_write_what_chunk_rewrite_and_summarize_write(tmp_path, tiny_model_dir):
    """Rewriter and Summarizer on the chunks of a chunker: the fields `chunk --rewrite --summarize`
    writes for the same chunks."""
    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    config = json.loads((student / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student)
    config["suppress_tokens"] = [i for i in range(len(tok)) if not tok.decode([i]).strip()]
    (student / "generation_config.json").write_text(json.dumps(config))

    chunker = metachunk.SentenceChunker(target_len=150, len_unit="char", lang="en")
    chunks = chunker(EN)
    rewriter = metachunk.Rewriter.from_pretrained(str(student), max_new_tokens=12)
    summarizer = metachunk.Summarizer(str(student), max_new_tokens=12)
    rewritten, summaries = rewriter(EN, chunks), summarizer(EN, chunks)
    assert len(rewritten) == len(summaries) == len(chunks) and all(rewritten) and all(summaries)

    cli = cli_chunks(tmp_path, [EN], "--method", "sentence", "--target-len", 150, "--len-unit", "char",
                     "--lang", "en", "--rewrite", student, "--summarize", student,
                     "--rewrite-max-new-tokens", 12, "--summary-max-new-tokens", 12)[0]  # fmt: skip
    assert [c["rewritten"] for c in cli] == rewritten and [c["summary"] for c in cli] == summaries
    assert rewriter(EN, (c for c in chunks)) == rewritten  # a generator of chunks, read once
    with pytest.raises(ValueError, match="is not text"):
        rewriter(EN, [metachunk.Chunk("nope", 0, 4)])


def test_a_chunkers_repr_shows_what_was_set():
    assert repr(metachunk.SentenceChunker(40, len_unit="char", lang="en")) == (
        "SentenceChunker(target_len=40, lang='en', len_unit='char')"
    )
    assert repr(metachunk.FixedChunker(1)) == "FixedChunker(target_len=1)"


def test_a_chunker_pickles_and_copies_as_its_config(tiny_model_dir):
    """multiprocessing, Ray and LlamaIndex's workers pickle a chunker; no chunker could be pickled or
    deep-copied (its thread state and model loader). The copy loads its own model and cuts alike."""
    import copy
    import pickle

    for chunker in (
        metachunk.FixedChunker(24, len_unit="char"),
        metachunk.PPLChunker(str(tiny_model_dir), target_len=60, len_unit="char", lang="en"),
    ):
        text = "Emma was clever. She was rich. Her home was Hartfield. She had few troubles."
        for twin in (pickle.loads(pickle.dumps(chunker)), copy.deepcopy(chunker)):
            assert type(twin) is type(chunker) and twin.config == chunker.config
            assert twin(text) == chunker(text)


def test_a_corpus_wide_setting_is_refused_by_a_chunker():
    """mean_chunk_chars is fitted over a corpus by `metachunk chunk`: a chunker had taken it and done
    nothing with it (the mean came out at 43 for 100 asked), or failed inside (target_len None)."""
    for make in (lambda: metachunk.SentenceChunker(None, mean_chunk_chars=100),
                 lambda: metachunk.FixedChunker(10, mean_chunk_chars_of="run.jsonl")):  # fmt: skip
        with pytest.raises(ValueError, match="fits target_len to a whole corpus"):
            make()


def test_moc_and_lumber_take_the_settings_every_chunker_takes(tiny_model_dir, tmp_path):
    """Every keyword had gone to MoC's or LumberChunker's own options: len_unit, batch_size or target_len
    raised TypeError. The repr shows the block that makes the chunker what it is."""
    model = str(tiny_model_dir)
    moc = metachunk.MoCChunker(model, [model] * 4, len_unit="char", batch_size=2, max_new_tokens=8)
    assert moc.config.len_unit == "char" and moc.config.batch_size == 2 and moc.config.moc.max_new_tokens == 8
    assert f"router={model!r}" in repr(moc)
    lumber = metachunk.LumberChunker({"model": "gpt-x", "base_url": "http://127.0.0.1:9/v1"}, target_len=100,
                                     tokens=300, cache=str(tmp_path / "answers.sqlite"))  # fmt: skip
    assert lumber.config.target_len == 100 and lumber.config.lumber.tokens == 300
    assert "gpt-x" in repr(lumber)
    lumber.close()
