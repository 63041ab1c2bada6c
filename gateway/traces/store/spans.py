"""Span rows: the batched insert (an encoded ``SpanBatch`` -> SQLite multi-row INSERT / PostgreSQL COPY, see
``span_insert``) and two reads that hand rows out as stored; ``tracegym.gateway.traces.reads`` makes span
dicts, ``CallRecord``s and the assembly's ``TokenCall``s of them."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby
from operator import itemgetter
from typing import Any

import sqlalchemy as sa

from tracegym.gateway.traces.store.db import PAGE_IDS, Database
from tracegym.gateway.traces.store.rollouts import (
    PG_SPAN_ROLLOUTS_WITH,
    pg_span_rollouts_params,
    write_span_rollouts,
)
from tracegym.gateway.traces.store.schema import spans as S
from tracegym.gateway.traces.store.span_insert import (
    SPANS_INSERT_HEAD,
    SPANS_INSERT_TAIL,
    insert_postgresql,
    insert_sqlite,
    values_sql,
)
from tracegym.gateway.traces.store.span_rows import COLUMNS, SpanBatch
from tracegym.gateway.traces.store.store_errors import StoreBusy


def _latest_versions(batch: SpanBatch) -> dict[str, str]:
    """``{rollout_id: weight_version}`` of each rollout's latest span in ``batch``."""
    return {rid: wv for rid, (_, wv) in batch.versions.items()}


def _write_batch(dialect: str, raw: Any, batch: SpanBatch, *, stored: bool = False) -> int:
    """The statements of a span batch in the open transaction of the DBAPI connection ``raw`` (``stored``:
    see ``insert_postgresql``)."""
    write_span_rollouts(dialect, raw, batch.tasks, _latest_versions(batch))
    if dialect == "postgresql":
        return insert_postgresql(raw, batch.rows, stored=stored)
    return insert_sqlite(raw, batch.rows)


_PG_ONE_SPAN = PG_SPAN_ROLLOUTS_WITH + values_sql(SPANS_INSERT_HEAD, SPANS_INSERT_TAIL, len(COLUMNS), 1, "%s")
"""A one-span batch on PostgreSQL: its rollouts' statement and the span's ``INSERT ... ON CONFLICT DO NOTHING``
as one statement, which the server commits as it runs it (``Database.span_statement``): one round trip, where
a transaction of the two takes four (BEGIN, the two, COMMIT) and the server's work for each. This is the
transaction a call alone in the gateway waits for before its answer (``--durability commit``)."""


def _write_one_postgresql(raw: Any, batch: SpanBatch) -> int:
    """``_PG_ONE_SPAN`` for a batch of one span on the autocommit connection ``raw``; 0 when it was stored."""
    rollouts = pg_span_rollouts_params(batch.tasks, _latest_versions(batch))
    with raw.cursor() as cur:
        cur.execute(_PG_ONE_SPAN, (*rollouts, *batch.rows[0]))
        return cur.rowcount


def _columns_sql(dialect: str, with_request: bool, columns: tuple[str, ...]) -> str:
    """``columns`` as selected by the raw reads: ``attributes`` as its raw JSON text (parsed once by the
    caller, not by the driver or SQLAlchemy); without ``with_request`` the ``request`` column is only tested
    for NULL, its bytes are not read."""
    attributes = "attributes::text" if dialect == "postgresql" else "CAST(attributes AS BLOB)"
    request = "request" if with_request else "request IS NOT NULL"
    return ", ".join(attributes if c == "attributes" else request if c == "request" else c for c in columns)


def select_sql(dialect: str, n_ids: int, with_request: bool, columns: tuple[str, ...]) -> str:
    """The page query of ``call_rows``: ``columns`` of the spans of ``n_ids`` rollouts, ordered by rollout,
    start time, insertion."""
    cols = _columns_sql(dialect, with_request, columns)
    where = "rollout_id = ANY(%s)" if dialect == "postgresql" else f"rollout_id IN ({','.join('?' * n_ids)})"
    return f"SELECT {cols} FROM spans WHERE {where} ORDER BY rollout_id, start_time_ns, id"


TOOL_PARSE_KINDS = ("ok", "failed", "none")
"""How a call's tool-call parse went (span attribute ``tracegym.tool_parse``: ``ok``, ``none`` or
``failed: <reason>``), as counted per rollout by ``SpansMixin.tool_parse_counts``."""


def _tool_parse_sql(dialect: str) -> str:
    """Per rollout of a page of ids, its gateway calls by parse status (calls never parsed are not counted)."""
    attr = ("(attributes ->> 'tracegym.tool_parse')" if dialect == "postgresql"
            else "json_extract(attributes, '$.\"tracegym.tool_parse\"')")
    return ("SELECT rollout_id, "
            f"SUM(CASE WHEN {attr} = 'ok' THEN 1 ELSE 0 END), "
            f"SUM(CASE WHEN {attr} LIKE :failed THEN 1 ELSE 0 END), "
            f"SUM(CASE WHEN {attr} = 'none' THEN 1 ELSE 0 END) "
            "FROM spans WHERE rollout_id IN :ids AND source = 'gateway' AND call_id IS NOT NULL "
            "GROUP BY rollout_id")


class SpansMixin:
    db: Database

    def tool_parse_counts(self, rollout_ids: list[str]) -> dict[str, dict[str, int]]:
        """``{rollout_id: {"ok", "failed", "none"}}``: how many of each rollout's gateway calls had their reply's
        tool calls parsed (``ok``), written in the family's syntax but not parsing (``failed``), or had no
        call syntax at all (``none``); calls whose replies were not parsed for tools (no tools offered) are
        not counted. Every id given is present (zeros when it has no such calls). One query per
        ``PAGE_IDS`` ids on the ``(rollout_id, start_time_ns)`` index."""
        ids = list(dict.fromkeys(rollout_ids))
        out = {rid: dict.fromkeys(TOOL_PARSE_KINDS, 0) for rid in ids}
        if not ids:
            return out
        sql = sa.text(_tool_parse_sql(self.db.dialect)).bindparams(sa.bindparam("ids", expanding=True))
        with self.db.read() as conn:
            for start in range(0, len(ids), PAGE_IDS):
                for rid, *counts in conn.execute(sql, {"ids": ids[start : start + PAGE_IDS], "failed": "failed%"}):
                    out[rid] = {k: int(n or 0) for k, n in zip(TOOL_PARSE_KINDS, counts, strict=True)}
        return out

    def insert_spans(self, rows: list[dict] | SpanBatch) -> int:
        """Insert span rows in one transaction: dicts keyed by the ``spans`` table's columns (OTLP ingest's
        form) or an encoded ``SpanBatch`` (the tracing exporter's, and ``call_spans.insert_call_records``').
        Rollouts named by the rows that do not exist yet are created with status ``adhoc``; a rollout's
        ``weight_version`` follows its latest span. Duplicate (trace_id, span_id) pairs are ignored.
        Returns the number of rows inserted."""
        batch = rows if isinstance(rows, SpanBatch) else SpanBatch.from_dicts(rows)
        if not batch.rows:
            return 0
        # One statement of each kind for the whole batch (see span_insert), on the span writer's connection:
        # SQLite: BEGIN IMMEDIATE, the rollouts upsert, the spans INSERT, COMMIT; PostgreSQL: BEGIN, the
        # rollouts upsert, the spans COPY, COMMIT (one span: one statement, _PG_ONE_SPAN).
        dialect = self.db.dialect
        if dialect == "sqlite":
            with self.db.span_write() as raw:
                return _write_batch(dialect, raw, batch)
        if len(batch.rows) == 1:
            with self.db.span_statement() as raw:
                return _write_one_postgresql(raw, batch)
        from psycopg import errors

        try:
            with self.db.span_write() as raw:
                return _write_batch(dialect, raw, batch)
        except errors.UniqueViolation:  # a span of the batch is stored already: again, skipping those
            with self.db.span_write() as raw:
                return _write_batch(dialect, raw, batch, stored=True)

    def insert_spans_now(self, batch: SpanBatch) -> int:
        """``insert_spans`` of a non-empty ``batch`` without waiting for the write lock (SQLite:
        ``Database.span_write(0)``), for a caller that must not block; ``StoreBusy``, nothing written, when
        another writer holds the lock or the store is PostgreSQL (whose writes wait on the server)."""
        if self.db.dialect != "sqlite":
            raise StoreBusy("only SQLite writes a span batch without waiting")
        with self.db.span_write(0) as raw:
            return _write_batch("sqlite", raw, batch)

    def call_row(self, call_id: str, columns: tuple[str, ...], *, with_request: bool = True) -> tuple | None:
        """``columns`` (rendered as in ``call_rows``) of the gateway call answered with ``call_id`` (None: no
        such call); one indexed query."""
        dialect = self.db.dialect
        mark = "%s" if dialect == "postgresql" else "?"
        sql = (f"SELECT {_columns_sql(dialect, with_request, columns)} FROM spans "
               f"WHERE call_id = {mark} AND source = 'gateway' LIMIT 1")
        with self.db.read() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            try:
                cur.execute(sql, (call_id,))
                return cur.fetchone()
            finally:
                cur.close()

    def recent_call_rows(self, rollout_id: str, columns: tuple[str, ...], limit: int) -> list[tuple]:
        """``columns`` (rendered as in ``call_rows``, request included) of the rollout's latest ``limit``
        gateway spans, in start order: one query on the ``(rollout_id, start_time_ns)`` index, read
        backwards (prefix reuse's parents recorded by another gateway, ``reads.recent_call_records``)."""
        dialect = self.db.dialect
        mark = "%s" if dialect == "postgresql" else "?"
        sql = (f"SELECT {_columns_sql(dialect, True, columns)} FROM spans WHERE rollout_id = {mark} "
               f"AND source = 'gateway' ORDER BY start_time_ns DESC, id DESC LIMIT {int(limit)}")
        with self.db.read() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            try:
                cur.execute(sql, (rollout_id,))
                rows = cur.fetchall()
            finally:
                cur.close()
        rows.reverse()
        return rows

    def span_rows(self, rollout_id: str) -> list[Mapping[str, Any]]:
        """Every column of a rollout's spans (gateway and OTLP-ingested) in start order: JSON columns
        parsed, token arrays as their stored blobs."""
        q = sa.select(S).where(S.c.rollout_id == rollout_id).order_by(S.c.start_time_ns, S.c.id)
        with self.db.read() as conn:
            return [r._mapping for r in conn.execute(q)]

    def call_rows(self, rollout_ids: list[str], columns: tuple[str, ...], *,
                  with_request: bool = True) -> dict[str, list[tuple]]:
        """``columns`` (the first must be ``rollout_id``; ``attributes`` comes as raw JSON text, see
        ``select_sql``) of the spans of ``rollout_ids``, grouped by rollout in start order (rollouts without
        spans are absent). One transaction, one plain-SQL query per ``PAGE_IDS`` rollouts on the DBAPI
        connection: per-row SQLAlchemy work would cost more than the query."""
        if columns[0] != "rollout_id":
            raise ValueError(f"call_rows groups by rollout: the first column must be rollout_id, "
                             f"not {columns[0]!r}")
        ids = list(rollout_ids)
        dialect = self.db.dialect
        out: dict[str, list[tuple]] = {}
        with self.db.read() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            try:
                for start in range(0, len(ids), PAGE_IDS):
                    page = ids[start : start + PAGE_IDS]
                    cur.execute(select_sql(dialect, len(page), with_request, columns),
                                (page,) if dialect == "postgresql" else page)
                    # ordered by rollout: grouped in C
                    out.update((rid, list(rows)) for rid, rows in groupby(cur.fetchall(), itemgetter(0)))
            finally:
                cur.close()
        return out
