"""Bulk insert of span value tuples through the raw DBAPI connection of the current transaction.

SQLite: one prepared ``INSERT ... ON CONFLICT (trace_id, span_id) DO NOTHING`` run by the driver's
``executemany`` (the loop is in C; rowcount sums the rows really inserted).

PostgreSQL: binary ``COPY spans (...) FROM STDIN`` (psycopg 3 ``write_row``), an order of magnitude
cheaper than multi-row INSERTs on both sides. COPY has no ``ON CONFLICT``: it runs under a savepoint, and
when a span is already stored (a re-sent OTLP batch) the batch is instead copied into a session-local
temporary table and moved with ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracegym.gateway.store.span_rows import COLUMNS

_COLS = ", ".join(COLUMNS)
SQLITE_INSERT = (
    f"INSERT INTO spans ({_COLS}) VALUES ({', '.join('?' * len(COLUMNS))}) "
    "ON CONFLICT (trace_id, span_id) DO NOTHING"
)
_BIGINT = frozenset({"start_time_ns", "end_time_ns"})
_BYTEA = frozenset({"prompt_ids", "output_ids", "output_logprobs"})
# Binary COPY types. JSON columns are sent as text: the binary wire format of ``json`` is its UTF-8 text,
# and psycopg's ``json`` dumper would re-serialize our (already serialized) str as a JSON string.
PG_COPY_TYPES = [
    "int8" if c in _BIGINT else "bytea" if c in _BYTEA else "text" for c in COLUMNS
]
_STAGE = "tg_spans_in"


def insert_sqlite(dbapi_conn: Any, rows: Sequence[tuple]) -> int:
    cur = dbapi_conn.cursor()
    try:
        cur.executemany(SQLITE_INSERT, rows)
        return cur.rowcount
    finally:
        cur.close()


def _copy(cur: Any, table: str, rows: Sequence[tuple]) -> None:
    with cur.copy(f"COPY {table} ({_COLS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(PG_COPY_TYPES)
        write = copy.write_row
        for row in rows:
            write(row)


def insert_postgresql(dbapi_conn: Any, rows: Sequence[tuple]) -> int:
    from psycopg import errors

    with dbapi_conn.cursor() as cur:
        cur.execute("SAVEPOINT tg_copy_spans")
        try:
            _copy(cur, "spans", rows)
        except errors.UniqueViolation:
            cur.execute("ROLLBACK TO SAVEPOINT tg_copy_spans")
        else:
            cur.execute("RELEASE SAVEPOINT tg_copy_spans")
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
