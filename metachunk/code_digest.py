"""The code a command runs, as one sha256: what a regeneration stage's fingerprint trusts instead
of a version number.

A command's code is the import closure of its module (the one its row of the CLI's table names,
[`metachunk.command.Command`][metachunk.command.Command]): every metachunk module it imports, at the top or inside a function, read from the source with ``ast`` (nothing
is imported but the packages' ``__init__``). The digest hashes those files' bytes, so a change to
``chunking/ppl.py`` reruns the stages that chunk and not the training stage, and an edit to the
README reruns nothing. ``metachunk/cli.py`` is hashed as a file for every command (it holds the
table and the dispatch) without following its imports: it is the composition root.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Callable
from functools import cache
from pathlib import Path

ALWAYS = ("metachunk.cli",)  # hashed as files, their imports not followed
# The package's __init__ is every module's parent: hashed, but the public API it imports when
# first named (chunking/api.py) is not part of a command's code.
NOT_FOLLOWED = ("metachunk",)


def find_source(name: str) -> Path | None:
    """The source file of module ``name`` (a package's ``__init__.py``), or None if it has none."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def imported_names(path: Path, name: str) -> frozenset[str]:
    """Every module name ``path`` (module ``name``) may import (see `_imported_names`); read
    once per version of the file, as the commands' closures share most modules."""
    st = path.stat()
    return _imported_names(path, st.st_mtime_ns, st.st_size, name)


@cache
def _imported_names(path: Path, mtime_ns: int, size: int, name: str) -> frozenset[str]:
    """Every module name ``path`` (module ``name``) may import, resolved, with ``from P import x``
    counted as both ``P`` and ``P.x`` (the caller keeps those that exist)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(out)


def closure(entries: tuple[str, ...], find: Callable[[str], Path | None] = find_source,
            root: str = "metachunk") -> dict[str, Path]:  # fmt: skip
    """``{module: source}`` for ``entries`` and every ``root`` module they import, transitively."""
    seen: dict[str, Path] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name.split(".")[0] != root or name in ALWAYS:
            continue
        path = find(name)
        if path is None:
            continue
        seen[name] = path
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parents' __init__ run first
        if name not in NOT_FOLLOWED:
            todo.extend(imported_names(path, name))
    return seen


def digest(modules: dict[str, Path], extra: tuple[Path, ...] = ()) -> str:
    h = hashlib.sha256()
    for name, path in sorted(modules.items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in extra:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@cache
def command_code(entries: tuple[str, ...]) -> str:
    """The sha256 of the code a command whose modules are ``entries`` runs."""
    always = tuple(p for p in map(find_source, ALWAYS) if p is not None)
    return digest(closure(entries), always)
