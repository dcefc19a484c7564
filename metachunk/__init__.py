"""metachunk: distil big teacher LLMs into small, fast models for RAG text chunking.

The stages install under this one namespace: :mod:`metachunk.chunking`, :mod:`metachunk.distill`,
:mod:`metachunk.train` and :mod:`metachunk.eval`; the rest of this package is their shared core
(CLI, config loader, model presets, token scoring, the teacher client and artifact I/O).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("metachunk")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
