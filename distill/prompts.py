"""The teacher prompts of the distill pipelines: ``distill/prompts/{name}.{lang}.txt``, in the one
prompt-file format (:mod:`metachunk.prompts`; the file's sha256 is the prompt's version).

The students' instructions (``student_rewrite``, ``student_summary``) live with the chunker that
runs the trained students (``chunking/prompts/``, :mod:`chunking.students`); ``load_prompt``
finds them there too, so the SFT rows and inference share one prompt.
"""

from __future__ import annotations

from chunking.students import load_student_prompt
from metachunk.prompts import LANGS, Prompt, check_lang, load_prompt_file

__all__ = ["LANGS", "Prompt", "load_prompt"]


def load_prompt(name: str, lang: str) -> Prompt:
    """The prompt of distill stage ``name`` (``reflection``, ``moc_chunk``, ...) or of a student
    (``student_rewrite``, ``student_summary``)."""
    check_lang(lang)
    if name.startswith("student_"):
        return load_student_prompt(name.removeprefix("student_"), lang)
    return load_prompt_file("distill", name, lang)
