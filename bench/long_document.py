"""Memory and time of cutting one long document: ``fixed_chunks`` (characters and words) and
``merge_chunks`` (what every other method's chunks go through), traced by ``tracemalloc``.

    python bench/long_document.py [--chars 2000000]

The document is synthetic English (short words, a full stop every ~10 words), so the figures
measure the cutting itself, not a tokenizer or a sentence splitter. Each line prints the traced
peak in MB, the seconds (of an untraced run), the chunk count and a hash of the chunks' offsets: run it at two commits
and the hashes say whether the output changed. Figures: docs/performance.md ("Fixed-length chunks
and long documents")."""

from __future__ import annotations

import argparse
import hashlib
import random
import time
import tracemalloc

from metachunk.chunking.baselines import fixed_chunks
from metachunk.chunking.merge import merge_chunks
from metachunk.chunking.types import Chunk

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def document(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words, size = [], 0
    while size < chars:
        word = rng.choice(WORDS) + ("." if rng.random() < 0.1 else "")
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def measure(name: str, cut) -> None:
    """Seconds from an untraced run (tracing slows code that allocates much), the peak from a traced one."""
    started = time.perf_counter()
    chunks = cut()
    seconds = time.perf_counter() - started
    tracemalloc.start()
    cut()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    offsets = hashlib.sha256(repr([(c.start, c.end) for c in chunks]).encode()).hexdigest()[:12]
    print(
        f"{name:<12} peak {peak / 1e6:7.1f} MB  {seconds:6.2f} s  {len(chunks):>7} chunks  offsets {offsets}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chars", type=int, default=2_000_000, help="the document's length (default 2,000,000)"
    )
    args = parser.parse_args()
    doc = document(args.chars)
    print(f"one document of {len(doc):,} characters")
    measure("fixed char", lambda: fixed_chunks(doc, 100, "char"))
    measure("fixed word", lambda: fixed_chunks(doc, 20, "word"))
    pieces = [Chunk.span(doc, a, min(a + 50, len(doc))) for a in range(0, len(doc), 50)]
    measure("merge", lambda: merge_chunks(doc, pieces, 400, "char"))


if __name__ == "__main__":
    main()
