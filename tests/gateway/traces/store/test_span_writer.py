"""PostgreSQL's span writers (``Database.span_write``): connections of their own, kept between batches and made
anew after one broke; two batches committing side by side; rollouts looked up through their key even
before the table has statistics; a one-span batch written in one statement."""

from __future__ import annotations

import threading

import psycopg
import pytest

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.call_spans import call_batch
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.rollouts import PG_SPAN_ROLLOUTS
from tracegym.gateway.traces.store.spans import _PG_ONE_SPAN, _write_batch

pytestmark = pytest.mark.pg


@pytest.fixture
def pg_store(pg_url: str):
    store = Store.open(pg_url)
    yield store
    store.close()


def _backend_pid(store: Store) -> int:
    with store.db.span_write() as raw:
        return raw.execute("SELECT pg_backend_pid()").fetchone()[0]


def test_the_writer_connection_is_kept_and_made_anew_after_it_broke(pg_store: Store, pg_url: str) -> None:
    pid = _backend_pid(pg_store)
    assert _backend_pid(pg_store) == pid  # kept between batches, outside the pool
    with pg_store.db.span_write() as raw:
        assert raw.execute("SHOW enable_seqscan").fetchone()[0] == "off"
    with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    batch = call_batch([make_record(0, rollout_id="ro-broken")])
    with pytest.raises(psycopg.OperationalError):  # the exporter's retry gets here next
        pg_store.insert_spans(batch)
    assert pg_store.insert_spans(batch) == 1
    assert _backend_pid(pg_store) != pid
    assert len(list_spans(pg_store, "ro-broken")) == 1


def test_a_failed_batch_leaves_the_connection_usable(pg_store: Store) -> None:
    batch = call_batch([make_record(0, rollout_id="ro-again")])
    pid = _backend_pid(pg_store)
    with pytest.raises(psycopg.errors.DivisionByZero), pg_store.db.span_write() as raw:
        raw.execute("SELECT 1 / 0")
    assert pg_store.insert_spans(batch) == 1
    assert pg_store.insert_spans(batch) == 0  # stored already: the second try skips it
    assert _backend_pid(pg_store) == pid


def test_two_batches_commit_side_by_side(pg_store: Store) -> None:
    # One transaction stays open; another batch commits meanwhile on a second connection instead of
    # waiting for it.
    first = call_batch([make_record(i, rollout_id=f"ro-a{i}") for i in range(3)])
    second = call_batch([make_record(i, rollout_id=f"ro-b{i}") for i in range(3)])
    written, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold_open() -> None:
        try:
            with pg_store.db.span_write() as raw:
                _write_batch("postgresql", raw, first)
                written.set()
                release.wait(10)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=hold_open)
    t.start()
    try:
        assert written.wait(10)
        assert pg_store.insert_spans(second) == 3
        assert len(list_spans(pg_store, "ro-b0")) == 1 and list_spans(pg_store, "ro-a0") == []
    finally:
        release.set()
        t.join(10)
    assert not errors
    assert len(list_spans(pg_store, "ro-a0")) == 1


def test_rollouts_are_found_through_their_key_before_the_table_has_statistics(pg_store: Store) -> None:
    # 2,000 rollouts and no ANALYZE yet: the planner takes the table for a few rows. The span writer's
    # rollouts statement still looks its ids up in the primary key instead of scanning the table.
    for start in range(0, 2000, 500):
        pg_store.insert_spans(call_batch([make_record(i, rollout_id=f"ro-{i:05d}")
                                          for i in range(start, start + 500)]))
    ids = [f"ro-{i:05d}" for i in range(10)]
    row = call_batch([make_record(5000, rollout_id="ro-00001")]).rows[0]
    for k, (sql, params) in enumerate([(PG_SPAN_ROLLOUTS, (ids, [None] * 10, ["v9"] * 10, 1.0)),
                                       (_PG_ONE_SPAN, (ids[:1], [None], ["v9"], 1.0, *row))]):  # one span's
        with pg_store.db.span_write() as raw:
            cur = psycopg.ClientCursor(raw)
            plan = "\n".join(r[0] for r in cur.execute("EXPLAIN " + sql, params))
            # and the plan the writer's prepared statement runs: the generic one (plan_cache_mode), for any values
            head, *rest = sql.split("%s")
            cur.execute(f"PREPARE plan_check_{k} AS " + head + "".join(f"${i}{part}" for i, part in enumerate(rest, 1)))
            generic = "\n".join(r[0] for r in cur.execute(
                f"EXPLAIN EXECUTE plan_check_{k} ({', '.join(['%s'] * len(params))})", params))
        for p in (plan, generic):
            assert "Index Scan using rollouts_pkey on rollouts" in p and "Seq Scan on rollouts" not in p, p


def test_the_writers_prepared_statements_are_planned_once(pg_store: Store) -> None:
    # psycopg prepares the span statements once they ran five times; the server then runs its generic plan
    # (checked above) instead of planning each run for its values
    for i in range(8):
        pg_store.insert_spans(call_batch([make_record(i, rollout_id=f"ro-one-{i}")]))
        pg_store.insert_spans(call_batch([make_record(10 * i + k, rollout_id=f"ro-two-{i}") for k in range(2)]))
    with pg_store.db.span_write() as raw:
        rows = raw.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements").fetchall()
    runs = {statement.split()[0] + (" spans" if "INSERT INTO spans" in statement else ""): (generic, custom)
            for statement, generic, custom in rows if "rollouts" in statement}
    assert set(runs) == {"WITH", "WITH spans"}, rows  # the batches' rollouts statement, the one-span statement
    assert all(generic >= 3 and custom == 0 for generic, custom in runs.values()), runs


def test_a_one_span_batch_writes_its_rollout_in_the_same_statement(pg_store: Store) -> None:
    # the rollouts part and the span's insert in one statement (spans._PG_ONE_SPAN): the rollout is created
    # with the span's task and version, a later span's version updates it, a span sent again is skipped, and
    # the writer connection is kept for the next batch
    first = call_batch([make_record(1, rollout_id="ro-one", task_id="task-1", weight_version="v1")])
    assert pg_store.insert_spans(first) == 1
    pid = _backend_pid(pg_store)
    rollout = pg_store.get_rollout("ro-one")
    assert (rollout["task_id"], rollout["weight_version"], rollout["status"]) == ("task-1", "v1", "adhoc")
    assert pg_store.insert_spans(call_batch([make_record(2, rollout_id="ro-one", weight_version="v2")])) == 1
    assert pg_store.get_rollout("ro-one")["weight_version"] == "v2"
    assert pg_store.insert_spans(first) == 0
    assert _backend_pid(pg_store) == pid
    assert len(list_spans(pg_store, "ro-one")) == 2


def test_a_one_span_batch_of_no_rollout_makes_no_rollout(pg_store: Store) -> None:
    # the one-span statement with empty rollout arrays (an OTLP span of no rollout): the span is stored, no
    # rollout is made, a span sent again is skipped, and a rollout's span after it still gets its rollout
    alone = call_batch([make_record(1, rollout_id=None)])
    assert not alone.tasks
    assert pg_store.insert_spans(alone) == 1
    assert pg_store.insert_spans(alone) == 0
    with pg_store.db.span_write() as raw:
        assert raw.execute("SELECT count(*), count(rollout_id) FROM spans").fetchone() == (1, 0)
        assert raw.execute("SELECT count(*) FROM rollouts").fetchone() == (0,)
    assert pg_store.insert_spans(call_batch([make_record(2, rollout_id="ro-after", weight_version="v3")])) == 1
    assert pg_store.get_rollout("ro-after")["weight_version"] == "v3"
