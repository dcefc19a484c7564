"""metachunk: distil big teacher LLMs into small, fast models for RAG text chunking.

The stages install under this one namespace: `metachunk.chunking`, `metachunk.distill`,
`metachunk.train` and `metachunk.eval`; the rest of this package is their shared core
(CLI, config loader, model presets, token scoring, the teacher client and artifact I/O).
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# Run from a checkout's root (`deepspeed --module metachunk.train`, `python -m metachunk.cli`), Python
# finds this folder before the installed package, since `-m` puts the working directory first on
# sys.path; and this folder holds only the core. The stages are the checkout's top-level folders,
# which pyproject's package-dir maps under metachunk in a wheel: so a checkout looks for them there,
# and a wheel install (non-editable, as from a wheelhouse) runs its recipes from the clone's root.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "train" / "__init__.py").is_file():
    __path__.append(str(_checkout))

try:
    __version__ = version("metachunk")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

# The public surface: the chunkers and the students (chunking/api.py, installed as metachunk.chunking.api), imported when
# first named, so `import metachunk` and the CLI stay light.
__all__ = [
    "Chunk", "TextChunker", "PPLChunker", "MSPChunker", "MoCChunker", "LumberChunker", "FixedChunker",
    "SentenceChunker", "SemanticChunker", "Rewriter", "Summarizer",
]  # fmt: skip


def __getattr__(name: str):
    if name in __all__:
        from metachunk.chunking import api

        return getattr(api, name)
    raise AttributeError(f"module 'metachunk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
