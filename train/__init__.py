"""Supervised fine-tuning of the student models (built in a later issue)."""
