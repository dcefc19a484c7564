"""Markdown for the cards and reports: tables and fenced blocks.

One table writer serves the dataset card, the model card and the eval reports; the cell rule is the
caller's, because their outputs differ (and are compared byte for byte): the cards put every cell on one
line with its whitespace runs collapsed (`cell`), the eval reports keep a value's own spacing and
only take the newlines out (`report_cell`).
"""

from __future__ import annotations

import re
from collections.abc import Callable


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
