"""Rewrites the package's docstrings from Sphinx markup into what the documentation site renders.

mkdocstrings renders a docstring as Markdown, with its own cross-references (``[title][identifier]``,
resolved by mkdocs-autorefs). This script, run once from the repository root after a site build:

- turns each Sphinx role (``:class:`~metachunk.chunking.pipeline.Chunker```, ``:func:`token_nll```,
  ``:mod:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``) into a cross-reference
  ``[`Chunker`][metachunk.chunking.pipeline.Chunker]`` when the site documents its target (the
  built site's ``objects.inv``), else into plain code (```Chunker```). A name is resolved in the
  scope of the object whose docstring holds it (griffe, statically), as Sphinx would;
- turns a reST literal block (a paragraph ending in ``::``, then an indented block) into the
  paragraph ending in ``:`` and a fenced code block.

It is a one-off migration kept for the record; ``tests/test_docs.py`` keeps the docstrings in the
site's syntax from then on. Not part of the package.

    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
    .venv/bin/python docs/migrate_docstrings.py            # rewrites the files, prints a summary
"""

from __future__ import annotations

import ast
import re
import sys
import zlib
from pathlib import Path

import griffe

from metachunk.artifacts import write_bytes

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"metachunk": "metachunk", "chunking": "metachunk.chunking", "distill": "metachunk.distill",
           "train": "metachunk.train", "eval": "metachunk.eval"}  # fmt: skip
ROLE = re.compile(r":(?:py:)?(class|func|mod|meth|attr|data|exc|obj):`(~?)([^`<]*?)(?:\s*<([^>`]+)>)?`")


def inventory(site: Path) -> set[str]:
    """The identifiers the built site documents (mkdocstrings writes them to objects.inv)."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode("utf-8")
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def load_package() -> griffe.Module:
    sys.path.insert(0, str(ROOT / "docs"))
    from griffe_extensions import OptionFields, StageFolders

    return griffe.load(
        "metachunk",
        search_paths=[str(ROOT)],
        extensions=griffe.Extensions(StageFolders(), OptionFields()),
        docstring_parser="sphinx",
        resolve_aliases=False,
    )


def owner_path(module: str, tree: ast.Module, line: int) -> str:
    """The dotted path of the innermost class or function whose body holds ``line``."""
    path = [module]

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    prefix.append(child.name)
                    visit(child, prefix)
                    return

    visit(tree, path)
    return ".".join(path)


class Resolver:
    def __init__(self, package: griffe.Module, documented: set[str]):
        self.package, self.documented = package, documented

    def lookup(self, path: str):
        try:
            return self.package[path.removeprefix("metachunk.")] if path != "metachunk" else self.package
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None

    def full_path(self, target: str, owner: str) -> str | None:
        """``target`` as a full dotted path, resolved from ``owner``'s scope outwards."""
        if target.startswith("metachunk"):
            return target
        head, _, rest = target.lstrip(".").partition(".")
        scope = owner
        while scope:
            obj = self.lookup(scope)
            if obj is not None:
                try:
                    found = obj.resolve(head)
                except (griffe.NameResolutionError, AttributeError, KeyError):
                    found = None
                if found:
                    return f"{found}.{rest}" if rest else found
            scope = scope.rpartition(".")[0]
        return None

    def documented_as(self, path: str | None) -> str | None:
        """The identifier the site documents ``path`` under (itself, or what an alias points to)."""
        seen = set()
        while path and path not in seen:
            seen.add(path)
            if path in self.documented:
                return path
            obj = self.lookup(path)
            if obj is None or not getattr(obj, "is_alias", False):
                break
            try:
                path = obj.target_path
            except Exception:  # an alias griffe cannot follow statically
                break
        return None


def convert_roles(text: str, owner: str, resolver: Resolver, counts: dict) -> str:
    def replace(m: re.Match) -> str:
        _, tilde, title, explicit = m.groups()
        target = (explicit or title).strip()
        bare = target.lstrip("~.")
        shown = title.strip() if explicit else (bare.rsplit(".", 1)[-1] if tilde else bare)
        link = resolver.documented_as(resolver.full_path(bare, owner))
        counts["linked" if link else "code"] += 1
        return f"[`{shown}`][{link}]" if link else f"`{shown}`"

    return ROLE.sub(replace, text)


def convert_literal_blocks(text: str, counts: dict) -> str:
    """``para::`` + blank + indented block -> ``para:`` + fenced block (at the paragraph's indent)."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
            indent = len(line) - len(line.lstrip())
            stripped = line.rstrip()[:-2].rstrip()
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_indent = len(lines[j]) - len(lines[j].lstrip()) if j < len(lines) else 0
            if j < len(lines) and block_indent > indent:
                end = j
                while end < len(lines) and (not lines[end].strip() or
                                            len(lines[end]) - len(lines[end].lstrip()) >= block_indent):  # fmt: skip
                    end += 1
                while end > j and not lines[end - 1].strip():
                    end -= 1
                if stripped.strip():
                    out.append(stripped + ":")
                    out.append("")
                pad = " " * indent
                block = [(pad + x[block_indent:]) if x.strip() else "" for x in lines[j:end]]
                doctest = block[0].lstrip().startswith(">>>")
                out.append(pad + ("```pycon" if doctest else "```"))
                out.extend(block)
                if doctest:  # a blank line ends a doctest's expected output before the fence
                    out.append("")
                out.append(pad + "```")
                counts["literal_blocks"] += 1
                i = end
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def docstring_spans(tree: ast.Module) -> list[tuple[int, int, int]]:
    """(first line, last line, owner line) of every docstring in the module (1-based, inclusive)."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
            ):
                if isinstance(body[0].value.value, str):
                    spans.append((body[0].lineno, body[0].end_lineno, body[0].lineno))
    return spans


def migrate_file(path: Path, module: str, resolver: Resolver, counts: dict) -> bool:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.split("\n")
    for first, last, at in sorted(docstring_spans(tree), reverse=True):
        owner = owner_path(module, tree, at)
        chunk = "\n".join(lines[first - 1 : last])
        new = convert_literal_blocks(convert_roles(chunk, owner, resolver, counts), counts)
        lines[first - 1 : last] = new.split("\n")
    result = "\n".join(lines)
    if result != source:
        ast.parse(result)  # still Python
        write_bytes(path, result.encode("utf-8"))  # a source file: never half-written
        return True
    return False


def main() -> None:
    resolver = Resolver(load_package(), inventory(ROOT / "site"))
    counts = {"linked": 0, "code": 0, "literal_blocks": 0}
    changed = 0
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            changed += migrate_file(path, ".".join([package, *parts]), resolver, counts)
    print(f"{changed} files rewritten: {counts['linked']} cross-references, {counts['code']} roles as code, "
          f"{counts['literal_blocks']} literal blocks fenced")  # fmt: skip


if __name__ == "__main__":
    main()
