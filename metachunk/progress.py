"""Progress bars for long work: a rate and an ETA on a terminal, and plain lines in a log.

Every bar in the package comes from `bar`. On a terminal it is tqdm's own bar, redrawn in place.
Written to a file or a pipe (a Slurm log, ``2> run.log``, ``| tee``), tqdm's in-place redraws would
leave one line thousands of ``\\r``-joined fragments long; there the same bar prints one whole line
every 30 seconds and one at the end, which reads in ``less`` and ``grep``. tqdm's own environment
variables still decide, e.g. ``TQDM_MININTERVAL=5`` for a line every 5 seconds, ``TQDM_DISABLE=1``
for none (https://tqdm.github.io/docs/tqdm/: "TQDM_* environment variables override defaults").
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

LOG_INTERVAL_S = 30.0
"""Seconds between two lines of a bar written to a file or a pipe."""


class LineWriter:
    """A stream for tqdm that turns its in-place redraws into whole lines.

    tqdm redraws by writing ``"\\r" + line + padding``, ends a kept bar with ``"\\n"`` and clears a
    dropped one with an empty redraw. Here each non-empty redraw is one line (a repeat of the line
    before it is dropped), and the bare ``"\\n"`` and ``"\\r"`` are dropped."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def bar(iterable=None, *, total: float | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
        **options):  # fmt: skip
    """A tqdm bar on stderr; off a terminal, a line every `LOG_INTERVAL_S` (see the module).

    ``enabled``: False shows nothing (the caller's ``--no-progress``). ``options``: tqdm's own
    (``unit_scale``, ``delay``, ``leave``, ...)."""
    from tqdm import tqdm

    stream = sys.stderr
    if stream is None:  # no stderr at all (a detached interpreter): nothing to draw on
        enabled = False
    elif stream.isatty():
        options.setdefault("dynamic_ncols", True)
    else:
        options["file"] = LineWriter(stream)
        options["ascii"] = True  # no block glyphs in a log read by tools
        options["ncols"] = 100
        options["mininterval"] = float(os.environ.get("TQDM_MININTERVAL", LOG_INTERVAL_S))
        # tqdm's monitor redraws a bar idle for `maxinterval` (10 s): not more often than the above
        options["maxinterval"] = max(options["mininterval"], float(os.environ.get("TQDM_MAXINTERVAL", 10)))
        options.pop("dynamic_ncols", None)
    if not enabled:  # else tqdm's default, which TQDM_DISABLE overrides
        options["disable"] = True
    return tqdm(iterable, total=total, desc=desc, unit=unit, **options)
