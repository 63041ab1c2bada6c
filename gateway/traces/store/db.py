"""Engine construction and transaction helpers shared by the store's parts.

SQLite: WAL journal, ``synchronous=NORMAL``, 16 KiB pages, a 32 MiB page cache, a busy timeout, and the
driver's own transaction handling switched off so that write transactions start with ``BEGIN IMMEDIATE``
(the write lock is taken up front; a deferred transaction that later writes can fail with
SQLITE_BUSY_SNAPSHOT under WAL). Read transactions use a plain ``BEGIN``. A ``Database`` on SQLite
checkpoints the WAL in a thread of its own (``checkpoint.Checkpointer``), not inside commits. PostgreSQL: psycopg 3, READ
COMMITTED, row locks with ``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.traces.store.checkpoint import Checkpointer
from tracegym.gateway.traces.store.span_rows import json_text

PAGE_IDS = 500
"""Rollout ids per ``IN (...)`` / ``ANY(...)`` query (well under SQLite's bound-parameter limit)."""
SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_PAGE_SIZE = 16_384
"""Page size of a new SQLite store (ignored for an existing file): a span row of a few KB fits a 16 KiB page
without overflow chains, and large pages split less often than the default 4 KiB."""
SQLITE_CACHE_KIB = 32_768
"""Page cache per connection (allocated as used): index inserts of large batches stay in memory."""
SQLITE_MMAP_BYTES = 1 << 30
"""SQLite reads the store through a memory map of up to this size: page reads without a ``pread`` and a
copy each, so a store larger than the page cache reads as fast per row as a small one."""


def _json_loads(value: Any) -> Any:
    # SQLite gives a JSON column NUMERIC affinity: a bare JSON number comes back as an int/float.
    if isinstance(value, int | float):
        return value
    return orjson.loads(value)


def make_engine(url: str) -> sa.Engine:
    """An engine for ``sqlite:///...`` or ``postgresql+psycopg://...`` (``postgresql://`` means psycopg)."""
    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError("the trace store needs a file database (sqlite:///path.db), not :memory:")
        engine = sa.create_engine(parsed, json_serializer=json_text, json_deserializer=_json_loads)
        _configure_sqlite(engine)
        return engine
    if backend == "postgresql":
        return sa.create_engine(
            parsed, json_serializer=json_text, json_deserializer=_json_loads,
            pool_size=10, max_overflow=20, pool_pre_ping=True,
        )
    raise ValueError(f"unsupported store URL {url!r}: use sqlite:///path.db or postgresql+psycopg://...")


def _configure_sqlite(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute(f"PRAGMA page_size = {SQLITE_PAGE_SIZE}")  # before WAL: only a new file takes it
        cur.execute(f"PRAGMA cache_size = -{SQLITE_CACHE_KIB}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute(f"PRAGMA mmap_size = {SQLITE_MMAP_BYTES}")  # reads of large stores stay linear
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        immediate = conn.get_execution_options().get("tg_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _no_autocheckpoint(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA wal_autocheckpoint = 0")  # the Database's Checkpointer thread does it


class Database:
    """Owns the engine; ``write()`` / ``read()`` yield a connection inside one transaction. On SQLite its
    connections do not checkpoint the WAL as they commit: its ``Checkpointer`` thread does, after writes."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.checkpointer: Checkpointer | None = None
        if self.dialect == "sqlite":
            sa.event.listen(engine, "connect", _no_autocheckpoint)
            self.checkpointer = Checkpointer(engine.url.database or "")

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn:
            conn.execution_options(tg_write=True)
            with conn.begin():
                yield conn
        if self.checkpointer is not None:
            self.checkpointer.written()

    def close(self) -> None:
        """Dispose of the connection pool (on SQLite: checkpoint what is left first)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.engine.dispose()

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def insert(self, table: sa.Table) -> Any:
        """The dialect's INSERT (supports ``on_conflict_do_nothing`` / ``on_conflict_do_update``)."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        return insert(table)


def now() -> float:
    return datetime.now(UTC).timestamp()


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def to_epoch(value: float | int | str | datetime | None) -> float | None:
    """Epoch seconds from a number, a numeric string (epoch seconds, e.g. ``"1700000000"``), an ISO-8601
    string (naive means UTC) or a datetime."""
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, str):
        try:
            seconds = float(value)
        except ValueError:
            pass
        else:
            if not math.isfinite(seconds):
                raise ValueError(f"bad time {value!r}: epoch seconds must be finite")
            return seconds
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"bad time {value!r}: expected ISO-8601 (e.g. 2025-01-31T12:00:00Z)") from None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    raise ValueError(f"bad time {value!r}: expected ISO-8601 string, datetime or epoch seconds")


def encode_cursor(created_at: float, key: str) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([created_at, key])).decode()


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        created_at, key = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
        return float(created_at), str(key)
    except (ValueError, TypeError) as e:
        raise ValueError(f"bad cursor {cursor!r}: pass back the next_cursor of a previous page") from e
