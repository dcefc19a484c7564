"""The API reference reads as a page: docstrings are written in the syntax the site renders
(Markdown, mkdocstrings cross-references ``[title][identifier]``, fenced code), never in Sphinx's.

Two gates, one rule: no Sphinx role (``:class:`X```, ``:func:``, ``:mod:``, ...) and no reST
literal-block marker (a line ending in ``::``). The first reads every docstring of the package's
sources and names the file, the line and the object; the second builds the site and reads its
HTML, naming the page and the object documented nearest above. Both are shown to fail on a
planted case. (``docs/migrate_docstrings.py`` did the one-off conversion.)
"""

from __future__ import annotations

import ast
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("metachunk", "chunking", "distill", "train", "eval")
ROLE = re.compile(r":(?:py:)?(?:class|func|mod|meth|attr|data|exc|obj|ref|term|const):`")
LITERAL = re.compile(r"(?<!:)::\s*$")  # "::" closing a line; ":::" is mkdocstrings' own


def docstring_findings(source: str, path: str) -> list[str]:
    """``path:line: object: problem`` for every Sphinx role or literal-block marker in a docstring."""
    found = []

    def visit(node, owner: str) -> None:
        body = getattr(node, "body", None)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                for k, line in enumerate(body[0].value.value.split("\n")):
                    problem = (
                        "Sphinx role" if ROLE.search(line) else "reST '::'" if LITERAL.search(line) else None
                    )
                    if problem:
                        found.append(f"{path}:{body[0].lineno + k}: {owner}: {problem}: {line.strip()}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{owner}.{child.name}")

    visit(ast.parse(source), Path(path).with_suffix("").as_posix().replace("/", "."))
    return found


def html_findings(page: str, text: str) -> list[str]:
    """``page: object: problem`` for every raw role or stray ``::`` in the page's prose (code blocks
    are left alone: a ``::`` there is code). The object is the documented one nearest above."""
    found = []
    prose = re.sub(r"<(pre|script|style)\b[^>]*>.*?</\1>", lambda m: " " * len(m.group(0)), text, flags=re.S)
    anchors = [(m.start(), m.group(1)) for m in re.finditer(r'<h\d[^>]*\bid="(metachunk[^"]*)"', prose)]
    visible = re.sub(r"<[^>]+>", lambda m: " " * len(m.group(0)), prose)
    for pattern, problem in ((ROLE, "Sphinx role"), (re.compile(r"(?<!:)::(?![:\w])"), "stray '::'")):
        for m in pattern.finditer(visible):
            owner = next((name for at, name in reversed(anchors) if at < m.start()), "-")
            snippet = html.unescape(" ".join(visible[max(0, m.start() - 40) : m.end() + 20].split()))
            found.append(f"{page}: {owner}: {problem}: ...{snippet}...")
    return found


def test_no_docstring_uses_sphinx_markup():
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += docstring_findings(path.read_text(encoding="utf-8"), rel)
    assert not found, "\n".join(found)


def test_the_docstring_gate_fails_on_a_planted_role_and_marker():
    planted = 'class A:\n    def f(self):\n        """Uses :class:`Chunker`.\n\n        Like this::\n\n            f()\n        """\n'
    found = docstring_findings(planted, "chunking/x.py")
    assert found == [
        "chunking/x.py:3: chunking.x.A.f: Sphinx role: Uses :class:`Chunker`.",
        "chunking/x.py:5: chunking.x.A.f: reST '::': Like this::",
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # not --quiet: it raises the log level past WARNING, and --strict then counts no warnings at all
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    return out


def test_the_built_site_shows_no_sphinx_markup(site):
    found = []
    for page in sorted(site.rglob("*.html")):
        found += html_findings(page.relative_to(site).as_posix(), page.read_text(encoding="utf-8"))
    assert not found, "\n".join(found)


def test_the_api_pages_link_their_cross_references(site):
    """The first paragraph of the API reference: ChunkConfig and Chunker are links, rendered."""
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert re.search(
        r'<a[^>]+href="#metachunk\.chunking\.pipeline\.ChunkConfig"[^>]*>\s*<code>ChunkConfig</code>', page
    )
    assert re.search(
        r'<a[^>]+href="#metachunk\.chunking\.pipeline\.Chunker"[^>]*>\s*<code>Chunker</code>', page
    )


def test_the_site_gate_fails_on_a_planted_role_and_marker():
    page = (
        '<h2 id="metachunk.chunking.api.PPLChunker">PPLChunker</h2>'
        "<p>Runs <code>x</code> over :class:`ChunkConfig` like this::</p>"
        "<pre><code>a::b  c ::</code></pre>"
    )
    found = html_findings("api/index.html", page)
    assert len(found) == 2 and all(
        f.startswith("api/index.html: metachunk.chunking.api.PPLChunker: ") for f in found
    )
    assert "Sphinx role" in found[0] and "stray '::'" in found[1]


def test_the_api_pages_cover_the_public_surface(site):
    """Every name of ``metachunk.__all__``, the integrations, the command contract and the config
    loader have a section on the API pages, each under a one-line summary of its own."""
    import importlib

    import metachunk

    pages = {
        p: (site / "api" / p / "index.html").read_text(encoding="utf-8")
        for p in ("", "integrations", "command", "config")
    }
    wanted = {"": [f"metachunk.chunking.{'types' if n == 'Chunk' else 'api'}.{n}" for n in metachunk.__all__],
              "integrations": [f"metachunk.integrations.{m}" for m in ("langchain_splitter", "llama_index_parser",
                                                                        "chonkie_chunker")],
              "command": ["metachunk.command", "metachunk.command.Command", "metachunk.command.Reads",
                          "metachunk.command.Result", "metachunk.command.Registry"],
              "config": ["metachunk.config", "metachunk.config.option", "metachunk.config.from_namespace"]}  # fmt: skip
    for page, paths in wanted.items():
        for path in paths:
            assert f'id="{path}"' in pages[page], (page, path)
            module, _, name = path.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):  # a module itself
                obj = importlib.import_module(path)
            summary = (obj.__doc__ or "").strip().split("\n")[0]
            assert summary and not summary.startswith(f"{name}("), (
                path,
                summary,
            )  # not a dataclass's signature
