"""Artifact I/O: reading documents with precise errors, writing files and folders atomically.

Every artifact is a file a person can open. Readers name the file, line and field they could not
parse; writers go through a temp file and a rename, so a crash never leaves a half-written file
in place of a good one:

* `AtomicWriter` - one file, through a temp file beside it and `os.replace`.
* `OutputPair` - an output and its ``.meta.json`` manifest, which must describe each other:
  both are written in full to temp files first, so running out of space (or any error) leaves the
  previous pair untouched; only then are they renamed in (see `OutputPair.commit`).
* `replace_dir` - a finished folder (dataset, exported model) swapped in for the previous one.
* `append_run_log` - how an attempt ran (engine, device, seconds), one line per attempt in the
  folder's ``runs.jsonl`` (a file's ``FILE.runs.jsonl``), kept apart from what it made so that a
  rerun writes the same bytes.
* `append_record` - one durable JSON line at the end of a log (run logs, a chunk folder's journal of
  finished shards), where a line a kill cut short spoils only itself.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metachunk import stopping

SCHEMA_VERSION = 1
# Exit status of a stage that had nothing to do: its input holds no rows (a training set that
# filtering left empty). `metachunk run` records such a stage as empty, and skips what needs its output.
EXIT_EMPTY = 5
EXIT_SKIPPED = 6  # finished, leaving out the bad input rows --on-bad-row skip rejected (metachunk.sources)


def cache_dir() -> Path:
    """metachunk's cache: ``$METACHUNK_CACHE``, else ``~/.cache/metachunk`` (converted presets,
    fetched datasets, compiled kernels, LumberChunker's answers, localized shipped recipes)."""
    return Path(os.environ.get("METACHUNK_CACHE", Path.home() / ".cache" / "metachunk"))


class InputError(ValueError):
    """Bad user input. The message names the file, the line (when there is one) and the problem."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")
        self.path, self.reason, self.line = path, problem, line

    def __reduce__(self):  # rebuilt from its own arguments when a worker process raises it
        return type(self), (self.path, self.reason, self.line)


class EmptyInput(InputError):
    """Well-formed input with nothing in it to work on (exit status `EXIT_EMPTY`)."""


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str


def check_unicode(path: Path, line: int, field: str, value: str) -> None:
    """JSON can spell half a UTF-16 surrogate pair (``"\\ud800"``), which no UTF-8 writer or
    tokenizer accepts later: a ``file:line`` error here instead."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # the only str that cannot be UTF-8: a lone surrogate
        raise InputError(
            path,
            f"field {field!r} holds a lone surrogate \\u{ord(value[e.start]):04x} at character {e.start} "
            "(half a UTF-16 pair, not text)",
            line,
        ) from None


class AtomicWriter:
    """Write a text file through a temp file in the same directory; rename into place on success.

    On an exception the temp file is removed and any existing file at ``path`` is left untouched.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __enter__(self):
        self.file, self._tmp = _temp_file(self.path)
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                _close_durably(self.file, self.path)
            _discard(self.file)
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)
        _name_the_file(exc, self.path)
        return False


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``,
    proc(5)); elsewhere set and put back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_mode(path: str | Path | int, folder: bool = False, like: Path | None = None) -> None:
    """Give ``path`` (or an open file descriptor) the mode a plain ``open`` or ``mkdir`` would, or the mode
    of the file ``like`` it replaces: temp files (``mkstemp``: 0600) and folders (``mkdtemp``: 0700)
    renamed into place would otherwise stay private, and a team's shared dataset unreadable by the team.
    Best effort: a file system without modes (vfat, some network mounts) keeps its own."""
    try:
        mode = like.stat().st_mode & 0o7777 if like is not None and like.exists() else None
    except OSError:
        mode = None
    if mode is None:
        mode = (0o777 if folder else 0o666) & ~umask()
    with contextlib.suppress(OSError):
        if isinstance(path, int):
            os.fchmod(path, mode)
        else:
            os.chmod(path, mode)


def _not_a_folder(path: Path) -> None:
    """A folder where a file is to be written: said of ``path``, not of the temp file beside it."""
    if path.is_dir():
        raise InputError(path, "a folder, where a file is to be written")


def process_space() -> str:
    """``HOST+NS``: the host, and the PID namespace its process ids belong to (containers on one host
    share its name, not their process ids). ``+`` is in no host name, so no host's reads as another's."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): one namespace per host
        namespace = 0
    return f"{socket.gethostname()}+{namespace}"


def _owner() -> str:
    """Who writes a temp file, in its name (``PID@HOST+NS``): what lets a later writer in the same
    process space tell a killed writer's leftovers from a live writer's file."""
    return f"{os.getpid()}@{process_space()}"


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field, see
    proc(5)): with the pid, it names one process, since a pid is reused. None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # the fields after the command's name start at the 3rd


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs in this process space."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_temps(path: Path) -> None:
    """The temp files beside ``path`` that a writer killed before its rename left (``kill -9``,
    a lost node): each names its writer, and one whose process is gone from this host's process
    space is removed. A live writer's, another host's (a shared file system) or another container's
    is left alone."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if temp_writer_gone(stale.name[len(path.name) + 2 :]):
            stale.unlink(missing_ok=True)


def remove_dead_temps_of(output: str | Path) -> None:
    """`remove_dead_temps` for an output a command wrote, a file or a folder of files: what a killed
    run left beside it or in it, when nothing will write it again (a cached stage of `metachunk run`)."""
    output = Path(output)
    if not output.is_dir():
        remove_dead_temps(output)
        return
    for temp in output.rglob(".*.tmp"):
        # .TARGET.PID@HOST+NS.XXXX.tmp: no host name holds an "@", so the last ".PID@" ends TARGET
        named = re.fullmatch(r"\.(.+)\.(\d+@.+)", temp.name)
        if named and temp.is_file() and temp_writer_gone(named[2]):
            temp.unlink(missing_ok=True)


def temp_writer_gone(tail: str, mine: bool = False) -> bool:
    """Whether the writer a temp file names is gone: ``tail`` is the part of the temp's name after
    ``.TARGET.`` (``PID@HOST+NS.XXXX.tmp``). Gone: a process of this host's process space that no
    longer runs, or with ``mine`` this process (a stop that cut its own write short)."""
    pid, at, rest = tail.partition("@")
    if not (at and pid.isdigit() and rest.startswith(f"{process_space()}.")):
        return False
    return (mine and int(pid) == os.getpid()) or not pid_alive(int(pid))


def _temp_file(path: Path):
    """``(text file, temp path)``: a new temp file beside ``path`` (same directory, so a rename
    into place never crosses file systems), named by its writer; a killed writer's are removed first."""
    _not_a_folder(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_owner()}.", suffix=".tmp", dir=path.parent)
    ordinary_mode(fd, like=path)
    return os.fdopen(fd, "w", encoding="utf-8"), tmp


def _discard(file) -> None:
    """Close a temp file whose content is being thrown away. Closing flushes the buffer, which on a
    full disk fails again: that must not stop the temp file's removal or hide the first error."""
    with contextlib.suppress(OSError):
        file.close()


def _name_the_file(exc: BaseException | None, path: Path) -> None:
    """A write that fails for want of space raises an OSError that names no file (write(2) has
    none to give): name the output it was for, so the CLI's one line says which."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno in _NO_SPACE:
        exc.filename = str(path)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _close_durably(file, path: Path) -> None:
    """Flush, fsync and close: a full disk shows up here, before anything is renamed. The error
    names ``path`` (fsync's own error names no file)."""
    try:
        file.flush()
        os.fsync(file.fileno())
        file.close()
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


class OutputPair:
    """An output file and its manifest ``OUTPUT.meta.json``, replaced together or not at all.

    ```
    with OutputPair(path) as pair:
        pair.file.write(...)  # a temp file beside ``path``
        pair.commit(manifest)
    ```

    `commit` writes the manifest to a temp file too and syncs both, so a full disk or any
    other error up to then leaves the previous output and manifest exactly as they were. Then,
    with everything on disk, three steps that need no space: remove the previous manifest, rename
    the new output in, rename the new manifest in. A crash between them can leave an output with
    no manifest, never an output beside another run's manifest: a manifest always describes the
    output next to it, and an output without one is unfinished (rerun the command). Leaving the
    block without `commit` (an error, Ctrl-C) removes the temp files.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest_path = self.path.with_suffix(".meta.json")

    def __enter__(self) -> OutputPair:
        self._temps: list[str] = []
        try:
            with stopping.deferred():  # a stop between the two would leave the temp file unknown
                self.file, tmp = _temp_file(self.path)
                self._temps.append(tmp)
        except BaseException:  # a stop at the block's end: __exit__ is not called for __enter__
            self.__exit__(None, None, None)
            raise
        return self

    def commit(self, manifest: dict) -> None:
        _close_durably(self.file, self.path)
        with stopping.deferred():
            meta, meta_tmp = _temp_file(self.manifest_path)
            self._temps.append(meta_tmp)
        with meta:
            json.dump(manifest, meta, ensure_ascii=False, indent=2)
            meta.write("\n")
            _close_durably(meta, self.manifest_path)
        output_tmp = self._temps[0]
        with stopping.deferred():  # the output and its manifest are replaced together, or neither
            if self.manifest_path.exists():
                os.unlink(self.manifest_path)
            os.replace(output_tmp, self.path)
            os.replace(meta_tmp, self.manifest_path)

    def __exit__(self, exc_type, exc, tb):
        if hasattr(self, "file"):
            _discard(self.file)
        for tmp in self._temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _name_the_file(exc, self.path)
        return False


class OutputSet:
    """Several output files replaced together or not at all, where they share a folder with other
    outputs (so `replace_dir` cannot swap the folder): a training pool and the test set it must not
    overlap, say.

    ```
    with OutputSet() as outputs:
        outputs.open(out / "test.jsonl").writelines(...)  # a temp file beside each path
        outputs.open(out / "pool.jsonl").writelines(...)
        outputs.commit(out / "report.json", report)
    ```

    `commit` writes the set's report and syncs every temp file first, so a full disk or any other
    error up to then leaves every previous file exactly as it was; leaving the block without it (an
    error, Ctrl-C, a kill) removes the temps and changes nothing. Then renames, which need no space:
    the report is removed first and renamed in at the end, so that a crash within the renames
    (microseconds) leaves no report beside a mixed set: a set without its report is unfinished
    (rerun the command).
    """

    def __enter__(self) -> OutputSet:
        self._files: dict[Path, tuple] = {}
        return self

    def open(self, path: str | Path):
        """A text file to write ``path``'s new content to (a temp file beside it)."""
        path = Path(path)
        self._files[path] = _temp_file(path)
        return self._files[path][0]

    def adopt(self, path: str | Path, written: str | Path) -> None:
        """``written`` (a whole file, synced, in ``path``'s folder: what an earlier step wrote
        through `AtomicWriter`) becomes ``path`` at `commit`, with the rest; it is not removed if
        the set is not committed."""
        self._files[Path(path)] = (None, str(written))

    def commit(self, report: str | Path, obj) -> None:
        """The set in place, ``report`` (``obj`` as `write_json` writes it) renamed in last."""
        report = Path(report)
        _dump_json(obj, self.open(report))
        for path, (file, _) in self._files.items():
            if file is not None:
                _close_durably(file, path)
        if report.exists():
            os.unlink(report)
        for path, (_, tmp) in sorted(self._files.items(), key=lambda item: item[0] == report):
            os.replace(tmp, path)

    def __exit__(self, exc_type, exc, tb):
        for file, tmp in self._files.values():
            if file is not None:  # an adopted file is its writer's to keep
                _discard(file)
                if os.path.exists(tmp):
                    os.unlink(tmp)
        if self._files:  # the set's folder: which of its files was being written is not known here
            _name_the_file(exc, next(iter(self._files)).parent)
        return False


def replace_dir(staging: str | Path, final: str | Path) -> None:
    """Put the finished folder ``staging`` at ``final``, replacing a previous ``final``.

    ``staging`` must be a sibling of ``final`` (same file system). POSIX ``rename`` cannot swap
    two folders in one step (Linux's ``renameat2(RENAME_EXCHANGE)`` can, but not on every file
    system), so: (1) the previous ``final`` is renamed aside to ``.NAME.old-PID``, (2) ``staging``
    is renamed to ``final``, (3) the old folder is deleted. If (2) fails, the old folder is renamed
    back. ``final`` is therefore always either the whole old folder, the whole new one, or - after
    a crash between (1) and (2) - absent with the whole old one at ``.NAME.old-PID`` (rename it back
    to keep it). Leftover ``.NAME.old-*`` folders are removed by the next successful call.
    """
    staging, final = Path(staging), Path(final)
    if final.exists() and not final.is_dir():  # a user's file is never renamed aside and lost
        raise InputError(
            final, "a file, where a folder is to be written: give another path, or move the file"
        )
    ordinary_mode(staging, folder=True)  # a mkdtemp folder is 0700
    trash = final.parent / f".{final.name}.old-{os.getpid()}"
    if trash.exists():  # left by a crashed run that had our pid
        shutil.rmtree(trash)
    moved_aside = final.exists()
    if moved_aside:
        os.rename(final, trash)
    try:
        os.rename(staging, final)
    except BaseException:
        if moved_aside:
            os.rename(trash, final)
        raise
    for leftover in final.parent.glob(f".{glob.escape(final.name)}.old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    """``data`` at ``path``, through a synced temp file beside it and a rename."""
    with staged_bytes(path, data) as rename_in:
        rename_in()


@contextlib.contextmanager
def staged_bytes(path: str | Path, data: bytes):
    """``data`` in a synced temp file beside ``path``; yields the function that renames it in. The
    caller renames it when it may (under a lock, after a check); a temp file not renamed in is
    removed on the way out."""
    path = Path(path)
    _not_a_folder(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_owner()}.", suffix=".tmp", dir=path.parent)
    ordinary_mode(fd, like=path)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                _close_durably(f, path)
        except OSError as e:
            _name_the_file(e, path)
            raise
        yield lambda: os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def new_figure(nrows: int = 1, ncols: int = 1, **figure_options):
    """``(figure, axes)`` as ``pyplot.subplots`` gives them, without pyplot: no backend is chosen
    and nothing global changes (a notebook's backend stays its own), and nothing holds the figure
    once it is dropped. matplotlib's way to draw off screen:
    https://matplotlib.org/stable/gallery/user_interfaces/web_application_server_sgskip.html"""
    from matplotlib.figure import Figure

    fig = Figure(**figure_options)
    return fig, fig.subplots(nrows, ncols)


def write_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure (`new_figure`'s) as ``path`` (PNG): rendered in memory, then written as
    `write_bytes` writes (synced, renamed in), so a crash never leaves half an image over a good one."""
    import io

    path = Path(path)
    image = io.BytesIO()
    fig.savefig(image, dpi=dpi, format=(path.suffix[1:] or "png"))
    write_bytes(path, image.getvalue())
    return path


def _dump_json(obj, file, default=None) -> None:
    json.dump(obj, file, ensure_ascii=False, indent=2, default=default)
    file.write("\n")


def write_json(path: str | Path, obj, default=None) -> None:
    """``obj`` as indented JSON, atomically; ``default`` as in `json.dump` (e.g. ``str``)."""
    with AtomicWriter(path) as f:
        _dump_json(obj, f, default)


def read_json(path: str | Path) -> dict:
    """The JSON object in file ``path`` (a manifest, a report, a model's config); one that is missing,
    not UTF-8, not JSON or not an object raises `InputError` naming the file (and the line)."""
    data = read_json_value(path)
    if not isinstance(data, dict):
        raise InputError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def read_json_value(path: str | Path):
    """Any JSON value in file ``path`` (a trainer's log is a list), with `read_json`'s errors."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, "a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise InputError(path, f"invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise InputError(path, json_error(e), e.lineno) from None


def json_error(e: json.JSONDecodeError) -> str:
    """``json.loads``'s complaint in one phrase: its message and where, a column, or the end of the text
    when it stopped there (a line or a file cut short, as a killed writer leaves it)."""
    if e.pos >= len(e.doc.rstrip()):
        return f"invalid JSON ({e.msg} at the end: cut short?)"
    return f"invalid JSON ({e.msg} at column {e.colno})"


# How each attempt on an output ran: engine, workers, device, seconds, what it skipped. That is not what
# the output holds, so it stays out of its manifest and reports (a resume or a rerun then writes them
# byte for byte) and out of `metachunk run`'s digests. A folder keeps it in its ``runs.jsonl``; an
# output file (``chunk -o FILE.jsonl``) in ``FILE.runs.jsonl`` beside it, as its ``FILE.meta.json``.
RUN_LOG = "runs.jsonl"


def run_log_path(output: str | Path) -> Path:
    """Where the attempts on ``output`` are logged: ``output/runs.jsonl`` for a folder, else
    ``OUTPUT.runs.jsonl`` beside the file."""
    output = Path(output)
    return output / RUN_LOG if output.is_dir() else output.with_suffix(f".{RUN_LOG}")


def is_run_log(name: str) -> bool:
    """A file name `run_log_path` gives: how attempts ran, not what they made."""
    return name == RUN_LOG or name.endswith(f".{RUN_LOG}")


def append_run_log(output: str | Path, record: dict) -> None:
    """``record`` as one more line of ``output``'s run log (`run_log_path`), with the UTC time it
    finished."""
    import datetime

    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    append_record(run_log_path(output), {"finished": stamp, **record})


def append_record(path: str | Path, record: dict) -> None:
    """``record`` as one JSON line at the end of ``path``, synced before it returns, under a lock on
    the file itself (``flock``: ranks or runs finishing together write whole lines, and no lock file
    is left beside it). A line a kill cut short is ended first, so it spoils only itself
    (`read_records_appended` skips it)."""
    import fcntl

    line = jsonl_line(record).encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        while line:
            line = line[os.write(fd, line) :]
        os.fsync(fd)
    finally:
        os.close(fd)  # and with it the lock


def read_records_appended(path: str | Path) -> list[dict]:
    """The records `append_record` wrote to ``path``, oldest first ([] when there is no file). A line
    cut short (inside a character, even) is skipped; lines split at ``\\n`` only (JSON leaves U+2028
    raw)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().split(b"\n"):
        with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError):
            if line.strip():
                records.append(json.loads(line.decode("utf-8")))
    return records


def read_run_log(output: str | Path) -> list[dict]:
    """The attempts `append_run_log` recorded for ``output`` (a folder or a file), oldest first ([]
    when none)."""
    return read_records_appended(run_log_path(output))


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def json_sha256(obj) -> str:
    """The sha256 of ``obj`` as canonical JSON (keys sorted, text as UTF-8, not escaped): the one
    content hash behind the request keys of the answer store, the stage and chunk-folder
    fingerprints and the eval index keys. Changing it would re-key every paid answer."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def jsonl_line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
