"""The answer store: every teacher response ever paid for, append-only, keyed by request hash.

SQLite in WAL mode with ``synchronous=NORMAL``: each answer is one committed INSERT, which reaches
the OS before the call returns, so a ``kill -9`` loses at most the requests still in flight (they
were never answered). Rows are never updated or deleted. A key can have several rows (a transport
error, then a success on a later run); the newest successful row wins, else the newest error.

What is stored is the raw HTTP response body, not our reading of it: changing the parsing code
re-reads the same bytes on the next run and sends nothing.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,             -- 'ok' (the server answered 200 with a completion) or 'error'
    reason TEXT NOT NULL DEFAULT '',  -- for errors: timeout, connection, http_429, http_500, malformed_response
    raw TEXT NOT NULL,                -- the response body as received, or the error message
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS answers_key ON answers (key);
"""


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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class AnswerStore:
    """One SQLite file, used from one event loop.

    Opening reads only ``key -> (row id, ok)`` into memory; ``get`` then fetches one row by id, so
    a store of 100K long answers does not have to fit in memory.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit: one INSERT = one txn
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._latest: dict[str, tuple[int, bool]] = {}
        self.total_cost = 0.0
        for rowid, key, status, cost in self._db.execute(
            "SELECT id, key, status, cost FROM answers ORDER BY id"
        ):
            self._remember(key, rowid, status == "ok")
            self.total_cost += cost

    def _remember(self, key: str, rowid: int, ok: bool) -> None:
        # Rows arrive in id order: a later success replaces anything, a later error only an error.
        previous = self._latest.get(key)
        if previous is None or ok or not previous[1]:
            self._latest[key] = (rowid, ok)

    def get(self, key: str) -> StoredAnswer | None:
        found = self._latest.get(key)
        if found is None:
            return None
        row = self._db.execute(
            "SELECT key, model, status, reason, raw, prompt_tokens, completion_tokens, cost FROM answers WHERE id = ?",
            (found[0],),
        ).fetchone()
        return StoredAnswer(*row)

    def has_answer(self, key: str) -> bool:
        found = self._latest.get(key)
        return found is not None and found[1]

    def put(self, answer: StoredAnswer) -> None:
        cursor = self._db.execute(
            "INSERT INTO answers (key, model, status, reason, raw, prompt_tokens, completion_tokens, cost, created)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            ),
        )
        self._remember(answer.key, cursor.lastrowid, answer.ok)
        self.total_cost += answer.cost

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
        return len(self._latest)

    def close(self) -> None:
        self._db.close()
