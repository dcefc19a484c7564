"""A LlamaIndex node parser over a metachunk chunker (``pip install 'metachunk[llamaindex]'``).

    >>> from llama_index.core import Document
    >>> from metachunk import SentenceChunker
    >>> from metachunk.integrations.llama_index_parser import MetachunkNodeParser
    >>> parser = MetachunkNodeParser.from_chunker(SentenceChunker(target_len=30, len_unit="char", lang="en"))
    >>> nodes = parser.get_nodes_from_documents([Document(text="Emma was clever. She was rich. Her home was Hartfield.")])
    >>> [(n.text, n.start_char_idx, n.end_char_idx) for n in nodes]
    [('Emma was clever. She was rich. ', 0, 31), ('Her home was Hartfield.', 31, 54)]

Each node is one chunk, with its exact character span in the document (``start_char_idx``,
``end_char_idx``), its SOURCE relationship to the document, and PREVIOUS/NEXT to its neighbours,
as LlamaIndex's own parsers set them
(https://developers.llamaindex.ai/python/framework/module_guides/loading/node_parsers/).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
    from llama_index.core.node_parser import NodeParser
    from llama_index.core.node_parser.node_utils import build_nodes_from_splits
    from llama_index.core.schema import BaseNode, Document, MetadataMode, TextNode
except ModuleNotFoundError as e:  # the adapter's framework is an extra
    raise ModuleNotFoundError(
        f"{e}: this adapter needs pip install 'metachunk[llamaindex]'", name=e.name
    ) from e


class MetachunkNodeParser(NodeParser):
    """Nodes from a metachunk chunker's chunks. Whitespace-only chunks (a blank document's) make no node."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    chunker: Any = Field(
        default=None, exclude=True, description="a metachunk chunker: chunker(text) -> chunks"
    )
    # What the chunker is, in the parser's serialised form: an IngestionPipeline's cache keys each step by
    # its to_dict(), and without it any two chunkers read alike (a cached run handed one parser's nodes
    # to another). A metachunk chunker's repr names its method, model and changed settings.
    chunker_spec: str = Field(default="", description="the chunker, as its repr says it")
    _spans: dict = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.chunker is None:
            raise ValueError("MetachunkNodeParser needs a chunker: MetachunkNodeParser.from_chunker(chunker)")
        self.chunker_spec = repr(self.chunker)

    @classmethod
    def from_chunker(cls, chunker, **kwargs: Any) -> MetachunkNodeParser:
        """A parser over ``chunker``, any metachunk chunker; ``kwargs`` are LlamaIndex's `NodeParser`
        settings (``include_metadata``, ``include_prev_next_rel``, ...)."""
        return cls(chunker=chunker, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "MetachunkNodeParser"

    def _parse_nodes(
        self, nodes: Sequence[BaseNode], show_progress: bool = False, **kwargs: Any
    ) -> list[BaseNode]:
        out: list[BaseNode] = []
        texts = [node.get_content(metadata_mode=MetadataMode.NONE) for node in nodes]
        for node, chunks in zip(nodes, self.chunker.chunk_batch(texts)):
            kept = [c for c in chunks if c.text.strip()]
            built = build_nodes_from_splits([c.text for c in kept], node, id_func=self.id_func)
            for child, chunk in zip(built, kept):
                child.start_char_idx, child.end_char_idx = chunk.start, chunk.end
                self._spans[child.node_id] = (chunk.start, chunk.end)
            out.extend(built)
        return out

    # The base class finds each node's text again in its document (str.find, after `_parse_nodes`): a
    # chunk knows its span, so the spans are put back once the public entry points are done.
    def get_nodes_from_documents(
        self, documents: Sequence[Document], show_progress: bool = False, **kwargs: Any
    ) -> list[BaseNode]:
        return self._with_spans(super().get_nodes_from_documents(documents, show_progress, **kwargs))

    async def aget_nodes_from_documents(
        self, documents: Sequence[Document], show_progress: bool = False, **kwargs: Any
    ) -> list[BaseNode]:
        return self._with_spans(await super().aget_nodes_from_documents(documents, show_progress, **kwargs))

    def _with_spans(self, nodes: list[BaseNode]) -> list[BaseNode]:
        for node in nodes:
            span = self._spans.pop(node.node_id, None)
            if span is not None and isinstance(node, TextNode):
                node.start_char_idx, node.end_char_idx = span
        return nodes
