"""Teacher prompts: versioned template files next to the stage that uses them.

``prompts/{name}.{lang}.txt`` holds a ``<<<system>>>`` part and a ``<<<user>>>`` part, filled
with ``str.format``. The sha256 of the file is the prompt's version: it is part of every
request's cache key and is recorded on every output record, so editing a prompt re-asks the
teacher for exactly the requests that prompt builds, and every answer says which text produced it.

The students' instructions (``student_rewrite``, ``student_summary``) live with the chunker that
runs the trained students (``chunking/prompts/``, :mod:`chunking.students`); ``load_prompt``
finds them there too, so the SFT rows and inference share one prompt.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from chunking.students import LANGS, Prompt, check_lang, load_student_prompt, parse_prompt

__all__ = ["LANGS", "Prompt", "load_prompt"]


@cache
def load_prompt(name: str, lang: str) -> Prompt:
    check_lang(lang)
    if name.startswith("student_"):
        return load_student_prompt(name.removeprefix("student_"), lang)
    resource = files("distill") / "prompts" / f"{name}.{lang}.txt"
    return parse_prompt(name, lang, resource.read_bytes(), resource)
