"""Training the students: SFT with TRL (``sft.py``; ``python -m metachunk.train`` = ``metachunk train``), DeepSpeed and
launchers (``distributed.py``), and export to a Hugging Face model folder (``export.py``) with its card (``card.py``)."""
