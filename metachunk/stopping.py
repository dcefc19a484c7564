"""How a command stops when a scheduler stops it, and how its children stop with it.

Schedulers (Slurm, Kubernetes, systemd, ``timeout``) send SIGTERM, then SIGKILL after a grace
period; a closed terminal sends SIGHUP. Python's default for SIGTERM and SIGHUP ends the process at
once: no ``finally`` runs, so a local teacher server, chunking workers or a Ray cluster it started
keep running. So:

* `stop_on_signals`: while a command runs, SIGTERM and SIGHUP raise `Stopped` in the
  main thread, as Ctrl-C raises ``KeyboardInterrupt``. Every ``with`` and ``finally`` then runs:
  children are stopped (SIGTERM, a timeout, then SIGKILL), temp files removed, no output replaced.
  The exit status is 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP; 130 for SIGINT).
* `die_with_parent`: a SIGKILL cannot be caught, so each child asks the kernel to send it
  SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, see prctl(2)). A server is
  started through `guarded` (this module as a launcher: set the signal, then exec the server);
  a worker process calls it first thing.
* `reap_on_death`: for processes that are not our children and so cannot be asked to die
  with us (a local Ray cluster's agents and workers are the raylet's children): a watchdog process
  notes our descendants twice a second and, if we die without saying so (SIGKILL), stops every one
  it has seen that still runs. It keeps a process it has seen even after the process leaves our
  tree: when we die, the raylet dies with us and its children are handed to init, possibly while the
  watchdog is reading ``/proc``.
* `deferred`: a few steps that must finish together (an output and its manifest renamed into
  place) let a signal wait until they have.
* `run`: an event loop's SIGTERM cancels its main task where it waits, as Ctrl-C does, so a
  teacher's answer that has arrived is stored before the command stops.
* `keep_signal_handlers`: a library that installs its own SIGTERM handler (``ray.init``
  exits with status 15) is put back in its place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

CAUGHT = (signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Stopped(KeyboardInterrupt):
    """A command was stopped by ``signum``: a KeyboardInterrupt, as Ctrl-C raises, so that what
    lets Ctrl-C through lets it through too: asyncio's event loop re-raises only KeyboardInterrupt
    and SystemExit from a callback and logs anything else (``asyncio.events.Handle._run``). The exit
    status tells them apart (`exit_status`; `metachunk.cli.invoke`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_deferred: list[int] | None = None  # inside `deferred`: the signals that came, raised at its end


def _raise(signum, frame) -> None:
    if _deferred is not None:
        _deferred.append(signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def deferred():
    """SIGTERM and SIGHUP wait until the block ends (then raise `Stopped`): for steps that must
    finish together, such as an output's rename and its manifest's, or a temp file's creation and
    its registration for removal. Only `stop_on_signals`' handler waits; a block that raises lets
    its own exception through, or `Stopped` when a signal came meanwhile."""
    global _deferred
    if _deferred is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferred = []
    try:
        yield
    except BaseException as e:  # the stop that came meanwhile is not lost to the block's error
        got, _deferred = _deferred, None
        if got and not isinstance(e, KeyboardInterrupt):
            raise Stopped(got[0]) from e
        raise
    got, _deferred = _deferred, None
    if got:
        raise Stopped(got[0])


def run(coro, runner=None):
    """``asyncio.run(coro)`` (or ``runner.run``, an `asyncio.Runner` kept across calls), except that
    under `stop_on_signals` SIGTERM and SIGHUP cancel the main task, as asyncio's runner does on
    Ctrl-C, instead of raising `Stopped` in whatever bytecode the main thread is at: the cancellation
    lands at an ``await``, never between a paid answer's arrival and its row in the answer store.
    `Stopped` is raised once the task has unwound. A second signal raises `Stopped` in the loop,
    whose shutdown then cancels the tasks left and waits for them (a third raises it there)."""
    import asyncio

    go = runner.run if runner is not None else asyncio.run
    if threading.current_thread() is not threading.main_thread() or not any(
        signal.getsignal(s) is _raise for s in CAUGHT
    ):
        return go(coro)
    got: list[int] = []
    task = None

    def cancel(signum, frame):
        if task is None or task.done() or got:  # not started yet, finished, or a second signal
            raise Stopped(signum)
        got.append(signum)
        task.cancel()
        task.get_loop().call_soon_threadsafe(lambda: None)  # wakes a loop waiting in select()

    async def main():
        nonlocal task
        task = asyncio.current_task()
        return await coro

    previous = {s: signal.signal(s, cancel) for s in CAUGHT if signal.getsignal(s) is _raise}
    try:
        result = go(main())
    except BaseException:  # the cancellation, or what it ended in: the command was stopped
        if got:
            raise Stopped(got[0]) from None
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if got:  # the task caught its cancellation and finished anyway
        raise Stopped(got[0])
    return result


_depth = 0  # nested commands (`metachunk run`'s stages): only the outermost reports the stop


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGHUP raise `Stopped` while the block runs (main thread only: Python
    delivers signals there; elsewhere this does nothing). Yields True for the outermost block."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    # a signal set to be ignored stays ignored: `nohup metachunk ...` is not stopped by its SIGHUP
    caught = [s for s in CAUGHT if signal.getsignal(s) is not signal.SIG_IGN] if _depth == 0 else []
    previous = {s: signal.signal(s, _raise) for s in caught}
    _depth += 1
    try:
        yield _depth == 1
    finally:
        _depth -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send this process ``sig`` when its parent dies; if the parent (``parent``, a
    pid) is already gone, end now. False where there is no prctl (not Linux): then only a parent
    that is stopped, not killed, stops its children."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:  # it died before the signal was set
        os._exit(0)
    return True


def guarded(command: list[str]) -> list[str]:
    """``command`` run through this module, so that it dies with the process that starts it: by SIGKILL,
    since a server's graceful shutdown on SIGTERM (uvicorn's) waits for the requests in flight, whose
    client died with the parent, for as long as their generation takes; a parent that is stopped, not
    killed, stops the server itself first."""
    return [sys.executable, "-m", "metachunk.stopping", str(os.getpid()), *command]


@contextlib.contextmanager
def keep_signal_handlers():
    """The SIGTERM and SIGHUP handlers as they were before the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in CAUGHT}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def reap_on_death(every: float = 0.5):
    """While the block runs, a watchdog (this module with ``--reap``) stops our descendants if we
    die by SIGKILL; at the block's end it leaves without touching anything (see the module
    docstring). It notes our descendants every ``every`` seconds; the block starts once it has noted
    those we have already. Linux only (it reads ``/proc``); elsewhere it does nothing."""
    if not os.path.isdir("/proc/self"):
        yield
        return
    # A group of its own: a signal to ours (Ctrl-C, a scheduler's SIGTERM or SIGKILL) does not reach it.
    watchdog = subprocess.Popen([sys.executable, "-m", "metachunk.stopping", "--reap", str(os.getpid()), str(every)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0)  # fmt: skip
    try:
        with watchdog.stdout:
            watchdog.stdout.readline()  # its first scan is done (or it failed to start: end of file)
        yield
    finally:
        with contextlib.suppress(OSError):
            watchdog.stdin.write(b"done\n")
            watchdog.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=5)


def _processes() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, start time)}`` of every process that has not ended, from ``/proc/PID/stat``
    (a zombie has ended: it waits for its parent to read its status, which in a container whose first
    process reaps nothing may be never)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if fields[0] != b"Z":  # state (field 3)
            out[int(name)] = (int(fields[1]), int(fields[19]))  # ppid (field 4), starttime (field 22)
    return out


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """``{pid: start time}`` of every descendant of ``root`` in ``table`` (`_processes`)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo += children.get(pid, [])
    return found


def _reap(parent: int, every: float = 0.5, grace: float = 3.0) -> None:
    """The watchdog: note ``parent``'s descendants every ``every`` seconds until the parent says
    "done" on stdin (leave) or dies (its pipe closes): then SIGTERM every process it has seen that
    is still the same process, and SIGKILL those left after ``grace`` seconds.

    ``seen`` only forgets a process that has ended. A scan that sees the tree after a process left it
    (its parent died and it was handed to init) must not drop it: the parent's death is what the
    watchdog is for, and a scan can read ``/proc`` while it happens. A last scan after the parent's
    death adds the children that the processes seen and still running started since the one before.

    The watchdog has a process group of its own (`reap_on_death`), and ignores the signals a terminal
    or a scheduler sends a whole group (Ctrl-C's SIGINT, SIGTERM, SIGHUP) in case one is sent to it:
    the parent stops its own children on those and says "done"; the watchdog is for the SIGKILL that
    may follow them."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    me, seen = os.getpid(), {}

    def running(
        table: dict[int, tuple[int, int]],
    ) -> dict[int, int]:  # not a new process that took a freed pid
        return {pid: start for pid, start in seen.items() if table.get(pid, (0, None))[1] == start}

    def scan() -> dict[int, int]:
        table = _processes()
        return running(table) | {
            pid: start for pid, start in _descendants(parent, table).items() if pid != me
        }

    seen = scan()
    print("watching", flush=True)  # `reap_on_death` starts its block
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], every)
        if ready:
            if sys.stdin.buffer.readline().strip() == b"done":
                return
            break  # end of file: the parent is gone
        seen = scan()

    table = _processes()
    seen = running(table)
    for root in list(seen):
        seen |= {pid: start for pid, start in _descendants(root, table).items() if pid != me}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in running(_processes()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and running(_processes()):
            time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[1] == "--reap":  # python -m metachunk.stopping --reap PARENT_PID SECONDS_BETWEEN_SCANS
        _reap(int(sys.argv[2]), float(sys.argv[3]))
    else:  # python -m metachunk.stopping PARENT_PID COMMAND...: die with PARENT, exec COMMAND
        die_with_parent(int(sys.argv[1]), signal.SIGKILL)
        os.execvp(sys.argv[2], sys.argv[2:])
