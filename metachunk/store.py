"""The answer store: every teacher response ever paid for, append-only, keyed by request hash.

SQLite in WAL mode with ``synchronous=NORMAL``: each answer is one committed INSERT, which reaches
the OS before the call returns, so a ``kill -9`` loses at most the requests still in flight (they
were never answered). Answer rows are never updated or deleted. A key can have several rows (a
transport error, then a success on a later run); the newest successful row wins, else the newest
error.

What is stored is the raw HTTP response body (secrets redacted), not our reading of it: changing
the parsing code re-reads the same bytes on the next run and sends nothing.

**Several processes may share one store** (a rewrite job and a summary job, or a rerun while the
first run still goes), and none pays for a request another one is paying for:

- Before a request is sent, its key is *claimed*: a ``claims`` row with the owner (host, pid and a
  random tag), a lease and the request's reserved worst-case cost, written in the same
  ``BEGIN IMMEDIATE`` transaction that checks for an answer and for a live claim. SQLite's write
  lock makes check-and-claim atomic across processes.
- A process that wants a key someone else holds waits for the answer. It takes the claim over only
  when the owner is dead: the owner's pid is gone from the same process space (host and PID
  namespace: `metachunk.artifacts.process_space`; containers on one host may share its name, never
  their pids), or its lease was not renewed in time (`AnswerStore.renew_claims` runs every few
  seconds in the owner).
- The answer row and the claim's release are one transaction.
- The budget is shared the same way: `claim` refuses a reservation when the cost of every
  row in the store plus every live claim's reservation (all processes) would pass the cap.

Calibration: per endpoint, the largest ratio of billed prompt tokens to prompt bytes seen so far
(``calibration`` table). The teacher client uses it to make its reservations upper bounds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from metachunk.artifacts import InputError, pid_alive, process_space, process_started

_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,             -- 'ok' (the server answered 200 with a completion) or 'error'
    reason TEXT NOT NULL DEFAULT '',  -- for errors: timeout, connection, http_429, http_500, malformed_response
    raw TEXT NOT NULL,                -- the response body as received (secrets redacted), or the error message
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS answers_key ON answers (key);
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,
    owner TEXT NOT NULL,              -- HOST+NS:pid:tag of the process sending the request
    host TEXT NOT NULL,               -- HOST+NS: its host and PID namespace (artifacts.process_space)
    pid INTEGER NOT NULL,
    expires REAL NOT NULL,            -- wall-clock time; the owner renews it while it runs
    reserved REAL NOT NULL DEFAULT 0  -- the request's worst-case cost, counted by every budget
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,              -- ours, made before anything is uploaded
    endpoint TEXT NOT NULL,           -- model @ URL
    input_file_id TEXT,               -- set once the file is uploaded
    batch_id TEXT,                    -- set once batches.create answered (a kill before: found by the file)
    status TEXT NOT NULL,             -- claimed | uploaded | submitted | done
    requests INTEGER NOT NULL,
    counts TEXT NOT NULL DEFAULT '{}',-- answered, failed, expired (JSON), once done
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_items (
    key TEXT NOT NULL,
    batch TEXT NOT NULL,              -- batches.id
    state TEXT NOT NULL,              -- submitted | answered | failed | expired
    reserved REAL NOT NULL DEFAULT 0, -- its discounted worst-case cost (an answer without usage costs this)
    PRIMARY KEY (key, batch)
);
CREATE INDEX IF NOT EXISTS batch_items_key ON batch_items (key);
CREATE TABLE IF NOT EXISTS calibration (
    endpoint TEXT PRIMARY KEY,        -- model @ URL
    tokens_per_byte REAL NOT NULL,    -- the largest billed prompt tokens / prompt bytes seen
    updated REAL NOT NULL
);
"""

# Columns added after stores were first written: a store opened by this code gets the ones it lacks,
# so the answers it holds (paid for) stay usable.
_ADDED_COLUMNS = (
    ("answers", "usage_estimated", "INTEGER NOT NULL DEFAULT 0"),  # the tokens are our (upper) estimate
    ("batches", "host", "TEXT"),  # the process uploading the batch's file, until it is submitted
    ("batches", "pid", "INTEGER"),
    ("claims", "started", "INTEGER"),  # when the owner's process started (a reused pid is another process)
    ("batches", "taken", "REAL"),  # when a run took over a killed run's upload (`take_batch`)
    ("claims", "sent", "INTEGER NOT NULL DEFAULT 0"),  # the owner's tries that left (`note_sent`)
)

LEASE_SECONDS = 30.0  # a claim not renewed for this long belongs to a dead process
# ... unless its owner runs in this process space, where it is asked: a process stopped (Ctrl-Z) or
# waiting on the store's lock for longer than the lease cannot renew it, yet will send. The lease then
# only bounds how long a reused pid holds the claim.
SAME_SPACE_GRACE_SECONDS = 3600.0
# A batch whose file another process was uploading counts as orphaned after this long: on another
# machine its process cannot be asked whether it still runs, and an upload of the largest file allowed
# takes minutes.
UPLOAD_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    key: str
    model: str
    status: str
    reason: str
    raw: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    usage_estimated: bool = False  # the server sent no usage: the tokens are our (upper) estimate

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class Claim:
    """What `AnswerStore.claim` found: ``claimed`` (send it), ``answered`` (read it),
    ``busy`` (another live sender, this process included, has it: wait) or ``over_budget`` (do not send)."""

    outcome: str
    owner: str = ""


@contextlib.contextmanager
def _not_a_store(path: Path, db: sqlite3.Connection):
    """A file that is not SQLite (another file named as the cache) is bad input, not a crash."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        if "file is not a database" not in str(e):
            raise
        db.close()
        raise InputError(
            path, "not an answer store (an SQLite file): name a new file or an existing store"
        ) from None


def no_space_error(error: BaseException, path: str | Path) -> OSError | None:
    """SQLite's "database or disk is full" (SQLITE_FULL, which names no file) as the OSError a full
    disk gives a plain write, naming the store, so that the CLI says it in one line; None for any
    other error."""
    if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:  # set by SQLite, not by hand
        return OSError(errno.ENOSPC, f"{error} (SQLite)", str(path))
    return None


class AnswerStore:
    """One SQLite file, used from one event loop in each of any number of processes.

    Nothing per answer is held in memory: a lookup is one query on the ``key`` index, so a process
    that reads a store of 120K answers stays as small as one that reads 12K (bench/regen_scale.py).
    Only the running total of the cost is kept, following the rows any process appends.
    """

    def __init__(self, path: str | Path, lease_seconds: float = LEASE_SECONDS, create: bool = True):
        """``create=False`` (a dry run, a status): a store that is not there yet is read as an empty
        one, in memory, and no file or folder is made for it."""
        self.path = Path(path)
        if self.path.is_dir():
            raise InputError(self.path, "a folder: the answer store is a file (answers.sqlite)")
        missing = not create and not self.path.exists()
        if not missing:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_seconds = lease_seconds
        # autocommit: one INSERT = one transaction; a busy writer is waited for, not an error
        self._db = sqlite3.connect(":memory:" if missing else self.path, isolation_level=None, timeout=60.0)
        # Switching a new file to WAL takes a lock SQLite does not wait for: two processes opening
        # the same new store at once would see "database is locked". The setup is serialised by a
        # file lock beside the store; once the file is in WAL mode (persistent) it is a no-op.
        lock = contextlib.nullcontext() if missing else FileLock(f"{self.path}.lock", timeout=60.0)
        with lock, _not_a_store(self.path, self._db):
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            for table, column, kind in _ADDED_COLUMNS:
                if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self.host = process_space()  # HOST+NS: a pid is asked about only in its own namespace
        self.owner = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self.started = process_started(os.getpid())
        self._heartbeat = None  # the asyncio task renewing this process's leases
        self._seen = 0  # the highest answer row id whose cost is in total_cost
        self.total_cost = 0.0  # every answer row in the file, whichever process wrote it
        self._refresh()

    def _rollback(self, error: BaseException) -> None:
        """Undo the open write transaction after ``error``. SQLite may have rolled it back itself (it
        may on SQLITE_FULL, SQLITE_IOERR, SQLITE_BUSY and SQLITE_NOMEM:
        https://www.sqlite.org/lang_transaction.html), and a ROLLBACK then would raise and hide
        ``error``. A full disk (SQLite names no file) becomes an OSError naming the store."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        if (full := no_space_error(error, self.path)) is not None:
            raise full from error

    # -- following the file

    def _refresh(self) -> None:
        """Add the cost of the rows appended since the last look (by this process or any other)."""
        seen, cost = self._db.execute(
            "SELECT MAX(id), TOTAL(cost) FROM answers WHERE id > ?", (self._seen,)
        ).fetchone()
        if seen is not None:
            self._seen, self.total_cost = seen, self.total_cost + cost

    def _latest(self, key: str) -> tuple[int, bool] | None:
        """``(row id, ok)`` of the row that stands for ``key``: its last success, else its last error."""
        return self._db.execute(
            "SELECT id, status = 'ok' FROM answers WHERE key = ? ORDER BY status = 'ok' DESC, id DESC LIMIT 1",
            (key,),
        ).fetchone()

    # -- answers

    def get(self, key: str) -> StoredAnswer | None:
        found = self._latest(key)
        if found is None:
            return None
        row = self._db.execute(
            "SELECT key, model, status, reason, raw, prompt_tokens, completion_tokens, cost, usage_estimated"
            " FROM answers WHERE id = ?",
            (found[0],),
        ).fetchone()
        return StoredAnswer(*row[:8], usage_estimated=bool(row[8]))

    def has_answer(self, key: str) -> bool:
        found = self._latest(key)
        return found is not None and bool(found[1])

    def put(self, answer: StoredAnswer, calibration: tuple[str, float] | None = None) -> None:
        """Append ``answer`` and release this process's claim on its key, in one transaction;
        ``calibration`` ``(endpoint, tokens_per_byte)`` raises that endpoint's ratio if higher."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "INSERT INTO answers (key, model, status, reason, raw, prompt_tokens, completion_tokens, cost,"
                " created, usage_estimated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    answer.key,
                    answer.model,
                    answer.status,
                    answer.reason,
                    answer.raw,
                    answer.prompt_tokens,
                    answer.completion_tokens,
                    answer.cost,
                    time.time(),
                    int(answer.usage_estimated),
                ),
            )
            self._db.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (answer.key, self.owner))
            if calibration is not None:
                self._db.execute(
                    "INSERT INTO calibration (endpoint, tokens_per_byte, updated) VALUES (?, ?, ?)"
                    " ON CONFLICT (endpoint) DO UPDATE SET tokens_per_byte = excluded.tokens_per_byte,"
                    " updated = excluded.updated WHERE excluded.tokens_per_byte > tokens_per_byte",
                    (*calibration, time.time()),
                )
            self._db.execute("COMMIT")
        except BaseException as e:
            self._rollback(e)
            raise
        self._refresh()

    # -- claims: one payer per request across processes, one budget across processes

    def claim(self, key: str, reserve: float = 0.0, limit: float | None = None) -> Claim:
        """Claim ``key`` for sending, reserving ``reserve`` USD against ``limit`` (the cap on the
        whole store's spend, all processes). Cheap when the answer is already here or the key is
        busy: the write lock is taken only when the key looks free."""
        self._refresh()
        if self.has_answer(key):
            return Claim("answered")
        held = self._db.execute(
            "SELECT owner, host, pid, expires, started FROM claims WHERE key = ?", (key,)
        ).fetchone()
        # Busy for its own holder too: two coroutines of one process asking the same request (copies
        # of a document) pay once, the second waiting for the first's answer.
        if held is not None and self._alive(*held[1:]):
            return Claim("busy", held[0])
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._refresh()  # under the write lock: nobody can answer or claim it now
            if self.has_answer(key):
                self._db.execute("COMMIT")
                return Claim("answered")
            held = self._db.execute(
                "SELECT owner, host, pid, expires, started, reserved, sent FROM claims WHERE key = ?", (key,)
            ).fetchone()
            if held is not None and self._alive(*held[1:5]):
                self._db.execute("COMMIT")
                return Claim("busy", held[0])
            if held is not None:  # its sender died holding it: what it sent may have been billed
                self._charge_dead_claim(key, held[0], held[5], held[6])
                self._refresh()  # the charge counts against the limit below
            if limit is not None and self.total_cost + self._reserved(excluding=key) + reserve > limit:
                self._db.execute("COMMIT")
                return Claim("over_budget")
            self._db.execute(
                "INSERT OR REPLACE INTO claims (key, owner, host, pid, expires, reserved, started)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    self.owner,
                    self.host,
                    os.getpid(),
                    time.time() + self.lease_seconds,
                    reserve,
                    self.started,
                ),
            )
            self._db.execute("COMMIT")
        except BaseException as e:
            self._rollback(e)
            raise
        return Claim("claimed", self.owner)

    def start_heartbeat(self) -> None:
        """Renew this process's leases every third of a lease from the running event loop, for as
        long as the loop runs; a no-op when a heartbeat already runs there."""
        import asyncio

        loop = asyncio.get_running_loop()
        task = self._heartbeat
        if task is not None and not task.done() and task.get_loop() is loop:
            return

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.lease_seconds / 3)
                self.renew_claims()

        self._heartbeat = loop.create_task(beat())

    def release(self, key: str) -> None:
        """Give up this process's claim without an answer (the request was cancelled)."""
        self._db.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, self.owner))

    def renew_claims(self) -> None:
        """Push this process's leases forward; the owner calls it every few seconds."""
        self._db.execute(
            "UPDATE claims SET expires = ? WHERE owner = ?", (time.time() + self.lease_seconds, self.owner)
        )

    def _alive(self, host: str, pid: int, expires: float, started: int | None = None) -> bool:
        # An owner in this process space is asked (a dead one is known at once, a reused pid by its start
        # time); elsewhere the lease says.
        if host == self.host:
            alive = pid_alive(pid) and (started is None or process_started(pid) in (None, started))
            return alive and expires + SAME_SPACE_GRACE_SECONDS >= time.time()
        return expires >= time.time()

    def _known_dead(self, host: str, pid: int, legacy: bool = False) -> bool:
        """True when ``pid`` ran in this process space (host and PID namespace) and is gone; a process
        elsewhere, or in another container on this host, cannot be asked. ``legacy``: a row an older
        version wrote names the host alone, and is asked here as that version asked it."""
        if host != self.host and not (legacy and host == self.host.rsplit("+", 1)[0]):
            return False
        return not pid_alive(pid)

    def _reserved(self, excluding: str = "") -> float:
        """The reservations of every claim that may be live (its lease unexpired, or within the grace
        an owner in this process space gets), this process's and others'. A dead owner's count until
        `claims_in_flight` clears them: erring high, and one query per request instead of a
        liveness check per claim."""
        now = time.time()
        (total,) = self._db.execute(
            "SELECT COALESCE(SUM(reserved), 0) FROM claims"
            " WHERE key != ? AND (expires >= ? OR (host = ? AND expires >= ?))",
            (excluding, now, self.host, now - SAME_SPACE_GRACE_SECONDS),
        ).fetchone()
        return total

    def claims_in_flight(self) -> int:
        """Live online claims of every process (requests being sent right now), after clearing the
        claims of dead owners, whose reservations would otherwise hold the budget until their leases
        end. A Batch API job's claims are not counted: they settle when the batch does, up to a day."""
        dead, online = [], 0
        for key, owner, reserved, sent, *held in self._db.execute(
            "SELECT key, owner, reserved, sent, host, pid, expires, started FROM claims"
        ).fetchall():
            if not self._alive(*held):
                dead.append((key, owner, reserved, sent))
            elif not owner.startswith("batch:"):
                online += 1
        for key, owner, reserved, sent in dead:
            with self._transaction():  # only the process whose DELETE removed the claim charges it
                if self._db.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner)).rowcount:
                    self._charge_dead_claim(key, owner, reserved, sent)
        self._refresh()
        return online

    @contextlib.contextmanager
    def _transaction(self):
        """A write transaction, or the caller's when one is open (`claim_batch` clears dead claims in its own)."""
        if self._db.in_transaction:
            yield
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException as e:
            self._rollback(e)
            raise
        self._db.execute("COMMIT")

    def note_sent(self, key: str) -> None:
        """One more try of ``key`` left this process (its endpoint says so as it leaves): if the process
        dies holding the claim, the run that takes it over pays for the tries (`_charge_dead_claim`)."""
        self._db.execute("UPDATE claims SET sent = sent + 1 WHERE key = ? AND owner = ?", (key, self.owner))

    def _charge_dead_claim(self, key: str, owner: str, reserved: float, sent: int) -> None:
        """The tries a dead sender (SIGKILL, a lost machine) made while it held ``key``'s claim may have
        been billed: each is an error row's cost at the reservation, one send's worst case, so the budget
        counts them (a stop that can be caught counts its sends itself, `Teacher._once`). The key stays
        a transport failure, which the next run sends again. Called inside the caller's transaction; a
        Batch API job's claims settle with their batch instead."""
        if owner.startswith("batch:") or not sent or not reserved:
            return
        detail = f"its sender ({owner}) died after {sent} tries left, unanswered"
        self._db.execute(
            "INSERT INTO answers (key, model, status, reason, raw, prompt_tokens, completion_tokens, cost, created)"
            " VALUES (?, '', 'error', 'killed_in_flight', ?, 0, 0, ?, ?)",
            (key, detail, reserved * sent, time.time()),
        )

    def holds(self, key: str) -> bool:
        """Whether this process holds the claim on ``key`` (it has not stored an answer for it)."""
        return (
            self._db.execute("SELECT 1 FROM claims WHERE key = ? AND owner = ?", (key, self.owner)).fetchone()
            is not None
        )

    def claims_held(self) -> int:
        """Claims (in-flight requests) this process holds: 0 once every request has settled."""
        return self._db.execute("SELECT COUNT(*) FROM claims WHERE owner = ?", (self.owner,)).fetchone()[0]

    # -- batches: a Batch API job's requests hold their claims (and budget) until it is done

    def claim_batch(self, endpoint: str, entries: list[tuple[str, float]], limit: float | None,
                    hold_seconds: float) -> tuple[str, list[str], int]:  # fmt: skip
        """Claim the ``(key, reserve)`` entries for one new batch, in order, until the budget refuses
        one: ``(batch id, claimed keys, refused by the budget)``; keys answered or held by another
        sender meanwhile are left out, not refused. The claims belong to the batch, not to this process, and
        hold for ``hold_seconds`` (the completion window and some), so a rerun after a kill neither
        resends them nor lets the budget forget them."""
        batch = f"b{secrets.token_hex(8)}"
        owner, expires = f"batch:{batch}", time.time() + hold_seconds
        claimed, refused = [], 0
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._refresh()
            self.claims_in_flight()  # dead owners' claims cleared: their reservations would refuse this batch
            reserved = self._reserved()
            for n, (key, reserve) in enumerate(entries):
                if self.has_answer(key):
                    continue
                held = self._db.execute(
                    "SELECT owner, host, pid, expires, started FROM claims WHERE key = ?", (key,)
                ).fetchone()
                if held is not None and self._alive(*held[1:]):
                    continue  # someone is sending it (online, this process included, or in another live batch)
                if limit is not None and self.total_cost + reserved + reserve > limit:
                    refused = len(entries) - n
                    break
                reserved += reserve
                self._db.execute(
                    "INSERT OR REPLACE INTO claims (key, owner, host, pid, expires, reserved) VALUES (?, ?, 'batch', 0, ?, ?)",
                    (key, owner, expires, reserve),
                )
                self._db.execute("INSERT INTO batch_items (key, batch, state, reserved) VALUES (?, ?, 'submitted', ?)",
                                 (key, batch, reserve))  # fmt: skip
                claimed.append(key)
            if claimed:
                self._db.execute(
                    "INSERT INTO batches (id, endpoint, status, requests, created, host, pid)"
                    " VALUES (?, ?, 'claimed', ?, ?, ?, ?)",
                    (batch, endpoint, len(claimed), time.time(), self.host, os.getpid()),
                )
            self._db.execute("COMMIT")
        except BaseException as e:
            self._rollback(e)
            raise
        return batch, claimed, refused

    def update_batch(self, batch: str, **fields) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch))

    def take_batch(self, batch: str) -> bool:
        """Take over an uploaded batch whose submitting run is gone, to create it at the provider:
        True for one process only (the check and the take are one transaction), so two runs
        recovering the same killed one do not both create it. Across machines a run is asked only by
        the upload window, which starts again when a run takes it."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute(
                "SELECT batch_id, host, pid, MAX(created, COALESCE(taken, 0)) FROM batches WHERE id = ?",
                (batch,),
            ).fetchone()
            taken = row is not None and row[0] is None and not self.being_submitted(*row[1:])
            if taken:
                self._db.execute("UPDATE batches SET host = ?, pid = ?, taken = ? WHERE id = ?",
                                 (self.host, os.getpid(), time.time(), batch))  # fmt: skip
            self._db.execute("COMMIT")
        except BaseException as e:
            self._rollback(e)
            raise
        return taken

    def live_batches(self) -> list[dict]:
        """Batches not done yet, oldest first, with their request keys."""
        rows = self._db.execute(
            "SELECT id, endpoint, input_file_id, batch_id, status, requests, created, host, pid,"
            " MAX(created, COALESCE(taken, 0)) FROM batches WHERE status != 'done' ORDER BY created"
        ).fetchall()
        out = []
        for bid, endpoint, file_id, batch_id, status, n, created, host, pid, since in rows:
            keys = [k for (k,) in self._db.execute("SELECT key FROM batch_items WHERE batch = ?", (bid,))]
            out.append({"id": bid, "endpoint": endpoint, "input_file_id": file_id, "batch_id": batch_id,
                        "status": status, "requests": n, "keys": keys,
                        "created": created,
                        "being_submitted": batch_id is None and self.being_submitted(host, pid, since)})  # fmt: skip
        return out

    def being_submitted(self, host: str | None, pid: int | None, since: float) -> bool:
        """Whether another live process may still be uploading or creating this batch. This process's
        own are not: it waits for batches only once its submitting returned."""
        if host is None or (host == self.host and pid == os.getpid()):
            return False
        # A pid reused by another process still ends with the window. A batch row an older version wrote
        # (the host alone) is asked as it asked: else it would hold a rerun for the whole window; a claim's
        # is never asked, its 30 s lease decides.
        return time.time() - since < UPLOAD_SECONDS and not self._known_dead(host, pid, legacy=True)

    def batch_item(self, key: str) -> tuple[str | None, int, float]:
        """``(latest state, batches it was in, its last reservation)`` of a request key."""
        rows = self._db.execute(
            "SELECT i.state, i.reserved FROM batch_items i JOIN batches b ON b.id = i.batch WHERE i.key = ?"
            " ORDER BY b.created", (key,)
        ).fetchall()  # fmt: skip
        return (rows[-1][0], len(rows), rows[-1][1]) if rows else (None, 0, 0.0)

    def finish_batch(
        self, batch: str, answers: list[StoredAnswer], states: dict[str, str], counts: dict
    ) -> bool:
        """A batch's results in one transaction: its answers and errors appended, every item's
        state, its claims released, the batch done. False when another process had collected it."""
        import json

        self._db.execute("BEGIN IMMEDIATE")
        try:
            (status,) = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch,)).fetchone()
            if status == "done":  # another process on this store collected it first: store nothing twice
                self._db.execute("COMMIT")
                return False
            for a in answers:
                self._db.execute(
                    "INSERT INTO answers (key, model, status, reason, raw, prompt_tokens, completion_tokens, cost,"
                    " created, usage_estimated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (a.key, a.model, a.status, a.reason, a.raw, a.prompt_tokens, a.completion_tokens, a.cost,
                     time.time(), int(a.usage_estimated)),
                )  # fmt: skip
            for key, state in states.items():
                self._db.execute(
                    "UPDATE batch_items SET state = ? WHERE key = ? AND batch = ?", (state, key, batch)
                )
            self._db.execute("DELETE FROM claims WHERE owner = ?", (f"batch:{batch}",))
            self._db.execute(
                "UPDATE batches SET status = 'done', counts = ? WHERE id = ?", (json.dumps(counts), batch)
            )
            self._db.execute("COMMIT")
        except BaseException as e:
            self._rollback(e)
            raise
        self._refresh()
        return True

    def drop_batch(self, batch: str) -> None:
        """A batch that was never submitted (killed before its file was sent): its claims go."""
        self._db.execute("BEGIN IMMEDIATE")
        self._db.execute("DELETE FROM claims WHERE owner = ?", (f"batch:{batch}",))
        self._db.execute("DELETE FROM batch_items WHERE batch = ?", (batch,))
        self._db.execute("DELETE FROM batches WHERE id = ?", (batch,))
        self._db.execute("COMMIT")

    def spent(self) -> float:
        """Cost of every answer in the store, all processes, as of now."""
        self._refresh()
        return self.total_cost

    # -- calibration

    def tokens_per_byte(self, *endpoints: str) -> float | None:
        """The largest calibrated ratio of the named rows; None when none is calibrated."""
        marks = ", ".join("?" * len(endpoints))
        (ratio,) = self._db.execute(
            f"SELECT MAX(tokens_per_byte) FROM calibration WHERE endpoint IN ({marks})", endpoints
        ).fetchone()
        return ratio

    # -- reports

    def totals(self) -> dict[str, dict]:
        """Per model: answered and error rows, tokens and cost over every row ever written."""
        out = {}
        for model, status, n, p, c, cost in self._db.execute(
            "SELECT model, status, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cost)"
            " FROM answers GROUP BY model, status"
        ):
            row = out.setdefault(
                model, {"answered": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}
            )
            row["answered" if status == "ok" else "errors"] += n
            row["prompt_tokens"] += p or 0
            row["completion_tokens"] += c or 0
            row["cost"] += cost or 0.0
        return out

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(DISTINCT key) FROM answers").fetchone()[0]

    def close(self) -> None:
        if self._heartbeat is not None and not self._heartbeat.get_loop().is_closed():
            self._heartbeat.cancel()
        self._db.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
        self._db.close()
