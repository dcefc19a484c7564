"""How a command stops when a scheduler stops it, and how its children stop with it.

Schedulers (Slurm, Kubernetes, systemd, ``timeout``) send SIGTERM, then SIGKILL after a grace
period; a closed terminal sends SIGHUP. Python's default for SIGTERM and SIGHUP ends the process at
once: no ``finally`` runs, so a local teacher server, chunking workers or a Ray cluster it started
keep running. So:

* :func:`stop_on_signals`: while a command runs, SIGTERM and SIGHUP raise :class:`Stopped` in the
  main thread, as Ctrl-C raises ``KeyboardInterrupt``. Every ``with`` and ``finally`` then runs:
  children are stopped (SIGTERM, a timeout, then SIGKILL), temp files removed, no output replaced.
  The exit status is 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP; 130 for SIGINT).
* :func:`die_with_parent`: a SIGKILL cannot be caught, so each child asks the kernel to send it
  SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, see prctl(2)). A server is
  started through :func:`guarded` (this module as a launcher: set the signal, then exec the server);
  a worker process calls it first thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

CAUGHT = (signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Stopped(BaseException):
    """A command was stopped by ``signum``. A BaseException, as KeyboardInterrupt: ``except
    Exception`` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _raise(signum, frame) -> None:
    raise Stopped(signum)


_depth = 0  # nested commands (`metachunk run`'s stages): only the outermost reports the stop


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGHUP raise :class:`Stopped` while the block runs (main thread only: Python
    delivers signals there; elsewhere this does nothing). Yields True for the outermost block."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {s: signal.signal(s, _raise) for s in CAUGHT} if _depth == 0 else {}
    _depth += 1
    try:
        yield _depth == 1
    finally:
        _depth -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_parent(parent: int | None = None) -> bool:
    """Ask Linux to send this process SIGTERM when its parent dies; if the parent (``parent``, a
    pid) is already gone, end now. False where there is no prctl (not Linux): then only a parent
    that is stopped, not killed, stops its children."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:  # it died before the signal was set
        os._exit(0)
    return True


def guarded(command: list[str]) -> list[str]:
    """``command`` run through this module, so that it dies with the process that starts it."""
    return [sys.executable, "-m", "metachunk.stopping", str(os.getpid()), *command]


if (
    __name__ == "__main__"
):  # python -m metachunk.stopping PARENT_PID COMMAND...: die with PARENT, exec COMMAND
    die_with_parent(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
