"""Span rows: batched insert (encoded ``SpanBatch`` -> SQLite multi-row INSERT / PostgreSQL COPY, see
``span_insert``) and decoded reads, CallRecords included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.assembly_calls import TokenCall
from tracegym.gateway.spans import REQUEST, call_record_to_row, decoded_choices
from tracegym.gateway.store.codec import decode
from tracegym.gateway.store.db import Database
from tracegym.gateway.store.rollouts import write_span_rollouts
from tracegym.gateway.store.schema import spans as S
from tracegym.gateway.store.span_insert import insert_postgresql, insert_sqlite
from tracegym.gateway.store.span_reads import TOKEN_COLUMNS, read_call_records, read_call_rows, token_calls
from tracegym.gateway.store.span_rows import COLUMNS, SpanBatch
from tracegym.types import CallRecord

_NOT_IN_SPAN_DICT = frozenset({"prompt_ids", "output_ids", "output_logprobs", "request"})


def _span_dict(m: Any) -> dict[str, Any]:
    d = {c: m[c] for c in COLUMNS if c not in _NOT_IN_SPAN_DICT}
    if m["request"] is not None:  # the call's request body has a column of its own (older rows: in attributes)
        d["attributes"][REQUEST] = orjson.loads(m["request"])
    d["prompt_ids"] = decode(m["prompt_ids"])
    d["choices"] = decoded_choices(m)
    return d


class SpansMixin:
    db: Database

    def insert_spans(self, rows: list[dict] | SpanBatch) -> int:
        """Insert span rows in one transaction: dicts keyed by the ``spans`` table's columns (build them
        with ``tracegym.gateway.spans.call_record_to_row``) or an encoded ``SpanBatch`` (the tracing
        exporter's form). Rollouts named by the rows that do not exist yet are created with status
        ``adhoc``; a rollout's ``weight_version`` follows its latest span. Duplicate (trace_id, span_id)
        pairs are ignored. Returns the number of rows inserted."""
        batch = rows if isinstance(rows, SpanBatch) else SpanBatch.from_dicts(rows)
        if not batch.rows:
            return 0
        # Every statement below is one multi-row statement (one for a whole tracing batch), so the SQLite write
        # thread waits for the GIL a handful of times per batch, not once per row (see span_insert): BEGIN
        # IMMEDIATE, the rollouts upsert, the spans INSERT, COMMIT.
        with self.db.write() as conn:
            write_span_rollouts(self.db, conn, batch.tasks,
                                {rid: wv for rid, (_, wv) in batch.versions.items()})
            raw = conn.connection.dbapi_connection
            if self.db.dialect == "postgresql":
                inserted = insert_postgresql(raw, batch.rows)
            else:
                inserted = insert_sqlite(raw, batch.rows)
        return inserted

    def insert_call_records(self, recs: list[CallRecord]) -> int:
        """``insert_spans`` of the records' rows (new random trace/span ids): for tests and imports."""
        import secrets

        rows = [call_record_to_row(r, trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8))
                for r in recs]
        return self.insert_spans(rows)

    def _span_rows(self, rollout_ids: list[str]) -> list[Any]:
        q = (sa.select(S).where(S.c.rollout_id.in_(rollout_ids))
             .order_by(S.c.rollout_id, S.c.start_time_ns, S.c.id))
        with self.db.read() as conn:
            return [r._mapping for r in conn.execute(q)]

    def list_spans(self, rollout_id: str) -> list[dict]:
        """All spans of a rollout (gateway and OTLP-ingested), ordered by start time, token arrays decoded:
        ``{"trace_id", "span_id", "parent_span_id", "rollout_id", "call_id", "source", "name", "kind",
        "start_time_ns", "end_time_ns", "status", "status_message", "attributes", "resource", "events",
        "prompt_ids", "choices"}``; for LLM spans ``choices`` is ``[{"index", "output_ids",
        "output_logprobs", "finish_reason", "message", "weight_versions"}]``, else None."""
        return [_span_dict(m) for m in self._span_rows([rollout_id])]

    def list_call_records(self, rollout_id: str) -> list[CallRecord]:
        """The rollout's LLM calls as ``CallRecord``s (bit-exact ids and logprobs), in start order."""
        return self.list_call_records_many([rollout_id]).get(rollout_id, [])

    def list_call_records_many(self, rollout_ids: list[str], *,
                               with_request: bool = True) -> dict[str, list[CallRecord]]:
        """``list_call_records`` for several rollouts, one raw query per page of rollouts (rollouts
        without calls are absent). ``with_request=False`` leaves the request body unread
        (``request == {}``), see ``span_reads``."""
        with self.db.read() as conn:
            return read_call_records(conn.connection.dbapi_connection, self.db.dialect, list(rollout_ids),
                                     with_request=with_request)

    def iter_token_calls(self, rollout_ids: list[str]) -> Iterator[tuple[str, list[TokenCall]]]:
        """``(rollout_id, calls)`` for each of ``rollout_ids`` in that order (``[]`` for a rollout without
        calls): the rollout's LLM calls as the assembly reads them (``TokenCall``: token columns as
        stored, no request body, no ``CallRecord``). The rows are read at once, in one transaction, and
        each rollout's calls are built only when it is reached, so a consumer that assembles one rollout at
        a time keeps one rollout's calls alive, not the page's (less for the garbage collector to scan,
        and the blobs are still in cache when they are compared)."""
        with self.db.read() as conn:
            rows = read_call_rows(conn.connection.dbapi_connection, self.db.dialect, list(rollout_ids),
                                  with_request=False, columns=TOKEN_COLUMNS)
        empty: list[tuple] = []
        return ((rid, token_calls(rows.get(rid, empty))) for rid in rollout_ids)
