"""Markdown for the cards and reports: tables, fenced blocks, and local paths as a card shows them.

One table writer serves the dataset card, the model card and the eval reports; the cell rule is the
caller's, because their outputs differ (and are compared byte for byte): the cards put every cell on one
line with its whitespace runs collapsed (`cell`), the eval reports keep a value's own spacing and
only take the newlines out (`report_cell`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def cell(value) -> str:
    """Text that fits in one Markdown table cell: one line, whitespace runs as one space, pipes escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def report_cell(value) -> str:
    """A table cell that keeps the text's own spacing: pipes escaped, newlines as spaces."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list, rows: list[list], cell: Callable[[object], str] = cell) -> str:
    """A GitHub Markdown table, its header and every row written with ``cell``."""
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def fenced(text: str, lang: str = "text") -> str:
    """A fenced block that the text cannot close: the fence is longer than any backtick run in it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def shown_path(path) -> str:
    """A local path as a card shows it. A card is a public document once pushed, and an absolute path
    names a user's home, cache and folder layout while saying nothing to its readers: one under the
    working directory is shown relative to it, any other only by its last part (``…/name``). A
    relative path is shown as given (what the user typed)."""
    p = Path(str(path))
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return f"…/{p.name}"


def shown_argument(value):
    """A command's word or a hyperparameter, an absolute path in it (``/home/…/recipe.yaml``,
    ``--deepspeed=/…/zero3.json``) shown by `shown_path`; anything else as it is."""
    if not isinstance(value, str):
        return value
    flag, eq, rest = value.partition("=")
    if eq and flag.startswith("-") and rest.startswith("/"):
        return f"{flag}={shown_path(rest)}"
    return shown_path(value) if value.startswith("/") else value
