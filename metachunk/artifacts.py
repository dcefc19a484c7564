"""Artifact I/O: reading documents with precise errors, writing JSONL atomically.

Every artifact is a file a person can open. Readers name the file, line and field they could not
parse; writers go through a temp file and a rename, so a crash never leaves a half-written file
in place of a good one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1


class InputError(ValueError):
    """Bad user input. The message names the file, the line (when there is one) and the problem."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str


def read_documents(path: str | Path) -> Iterator[Document]:
    """Documents from a ``.jsonl`` file (``text``, optional ``id``; a missing id becomes the line
    number) or from a ``.txt`` file holding one document (its id is the file stem)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "no such file")
    if path.suffix == ".txt":
        try:
            yield Document(path.stem, path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(path, f"invalid UTF-8 at byte {e.start}") from None
        return
    if path.suffix != ".jsonl":
        raise InputError(path, "input must be a .jsonl file (one JSON object per line) or a .txt file")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(path, f"invalid UTF-8 at byte {e.start} of the line", number) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(path, f"invalid JSON ({e.msg} at column {e.colno})", number) from None
            if not isinstance(record, dict):
                raise InputError(path, "expected a JSON object with a 'text' field", number)
            if "text" not in record:
                raise InputError(path, "missing field 'text'", number)
            if not isinstance(record["text"], str):
                raise InputError(
                    path, f"field 'text' must be a string, got {type(record['text']).__name__}", number
                )
            doc_id = record.get("id", number)
            yield Document(str(doc_id), record["text"])


class AtomicWriter:
    """Write a text file through a temp file in the same directory; rename into place on success.

    On an exception the temp file is removed and any existing file at ``path`` is left untouched.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)
        return False


def write_json(path: str | Path, obj) -> None:
    with AtomicWriter(path) as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


def jsonl_line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
