"""The usage store: requests, errors and tokens per tenant and UTC day, in SQLite (stdlib sqlite3).

Requests add to an in-memory batch; `flush` (every `tenants.usage_flush_interval_s`, at shutdown
and before a usage report) adds the batch to the file in one transaction, in a worker thread.
The file is in WAL mode with a busy timeout, so instances on one host may share it; each adds
its own counts (upserts that add, never overwrite).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

logger = logging.getLogger("llm_gateway.tenants")

COUNTS = ("requests", "errors", "prompt_tokens", "completion_tokens", "queued", "queue_ms")
COUNT_INDEX = {name: i for i, name in enumerate(COUNTS)}  # record() adds by name, not position

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL,
    day TEXT NOT NULL,               -- UTC, YYYY-MM-DD
    requests INTEGER NOT NULL DEFAULT 0,          -- generation requests, refused ones included
    errors INTEGER NOT NULL DEFAULT 0,            -- answered 4xx/5xx (429s included), or a stream ended by an error
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    queued INTEGER NOT NULL DEFAULT 0,            -- requests that waited for a place in a full engine (fair queue)
    queue_ms INTEGER NOT NULL DEFAULT 0,          -- milliseconds they waited, all together
    PRIMARY KEY (tenant, day)
)
"""
SHOWN = ("requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens", "queued", "queue_ms")
"""A row's numbers as /admin/usage and `llm-gateway usage` show them."""
ADDED_COLUMNS = ("queued", "queue_ms")
"""Columns newer than the first usage files: added to an older file when it is opened."""
# One statement for every count: a count added to COUNTS (and SCHEMA) is written with the rest.
UPSERT = (
    f"INSERT INTO usage (tenant, day, {', '.join(COUNTS)}) VALUES ({', '.join('?' * (len(COUNTS) + 2))})\n"
    "ON CONFLICT (tenant, day) DO UPDATE SET\n    "
    + ",\n    ".join(f"{name} = {name} + excluded.{name}" for name in COUNTS) + "\n"
)


@dataclass
class UsageRow:
    tenant: str
    day: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued: int = 0
    """Requests that waited for a place in a full engine (`auth.fair_share`)."""
    queue_ms: int = 0
    """How long they waited, all together (milliseconds)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def counts(self) -> dict[str, int]:
        """The row's numbers in the order reports show them (`SHOWN`)."""
        return {name: getattr(self, name) for name in SHOWN}

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "day": self.day, **self.counts()}


def day_of(now: float) -> str:
    return _day_of_minute(int(now // 60))


@functools.lru_cache(maxsize=4)
def _day_of_minute(minute: int) -> str:
    # Asked on every request; a UTC day starts on a whole minute, so one answer serves a minute.
    return datetime.fromtimestamp(minute * 60, timezone.utc).strftime("%Y-%m-%d")


OPEN_TIMEOUT_S = 10.0


def open_usage_db(path: Path, timeout_s: float = OPEN_TIMEOUT_S) -> sqlite3.Connection:
    """A connection to the usage file in WAL mode with the table in place.

    Two instances starting at once on one new file race to switch it to WAL. SQLite answers the
    loser's journal-mode change with SQLITE_BUSY at once, without waiting on its busy timeout,
    so the setup is retried here until `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        db = sqlite3.connect(path, timeout=timeout_s, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(SCHEMA)
            _add_columns(db)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.25)


def _add_columns(db: sqlite3.Connection) -> None:
    """Bring a usage file written by an older gateway up to the current columns (zero for the
    days before)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
    for column in ADDED_COLUMNS:
        if column in have:
            continue
        try:
            db.execute(f"ALTER TABLE usage ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):  # another instance added it just now
                raise


class UsageStore:
    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self._pending: dict[tuple[str, str], list[int]] = {}
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()  # one connection, used from worker threads one at a time
        self._flushing = asyncio.Lock()

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = open_usage_db(self.path)
        return self._db

    def record(self, tenant: str, *, error: bool, prompt_tokens: int = 0, completion_tokens: int = 0,
               queue_s: float | None = None) -> None:
        """One generation request of `tenant`, answered now; `queue_s`: how long it waited for
        a place in a full engine (None: it did not wait)."""
        add = {"requests": 1, "errors": int(error), "prompt_tokens": prompt_tokens,
               "completion_tokens": completion_tokens}
        if queue_s is not None:
            add |= {"queued": 1, "queue_ms": round(queue_s * 1000)}
        counts = self._pending.setdefault((tenant, day_of(self.clock())), [0] * len(COUNTS))
        for name, value in add.items():
            counts[COUNT_INDEX[name]] += value

    def _write(self, batch: dict[tuple[str, str], list[int]]) -> None:
        with self._db_lock:
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(UPSERT, [(t, d, *c) for (t, d), c in batch.items()])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    async def flush(self) -> None:
        async with self._flushing:
            batch, self._pending = self._pending, {}
            if not batch:
                return
            try:
                await asyncio.to_thread(self._write, batch)
            except (sqlite3.Error, OSError) as exc:
                logger.error("usage store %s: write failed (%s); keeping %d rows for the next flush",
                             self.path, exc, len(batch))
                for key, counts in batch.items():  # merged with what arrived meanwhile
                    pending = self._pending.setdefault(key, [0] * len(COUNTS))
                    for i, value in enumerate(counts):
                        pending[i] += value

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._db_lock:
            return self._connect().execute(sql, args).fetchall()

    async def period_tokens(self, period: str) -> dict[str, int]:
        """Tokens per tenant in a budget period ("YYYY-MM-DD" or "YYYY-MM"), as the file holds them."""
        rows = await asyncio.to_thread(
            self._query, "SELECT tenant, SUM(prompt_tokens + completion_tokens) FROM usage "
            "WHERE day = ? OR day LIKE ? GROUP BY tenant", (period, f"{period}-%"))
        return {tenant: int(total) for tenant, total in rows}

    async def rows(self, tenant: str | None = None, start: str | None = None,
                   end: str | None = None) -> list[UsageRow]:
        """Daily rows, oldest first, after writing what is pending; `start`/`end` are
        inclusive UTC days (YYYY-MM-DD)."""
        await self.flush()
        return await asyncio.to_thread(read_rows, self._query, tenant, start, end)

    async def close(self) -> None:
        await self.flush()
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None


Query = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]


def read_rows(query: Query, tenant: str | None, start: str | None, end: str | None) -> list[UsageRow]:
    """The usage rows matching the filters (None: any), oldest first (also `llm-gateway usage`)."""
    where, args = [], []
    for clause, value in (("tenant = ?", tenant), ("day >= ?", start), ("day <= ?", end)):
        if value is not None:
            where.append(clause)
            args.append(value)
    # A file no gateway has opened since it gained columns (read-only, `llm-gateway usage`): 0.
    have = {row[1] for row in query("PRAGMA table_info(usage)", ())}
    sql = f"SELECT tenant, day, {', '.join(c if c in have else '0' for c in COUNTS)} FROM usage"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY day, tenant"
    return [UsageRow(*row) for row in query(sql, tuple(args))]


def totals(rows: list[UsageRow]) -> dict[str, dict[str, int]]:
    """Per tenant, the sums of its rows' counts."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        entry = out.setdefault(row.tenant, dict.fromkeys(row.counts(), 0))
        for key, value in row.counts().items():
            entry[key] += value
    return out
