"""Shared test fixtures: planted distilled records, the SFT dataset built from them, a free port.

Registered for every test module by ``tests/conftest.py`` (``pytest_plugins``).
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from support.data import data_file

WORDS = (
    "river meadow lantern harvest village market orchard bridge chapel letter carriage garden winter "
    "candle parcel ribbon shilling sermon pony basket ladder kettle window blanket journey cottage "
    "bonnet fiddle vicar miller baker"
).split()


# Six real sentences of Emma, ch. I: distinct texts make distinct teacher requests.
EMMA_SENTENCES = (
    "She had lived nearly twenty-one years in the world with very little to distress or vex her.",
    "Her mother had died too long ago for her to have more than an indistinct remembrance of her caresses.",
    "Sixteen years had Miss Taylor been in the family, less as a governess than a friend.",
    "The wedding was very much like other weddings, where the parties have no taste for finery or parade.",
    "He was a nervous man, easily depressed, fond of everybody that he was used to.",
    "The evil of the actual disparity in their ages was much increased by his constitution and habits.",
)


def sentence(seed: int, n: int = 20) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _record(doc_id, doc, chunk, output, status="ok"):
    stage = {"status": "ok", "teacher": "teacher-model", "prompt_sha256": "ab" * 32,
             "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "cost": 0.001}  # fmt: skip
    start = doc.index(chunk)
    return {"schema_version": 1, "task": "rewrite", "doc_id": doc_id, "chunk_index": 1, "start": start,
            "end": start + len(chunk), "text": chunk, "lang": "en", "context_spans": [[0, len(doc)]],
            "status": status, "reason": "", "output": output,
            "stages": {"reflection": dict(stage), "refinement": dict(stage), "completion": dict(stage)}}  # fmt: skip


def write_planted(folder: Path) -> Path:
    """Twelve good rewrites on twelve documents, plus one planted bad record per filter: ``docs.jsonl``,
    ``test_docs.jsonl`` and ``rewrite.jsonl`` in ``folder``."""
    docs, records = {}, []
    for i in range(15):
        docs[f"d{i}"] = " ".join(sentence(3 * i + k) for k in range(3))
    for i in range(12):
        chunk = sentence(3 * i + 1)
        records.append(_record(f"d{i}", docs[f"d{i}"], chunk, f"In the letter of document {i}, {chunk}"))
    held_out = " ".join(sentence(500 + k) for k in range(3))
    docs["test-copy"] = held_out  # the held-out test document again, under another id
    near_chunk = sentence(1) + " Bridge."  # document 0's chunk with one more word
    docs["d13"] = sentence(99) + " " + near_chunk
    records += [
        _record("d12", docs["d12"], sentence(37), "", status="failed"),  # failed_or_empty
        _record("d12", docs["d12"], sentence(37), "I'm sorry, but as an AI I cannot rewrite this."),
        _record("d12", docs["d12"], sentence(37), "A short unrelated phrase."),  # lost_content
        _record("test-copy", held_out, sentence(501), "Rewritten: " + sentence(501)),  # contaminated
        dict(records[0]),  # exact_duplicate
        _record("d13", docs["d13"], near_chunk, "Near: " + near_chunk),  # near_duplicate
        _record("d14", docs["d14"], sentence(43), sentence(43) + " very" * 3000),  # too_long
    ]
    (folder / "docs.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items())
    )
    (folder / "test_docs.jsonl").write_text(json.dumps({"id": "held-out", "text": held_out}) + "\n")
    (folder / "rewrite.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture
def planted(tmp_path):
    """The planted records in ``tmp_path``: per test, because tests build into and write next to them."""
    return write_planted(tmp_path)


@pytest.fixture(scope="session")
def sft_dataset(tmp_path_factory, tiny_model_dir) -> Path:
    """``metachunk data build-sft`` of the planted records (tiny Qwen2 tokenizer, a quarter for validation),
    built once per session. Read-only: a test that changes it works on a copy."""
    from metachunk.distill.sft import BuildSftConfig, build_sft

    planted = write_planted(tmp_path_factory.mktemp("planted"))
    out = planted / "ds"
    build_sft(
        BuildSftConfig(task="rewrite", distilled=planted / "rewrite.jsonl", out=out, documents=planted / "docs.jsonl",
                       cards_dir=planted / "cards", tokenizer=str(tiny_model_dir), max_length=100_000,
                       validation_fraction=0.25),
        progress=False,
    )  # fmt: skip
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_emma_chunks(folder: Path, n_chunks: int, min_chars: int = 0, n_paragraphs: int = 6) -> None:
    """``docs.jsonl`` (Emma's first ``n_paragraphs`` paragraphs of at least ``min_chars`` characters,
    among the first 8, as one document) and ``chunks.jsonl`` (its first ``n_chunks`` paragraphs as
    chunks, offsets exact) in ``folder``."""
    paragraphs = []
    with data_file("gutenqa-emma/paragraphs.jsonl").open(encoding="utf-8") as f:
        for line, _ in zip(f, range(8)):
            paragraphs.append(json.loads(line)["text"])
    paragraphs = [p for p in paragraphs if len(p) >= min_chars][:n_paragraphs]
    text = "\n\n".join(paragraphs)
    chunks, start = [], 0
    for p in paragraphs[:n_chunks]:
        start = text.index(p, start)
        chunks.append({"text": p, "start": start, "end": start + len(p)})
        start += len(p)
    (folder / "docs.jsonl").write_text(json.dumps({"id": "emma", "text": text}) + "\n", encoding="utf-8")
    (folder / "chunks.jsonl").write_text(
        json.dumps({"id": "emma", "chunks": chunks}) + "\n", encoding="utf-8"
    )
