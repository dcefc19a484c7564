"""Progress bars for long work: a rate and an ETA on a terminal, and plain lines in a log.

Every bar in the package comes from `bar`. On a terminal it is tqdm's own bar, redrawn in place.
Written to a file or a pipe (a Slurm log, ``2> run.log``, ``| tee``), tqdm's in-place redraws would
leave one line thousands of ``\\r``-joined fragments long; there the same bar prints one whole line
every 30 seconds and one at the end, which reads in ``less`` and ``grep``; work done within
30 seconds prints none. A notebook keeps
tqdm's own bar. ``TQDM_MININTERVAL=5`` gives a line every 5 seconds, ``TQDM_DISABLE=1`` no bar;
tqdm's other variables apply on a terminal (https://tqdm.github.io/docs/tqdm/: "TQDM_*
environment variables override defaults"), not to the log lines' width or glyphs.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO

LOG_INTERVAL_S = 30.0
"""Seconds between two lines of a bar written to a file or a pipe."""
TERMINAL_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # an ANSI control sequence (tqdm's cursor moves)


class LineWriter:
    """A stream for tqdm that turns its in-place redraws into whole lines.

    tqdm redraws by writing ``"\\r" + line + padding``, ends a kept bar with ``"\\n"``, clears a
    dropped one with an empty redraw, and moves between two open bars with newlines and the
    cursor-up code ``ESC[A``. Here each non-empty redraw is one line (a repeat of the line before
    it is dropped); the newlines, ``"\\r"`` and terminal codes are dropped."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        line = TERMINAL_CODE.sub("", text).replace("\r", "").strip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def interactive(stream: TextIO) -> bool:
    """A terminal, or a notebook's output (Jupyter renders tqdm's redraws in place)."""
    return stream.isatty() or "ipykernel" in sys.modules


def env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:  # tqdm itself would refuse it at import; here the default stands
        return default


def bar(iterable=None, *, total: float | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
        **options):  # fmt: skip
    """A tqdm bar on stderr; off a terminal, a line every `LOG_INTERVAL_S` (see the module).

    ``enabled``: False shows nothing (the caller's ``--no-progress``). ``options``: tqdm's own
    (``unit_scale``, ``delay``, ``leave``, ...)."""
    from tqdm import tqdm

    stream = sys.stderr
    if stream is None:  # no stderr at all (a detached interpreter): nothing to draw on
        enabled = False
    elif interactive(stream):
        options.setdefault("dynamic_ncols", True)
    else:  # no width: tqdm trims a line to its width, which cut the spend off a long postfix
        options["file"] = LineWriter(stream)
        options["ascii"] = True  # no block glyphs in a log read by tools
        options["mininterval"] = env_seconds("TQDM_MININTERVAL", LOG_INTERVAL_S)
        # tqdm's monitor redraws a bar idle for `maxinterval` (10 s): not more often than the above
        options["maxinterval"] = max(options["mininterval"], env_seconds("TQDM_MAXINTERVAL", 10))
        # work shorter than that prints no line (a command's own summary says how it went)
        options.setdefault("delay", options["mininterval"])
        options.pop("dynamic_ncols", None)
    if not enabled:  # else tqdm's default, which TQDM_DISABLE overrides
        options["disable"] = True
    return tqdm(iterable, total=total, desc=desc, unit=unit, **options)
