"""Reading ahead and writing behind while the model works: a corpus run's three stages overlapped.

On a GPU, a corpus run that reads, splits and tokenizes a group of documents, then scores it, then
decides and writes it leaves the device idle during the first and last steps (on the 1,200 CRUD
articles, tokenizing alone takes about a second on one core). `overlapped` runs them side by side:

* **ahead**, in a thread: ``prepare(group)`` for the next groups (reading, sentence splitting,
  tokenizing), at most ``depth`` groups in advance, so memory stays bounded;
* **in the calling thread**: ``score(prepared)``, the model's work; this thread alone drives the
  device, as without overlap;
* **behind**, in a thread: ``finish(scored)`` (merging to the target length, writing), at most
  ``depth`` groups behind.

**Order.** ``finish`` is called for the groups in the order ``groups`` yields them, whatever the
timing, and each stage sees the same values as in the sequential run: the records are the same bytes.
``depth=0`` runs all three in the calling thread, one group after the other (the CPU default, where
the threads would take the cores the model uses).

**Stops.** An exception in any stage (a document that fails to prepare, a write that fails) stops
the other two, and is raised in the calling thread with its own traceback. A signal raised in the
calling thread (``KeyboardInterrupt``, `metachunk.stopping.Stopped` for SIGTERM) stops them too.
Either way ``finish`` has been called for a prefix of the groups, never for a group after the one
that failed, and both threads have ended (each finishes the group in its hands, then returns) before
`overlapped` returns or raises.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

# How often a blocked stage looks at the stop flag, in seconds.
POLL = 0.05


class _End:
    """What the ahead thread queues after the last group, or with the error that ended it."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def overlapped(
    groups: Iterable[Any],
    prepare: Callable[[Any], Any],
    score: Callable[[Any], Any],
    finish: Callable[[Any], None],
    depth: int,
    on_start: Callable[[], None] | None = None,
) -> None:
    """``finish(score(prepare(g)))`` for every group ``g`` in order; with ``depth > 0``, ``prepare``
    runs up to ``depth`` groups ahead and ``finish`` up to ``depth`` groups behind, each in its
    own thread (see the module docstring for the order and the stops). ``on_start()`` runs in the
    calling thread before the first ``score``, once the thread ahead has started: what the model
    needs first (loading it) overlaps the first ``prepare``; a failure there stops the run as a
    failing stage does."""
    if depth <= 0:
        if on_start:
            on_start()
        for group in groups:
            finish(score(prepare(group)))
        return

    stop = threading.Event()
    ahead_q: queue.Queue = queue.Queue(maxsize=depth)
    behind_q: queue.Queue = queue.Queue(maxsize=depth)
    behind_error: list[BaseException] = []

    def put(q: queue.Queue, item) -> bool:
        """Queue ``item`` unless the run stops first."""
        while not stop.is_set():
            try:
                q.put(item, timeout=POLL)
                return True
            except queue.Full:
                continue
        return False

    def run_ahead() -> None:
        try:
            for group in groups:
                if stop.is_set() or not put(ahead_q, prepare(group)):
                    return
            put(ahead_q, _End())
        except BaseException as error:  # carried to the calling thread, which raises it
            put(ahead_q, _End(error))

    def run_behind() -> None:
        try:
            while True:
                try:
                    item = behind_q.get(timeout=POLL)
                except queue.Empty:
                    if stop.is_set():
                        return
                    continue
                if isinstance(item, _End) or stop.is_set():
                    return
                finish(item)
        except BaseException as error:
            behind_error.append(error)
            stop.set()

    threads = [
        threading.Thread(target=run_ahead, name="chunk-ahead", daemon=True),
        threading.Thread(target=run_behind, name="chunk-behind", daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        if on_start:
            on_start()
        while True:
            try:
                item = ahead_q.get(timeout=POLL)
            except queue.Empty:
                if behind_error:
                    break
                continue
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                break
            scored = score(item)
            if not put(behind_q, scored):
                break
        # The last group is queued; the behind thread ends after it (or has failed).
        while not behind_error and not put(behind_q, _End()):
            pass
        threads[1].join()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    if behind_error:
        raise behind_error[0]
