"""A LangChain text splitter over a metachunk chunker (``pip install 'metachunk[langchain]'``).

    >>> from metachunk import SentenceChunker
    >>> from metachunk.integrations.langchain_splitter import MetachunkTextSplitter
    >>> splitter = MetachunkTextSplitter(SentenceChunker(target_len=30, len_unit="char", lang="en"))
    >>> splitter.split_text("Emma was clever. She was rich. Her home was Hartfield.")
    ['Emma was clever. She was rich.', 'Her home was Hartfield.']
    >>> [d.metadata for d in splitter.create_documents(["Emma was clever. She was rich."])]
    [{'start_index': 0}]

LangChain's own splitters find ``start_index`` again with ``text.find`` after stripping; here it is
the chunk's offset, so ``text[start_index:start_index + len(page_content)] == page_content``
always holds (https://python.langchain.com/api_reference/text_splitters/base/langchain_text_splitters.base.TextSplitter.html).
"""

from __future__ import annotations

import copy
from typing import Any

try:
    from langchain_core.documents import Document
    from langchain_text_splitters import TextSplitter
except ModuleNotFoundError as e:  # the adapter's framework is an extra
    raise ModuleNotFoundError(
        f"{e}: this adapter needs pip install 'metachunk[langchain]'", name=e.name
    ) from e


class MetachunkTextSplitter(TextSplitter):
    """``chunker``: any metachunk chunker. ``add_start_index`` (default True) puts each chunk's
    offset in its document's metadata; ``strip_whitespace`` (default True, LangChain's default)
    trims each chunk, and moves ``start_index`` past what was trimmed."""

    def __init__(
        self, chunker, *, add_start_index: bool = True, strip_whitespace: bool = True, **kwargs: Any
    ):
        # chunk_size/overlap are the chunker's business; LangChain's base only checks them.
        kwargs.pop("chunk_overlap", None)
        super().__init__(chunk_size=max(kwargs.pop("chunk_size", 1), 1), chunk_overlap=0,
                         add_start_index=add_start_index, strip_whitespace=strip_whitespace, **kwargs)  # fmt: skip
        self.chunker = chunker
        self.add_start_index, self.strip_whitespace = add_start_index, strip_whitespace

    def _pieces(self, text: str) -> list[tuple[str, int]]:
        out = []
        for chunk in self.chunker(text):
            piece, start = chunk.text, chunk.start
            if self.strip_whitespace:
                stripped = piece.lstrip()
                start += len(piece) - len(stripped)
                piece = stripped.rstrip()
            if piece:
                out.append((piece, start))
        return out

    def split_text(self, text: str) -> list[str]:
        """The chunks of ``text`` as strings, each trimmed with ``strip_whitespace``; a chunk that is
        only whitespace is left out then."""
        return [piece for piece, _ in self._pieces(text)]

    def create_documents(
        self, texts: list[str], metadatas: list[dict[Any, Any]] | None = None
    ) -> list[Document]:
        """One LangChain `Document` per chunk of each text, its metadata a copy of the text's
        (``metadatas``, in the same order) with ``start_index``, the chunk's offset in its text
        (``add_start_index``)."""
        metadatas = metadatas or [{}] * len(texts)
        if len(metadatas) != len(texts):  # zip would drop the texts past the last metadata
            raise ValueError(f"metadatas: {len(metadatas)} for {len(texts)} texts; give one per text")
        documents = []
        for text, metadata in zip(texts, metadatas):
            for piece, start in self._pieces(text):
                meta = copy.deepcopy(metadata)
                if self.add_start_index:
                    meta["start_index"] = start
                documents.append(Document(page_content=piece, metadata=meta))
        return documents
