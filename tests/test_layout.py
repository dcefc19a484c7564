"""The import rules of docs/ARCHITECTURE.md, checked by parsing every module's imports (``ast``).

- No cycle between the top-level packages, and none between the modules of one package.
- ``chunking/`` imports only ``metachunk/``; ``eval/`` and ``train/`` import no ``distill/``.
- ``metachunk/`` (the shared core) imports no stage package, except its two composition roots,
  the CLI and the package's ``__init__`` (the public API), which import stages when first used.
- No module imports another module's ``_private`` name, or reads one through the module.

Every import counts: at the top, inside a function (a lazy import is still a dependency) and under
``if TYPE_CHECKING:`` (a type that has to be imported from a module that imports this one says the
type lives in the wrong module).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("metachunk", "chunking", "distill", "train", "eval")  # the folders at the repo's top
STAGES = PACKAGES[1:]  # installed as metachunk.chunking, ...
# They compose the stages: the CLI, and the package's __init__, whose public names (PPLChunker, ...)
# are chunking/api.py's, imported when first used. Nothing in the project imports them for a stage.
COMPOSITION_ROOTS = {"metachunk.cli", "metachunk"}
ALLOWED = {  # package -> the packages it may import (besides itself)
    "metachunk": set(),
    "chunking": {"metachunk"},
    "distill": {"metachunk", "chunking"},
    "train": {"metachunk"},
    "eval": {"metachunk", "chunking"},
}


def module_name(path: Path) -> str:
    """The name a module imports as: a stage folder's under ``metachunk.``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in STAGES:
        parts.insert(0, "metachunk")
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imports(path: Path, name: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import in the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return sorted(found, key=lambda f: f[2])


def project_edges() -> dict[str, set[tuple[str, int]]]:
    """module -> {(project module it imports, line)}; ``from pkg import mod`` counts as ``pkg.mod``."""
    known = modules()
    edges: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for name, path in known.items():
        for target, names, line in imports(path, name):
            if target.split(".")[0] != "metachunk":
                continue
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            for module in submodules or [target]:
                if module in known and module != name:
                    edges[name].add((module, line))
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def package_of(module: str) -> str:
    """``metachunk.chunking.ppl`` -> ``chunking``; ``metachunk.teacher`` -> ``metachunk``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else parts[0]


def test_every_package_imports_only_what_it_may():
    wrong = []
    for module, targets in sorted(project_edges().items()):
        if module in COMPOSITION_ROOTS:
            continue
        for target, line in sorted(targets):
            source, dest = package_of(module), package_of(target)
            if dest != source and dest not in ALLOWED[source]:
                wrong.append(f"{modules()[module].relative_to(REPO)}:{line}: {module} imports {target}")
    assert wrong == []


def test_no_import_cycle_between_packages_or_within_one():
    edges = project_edges()
    between: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        if module in COMPOSITION_ROOTS:
            continue
        for target, _ in targets:
            if package_of(target) != package_of(module):
                between[package_of(module)].add(package_of(target))
    assert find_cycle(between) is None
    for package in PACKAGES:
        within = {
            m: {t for t, _ in targets if package_of(t) == package}
            for m, targets in edges.items()
            if package_of(m) == package
        }
        assert find_cycle(within) is None, package


def suite_and_bench_files() -> dict[str, Path]:
    """The suite's and the benchmarks' files, under the same rules as the product's modules: a test
    that needs an internal gets it made public (with a docstring) rather than reached for."""
    files = sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in files}


def test_no_module_imports_another_modules_private_names():
    known = {**modules(), **suite_and_bench_files()}
    wrong = []
    for name, path in known.items():
        for target, names, line in imports(path, name):
            if target.split(".")[0] not in PACKAGES or target == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            wrong += [f"{path.relative_to(REPO)}:{line}: {target}.{n}" for n in private]
    assert wrong == []


# Documented under a leading underscore: os._exit is the exit that skips cleanup (a child after fork).
PUBLIC_UNDERSCORED = {"os._exit"}
# The suite's mock Hub transport restores huggingface_hub's own client factory afterwards, and keeps its
# request hook (the offline check): the library has no public name for either.
TEST_ONLY_PRIVATE = {"huggingface_hub.utils._http"}


def test_no_module_reads_a_private_name_through_another_module():
    """``module._name`` where ``module`` is imported (``re._MAXCACHE``, ``huggingface_hub.utils._http``):
    the import rule's twin for attribute reads, for every module, ours or a library's."""
    wrong = []
    tests = suite_and_bench_files()
    for path in [*modules().values(), *tests.values()]:
        allowed = PUBLIC_UNDERSCORED | (TEST_ONLY_PRIVATE if path in tests.values() else set())
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imported = {}  # the local name -> the module or object it was imported as
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    imported[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    imported.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):  # fmt: skip
                name = f"{imported[node.value.id]}.{node.attr}"
                if name not in allowed:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert wrong == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from metachunk.distill.run import x\n", [("metachunk.distill.run", ["x"], 1)]),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import metachunk.eval.qa\n",
            [("typing", ["TYPE_CHECKING"], 1), ("metachunk.eval.qa", [], 3)],
        ),
        ("def f():\n    from . import store\n", [("metachunk", ["store"], 2)]),
    ],
)
def test_the_import_reader(tmp_path, source, expected):
    path = tmp_path / "mod.py"
    path.write_text(source, encoding="utf-8")
    assert imports(path, "metachunk.mod") == expected


def test_the_runner_knows_the_commands_only_through_their_contract():
    """``metachunk/regen.py`` names no other module's output file, manifest key, config field or
    command: what a stage reads, writes, reports and costs comes from its command's contract
    (``metachunk/command.py``), handed to it by the CLI."""
    path = REPO / "metachunk" / "regen.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }
    # (Its own recipe and manifest have a `model`, `summary` and `teachers` of their own.)
    others = {
        # output files and manifest keys of other commands
        ".meta.json", "manifest.json", "build_report.json", "metrics.json", "sample.json", "report.json",
        "metachunk_run.json", "mean_chunk_chars", "length_fit", "rows", "requests_sent", "hits@",
        # config fields of other commands
        "out", "output", "output_dir", "cards_dir", "plot", "experts", "generator_teacher", "regen_manifest",
        "dataset_name", "method", "dry_run",
        # command words
        "chunk", "data", "distill", "push", "build-sft", "train", "export", "eval",
    }  # fmt: skip
    named = sorted(s for s in strings if s in others or s.endswith((".meta.json", "/manifest.json")))
    assert named == []
    assert not any("--dry-run" in s for s in strings)  # no printed output is parsed
