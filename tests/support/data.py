"""The named datasets in tests: ``data_file("crud-news/news.jsonl")`` resolves a file the way every
reader does (:func:`metachunk.named_data.resolve`: ``$METACHUNK_DATA``, the cache, the wheel), and
skips the test with the resolver's one line, which names ``metachunk data fetch NAME``, when the
dataset is absent. Emma ships in the package, so the tests that read it always run; the CRUD tests
run where ``$METACHUNK_DATA`` or the cache holds CRUD (CI points ``$METACHUNK_DATA`` at our copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metachunk.artifacts import InputError
from metachunk.named_data import PREFIX, resolve


def data_file(name: str) -> Path:
    try:
        return resolve(PREFIX + name)
    except InputError as e:
        pytest.skip(str(e))
