"""The teacher prompts of the distill pipelines: ``distill/prompts/{name}.{lang}.txt``, in the one
prompt-file format (`metachunk.prompts`; the file's sha256 is the prompt's version). A stage
whose answer is JSON (``refinement``, ``moc_chunk``) has its answer schema beside its prompts,
``distill/prompts/{name}.schema.json`` (`load_schema`).

The students' instructions (``student_rewrite``, ``student_summary``) live with the chunker that
runs the trained students (``chunking/prompts/``, `metachunk.chunking.students`); ``load_prompt``
finds them there too, so the SFT rows and inference share one prompt.
"""

from __future__ import annotations

from metachunk.chunking.students import load_student_prompt

from metachunk.prompts import LANGS, Prompt, Schema, check_lang, load_prompt_file, load_schema_file

__all__ = ["LANGS", "Prompt", "Schema", "load_prompt", "load_schema"]


def load_prompt(name: str, lang: str) -> Prompt:
    """The prompt of distill stage ``name`` (``reflection``, ``moc_chunk``, ...) or of a student
    (``student_rewrite``, ``student_summary``)."""
    check_lang(lang)
    if name.startswith("student_"):
        return load_student_prompt(name.removeprefix("student_"), lang)
    return load_prompt_file("metachunk.distill", name, lang)


def load_schema(name: str) -> Schema | None:
    """The answer schema of distill stage ``name``; None for a stage whose answer is text."""
    return load_schema_file("metachunk.distill", name)
