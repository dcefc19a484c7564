"""The documentation cannot rot: the README stays short and its links stay inside the repository,
and every command the getting-started page shows runs, in the order shown.

A code block on ``docs/getting-started.md`` whose first line is ``# needs: ...`` (an install, a
model, minutes of CPU, a GPU or a key) is shown but not run; every other block is. The strict site
build itself (``mkdocs build --strict``) runs in ``make test`` and ``make docs``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
README_MAX_BYTES = 12_000

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
# [text](target) and ![alt](target), not inside code; <a href="..."> too
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def links(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return MD_LINK.findall(prose) + HTML_LINK.findall(prose)


def test_readme_is_short():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; the limit is {README_MAX_BYTES}"


def test_readme_starts_with_the_python_quickstart():
    lang, body = code_blocks(README.read_text(encoding="utf-8"))[0]
    assert lang == "python" and "from metachunk import" in body


def test_readme_links_stay_in_the_repository_or_are_public_urls():
    bad = []
    for target in links(README.read_text(encoding="utf-8")):
        if re.match(r"^https?://", target):
            continue
        if target.startswith("#"):  # a heading of the README itself
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            bad.append(f"{target}: neither a public URL nor a path in the repository")
            continue
        path = (ROOT / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file in the repository")
    assert not bad, "README.md links:\n" + "\n".join(bad)


def test_the_link_check_sees_bad_links():
    assert links("see [a](../shared/papers/moc.md) and `[b](x)`\n```\n[c](y)\n```\n") == [
        "../shared/papers/moc.md"
    ]


def getting_started_blocks() -> list[tuple[str, str]]:
    return code_blocks(GETTING_STARTED.read_text(encoding="utf-8"))


def test_every_getting_started_block_is_runnable_or_says_what_it_needs():
    blocks = getting_started_blocks()
    assert blocks, "no code blocks on the getting-started page"
    for lang, body in blocks:
        first = body.lstrip().splitlines()[0] if body.strip() else ""
        if first.startswith("# needs:"):
            assert len(first) > len("# needs:") + 3, f"a block says it needs nothing in particular: {first!r}"
            continue
        assert lang in ("bash", "python"), f"a block the test cannot run ({lang!r}):\n{body}"


def test_getting_started_commands_run(tmp_path):
    """Every block not marked ``# needs:``, in page order, in one folder (later blocks read what
    earlier ones wrote), with the venv's ``metachunk`` first on PATH."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    ran = []
    for lang, body in getting_started_blocks():
        if body.lstrip().startswith("# needs:"):
            continue
        if lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", body]
        else:
            cmd = [sys.executable, "-c", body]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (
            f"getting-started block failed (exit {proc.returncode}):\n{body}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
        ran.append((lang, body, proc.stdout))
    assert any(lang == "python" for lang, _, _ in ran) and any(lang == "bash" for lang, _, _ in ran)
    versions = [out for _, body, out in ran if "metachunk --version" in body]
    assert versions and versions[0].startswith("metachunk ")
    # the CLI quickstart's outputs: one line per document, chunks that tile it
    docs = {
        json.loads(line)["id"]: json.loads(line)["text"]
        for line in (tmp_path / "docs.jsonl").read_text(encoding="utf-8").splitlines()
    }
    for out in ("fixed.jsonl", "sentences.jsonl"):
        records = [json.loads(line) for line in (tmp_path / out).read_text(encoding="utf-8").splitlines()]
        assert [r["id"] for r in records] == list(docs)
        for r in records:
            text = docs[r["id"]]
            assert "".join(c["text"] for c in r["chunks"]) == text
            assert all(text[c["start"] : c["end"]] == c["text"] for c in r["chunks"])


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_pages_link_no_path_outside_the_docs(page):
    """mkdocs --strict checks links between pages; a link out of docs/ (``../chunking/ppl.py``) would
    be dead on the site, so the pages name repository files in code spans instead."""
    bad = [
        t
        for t in links((ROOT / "docs" / page).read_text(encoding="utf-8"))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)
        and not t.startswith("#")
        and not (ROOT / "docs" / t.split("#", 1)[0]).resolve().is_relative_to(ROOT / "docs")
    ]
    assert not bad, f"docs/{page} links outside docs/: {bad}"


def test_the_strict_site_builds_count_warnings():
    # mkdocs --quiet raises the log level past WARNING, so --strict beside it counts none: a cross-reference
    # to an undocumented member passed `make test` that way while `make docs` failed on it.
    builds = [line for line in (ROOT / "Makefile").read_text().splitlines() if "mkdocs build" in line]
    assert builds and all("--strict" in line and "--quiet" not in line for line in builds), builds
