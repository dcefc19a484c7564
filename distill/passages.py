"""``metachunk data passages``: documents from a paragraph-level corpus.

GutenQA ships a book as one line per paragraph with its chapter (``{"chapter", "text"}``). A
stage wants documents: whole chapters to chunk and evaluate, or passages of a given size to
distil. This command groups consecutive lines by a field (``--group-field chapter``), picks
groups by position (``--groups 0:6``) or name (``--group-prefix "VOLUME II."``), and writes one
document per group, or per run of consecutive paragraphs of at least ``--min-chars``
characters within a group (a group's remainder shorter than that is dropped). ``--max-chars``
cuts each document, ``--skip`` and ``--limit`` take a slice of them. Without a group field
each line is a document of its own (``--limit 5``: the first five articles).

Ids: a whole group is named by its group (``CHAPTER I``); a passage by its group and position
(``CHAPTER X #2``); an ungrouped line keeps its id. Each id is written once: an ungrouped line
whose id was seen is a bad row, a group whose lines recur after another group's is refused. The
output is written atomically.

A bad line (not UTF-8 or JSON, no text or group string, a lone surrogate) stops the run with its
``file:line``, or with ``--on-bad-row skip`` is left out and written to ``OUT.rejects.jsonl``
(`metachunk.sources.BadRows`). The read stops where the output is complete: after ``--limit``
documents, or after the last group of a ``--groups`` slice counted from the start, so lines past
that point are not checked.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from metachunk.artifacts import AtomicWriter, InputError, check_unicode, jsonl_line
from metachunk.command import Reads, Result
from metachunk.config import block, option
from metachunk.sources import (
    BadRow,
    BadRows,
    Rejects,
    finish_rejects,
    read_records,
    record_id,
    refuse_or_skip,
)


@dataclass
class PassagesConfig:
    input: Path = option(None, "paragraphs: JSONL, one object per line with a text field (and a group field)")
    out: Path = option(None, "output JSONL: one {id, text} per document")
    text_field: str = option("text", "the field holding the paragraph's text")
    id_field: str = option("id", "the field holding a line's id (ungrouped input; default the line number)")
    group_field: str | None = option(
        None, "consecutive lines with the same value of this field form a group (a chapter)"
    )
    groups: str | None = option(
        None, "which groups, by position: START:STOP as in Python (0:6 = the first six); default all"
    )
    group_prefix: str | None = option(None, "only the groups whose name starts with this")
    min_chars: int = option(
        0, "0: one document per group; N: passages of consecutive paragraphs of >= N characters each"
    )
    joiner: str = option("\n\n", "what joins a document's paragraphs")
    max_chars: int = option(0, "cut each document to its first N characters (0: no cut)")
    skip: int = option(0, "drop the first N documents")
    limit: int = option(0, "keep at most N documents (0: all)")
    bad_rows: BadRows = block(BadRows, "what a bad input line does", prefix="")

    def __post_init__(self):
        for name in ("input", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"field '{name}': required")
        for name in ("min_chars", "max_chars", "skip", "limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"field '{name}': must be >= 0, got {getattr(self, name)}")
        if self.groups is not None:
            parse_slice(self.groups)
        if self.group_field is None and (self.groups or self.group_prefix):
            raise ValueError("fields 'groups' and 'group_prefix' need 'group_field'")


def parse_slice(text: str) -> slice:
    try:
        start, stop = (int(p) if p.strip() else None for p in str(text).split(":"))
    except ValueError:
        raise ValueError(f"field 'groups': START:STOP (e.g. 0:6 or 9:), got {text!r}") from None
    return slice(start, stop)


def read_groups(
    cfg: PassagesConfig, rejects: Rejects | None = None
) -> Iterator[tuple[str, list[str], int, bytes]]:
    """``(name, paragraphs, line, raw)`` per group of consecutive lines (a line per group when
    ungrouped), with its first line's number and bytes; bad lines to ``rejects`` (None: a bad line
    is an error)."""
    path = Path(cfg.input)
    name, paragraphs, first = None, [], (0, b"")
    for number, raw, row in read_records(path, rejects, cfg.bad_rows.max_row_bytes):
        try:
            if not isinstance(row.get(cfg.text_field), str):
                raise BadRow(path, f"field '{cfg.text_field}': a string is required", number)
            check_unicode(path, number, cfg.text_field, row[cfg.text_field])
            group = row.get(cfg.group_field) if cfg.group_field else None
            if cfg.group_field and (not isinstance(group, str) or not group):
                raise BadRow(path, f"field '{cfg.group_field}': a non-empty string is required", number)
            if group:
                check_unicode(path, number, cfg.group_field, group)
            row_id = record_id(path, number, row, cfg.id_field)
            if row_id is not None:
                check_unicode(path, number, cfg.id_field, row_id)
        except InputError as e:
            refuse_or_skip(rejects, e, raw)
            continue
        if cfg.group_field is None:
            yield row_id if row_id is not None else str(number), [row[cfg.text_field]], number, raw
            continue
        if group != name and paragraphs:
            yield name, paragraphs, *first
            paragraphs = []
        if not paragraphs:
            first = (number, raw)
        name = group
        paragraphs.append(row[cfg.text_field])
    if paragraphs:
        yield name, paragraphs, *first


def documents(cfg: PassagesConfig, rejects: Rejects | None = None) -> Iterator[dict]:
    """The documents, each id once: an input line whose id was seen is a bad row (as `metachunk
    chunk` would find it); a group whose lines come back after another group's is refused, naming
    both lines, since its documents would repeat the first run's ids."""
    path = Path(cfg.input)
    groups = read_groups(cfg, rejects)
    if cfg.group_prefix:
        groups = (g for g in groups if g[0].startswith(cfg.group_prefix))
    if cfg.groups:
        part = parse_slice(cfg.groups)
        if (part.start or 0) >= 0 and (part.stop or 0) >= 0:  # read no further than the slice's end
            groups = itertools.islice(groups, part.start, part.stop)
        else:  # counted from the end: every group is read first
            groups = iter(list(groups)[part])
    seen: dict[str, int] = {}  # id -> the line it came from: only the ids are held
    for name, paragraphs, line, raw in groups:
        if name in seen:
            again = f"id {name!r} again (first at line {seen[name]})"
            if cfg.group_field is None:
                refuse_or_skip(rejects, BadRow(path, f"duplicate {again}", line), raw)
                continue
            raise InputError(
                path, f"field '{cfg.group_field}': group {again}, after other groups: its documents' "
                "ids would repeat; give each run of lines a name of its own", line
            )  # fmt: skip
        seen[name] = line
        if not cfg.min_chars:
            yield {"id": name, "text": cfg.joiner.join(paragraphs)}
            continue
        current, size, k = [], 0, 0
        for text in paragraphs:
            current.append(text)
            size += len(text)
            if size >= cfg.min_chars:
                yield {"id": f"{name} #{k}", "text": cfg.joiner.join(current)}
                current, size, k = [], 0, k + 1


def write_passages(cfg: PassagesConfig) -> dict:
    n = chars = 0
    rejects = cfg.bad_rows.rejects(cfg.out)
    with AtomicWriter(cfg.out) as out:
        for i, doc in enumerate(documents(cfg, rejects)):
            if i < cfg.skip:
                continue
            if cfg.limit and n >= cfg.limit:
                break
            if cfg.max_chars:
                doc["text"] = doc["text"][: cfg.max_chars]
            out.write(jsonl_line(doc))
            n, chars = n + 1, chars + len(doc["text"])
        if not n:  # raised inside: the writer keeps whatever file was there
            raise InputError(cfg.input, "no document matched (check groups, group_prefix, skip and limit)")
    return {"documents": n, "characters": chars, "rejects": finish_rejects(rejects, "data passages")}


CONFIG = PassagesConfig


def run(cfg: PassagesConfig) -> Result:
    """``metachunk data passages``."""
    report = write_passages(cfg)
    print(f"{cfg.out}: {report['documents']} documents, {report['characters']:,} characters", file=sys.stderr)
    return Result.with_rejects({"documents": report["documents"]}, report["rejects"])


def inputs(cfg: PassagesConfig) -> Reads:
    return Reads.of(paths=[cfg.input])


def outputs(cfg: PassagesConfig) -> list:
    return [cfg.out, *cfg.bad_rows.outputs(cfg.out)]
