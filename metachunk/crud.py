"""How the CRUD-News QA pairs are read, shared by the stage that prepares the corpus
(``metachunk data prepare-crud``, `metachunk.distill.corpus`: which article each QA entry comes from)
and the one that evaluates on it (`metachunk.eval.retrieval`: the evidence a retrieved chunk must hold).

Both skip the same answers that state no fact to look for (`informative`: 无法推断, 是的, a single
character, ...). Each matches in its own normal form: `normalize` here (NFKC, lower case, no
whitespace); the evaluation's also drops quote marks, which a chunk and its answer often write
differently (`metachunk.eval.retrieval.normalize_with_map`), and maps offsets back to the text.
"""

from __future__ import annotations

import re
import unicodedata

# Answers that carry no fact to look for in an article.
NON_INFORMATIVE = frozenset(
    {"是", "否", "是的", "不是", "有", "没有", "无", "对", "不对", "不确定", "未知", "不知道", "未提及"}
)

_WHITESPACE = re.compile(r"\s+")
_PUNCTUATION = re.compile(r"[\W_]+")


def normalize(text: str) -> str:
    """The form all matching compares: NFKC (full-width -> half-width), lower case, no whitespace."""
    return _WHITESPACE.sub("", unicodedata.normalize("NFKC", text)).lower()


def informative(answer: str) -> bool:
    """Whether an answer states a fact worth looking for (not 无法推断, 是的, a single character...)."""
    a = normalize(answer)
    return len(_PUNCTUATION.sub("", a)) >= 2 and a not in NON_INFORMATIVE and "无法" not in a
