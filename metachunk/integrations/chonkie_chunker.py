"""A metachunk chunker where chonkie expects one of its own (``pip install 'metachunk[chonkie]'``).

    >>> from metachunk import SentenceChunker
    >>> from metachunk.integrations.chonkie_chunker import MetachunkChonkieChunker
    >>> chunker = MetachunkChonkieChunker(SentenceChunker(target_len=30, len_unit="char", lang="en"))
    >>> [(c.text, c.start_index, c.end_index, c.token_count) for c in chunker("Emma was clever. She was rich.")]
    [('Emma was clever. She was rich.', 0, 30, 30)]

chonkie's chunkers subclass ``chonkie.BaseChunker``: ``chunk(text) -> list[chonkie.Chunk]`` (text,
``start_index``, ``end_index``, ``token_count``), ``chunk_batch``, and ``__call__`` on a text or a
list (https://docs.chonkie.ai/python-sdk/chunkers/overview). This one is such a subclass, so it
goes wherever a chonkie chunker does (its pipelines, refineries, handshakes); ``token_count`` is
counted with chonkie's tokenizer (default: characters).
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from chonkie import BaseChunker
    from chonkie.types import Chunk as ChonkieChunk
except ModuleNotFoundError as e:  # the adapter's framework is an extra
    raise ModuleNotFoundError(f"{e}: this adapter needs pip install 'metachunk[chonkie]'", name=e.name) from e


class MetachunkChonkieChunker(BaseChunker):
    """``chunker``: any metachunk chunker; ``tokenizer``: what ``token_count`` counts (chonkie's names)."""

    def __init__(self, chunker, tokenizer: str = "character"):
        super().__init__(tokenizer)
        self.chunker = chunker

    def __repr__(self) -> str:
        return f"MetachunkChonkieChunker({self.chunker!r})"

    def _convert(self, chunks) -> list[ChonkieChunk]:
        counts = self.tokenizer.count_tokens_batch([c.text for c in chunks]) if chunks else []
        return [ChonkieChunk(text=c.text, start_index=c.start, end_index=c.end, token_count=n)
                for c, n in zip(chunks, counts)]  # fmt: skip

    def chunk(self, text: str) -> list[ChonkieChunk]:
        """The chunks of ``text`` as chonkie `Chunk`s: the metachunk chunker's text and offsets, and
        ``token_count`` by this chunker's tokenizer."""
        return self._convert(self.chunker(text))

    def chunk_batch(self, texts: Sequence[str], show_progress: bool = True) -> list[list[ChonkieChunk]]:
        """The chunks of each text, in order, the texts chunked together (the metachunk chunker's
        ``chunk_batch``). ``show_progress``, chonkie's argument, shows nothing here."""
        return [self._convert(chunks) for chunks in self.chunker.chunk_batch(list(texts))]
