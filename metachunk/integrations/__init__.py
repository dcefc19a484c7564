"""metachunk's chunkers where RAG frameworks expect theirs: a LangChain ``TextSplitter``
([`langchain_splitter`][metachunk.integrations.langchain_splitter]), a LlamaIndex ``NodeParser`` ([`llama_index_parser`][metachunk.integrations.llama_index_parser]) and a
chonkie chunker ([`chonkie_chunker`][metachunk.integrations.chonkie_chunker]). Each wraps any metachunk chunker (``PPLChunker``,
``MSPChunker``, ...: ``chunker(text) -> chunks`` with ``text``, ``start``, ``end``) and keeps its
exact offsets; each needs its framework's extra (``pip install 'metachunk[langchain]'``, ...)."""
