"""Teacher distillation through OpenAI-compatible APIs (built in a later issue)."""
