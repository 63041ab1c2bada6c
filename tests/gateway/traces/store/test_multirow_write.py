"""The span batch write as few multi-row statements: chunking under the bound-parameter limit (padded
partial chunks), exact rowcounts with duplicates within and among chunks, the rollouts upsert / versions
update, the statement count of a tracing batch, and ``SpanBatch.extend`` (the write thread's merge)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.gateway.helpers import make_record, span_row
from tracegym.gateway.traces.call_spans import call_record_store_row
from tracegym.gateway.traces.reads import list_call_records
from tracegym.gateway.traces.store import Store, rollouts, span_insert
from tracegym.gateway.traces.store.span_insert import rows_per_statement, statement_sizes, values_sql
from tracegym.gateway.traces.store.span_rows import COLUMNS, SpanBatch

T0 = 1_700_000_001_000_000_000
"""A time after every span start of ``make_record``: explicit end times are ``T0 + offset``."""


def _row(i: int, *, rollout_id: str = "ro-m", prefix: str = "a", end: int | None = None,
         weight_version: str | None = "v1", task_id: str | None = "task-1") -> dict:
    kw = {} if end is None else {"end_time_ns": T0 + end}
    rec = make_record(i, rollout_id=rollout_id, weight_version=weight_version, task_id=task_id, **kw)
    return span_row(rec, trace_id=f"{prefix}{i:031x}", span_id=f"{i:016x}")


def _count(store: Store, table: str = "spans") -> int:
    with store.db.engine.connect() as conn:
        return conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one()


@pytest.fixture
def traced_sqlite(sqlite_url: str) -> Iterator[tuple[Store, list[str]]]:
    """A SQLite store whose connections allow only 100 bound parameters per statement (5 span rows, 11
    rollouts) and log every statement they run."""
    store = Store.open(sqlite_url)
    statements: list[str] = []

    @sa.event.listens_for(store.db.engine, "connect")
    def _small(dbapi_conn, _record) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 100)
        dbapi_conn.set_trace_callback(lambda sql: statements.append(sql[:60]))

    store.db.engine.dispose()  # the pooled connection predates the listener
    yield store, statements
    store.close()


def test_statement_sizes_cover_the_rows_with_few_statement_texts():
    assert list(statement_sizes(0, 5)) == []
    assert list(statement_sizes(3, 5)) == [(0, 3, 4)]
    assert list(statement_sizes(5, 5)) == [(0, 5, 5)]
    assert list(statement_sizes(23, 5)) == [(0, 5, 5), (5, 10, 5), (10, 15, 5), (15, 20, 5), (20, 23, 4)]
    assert list(statement_sizes(1, 2000)) == [(0, 1, 1)]
    assert list(statement_sizes(2000, 2000)) == [(0, 2000, 2000)]
    assert list(statement_sizes(4100, 2000))[-1] == (4000, 4100, 128)
    sizes = {size for n in range(1, 5000) for *_, size in statement_sizes(n, 2000)}
    assert sizes == {2000} | {1 << k for k in range(11)}  # 12 statement texts for any batch size
    assert values_sql("INSERT INTO t VALUES ", "", 2, 3) == "INSERT INTO t VALUES (?, ?), (?, ?), (?, ?)"
    assert values_sql("X ", " Y", 1, 2, "%s") == "X (%s), (%s) Y"


def test_rows_per_statement_follows_the_parameter_limit(store: Store):
    with store.db.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        if store.dialect == "sqlite":
            limit = raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
            assert rows_per_statement(raw, "sqlite", len(COLUMNS)) == min(2000, limit // len(COLUMNS))
            old = raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # an old build's limit
            try:
                assert rows_per_statement(raw, "sqlite", len(COLUMNS)) == 999 // len(COLUMNS)
                assert rows_per_statement(raw, "sqlite", 9, cap=50) == 50
                assert rows_per_statement(raw, "sqlite", 1000) == 1  # never less than one row
            finally:
                raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, old)
        else:
            assert rows_per_statement(raw, "postgresql", len(COLUMNS)) == 2000
            assert rows_per_statement(raw, "postgresql", 100, cap=10_000) == 655


def test_batches_span_several_statements_and_count_exactly(traced_sqlite):
    store, statements = traced_sqlite
    assert store.insert_spans([_row(i) for i in range(7)]) == 7
    # 23 rows in 5 statements of 5, 5, 5, 5 and 3 (padded to 4) rows: rows 0-6 are stored already, row 8
    # and row 19 come twice in their statement, row 7 again in a later one
    order = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11, 7, 12, 13, 14, 15, 16, 17, 18, 19, 19]
    rows = [_row(i) for i in order]
    statements.clear()
    assert store.insert_spans(rows) == 13  # rows 7..19, once each
    span_inserts = [s for s in statements if s.startswith("INSERT INTO spans")]
    assert len(span_inserts) == 5
    assert _count(store) == 20
    assert {c.call_id for c in list_call_records(store, "ro-m")} == {f"chatcmpl-0-{i}" for i in range(20)}
    assert store.insert_spans(rows) == 0  # all stored: nothing counts
    assert store.insert_spans([_row(i) for i in range(18, 22)]) == 2
    assert _count(store) == 22


def test_a_tracing_batch_is_one_statement_of_each_kind(sqlite_url: str):
    store = Store.open(sqlite_url)
    statements: list[str] = []
    with store.db.engine.connect() as conn:
        conn.connection.dbapi_connection.set_trace_callback(lambda sql: statements.append(sql[:40]))
    try:
        batch = SpanBatch()
        for i in range(2000):
            rec = make_record(i, rollout_id=f"ro-{i % 200}", weight_version=f"v{i}")
            batch.add(call_record_store_row(rec, trace_id=f"{i:032x}", span_id=f"{i:016x}",
                                            resource_json="{}", start_time_ns=rec.start_time_ns,
                                            end_time_ns=rec.end_time_ns),
                      rec.task_id, rec.weight_version)
        assert store.insert_spans(batch) == 2000
        kinds = [s.split(" (")[0].split(" VALUES")[0] for s in statements if not s.startswith("PRAGMA")]
        assert kinds == ["BEGIN IMMEDIATE", "INSERT INTO rollouts", "INSERT INTO spans", "COMMIT"]
        assert store.get_rollout("ro-7")["weight_version"] == "v1807"
    finally:
        store.close()


def test_rollouts_are_created_once_and_follow_the_latest_span(store: Store, monkeypatch):
    # two rollouts per statement: the 5 rollouts of a batch need several statements on both backends
    small = lambda raw, dialect, ncols, cap=2000: 2  # noqa: E731
    monkeypatch.setattr(rollouts, "rows_per_statement", small)
    store.ensure_rollout("ro-q0", task_id="queued-task", status="queued")
    rows = [_row(0, rollout_id=f"ro-q{k}", prefix=f"{k}", end=1_000 + k, weight_version=f"w{k}",
                 task_id=f"t{k}") for k in range(5)]
    # within the batch ro-q1's latest span (by end time) is w1-late, added before an older w1-early one
    rows.append(_row(1, rollout_id="ro-q1", prefix="1", end=5_000, weight_version="w1-late"))
    rows.append(_row(2, rollout_id="ro-q1", prefix="1", end=4_000, weight_version="w1-early"))
    rows.append(_row(3, rollout_id="ro-q2", prefix="2", end=9_000, weight_version=None))
    assert store.insert_spans(rows) == 8
    got = store.get_rollouts([f"ro-q{k}" for k in range(5)])
    assert {rid: r["weight_version"] for rid, r in got.items()} == {
        "ro-q0": "w0", "ro-q1": "w1-late", "ro-q2": "w2", "ro-q3": "w3", "ro-q4": "w4"}
    # an existing rollout keeps its status and task; new ones are adhoc with the task of their first span
    assert (got["ro-q0"]["status"], got["ro-q0"]["task_id"]) == ("queued", "queued-task")
    assert all((got[f"ro-q{k}"]["status"], got[f"ro-q{k}"]["task_id"]) == ("adhoc", f"t{k}")
               for k in range(1, 5))
    assert got["ro-q3"]["created_at"] is not None and got["ro-q3"]["attempt"] == 1
    # a later batch sets the version of its latest span, also when that span ended earlier (the batch is
    # later), and a batch without a version for a rollout leaves it
    assert store.insert_spans([_row(7, rollout_id="ro-q3", prefix="7", end=10, weight_version="w3-next"),
                               _row(8, rollout_id="ro-q4", prefix="8", weight_version=None)]) == 2
    got = store.get_rollouts(["ro-q3", "ro-q4"])
    assert (got["ro-q3"]["weight_version"], got["ro-q4"]["weight_version"]) == ("w3-next", "w4")
    assert _count(store, "rollouts") == 5


def test_ensure_rollouts_in_chunks_keeps_its_behaviour(store: Store, monkeypatch):
    monkeypatch.setattr(rollouts, "rows_per_statement", lambda raw, dialect, ncols, cap=2000: 3)
    store.ensure_rollout("ro-e1", task_id="old")
    with store.db.write() as conn:
        rollouts.ensure_rollouts(store.db, conn, [(f"ro-e{k}", f"t{k}") for k in range(8)], status="queued")
        rollouts.update_weight_versions(store.db, conn, {f"ro-e{k}": f"v{k}" for k in range(1, 8)})
        rollouts.update_weight_versions(store.db, conn, {})
    got = store.get_rollouts([f"ro-e{k}" for k in range(8)])
    assert got["ro-e1"]["task_id"] == "old" and got["ro-e1"]["status"] == "adhoc"
    assert all(got[f"ro-e{k}"]["status"] == "queued" and got[f"ro-e{k}"]["task_id"] == f"t{k}"
               for k in range(2, 8))
    assert [got[f"ro-e{k}"]["weight_version"] for k in range(8)] == [None] + [f"v{k}" for k in range(1, 8)]
    with pytest.raises(ValueError, match="unknown rollout status"), store.db.write() as conn:
        rollouts.ensure_rollouts(store.db, conn, [("ro-x", None)], status="nope")


def test_span_batch_extend_is_inserting_one_batch_after_the_other(store: Store):
    a = SpanBatch.from_dicts([_row(0, rollout_id="ro-x", end=900, weight_version="va"),
                              _row(1, rollout_id="ro-y", task_id=None)])
    b = SpanBatch.from_dicts([_row(2, rollout_id="ro-x", end=100, weight_version="vb", task_id="other"),
                              _row(3, rollout_id="ro-y", task_id="late"), _row(4, rollout_id="ro-z")])
    a.extend(b)
    assert len(a) == 5 and len(b) == 3
    assert a.tasks == {"ro-x": "task-1", "ro-y": None, "ro-z": "task-1"}  # as the first insert creates them
    assert a.versions["ro-x"][1] == "vb"  # the later batch wins, as a later insert does
    assert store.insert_spans(a) == 5
    assert store.get_rollout("ro-x")["weight_version"] == "vb"
    assert store.get_rollout("ro-y")["task_id"] is None


@pytest.mark.pg
def test_postgresql_copy_path_is_unchanged_by_chunking(pg_url: str, monkeypatch):
    """The span rows of PostgreSQL still go by COPY (one statement whatever the batch size), duplicates
    through the staging table; the rollouts statements take the multi-row path."""
    store = Store.open(pg_url)
    try:
        monkeypatch.setattr(span_insert, "rows_per_statement",
                            lambda *a, **k: pytest.fail("no chunking on COPY"))
        assert store.insert_spans([_row(i) for i in range(30)]) == 30
        assert store.insert_spans([_row(i) for i in range(25, 40)]) == 10
        assert _count(store) == 40 and store.get_rollout("ro-m")["weight_version"] == "v1"
    finally:
        store.close()


def test_spans_fill_the_task_of_a_rollout_created_before_its_first_call(store: Store):
    # a reward (or event) before any call creates the rollout with no task; its spans name the task
    store.ensure_rollout("ro-early")
    store.ensure_rollout("ro-known", task_id="kept")
    assert store.insert_spans([_row(0, rollout_id="ro-early", prefix="e", task_id="t-early", weight_version=None),
                               _row(1, rollout_id="ro-known", prefix="k", task_id="other")]) == 2
    got = store.get_rollouts(["ro-early", "ro-known"])
    assert (got["ro-early"]["task_id"], got["ro-early"]["weight_version"]) == ("t-early", None)
    assert (got["ro-known"]["task_id"], got["ro-known"]["weight_version"]) == ("kept", "v1")
