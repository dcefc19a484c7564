"""Evaluation of chunkers and RAG answers (built in a later issue)."""
