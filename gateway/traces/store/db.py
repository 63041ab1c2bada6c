"""Engine construction and transaction helpers shared by the store's parts.

SQLite: WAL journal, ``synchronous=NORMAL``, 4 KiB pages (new files), a 32 MiB page cache, a busy timeout,
and the driver's own transaction handling switched off so that write transactions start with ``BEGIN
IMMEDIATE`` (the write lock is taken up front; a deferred transaction that later writes can fail with
SQLITE_BUSY_SNAPSHOT under WAL). Read transactions use a plain ``BEGIN``. A ``Database`` on SQLite
checkpoints the WAL in a thread of its own (``checkpoint.Checkpointer``), not inside commits. PostgreSQL:
psycopg 3, READ COMMITTED, row locks with ``FOR UPDATE SKIP LOCKED``. On both, span batches are written on
DBAPI connections of their own (``Database.span_write``; on PostgreSQL a one-span batch as one statement,
``Database.span_statement``), outside the pool.
"""

from __future__ import annotations

import base64
import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from itertools import chain, repeat
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.traces.store.checkpoint import Checkpointer
from tracegym.gateway.traces.store.span_rows import json_text
from tracegym.gateway.traces.store.store_errors import StoreBusy

PAGE_IDS = 500
"""Rollout ids per ``IN (...)`` / ``ANY(...)`` query (well under SQLite's bound-parameter limit)."""
SQLITE_BUSY_TIMEOUT_MS = 30_000
_BUSY_PAUSES_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.025, 0.025, 0.05, 0.05, 0.1)
"""The span writer's pauses between tries for the write lock (SQLite's own busy handler's)."""
SQLITE_PAGE_SIZE = 4_096
"""Page size of a new SQLite store (an existing file keeps its own): SQLite writes every page a transaction
touched, whole, to its write-ahead log, and a group commit of a few calls touches about a dozen (the last
leaf of the spans table and of each index), so small pages make the default durability cheap (at c=32, 1.1-1.2x
the calls per second of 16 KiB pages; ``docs/benchmarks.md``). Reads are as fast (a larger span continues
on overflow pages, read through the memory map); bulk ingest is 0.85-0.9x."""
PG_SPAN_CONNECTIONS = 4
"""PostgreSQL span writer connections kept between batches (``Database.span_write``): the recorder's two
threads, and OTLP ingest beside them."""
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
    connections do not checkpoint the WAL as they commit: its ``Checkpointer`` thread does, after writes.
    Span batches are written on a connection of their own (``span_write``)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.checkpointer: Checkpointer | None = None
        self._span_conn: sqlite3.Connection | None = None  # SQLite's span writer
        self._pg_span_conns: list[Any] = []  # PostgreSQL's span writers not in use
        self._closed = False
        self._span_lock = threading.Lock()
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

    def _new_span_connection(self) -> Any:
        """A DBAPI connection made by the engine (its connect hooks run), detached from the pool for good."""
        fairy = self.engine.raw_connection()
        fairy.detach()
        conn = fairy.dbapi_connection
        if self.dialect == "postgresql":
            # Transactions are begun explicitly (_pg_span_connection): a one-span batch is one statement, which
            # the server commits as it runs it (one round trip, no BEGIN and COMMIT of its own).
            conn.autocommit = True
            # Its statements look rollouts up by primary key (rollouts.write_span_rollouts). While the table
            # grows faster than autovacuum analyzes it, the planner takes it for a few rows and scans it whole
            # in every batch (a plan psycopg's prepared statement then keeps): 1 ms at 6,000 rollouts, growing
            # with the table, against 0.1 ms through the key.
            conn.execute("SET enable_seqscan = off")
            # psycopg prepares a statement it runs often; the server would still plan each run of the span
            # statements for its values (a custom plan: with array parameters it keeps choosing those), about
            # 0.1 ms of a one-span statement's 0.5. One generic plan instead, through the key as above.
            conn.execute("SET plan_cache_mode = force_generic_plan")
        return conn

    @contextmanager
    def span_write(self, wait_s: float = SQLITE_BUSY_TIMEOUT_MS / 1000) -> Iterator[Any]:
        """A write transaction on the store's span writer, a DBAPI connection of its own (no pool, no
        SQLAlchemy events: a span batch is a few raw statements), committed on exit and rolled back on an
        error.

        SQLite: it waits up to ``wait_s`` for the write lock and for the writer, polling as SQLite's busy
        handler does; with 0 it never waits, for a caller that must not block (an event loop). Raises
        ``StoreBusy``, having written nothing, when the lock stayed taken (another writer's transaction). One
        writer connection, so that its page cache stays valid between batches.

        PostgreSQL (``wait_s`` is ignored: the server's locks wait): a pooled connection would cost every
        batch the pool's liveness check (a round trip) and SQLAlchemy's transaction bookkeeping, about a
        third of a small batch's time in the writing thread. Each caller takes a writer connection of its own
        (up to ``PG_SPAN_CONNECTIONS`` are kept between batches), so that batches commit side by side; one
        that broke (the server restarted) is closed with the error, and the caller's retry gets a new one."""
        if self.dialect != "sqlite":
            yield from self._pg_span_connection(transaction=True)
            return
        deadline = time.monotonic() + wait_s
        if not (self._span_lock.acquire(timeout=wait_s) if wait_s > 0 else self._span_lock.acquire(False)):
            raise StoreBusy("the span writer is in use")
        try:
            conn = self._span_conn
            if conn is None:  # one writer connection, kept: its page cache stays valid between batches
                conn = self._span_conn = self._new_span_connection()
                conn.execute("PRAGMA busy_timeout = 0")  # BUSY at once: the waiting is below, within wait_s
            for pause in chain(_BUSY_PAUSES_S, repeat(_BUSY_PAUSES_S[-1])):
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    break
                except sqlite3.OperationalError as e:
                    if e.sqlite_errorcode != sqlite3.SQLITE_BUSY:  # not another writer's open transaction
                        raise
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StoreBusy(str(e)) from e
                    time.sleep(min(pause, left))
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            self._span_lock.release()
        if self.checkpointer is not None:
            self.checkpointer.written()

    @contextmanager
    def span_statement(self) -> Iterator[Any]:
        """PostgreSQL: a span writer connection (see ``span_write``) outside a transaction, for one statement
        that the server commits as it runs it (a one-span batch with its rollouts: one round trip)."""
        if self.dialect != "postgresql":
            raise ValueError("span_statement is PostgreSQL's: SQLite writes spans in span_write")
        yield from self._pg_span_connection(transaction=False)

    def _pg_span_connection(self, transaction: bool) -> Iterator[Any]:
        """A PostgreSQL span writer connection (autocommit) from the free list or new; with ``transaction``,
        in a transaction begun here, committed on exit and rolled back on an error. Kept after, unless it
        broke or enough are kept."""
        with self._span_lock:
            conn = self._pg_span_conns.pop() if self._pg_span_conns else None
        if conn is None:
            conn = self._new_span_connection()
        try:
            if transaction:
                conn.execute("BEGIN")
            yield conn
            if transaction:
                conn.commit()  # psycopg sends COMMIT while the server has the transaction open
        except BaseException:
            if transaction and not (conn.broken or conn.closed):
                with suppress(Exception):  # a rollback that fails leaves the connection broken: closed below
                    conn.rollback()
            raise
        finally:
            with self._span_lock:
                keep = (not (self._closed or conn.broken or conn.closed)
                        and len(self._pg_span_conns) < PG_SPAN_CONNECTIONS)
                if keep:
                    self._pg_span_conns.append(conn)
            if not keep:
                with suppress(Exception):  # a broken connection's close has nothing left to do
                    conn.close()

    def close(self) -> None:
        """Dispose of the connection pool (on SQLite: checkpoint what is left first)."""
        with self._span_lock:
            self._closed = True
            conns, self._pg_span_conns = self._pg_span_conns, []
            if self._span_conn is not None:
                conns.append(self._span_conn)
                self._span_conn = None
        for conn in conns:
            with suppress(Exception):
                conn.close()
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
