"""Bulk insert of span value tuples on the raw DBAPI connection of the current transaction, and the
multi-row statement helper (``execute_values``) the rollouts side of a batch shares.

SQLite: multi-row ``INSERT ... VALUES (...),(...) ON CONFLICT (trace_id, span_id) DO NOTHING``, not
``executemany``: the driver releases the GIL around every row's step, and while the tracing build thread
runs Python each re-acquisition waits up to the switch interval; one statement's C work runs outside the
GIL in one piece. Hence one statement of each kind per batch, and chunk sizes from a small fixed set
(full chunks, a partial one padded to a power of two with copies its ``ON CONFLICT`` ignores) so that the
driver's statement cache holds them: preparing a large multi-row statement costs about as much as
running it. PostgreSQL: binary ``COPY ... FROM STDIN``; when a span is already stored (a re-sent OTLP
batch) the transaction fails and is tried again with the batch going through a temporary table and ``INSERT
... ON CONFLICT DO NOTHING`` (a savepoint would cost two more round trips in every transaction, for a rare
case). A batch of one span is written with its rollouts in one statement instead (``spans._PG_ONE_SPAN``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from typing import Any

from tracegym.gateway.traces.store.span_rows import COLUMNS

_COLS = ", ".join(COLUMNS)
SPANS_INSERT_HEAD = f"INSERT INTO spans ({_COLS}) VALUES "
SPANS_INSERT_TAIL = " ON CONFLICT (trace_id, span_id) DO NOTHING"
MAX_ROWS_PER_STATEMENT = 2_000
"""Cap on the rows of one multi-row statement (the tracing exporter's batch size): bounds the memory of a
prepared statement while a full batch stays one statement."""
PG_MAX_PARAMS = 65_535
"""PostgreSQL's bound-parameter limit per statement (a 16-bit count in the wire protocol)."""
_SQL_LENGTH_RESERVE = 4_096
"""Room in SQLite's SQL length limit for the statement around its VALUES list."""
_CHARS_PER_PARAM = 3
"""SQL text per parameter in a VALUES list (``?, ``)."""
_BIGINT = frozenset({"start_time_ns", "end_time_ns"})
_BYTEA = frozenset({"prompt_ids", "output_ids", "output_logprobs"})
# Binary COPY types. JSON columns are sent as text: the binary wire format of ``json`` is its UTF-8 text,
# and psycopg's ``json`` dumper would re-serialize our (already serialized) str as a JSON string.
PG_COPY_TYPES = [
    "int8" if c in _BIGINT else "bytea" if c in _BYTEA else "text" for c in COLUMNS
]
_STAGE = "tg_spans_in"


def rows_per_statement(dbapi_conn: Any, dialect: str, ncols: int, cap: int = MAX_ROWS_PER_STATEMENT) -> int:
    """How many rows of ``ncols`` parameters one multi-row statement may carry on this connection: within
    the bound-parameter limit (SQLite: ``SQLITE_LIMIT_VARIABLE_NUMBER``, 32,766 or 250,000 in current
    builds, 999 in old ones; PostgreSQL: 65,535) and SQLite's SQL length limit, at most ``cap``."""
    if dialect == "sqlite":
        params = dbapi_conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        text = dbapi_conn.getlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH) - _SQL_LENGTH_RESERVE
        return max(1, min(cap, params // ncols, text // (ncols * _CHARS_PER_PARAM)))
    return max(1, min(cap, PG_MAX_PARAMS // ncols))


def statement_sizes(n: int, max_rows: int) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, rows of the statement)`` covering ``n`` rows: full chunks of ``max_rows``, then the
    rest in one statement of the next power of two rows (at most ``max_rows``), to be padded."""
    start = 0
    while n - start >= max_rows:
        yield start, start + max_rows, max_rows
        start += max_rows
    if start < n:
        yield start, n, min(max_rows, 1 << (n - start - 1).bit_length())


def values_sql(head: str, tail: str, ncols: int, nrows: int, mark: str = "?") -> str:
    """``head`` + ``nrows`` parenthesized groups of ``ncols`` placeholders + ``tail``."""
    group = f"({', '.join([mark] * ncols)})"
    return f"{head}{', '.join([group] * nrows)}{tail}"


def execute_values(cur: Any, head: str, tail: str, rows: Sequence[Sequence[Any]], max_rows: int,
                   mark: str = "?") -> int:
    """Run ``head VALUES-groups tail`` over ``rows`` with as few statements as ``max_rows`` allows (see
    ``statement_sizes``; a partial chunk is padded with copies of its first row, so the statement must
    ignore repeated rows: ``ON CONFLICT DO NOTHING``, an ``UPDATE ... FROM`` the copies join identically).
    Returns the sum of the statements' rowcounts (-1 for a statement the driver does not count)."""
    if not rows:
        return 0
    ncols = len(rows[0])
    total = 0
    for start, stop, size in statement_sizes(len(rows), max_rows):
        chunk = chain.from_iterable(rows[start:stop])
        if size > stop - start:
            chunk = chain(chunk, chain.from_iterable(repeat(rows[start], size - (stop - start))))
        cur.execute(values_sql(head, tail, ncols, size, mark), tuple(chunk))
        total += cur.rowcount
    return total


def insert_sqlite(dbapi_conn: Any, rows: Sequence[tuple]) -> int:
    """Insert span value tuples, ignoring stored (trace_id, span_id) pairs; the number inserted. One
    statement per ``rows_per_statement`` rows (one for a tracing batch), see the module docstring."""
    cur = dbapi_conn.cursor()
    try:
        return execute_values(cur, SPANS_INSERT_HEAD, SPANS_INSERT_TAIL, rows,
                              rows_per_statement(dbapi_conn, "sqlite", len(COLUMNS)))
    finally:
        cur.close()


def _copy(cur: Any, table: str, rows: Sequence[tuple]) -> None:
    with cur.copy(f"COPY {table} ({_COLS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(PG_COPY_TYPES)
        write = copy.write_row
        for row in rows:
            write(row)


def insert_postgresql(dbapi_conn: Any, rows: Sequence[tuple], *, stored: bool = False) -> int:
    """Insert span value tuples with one binary ``COPY``: ``psycopg.errors.UniqueViolation``, which aborts
    the transaction, when a span is stored already. With ``stored`` (a transaction's second try), through
    the temporary table, skipping the stored ones; the number inserted. (A batch of one span is written
    with its rollouts in one statement instead: ``spans._PG_ONE_SPAN``.)"""
    with dbapi_conn.cursor() as cur:
        if not stored:
            _copy(cur, "spans", rows)
            return len(rows)
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} ON COMMIT DELETE ROWS AS "
            f"SELECT {_COLS} FROM spans WITH NO DATA"
        )
        _copy(cur, _STAGE, rows)
        cur.execute(
            f"INSERT INTO spans ({_COLS}) SELECT {_COLS} FROM {_STAGE} "
            "ON CONFLICT (trace_id, span_id) DO NOTHING"
        )
        # No DELETE of the stage: ON COMMIT DELETE ROWS empties it, and a second call in the same
        # transaction would only offer again rows that are stored by now (and skipped by DO NOTHING).
        return cur.rowcount
