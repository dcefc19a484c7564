"""Evaluation of chunkers and RAG answers: QA metrics, the Milvus RAG loop, chunk quality, reports."""
