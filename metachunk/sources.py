"""Document sources: the corpora users have, read as a stream of `Document`.

One `DocumentSource` covers every input layout the toolkit accepts:

* ``.jsonl`` and ``.jsonl.gz`` (one JSON object per line, ``text`` and optional ``id``);
* ``.parquet`` (read with pyarrow, one row group at a time);
* a ``datasets`` folder (``Dataset.save_to_disk``; memory-mapped Arrow);
* ``--input-format lines``: one document per line of plain text, as the raw CRUD corpus ships
  (``data/80000_docs/documents_dup_part_*``); a document's id is ``FILE:LINE``;
* a ``.txt`` file: one document, its id the file stem;
* a folder of ``.jsonl``/``.jsonl.gz``/``.parquet`` shards, or of plain-text files under
  ``--input-format lines`` (sorted by path; hidden files skipped; ``.txt`` files are not read from a
  folder); ``--input-format jsonl`` or ``parquet`` reads that kind's shards only.

A named ``--input-format`` reads a file whose suffix says nothing (``corpus.json``, ``part-0``), or
``.txt``, as that format; a suffix that contradicts it (``parquet`` on ``x.jsonl``) is refused.

``text_field`` and ``id_field`` name the columns for corpora that do not call them ``text`` and
``id``. A record without an id is named by its line (or row) number; in a folder of shards, by
``FILE:LINE`` so that two shards never collide.

`DocumentSource.scan` reads everything once, in order and in bounded memory, and checks it:
invalid UTF-8 or JSON, a missing or non-string text, a lone surrogate, a duplicate id, each a
``file:line`` `InputError` before any model loads. It returns a
`SourceIndex`: the count, the characters, the content hash of the input bytes and, every
``every`` documents, where that document starts (a byte offset, or a record number where a file
cannot seek: gzip, parquet, Arrow). `DocumentSource.documents` then streams any range of
positions from the nearest checkpoint, so a shard of a 20K-document corpus is read without
reading the 19K documents before it. Only the ids are held (for the duplicate check), never the
texts.

**Bad rows.** By default (``on_bad_row="error"``) a bad row stops the read with its ``file:line``
error, before any model loads: right for a hand-made file. ``on_bad_row="skip"`` is for a crawl
where a few rows are broken: each bad row (invalid UTF-8 or JSON, a missing or non-string text, a
lone surrogate, a duplicate id, a row over ``max_row_bytes``) is left out, once, and handed to
`Rejects` with its ``file:line`` and reason; the good rows keep their order and ids, so
their output is what the good rows alone give. ``max_bad_rows`` still stops a read whose input is
mostly broken.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from metachunk.artifacts import (
    EXIT_SKIPPED,
    RUN_LOG,
    AtomicWriter,
    Document,
    InputError,
    check_unicode,
    json_error,
    read_json,
)
from metachunk.config import option

FORMATS = ("auto", "jsonl", "lines", "parquet", "datasets", "txt")
CHECKPOINT_EVERY = 256  # documents between two recorded read positions
MAX_ROW_BYTES = 64 << 20  # a larger line is not a document but a broken or hostile row
BAD_ROW_POLICIES = ("error", "skip")


class BadRow(InputError):
    """One row that cannot be a document (the others may be)."""


def rejects_path(output: str | Path) -> Path:
    """Where ``--on-bad-row skip`` writes the rows it left out: ``OUT.rejects.jsonl`` beside the
    output file (``chunks.jsonl`` -> ``chunks.rejects.jsonl``) or folder (``DIR.rejects.jsonl``)."""
    path = Path(output)
    if path.name in ("", ".."):  # `.` and `..` have no name of their own to put the file beside
        path = Path(os.path.abspath(output))
    return path.with_name(path.name.removesuffix(".jsonl") + ".rejects.jsonl")


class Rejects:
    """The rows a read left out (``on_bad_row="skip"``), written as JSONL (``file``, ``line``,
    ``reason``, ``row``: the row's first 2,000 characters) to ``path``, each row once.
    ``max_bad_rows``: more than this many stops the read (None: no limit)."""

    def __init__(self, path: str | Path | None, max_bad_rows: int | None = None):
        self.path = Path(path) if path else None
        self.max_bad_rows = max_bad_rows
        self.rows: dict[tuple[str, int | str], int | None] = {}  # each row left out, in order: its line
        # The rows themselves, spooled to a temp file as they come: a broken crawl's bad rows (2,000
        # characters each) held in memory had taken 838 MB where the good rows took 246.
        self._spool = None

    def add(self, error: InputError, raw: bytes | str | None) -> None:
        import tempfile

        # A row is named by its line; a record of a JSON file that has no lines, by the reason (its key).
        key = (str(error.path), error.line if error.line is not None else error.reason)
        if key in self.rows:
            return
        row = raw[:8000].decode("utf-8", "replace") if isinstance(raw, bytes) else (raw or "")
        self.rows[key] = error.line
        if self._spool is None:
            self._spool = tempfile.TemporaryFile("w+", encoding="utf-8")
        entry = {"file": str(error.path), "line": error.line, "reason": error.reason, "row": row[:2000]}
        self._spool.write(json.dumps(entry, ensure_ascii=False) + "\n")
        if self.max_bad_rows is not None and len(self.rows) > self.max_bad_rows:
            raise InputError(error.path, f"more than --max-bad-rows {self.max_bad_rows} bad rows; the last: "
                             f"{error.reason}", error.line)  # fmt: skip

    def write(self) -> dict:
        """The rejects file (only when there are rejects: one from an earlier run is removed, so
        the file always belongs to the output beside it) and what a manifest records of it."""
        if not self.rows or self.path is None:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            return {"rows": len(self.rows)}
        digest = hashlib.sha256()
        self._spool.seek(0)
        with AtomicWriter(self.path) as f:
            for line in self._spool:
                f.write(line)
                digest.update(line.encode("utf-8"))
        self._spool.seek(0, 2)  # on at the end, should more rows come
        return {"rows": len(self.rows), "file": str(self.path), "sha256": digest.hexdigest()}


def refuse_or_skip(rejects: Rejects | None, error: InputError, raw: bytes | str | None = None) -> None:
    """A bad row: raised as the ``file:line`` error it is (``--on-bad-row error``), or handed to
    ``rejects`` and left out (``skip``)."""
    if rejects is None:
        raise error
    rejects.add(error, raw)


@dataclass
class BadRows:
    """What a command does with a bad row of what it reads; a flat block (its keys and flags are
    top-level) in every command that reads a corpus or records."""

    on_bad_row: str = option(
        "error",
        "a bad input row (invalid UTF-8 or JSON, a missing or wrong field, a lone surrogate, a duplicate "
        "id, over --max-row-bytes): error stops with its file:line before any model loads; skip leaves it "
        "out, writes it with file:line and the reason to the rejects file beside the output (OUTPUT.rejects.jsonl; "
        "distill: OUT/TASK.rejects.jsonl), counts "
        "it in the summary and the manifest, and exits 6",
        choices=list(BAD_ROW_POLICIES),
    )
    max_bad_rows: int | None = option(None, "--on-bad-row skip: stop (exit 2) past this many bad rows")
    max_row_bytes: int = option(MAX_ROW_BYTES, "a longer input row is a bad row")

    def __post_init__(self):
        if self.max_bad_rows is not None and self.max_bad_rows < 0:
            raise ValueError(f"'max_bad_rows' must be >= 0, got {self.max_bad_rows}")
        if self.max_row_bytes < 1:
            raise ValueError(f"'max_row_bytes' must be >= 1, got {self.max_row_bytes}")

    def rejects(self, output: str | Path) -> Rejects | None:
        """Where the rows left out go for a run writing ``output``; None under ``error``."""
        return Rejects(rejects_path(output), self.max_bad_rows) if self.on_bad_row == "skip" else None

    def outputs(self, output: str | Path) -> list[Path]:
        """The rejects file a run writing ``output`` may write (for the command's ``outputs``)."""
        return [rejects_path(output)] if self.on_bad_row == "skip" else []


def finish_rejects(rejects: Rejects | None, command: str) -> dict | None:
    """Write the rejects file and say on stderr how many rows were left out; what the summary and
    the manifest record of it (None under ``--on-bad-row error``)."""
    if rejects is None:
        return None
    written = rejects.write()
    if written["rows"]:
        print(f"{command}: {written['rows']} bad rows left out (--on-bad-row skip): {written['file']}",
              file=sys.stderr)  # fmt: skip
    return written


def rows_left_out(rejected: dict | None) -> int:
    """How many rows a run's rejects (`Rejects.write`, or None) say it left out."""
    return (rejected or {}).get("rows", 0)


def total_rejects(rejected: list[dict | None]) -> dict | None:
    """Several runs' rejects as one count (``metachunk run``'s stages); None when none left rows out."""
    rows = sum(map(rows_left_out, rejected))
    return {"rows": rows} if rows else None


def skipped_exit(rejected: dict | None) -> int:
    """`EXIT_SKIPPED` when a run left rows out, else 0."""
    return EXIT_SKIPPED if rows_left_out(rejected) else 0


# RFC 8259 section 8.1: a parser "MAY ignore the presence of a byte order mark rather than treating it
# as an error". Windows tools write one at the start of a UTF-8 file, and it is no part of the text:
# kept, it would start the first document's first chunk.
UTF8_BOM = b"\xef\xbb\xbf"


def without_bom(raw: bytes, number: int) -> bytes:
    """Line ``number`` (from 1) of a file without the byte order mark that may open the file."""
    return raw[len(UTF8_BOM) :] if number == 1 and raw.startswith(UTF8_BOM) else raw


def bounded_lines(f, limit: int) -> Iterator[tuple[bytes, int]]:
    """Each line of the binary file ``f`` as ``(bytes, its length)``; a line longer than ``limit``
    is read through in blocks and given as its first ``limit + 1`` bytes, so that no more is held at
    once whatever one line's length (a 300 MB line had peaked at 832 MB before it was refused)."""
    while raw := f.readline(limit + 1):
        size = len(raw)
        if size > limit and not raw.endswith(b"\n"):
            while block := f.readline(1 << 20):
                size += len(block)
                if block.endswith(b"\n"):
                    break
        yield raw, size


def read_records(path: str | Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES
                 ) -> Iterator[tuple[int, bytes, dict]]:  # fmt: skip
    """``(line number, raw line, object)`` for each non-blank line of a JSONL file of records
    (chunks, distilled records, questions), streamed. A line over ``max_row_bytes``, not UTF-8, not
    JSON or not an object is a bad row (`refuse_or_skip`); field checks are the caller's."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "no such file")
    with path.open("rb") as f:
        for number, (raw, size) in enumerate(bounded_lines(f, max_row_bytes), 1):
            try:
                if size > max_row_bytes:
                    raise BadRow(path, f"a row of {size:,} bytes, over {max_row_bytes:,}", number)
                try:
                    line = without_bom(raw, number).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRow(path, f"invalid UTF-8 at byte {e.start} of the line", number) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadRow(path, json_error(e), number) from None
                if not isinstance(record, dict):
                    raise BadRow(path, "expected a JSON object", number)
            except BadRow as e:
                refuse_or_skip(rejects, e, raw)
                continue
            yield number, raw, record


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: str  # jsonl | jsonl.gz | lines | parquet | datasets | txt
    name: str  # how ids and errors name it: relative to the source folder, or the file name


@dataclass
class SourceIndex:
    """What one scan learnt: enough to read any range of positions again without rescanning."""

    documents: int = 0
    chars: int = 0
    sha256: str = ""
    # (position, file number, byte offset, records before): see DocumentSource._records
    checkpoints: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (file number, records before) of the duplicates a skipping scan left out (bounded by max_bad_rows)
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"documents": self.documents, "chars": self.chars, "sha256": self.sha256,
                "checkpoints": self.checkpoints, "skipped": self.skipped}  # fmt: skip

    @classmethod
    def from_json(cls, obj: dict) -> SourceIndex:
        return cls(obj["documents"], obj["chars"], obj["sha256"], [tuple(c) for c in obj["checkpoints"]],
                   [tuple(s) for s in obj.get("skipped", [])])  # fmt: skip


def _suffix_kind(name: str) -> str | None:
    for suffix, kind in (
        (".jsonl.gz", "jsonl.gz"),
        (".jsonl", "jsonl"),
        (".parquet", "parquet"),
        (".txt", "txt"),
    ):
        if name.endswith(suffix):
            return kind
    return None


def _kind(path: Path, input_format: str) -> str | None:
    """How ``path`` is read: ``lines`` as asked; else by its suffix, or as ``input_format`` says
    when the suffix is none we know (a gzip suffix kept: ``jsonl`` on ``x.gz`` is ``jsonl.gz``). A
    format that its suffix contradicts is refused rather than either one silently ignored."""
    if input_format == "lines":
        return "lines"
    by_name = _suffix_kind(path.name)
    if input_format not in ("jsonl", "parquet", "txt"):
        return by_name
    if by_name is None or by_name == "txt":  # .txt says little: JSON lines are often saved so
        return "jsonl.gz" if input_format == "jsonl" and path.name.endswith(".gz") else input_format
    if by_name.split(".")[0] != input_format:
        raise InputError(
            path, f"--input-format {input_format}, but its name says {by_name}: rename the file, or leave "
            "--input-format auto"
        )  # fmt: skip
    return by_name


def hub_dataset(path: str | Path) -> Path:
    """``hf://datasets/ORG/NAME[@REV]`` (a ``Path`` has folded its ``//``): the dataset repo's local
    snapshot (`metachunk.hub.snapshot`), read as a folder of shards; any other path as is."""
    text = str(path)
    if not text.startswith(("hf://", "hf:/")):
        return Path(path)
    from metachunk import hub

    ref = "hf://" + text.split(":/", 1)[1].lstrip("/")
    try:
        return hub.snapshot(ref, "dataset")
    except hub.HubNotFound as e:
        raise InputError(text, str(e)) from None


def _whole_gzip(f, path: Path, limit: int) -> Iterator[tuple[bytes, int]]:
    """The lines of gzip file ``f``, as `bounded_lines` gives them; a file that is not gzip, or one
    cut short, is an `InputError`."""
    try:
        yield from bounded_lines(f, limit)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise InputError(path, f"not a whole gzip file ({e})") from None


class DocumentSource:
    """A corpus on disk, as documents in a fixed order (see the module docstring)."""

    def __init__(self, path: str | Path, input_format: str = "auto", text_field: str = "text",
                 id_field: str = "id", rejects: Rejects | None = None,
                 max_row_bytes: int = MAX_ROW_BYTES):  # fmt: skip
        self.rejects = rejects  # on_bad_row skip: where bad rows go; None: a bad row is an error
        self.max_row_bytes = max_row_bytes
        if input_format not in FORMATS:
            raise InputError(path, f"unknown input format {input_format!r}; one of {', '.join(FORMATS)}")
        self.path, self.input_format = hub_dataset(path), input_format
        self.text_field, self.id_field = text_field, id_field
        self.files = self._files()
        self._follow = None  # (position, index, the documents from there on): where the last range ended

    def _files(self) -> list[SourceFile]:
        path = self.path
        if not path.exists():
            raise InputError(path, "no such file or directory")
        if path.is_dir():
            if (path / "dataset_dict.json").is_file():
                splits = read_json(path / "dataset_dict.json").get("splits", [])
                raise InputError(
                    path, f"a datasets DatasetDict; point at one split's folder ({', '.join(splits)})"
                )
            if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
                return [SourceFile(path, "datasets", path.name)]
            if self.input_format == "datasets":
                raise InputError(path, "not a folder written by datasets' save_to_disk (no state.json)")
            if self.input_format == "txt":
                raise InputError(path, "a folder: --input-format txt reads one .txt file as one document")
            # In a folder only suffixes decide (a README is not a shard), unless every file is lines;
            # --input-format jsonl or parquet keeps that kind's shards only.
            wanted = {"lines": ("lines",), "jsonl": ("jsonl", "jsonl.gz"), "parquet": ("parquet",)}.get(
                self.input_format, ("jsonl", "jsonl.gz", "parquet")
            )
            files = []
            for p in sorted(path.rglob("*")):
                rel = p.relative_to(path)
                # a run log (chunk and eval folders' runs.jsonl) is how a folder was made, not its rows
                if not p.is_file() or any(part.startswith(".") for part in rel.parts) or p.name == RUN_LOG:
                    continue
                kind = "lines" if self.input_format == "lines" else _suffix_kind(p.name)
                if kind in wanted:
                    files.append(SourceFile(p, kind, rel.as_posix()))
            if not files:
                shown = (
                    "plain-text files" if self.input_format == "lines" else ", ".join(f".{k}" for k in wanted)
                )
                raise InputError(path, f"a folder with no input shards ({shown})")
            return files
        kind = _kind(path, self.input_format)
        if kind is None or self.input_format == "datasets":
            raise InputError(
                path,
                "input must be .jsonl, .jsonl.gz, .parquet, .txt, a folder of shards or a datasets folder "
                "(or --input-format lines for one document per line of plain text)",
            )
        return [SourceFile(path, kind, path.name)]

    # ---- reading -------------------------------------------------------------------------------

    def _default_id(self, file: SourceFile, number: int) -> str:
        # One file: the line number, as ever. Several: FILE:LINE, unique across the shards.
        return f"{file.name}:{number}" if len(self.files) > 1 or file.kind == "lines" else str(number)

    def _records(self, k: int, cursor: int = 0, before: int = 0) -> Iterator[tuple[int, int, Document]]:
        """``(cursor, before, document)`` for file ``k``, validated, from the document that
        ``(cursor, before)`` names: a byte offset and the lines before it in a plain file; the
        lines (gzip) or rows (parquet, Arrow) before it otherwise. Each document comes with its own
        pair, which `documents` resumes from."""
        file = self.files[k]
        if file.kind in ("jsonl", "jsonl.gz", "lines"):
            yield from self._text_records(file, cursor, before)
        elif file.kind == "parquet":
            yield from self._parquet_records(file, before)
        elif file.kind == "datasets":
            yield from self._datasets_records(file, before)
        else:  # txt: one document
            try:
                yield 0, 0, Document(file.path.stem, without_bom(file.path.read_bytes(), 1).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(file.path, f"invalid UTF-8 at byte {e.start}") from None

    def _text_records(self, file: SourceFile, cursor: int, lines_before: int
                      ) -> Iterator[tuple[int, int, Document]]:  # fmt: skip
        gz = file.kind == "jsonl.gz"
        with (gzip.open if gz else open)(file.path, "rb") as f:
            # A plain file seeks to its cursor (a byte offset); gzip cannot, so it reads past
            # ``lines_before`` lines instead.
            offset, number = (cursor, lines_before) if not gz else (0, 0)
            if not gz and cursor:
                f.seek(cursor)
            for raw, size in (
                _whole_gzip(f, file.path, self.max_row_bytes) if gz else bounded_lines(f, self.max_row_bytes)
            ):
                start = offset
                offset += size
                number += 1
                if gz and number <= lines_before:
                    continue
                try:
                    if size > self.max_row_bytes:
                        raise BadRow(
                            file.path, f"a row of {size:,} bytes, over {self.max_row_bytes:,}", number
                        )
                    doc = self._parse_line(file, raw, number)
                except InputError as e:
                    if self.rejects is None or e.line is None:
                        raise
                    self.rejects.add(e, raw)
                    continue
                if doc is not None:
                    yield (0 if gz else start), number - 1, doc

    def _parse_line(self, file: SourceFile, raw: bytes, number: int) -> Document | None:
        try:
            line = without_bom(raw, number).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(file.path, f"invalid UTF-8 at byte {e.start} of the line", number) from None
        if not line.strip():
            return None
        if file.kind == "lines":
            text = line.rstrip("\r\n")
            check_unicode(file.path, number, "text", text)
            return Document(self._default_id(file, number), text)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(file.path, json_error(e), number) from None
        if not isinstance(record, dict):
            raise InputError(file.path, f"expected a JSON object with a {self.text_field!r} field", number)
        return self._document(file, record, number)

    def _document(self, file: SourceFile, record: dict, number: int) -> Document:
        tf, idf = self.text_field, self.id_field
        if tf not in record:
            raise InputError(file.path, f"missing field {tf!r}" + _fields_hint(record), number)
        text = record[tf]
        if not isinstance(text, str):
            raise InputError(file.path, f"field {tf!r} must be a string, got {type(text).__name__}", number)
        doc_id = record_id(file.path, number, record, idf)
        if doc_id is None:
            doc_id = self._default_id(file, number)
        check_unicode(file.path, number, idf, doc_id)
        check_unicode(file.path, number, tf, text)
        return Document(doc_id, text)

    def _checked_document(self, file: SourceFile, record: dict, number: int) -> Document | None:
        """A row of a parquet or Arrow file as a document, or None when it is a bad row skipped."""
        try:
            return self._document(file, record, number)
        except InputError as e:
            refuse_or_skip(self.rejects, e, json.dumps(record, ensure_ascii=False, default=str))
            return None

    def _parquet_records(self, file: SourceFile, cursor: int) -> Iterator[tuple[int, int, Document]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(file.path)
        except (pa.ArrowException, OSError) as e:  # not parquet, empty, cut short
            raise InputError(file.path, f"not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise InputError(file.path, f"no column {self.text_field!r} (columns: {', '.join(names)})")
        columns = [c for c in (self.text_field, self.id_field) if c in names]
        # Skip whole row groups before the cursor, then rows within the first one read.
        row, groups = 0, []
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if groups or row + n > cursor:
                groups.append(g)
            else:
                row += n
        if not groups:
            return
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups, columns=columns):
            if row + batch.num_rows <= cursor:  # before the cursor: decoded, never made Python objects
                row += batch.num_rows
                continue
            if row < cursor:
                batch, row = batch.slice(cursor - row), cursor
            for record in batch.to_pylist():
                if doc := self._checked_document(file, record, row + 1):
                    yield 0, row, doc
                row += 1

    def _datasets_records(self, file: SourceFile, cursor: int) -> Iterator[tuple[int, int, Document]]:
        import datasets

        ds = datasets.load_from_disk(str(file.path))
        if self.text_field not in ds.column_names:
            raise InputError(
                file.path, f"no column {self.text_field!r} (columns: {', '.join(ds.column_names)})"
            )
        columns = [c for c in (self.text_field, self.id_field) if c in ds.column_names]
        ds = ds.select_columns(columns)
        for first in range(cursor, len(ds), 1024):
            batch = ds[first : first + 1024]
            for j in range(len(batch[self.text_field])):
                row = first + j
                if doc := self._checked_document(file, {c: batch[c][j] for c in columns}, row + 1):
                    yield 0, row, doc

    # ---- the two public passes -----------------------------------------------------------------

    def checked(self, index: SourceIndex | None = None) -> Iterator[tuple[int, int, int, Document]]:
        """Every document in order, with its file number and read position, every check applied
        (duplicate ids too: only the ids are held). A duplicate skipped (``on_bad_row="skip"``)
        is noted in ``index``, so that `documents` skips it too."""
        first_seen: dict[str, str] = {}
        for k, file in enumerate(self.files):
            for cursor, before, doc in self._records(k):
                number = before + 1
                if doc.id in first_seen:
                    error = BadRow(
                        file.path, f"duplicate id {doc.id!r}: first seen at {first_seen[doc.id]}", number
                    )
                    if self.rejects is None:
                        raise error
                    self.rejects.add(error, json.dumps({self.id_field: doc.id, self.text_field: doc.text[:2000]},
                                                       ensure_ascii=False))  # fmt: skip
                    if index is not None:
                        index.skipped.append((k, before))
                    continue
                first_seen[doc.id] = f"{file.name}:{number}" if len(self.files) > 1 else f"line {number}"
                yield k, cursor, before, doc

    def scan(self, every: int = CHECKPOINT_EVERY, progress: bool = False) -> SourceIndex:
        """Read and check everything once; see the module docstring. ``progress``: a bar of the
        documents checked, with their rate (a corpus of millions takes minutes to check)."""
        from metachunk.progress import bar as progress_bar

        index = SourceIndex()
        # shown after 2 s only: a small input's check (and its one-line error) prints no bar
        with progress_bar(unit="doc", desc=f"check {self.path.name}", enabled=progress,
                  mininterval=0.5, delay=2.0) as bar:  # fmt: skip
            for k, cursor, before, doc in self.checked(index):
                if index.documents % every == 0:
                    index.checkpoints.append((index.documents, k, cursor, before))
                    bar.update(every if index.documents else 0)
                index.documents += 1
                index.chars += len(doc.text)
            bar.update(index.documents - bar.n)
        digest = hashlib.sha256()
        for file in self.files:
            _hash_file(digest, file)
        index.sha256 = digest.hexdigest()
        return index

    def documents(self, start: int = 0, stop: int | None = None, index: SourceIndex | None = None
                  ) -> Iterator[Document]:  # fmt: skip
        """The documents at positions ``start`` to ``stop`` (input order), read from the nearest
        checkpoint of ``index`` before ``start`` (from the beginning without one)."""
        position, k, cursor, before = 0, 0, 0, 0
        if index is not None and index.checkpoints:
            for cp in index.checkpoints:
                if cp[0] > start:
                    break
                position, k, cursor, before = cp
        follow = self._follow
        self._follow = None
        if follow is not None and follow[0] == start and follow[1] is index:
            # The next range of a read that ended here (a worker's consecutive shards): go on from where it
            # stopped. A gzip or parquet file cannot seek to a checkpoint, and re-reading it up to each
            # shard's start made a run's reading grow with the square of the corpus.
            position, docs = start, follow[2]
        else:
            if follow is not None:  # not followed on: its file is closed now, not when collected
                follow[2].close()
            skipped = {tuple(s) for s in index.skipped} if index is not None else set()
            docs = self._from(k, cursor, before, skipped)
        wanted = None if stop is None else stop - position
        n = 0
        for doc in islice(docs, start - position, wanted):
            n += 1
            yield doc
        if stop is not None and n == stop - start:  # read to its end: the next range may follow on
            self._follow = (stop, index, docs)

    def _from(self, k: int, cursor: int, before: int, skipped: set = frozenset()) -> Iterator[Document]:
        for j in range(k, len(self.files)):
            for _, row, doc in self._records(j, *((cursor, before) if j == k else (0, 0))):
                if (j, row) not in skipped:  # a duplicate the scan left out
                    yield doc

    def __iter__(self) -> Iterator[Document]:
        return (doc for *_, doc in self.checked())

    def describe(self) -> dict:
        """How the manifest names this input (no texts)."""
        return {"path": str(self.path), "format": self.input_format, "files": len(self.files),
                "text_field": self.text_field, "id_field": self.id_field}  # fmt: skip


def read_documents(path: str | Path, input_format: str = "auto", text_field: str = "text",
                   id_field: str = "id", rejects: Rejects | None = None,
                   max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Document]:  # fmt: skip
    """The documents of any input `DocumentSource` reads, streamed and checked (bad rows to
    ``rejects`` when given)."""
    return iter(
        DocumentSource(path, input_format, text_field, id_field, rejects=rejects, max_row_bytes=max_row_bytes)
    )


class DocumentsFileError(InputError):
    """The documents file a `DocumentTexts` reads could not be read on (a cut gzip, more bad rows
    than ``max_bad_rows``): an error of that file, never of the record that asked."""


class DocumentTexts:
    """Texts by id from a documents file, read front to back as they are asked for: a reader whose ids
    come in the file's order (records made from it, as distill keeps its input order) holds only
    the last ``window`` documents, so memory is bounded by the window, not by the corpus. An id
    asked for after the read has passed it (records in another order) loads every text once, as a
    dict: correct in any order, bounded only in the file's. Only the ids read are held besides
    (an id the file lacks is known once the read has ended). `finish` reads the rest, so every row
    is checked (and a bad one rejected) as a full read would. The file is opened once (a Hub
    dataset is resolved to one snapshot, however often it is read)."""

    def __init__(self, path: str | Path, rejects: Rejects | None = None, max_row_bytes: int = MAX_ROW_BYTES,
                 window: int = 256):  # fmt: skip
        from collections import OrderedDict

        self.window = window
        self._source = DocumentSource(path, rejects=rejects, max_row_bytes=max_row_bytes)
        self._ahead = iter(self._source)
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._passed: set[str] = set()
        self._failed: DocumentsFileError | None = None
        self.all: dict[str, str] | None = None  # set once an id was asked out of order

    @property
    def held(self) -> int:
        """How many texts the window holds now (at most ``window``)."""
        return len(self._recent)

    def get(self, doc_id: str) -> str | None:
        """The document's text, or None when the file has no such id."""
        if self._failed is not None:
            raise self._failed
        if self.all is not None:
            return self.all.get(doc_id)
        if doc_id in self._recent:
            return self._recent[doc_id]
        with self._reading():
            if doc_id in self._passed:  # behind the read: the asker's order is not the file's
                self.all = {d.id: d.text for d in self._source}
                self._recent.clear()
                self._ahead = iter(())  # the whole file is read
                return self.all.get(doc_id)
            for doc in self._ahead:
                self._passed.add(doc.id)
                self._recent[doc.id] = doc.text
                if len(self._recent) > self.window:
                    self._recent.popitem(last=False)
                if doc.id == doc_id:
                    return doc.text
        return None

    def finish(self) -> None:
        """Read (and check) the rows no one asked for."""
        if self._failed is not None:
            raise self._failed
        with self._reading():
            for _ in self._ahead:
                pass

    @contextlib.contextmanager
    def _reading(self):
        try:
            yield
        except DocumentsFileError:
            raise
        except InputError as e:  # the read cannot go on: every later ask fails the same way
            self._failed = DocumentsFileError(e.path, e.reason, e.line)
            raise self._failed from None


def _hash_file(digest, file: SourceFile) -> None:
    """The input's bytes (a folder's files in order), so a changed input is a changed hash."""
    paths = sorted(p for p in file.path.rglob("*") if p.is_file()) if file.path.is_dir() else [file.path]
    for p in paths:
        digest.update(str(p.relative_to(file.path) if file.path.is_dir() else file.name).encode())
        with open(p, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)


def record_id(path, line: int, record: dict, field: str) -> str | None:
    """The id ``record[field]`` holds, as text (a number as Python writes it), or None when it has
    none; a bool, an object or a list is refused naming the field (``str()`` made ``"True"`` of it)."""
    raw = record.get(field)
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int, float))):
        raise InputError(path, f"field {field!r} must be a string or a number, got "
                         f"{type(raw).__name__} ({json.dumps(raw, default=str)[:40]})", line)  # fmt: skip
    return None if raw is None else str(raw)


def _fields_hint(record: dict) -> str:
    names = [str(k) for k in record][:8]
    return f" (the record has: {', '.join(names)}; choose one with --text-field)" if names else ""
