"""metachunk's chunkers where RAG frameworks expect theirs: a LangChain ``TextSplitter``
(:mod:`.langchain_splitter`), a LlamaIndex ``NodeParser`` (:mod:`.llama_index_parser`) and a
chonkie chunker (:mod:`.chonkie_chunker`). Each wraps any metachunk chunker (``PPLChunker``,
``MSPChunker``, ...: ``chunker(text) -> chunks`` with ``text``, ``start``, ``end``) and keeps its
exact offsets; each needs its framework's extra (``pip install 'metachunk[langchain]'``, ...)."""
