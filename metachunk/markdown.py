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


def shown_path(path, relative_to_cwd: bool = True) -> str:
    """A local path as a card shows it. A card is a public document once pushed, and an absolute path
    names a user's home, cache and folder layout while saying nothing to its readers: it is shown by
    its last part only (``…/name``), or, with ``relative_to_cwd`` (a path typed for this command),
    relative to the working directory when it lies under it, unless that directory holds the home
    folder (``/``, ``/home``), which would show the home in full. A relative path is shown as given."""
    p = Path(str(path))
    if not p.is_absolute():
        return str(p)
    if relative_to_cwd:
        cwd = Path.cwd().resolve()
        try:
            home_under_cwd = Path.home().resolve().is_relative_to(cwd)
        except RuntimeError:  # no home folder to find
            home_under_cwd = False
        if not home_under_cwd and p.resolve().is_relative_to(cwd):
            return str(p.resolve().relative_to(cwd))
    return f"…/{p.name}"


def shown_argument(value, relative_to_cwd: bool = True):
    """A command's word or a hyperparameter, an absolute path in it (``/home/…/recipe.yaml``,
    ``--deepspeed=/…/zero3.json``) shown by `shown_path`; anything else as it is."""
    if not isinstance(value, str):
        return value
    flag, eq, rest = value.partition("=")
    if eq and flag.startswith("-") and rest.startswith("/"):
        return f"{flag}={shown_path(rest, relative_to_cwd)}"
    return shown_path(value, relative_to_cwd) if value.startswith("/") else value


def shown_paths_in(text: str) -> str:
    """``text``, a YAML recipe published with a dataset, with each value that is an absolute path (or
    a ``--flag=/path``) shown as `shown_argument` shows it without a working directory:
    ``…/records.jsonl``. Only the recipe's own string values are replaced, where they appear in the
    text; comments (an API's ``/v2/chat/completions``) and anything that does not parse are kept."""
    import yaml

    try:
        recipe = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, dict):
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)
        elif isinstance(node, str) and shown_argument(node, relative_to_cwd=False) != node:
            found.add(node)

    visit(recipe)
    for value in sorted(found, key=len, reverse=True):  # a path that holds another goes first
        text = text.replace(value, shown_argument(value, relative_to_cwd=False))
    return text


def shown_keys(by_path: dict) -> dict:
    """``by_path`` keyed by its paths as `shown_argument` shows them; two that would show alike
    (``…/documents.jsonl`` of two folders) keep as many of their last parts as tell them apart, so no
    entry is lost."""
    shown: dict = {}
    for path, value in by_path.items():
        key, parts = shown_argument(path), Path(path).parts
        for n in range(2, len(parts) + 1):
            if key not in shown:
                break
            key = "…/" + "/".join(parts[-n:])
        shown[key] = value
    return shown
