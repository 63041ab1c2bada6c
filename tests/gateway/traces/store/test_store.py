"""The trace store against SQLite and a real PostgreSQL: migrations, span round trips, rollout queries,
idempotent events, weight versions and metrics."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tests.gateway.helpers import make_record, span_row
from tracegym.gateway.traces.call_spans import REQUEST, insert_call_records
from tracegym.gateway.traces.codec import decode, decode_array, encode_floats, encode_ints
from tracegym.gateway.traces.reads import list_call_records, list_call_records_many, list_spans
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.migrate import alembic_config, head_revision
from tracegym.gateway.traces.store.migrate import main as db_main
from tracegym.gateway.traces.store.schema import metadata


def test_codec_is_bit_exact():
    ids = [0, 1, 49151, 2**31 - 1]
    assert decode(encode_ints(ids)) == ids
    big = [2**40, -3]
    assert decode(encode_ints(big)) == big and encode_ints(big)[:1] == b"q"
    f32 = [-0.5, -1.25, float("-inf")]
    assert encode_floats(f32)[:1] == b"f" and decode(encode_floats(f32)) == f32
    f64 = [-0.1234567891234, -1e-300]
    blob = encode_floats(f64)
    assert blob[:1] == b"d" and len(blob) == 1 + 8 * len(f64)
    assert [x.hex() for x in decode(blob)] == [x.hex() for x in f64]
    assert decode(None) is None and decode(encode_ints([])) == []
    with pytest.raises(ValueError, match="tag"):
        decode(b"z\x00")


def test_decode_array_takes_any_bytes_like_and_rejects_misaligned_blobs():
    blob = encode_ints([7, 2**31 - 1, 0])
    for form in (blob, bytearray(blob), memoryview(blob)):  # memoryview: psycopg's bytea may come as one
        arr = decode_array(form)
        assert arr.typecode == "i" and arr.tolist() == [7, 2**31 - 1, 0]
    assert decode_array(encode_floats([-0.5])).typecode == "f"
    with pytest.raises(ValueError, match="multiple of item size"):
        decode_array(blob[:-1])
    with pytest.raises(ValueError, match="missing type tag"):
        decode_array(b"")


def test_migrations_match_schema_and_cli(store_url: str, capsys):
    assert db_main(argparse.Namespace(action="upgrade", store=store_url)) == 0
    assert capsys.readouterr().out.strip() == head_revision()
    assert db_main(argparse.Namespace(action="current", store=store_url)) == 0
    assert capsys.readouterr().out.strip() == head_revision()
    s = Store.open(store_url)  # upgrading an up-to-date store is a no-op
    try:
        with s.db.engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diffs == [], diffs
        if s.dialect == "sqlite":
            with s.db.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        s.close()


def _migrate(store: Store, action: str, revision: str) -> None:
    cfg = alembic_config()
    with store.db.write() as conn:
        cfg.attributes["connection"] = conn
        getattr(command, action)(cfg, revision)


def test_request_column_migration_keeps_the_bodies_both_ways(store: Store):
    """0003 moved call request bodies out of ``attributes``: its downgrade puts them back (nothing lost),
    and rows as the downgrade leaves them read the same once upgraded again."""
    recs = [make_record(0), make_record(1, n=2), make_record(2, rollout_id="ro-2")]
    insert_call_records(store, recs)
    ids = ["ro-1", "ro-2"]
    before = {k: [c.to_dict() for c in v] for k, v in list_call_records_many(store, ids).items()}
    fast = list_call_records_many(store, ids, with_request=False)
    _migrate(store, "downgrade", "0002_spans_inline_rows")
    with store.db.read() as conn:
        assert "request" not in {c["name"] for c in sa.inspect(conn).get_columns("spans")}
        bodies = [a[REQUEST] for a in conn.execute(sa.select(sa.column("attributes", sa.JSON))
                                                   .select_from(sa.table("spans"))).scalars()]
    def canon(bodies: list) -> list[str]:
        return sorted(json.dumps(b, sort_keys=True) for b in bodies)

    assert canon(bodies) == canon([r.request for r in recs])
    _migrate(store, "upgrade", "head")
    assert {k: [c.to_dict() for c in v] for k, v in list_call_records_many(store, ids).items()} == before
    assert list_call_records_many(store, ids, with_request=False) == fast


def test_call_records_round_trip_exactly(store: Store):
    recs = [
        make_record(0),
        make_record(1, n=3, upstream="http://127.0.0.1:30001"),  # n > 1; served by one engine of a fleet
        make_record(2, status="error", error="client disconnected", first_token_time_ns=None),
        make_record(3, prompt_ids=None, retokenized=True, upstream_kind="litellm", weight_version=None,
                    task_id=None, agent_name=None, drift="none", prefix_len=0),
    ]
    recs[3].choices[0].output_ids = None
    recs[3].choices[0].output_logprobs = None
    recs[3].choices[0].weight_versions = []
    assert insert_call_records(store, list(reversed(recs))) == 4
    got = list_call_records(store, "ro-1")
    assert [g.to_dict() for g in got] == [r.to_dict() for r in recs]
    lp = [x.hex() for c in got[1].choices for x in c.output_logprobs]
    assert lp == [x.hex() for c in recs[1].choices for x in c.output_logprobs]


def test_spans_listing_and_adhoc_rollout(store: Store):
    rec = make_record(0, rollout_id="adhoc-x")
    row = span_row(rec, trace_id="a" * 32, span_id="b" * 16)
    assert store.insert_spans([row]) == 1
    assert store.insert_spans([row]) == 0  # a re-sent span is stored once
    spans = list_spans(store, "adhoc-x")
    assert len(spans) == 1
    s = spans[0]
    assert s["name"] == "chat tiny-random" and s["status"] == "ok" and s["source"] == "gateway"
    assert s["prompt_ids"] == rec.prompt_ids
    assert s["choices"][0]["output_ids"] == rec.choices[0].output_ids
    assert s["attributes"]["tracegym.request"]["messages"][0]["content"] == "q0 ✓"  # structured JSON
    assert s["attributes"]["gen_ai.usage.input_tokens"] == 20
    ro = store.get_rollout("adhoc-x")
    assert ro["status"] == "adhoc" and ro["task_id"] == "task-1" and ro["weight_version"] == "v2"
    assert list_spans(store, "nope") == [] and store.get_rollout("nope") is None
    with pytest.raises(ValueError, match="lacks"):
        store.insert_spans([{"trace_id": "a" * 32}])


def test_list_rollouts_filters_and_pagination(store: Store):
    out = store.enqueue_tasks([{"task_id": f"t{i}", "input": i} for i in range(5)], group_size=3)
    assert len(out) == 5 and all(len(o["rollout_ids"]) == 3 for o in out)
    seen, cursor = [], None
    while True:
        page, cursor = store.list_rollouts(limit=4, cursor=cursor)
        seen += page
        if cursor is None:
            break
    assert len(seen) == 15 and len({r["rollout_id"] for r in seen}) == 15
    created = [r["created_at"] for r in seen]
    assert created == sorted(created, reverse=True)
    grp = store.list_rollouts(group_id=out[2]["group_id"])[0]
    assert {r["rollout_id"] for r in grp} == set(out[2]["rollout_ids"])
    assert all(r["input"] == 2 and r["task_id"] == "t2" for r in grp)
    assert len(store.list_rollouts(task_id="t4")[0]) == 3
    assert len(store.list_rollouts(status="queued", limit=100)[0]) == 15
    assert store.list_rollouts(status="running")[0] == []
    assert store.list_rollouts(since="2999-01-01T00:00:00Z")[0] == []
    assert len(store.list_rollouts(until="2999-01-01T00:00:00Z", limit=100)[0]) == 15
    for bad in ({"status": "bogus"}, {"cursor": "!!"}, {"since": "yesterday"}, {"limit": 0}):
        with pytest.raises(ValueError):
            store.list_rollouts(**bad)


_T = 1_700_000_000.5  # 2023-11-14T22:13:20.5Z
_INPUTS = [{"q": "2+3", "n": [1, 2.5]}, 7, 1.5, "text", None, [1, "a"], {"x": None}]


def _queued(i: int, value: object) -> dict:
    return {"rollout_id": f"ro-{i}", "task_id": f"t{i}", "group_id": "g", "status": "queued", "attempt": 1,
            "max_attempts": 3, "input": value, "reward": None, "worker_id": None, "lease_expires_at": None,
            "weight_version": None, "error": None, "created_at": f"2023-11-14T22:13:{20 + i}.500000+00:00",
            "started_at": None, "finished_at": None}


_DONE = {"rollout_id": "ro-done", "task_id": None, "group_id": None, "status": "completed", "attempt": 2,
         "max_attempts": 3, "input": None, "reward": 0.5, "worker_id": "w1",
         "lease_expires_at": "2023-11-14T22:15:00.500000+00:00", "weight_version": "v7",
         "error": "lease expired", "created_at": "2023-11-14T22:13:10.500000+00:00",
         "started_at": "2023-11-14T22:13:15.500000+00:00", "finished_at": "2023-11-14T22:13:19.500000+00:00"}


def test_rollout_reads_give_the_rollout_json(store: Store):
    """Every rollout read (one, many, a filtered page) gives the Rollout JSON of docs/api.md, every kind of
    task input included (objects, numbers, strings, JSON null, lists); rows written here with SQLAlchemy."""
    from tracegym.gateway.traces.store.schema import rollouts as R

    with store.db.write() as conn:
        conn.execute(sa.insert(R), [
            {"rollout_id": f"ro-{i}", "task_id": f"t{i}", "group_id": "g", "status": "queued", "attempt": 1,
             "max_attempts": 3, "input": v, "reward_final": False, "created_at": _T + i}
            for i, v in enumerate(_INPUTS)])
        conn.execute(sa.insert(R), [{
            "rollout_id": "ro-done", "task_id": None, "group_id": None, "status": "completed", "attempt": 2,
            "max_attempts": 3, "input": None, "reward": 0.5, "reward_final": True, "worker_id": "w1",
            "lease_seconds": 30.0, "lease_expires_at": _T + 100, "weight_version": "v7",
            "error": "lease expired", "traceback": "Traceback ...", "created_at": _T - 10,
            "started_at": _T - 5, "finished_at": _T - 1}])
    want = {r["rollout_id"]: r for r in [*(_queued(i, v) for i, v in enumerate(_INPUTS)), _DONE]}
    newest_first = [f"ro-{i}" for i in reversed(range(len(_INPUTS)))] + ["ro-done"]
    assert store.list_rollouts(limit=100) == ([want[r] for r in newest_first], None)
    page, cursor = store.list_rollouts(limit=3)
    assert page == [want[r] for r in newest_first[:3]] and cursor is not None
    assert store.list_rollouts(limit=100, cursor=cursor)[0] == [want[r] for r in newest_first[3:]]
    assert store.list_rollouts(status="completed")[0] == [want["ro-done"]]
    assert store.list_rollouts(group_id="g", task_id="t3")[0] == [want["ro-3"]]
    assert store.get_rollouts([*reversed(newest_first), "ghost", "ro-0"]) == want
    assert store.get_rollout("ro-done") == want["ro-done"] and store.get_rollout("ro-1") == want["ro-1"]
    assert store.get_rollout("ghost") is None
    # the queue's updates return their rows through RETURNING: the same JSON as a read of the row
    [claimed] = store.claim("w2", limit=1, lease_seconds=30)
    assert claimed["rollout_id"] == "ro-0" and claimed == store.get_rollout("ro-0")


def test_events_are_idempotent_and_set_reward(store: Store):
    e1, dup = store.add_event("r-new", kind="reward", value=0.5, idempotency_key="k1")
    assert not dup and store.get_rollout("r-new")["status"] == "adhoc"
    assert store.add_event("r-new", kind="reward", value=0.5, idempotency_key="k1") == (e1, True)
    store.add_event("r-new", kind="reward", value=0.25, name="format", idempotency_key="k2", call_index=0)
    store.add_event("r-new", kind="event", name="tool", value={"ok": True}, attributes={"a": 1},
                    idempotency_key="k3")
    assert store.get_rollout("r-new")["reward"] == 0.5  # named rewards do not set the rollout's reward
    store.add_event("r-new", kind="reward", value=0.75, idempotency_key="k4")
    assert store.get_rollout("r-new")["reward"] == 0.75  # the last unnamed reward
    rewards = store.list_events("r-new", "reward")
    assert [(r["value"], r["name"]) for r in rewards] == [(0.5, None), (0.25, "format"), (0.75, None)]
    assert store.list_events("r-new", "event")[0]["value"] == {"ok": True}
    assert len(store.list_events("r-new")) == 4
    store.complete("r-new", reward=1.0)
    store.add_event("r-new", kind="reward", value=0.1, idempotency_key="k5")
    assert store.get_rollout("r-new")["reward"] == 1.0  # complete's reward wins
    for bad in ({"kind": "bogus", "value": 1}, {"kind": "reward", "value": "x"},
                {"kind": "reward", "value": math.nan}):
        with pytest.raises(ValueError):
            store.add_event("r-new", idempotency_key="kx", **bad)


def test_weight_versions_and_metrics(store: Store):
    store.add_weight_version("v0")
    wv = store.add_weight_version("v1", path="/ckpt/1", step=1, swap_seconds=0.5)
    assert wv["version"] == "v1" and wv["path"] == "/ckpt/1"
    store.add_weight_version("v1", swap_seconds=0.7)  # upsert keeps the known fields
    versions = store.list_weight_versions()
    assert [v["version"] for v in versions] == ["v0", "v1"]
    assert versions[1]["step"] == 1 and versions[1]["swap_seconds"] == 0.7
    store.add_metrics("run-a", 2, {"loss": 0.5})
    store.add_metrics("run-a", 1, {"loss": 0.9, "reward/mean": 0.1})
    store.add_metrics("run-a", 2, {"loss": 0.4})  # re-post of a step replaces it
    store.add_metrics("run-b", 1, {"loss": 1.0})
    ms = store.list_metrics("run-a")
    assert [(m["step"], m["metrics"]["loss"]) for m in ms] == [(1, 0.9), (2, 0.4)]
    with pytest.raises(ValueError):
        store.add_metrics("run-a", "x", {})  # type: ignore[arg-type]


def test_bad_store_urls():
    with pytest.raises(ValueError, match="file database"):
        Store.open("sqlite://")
    with pytest.raises((ValueError, sa.exc.ArgumentError, sa.exc.NoSuchModuleError)):
        Store.open("mysql://x/y")


def test_get_rollouts_reads_many_in_pages(store: Store):
    from tracegym.gateway.traces.store.db import PAGE_IDS

    groups = store.enqueue_tasks([{"input": i} for i in range(3)], group_size=PAGE_IDS // 2)
    rids = [rid for g in groups for rid in g["rollout_ids"]]
    assert len(rids) > PAGE_IDS
    got = store.get_rollouts([*rids, "ghost", rids[0]])
    assert set(got) == set(rids) and all(got[r]["rollout_id"] == r for r in rids)
    assert [got[r]["input"] for r in rids] == [i for i, g in enumerate(groups) for _ in g["rollout_ids"]]
    assert store.get_rollouts([]) == {}


def test_times_are_epoch_seconds_iso_or_datetimes():
    from datetime import UTC, datetime

    from tracegym.gateway.traces.store.db import to_epoch

    assert to_epoch("1700000000") == to_epoch(" 1700000000.5 ") - 0.5 == 1_700_000_000
    assert to_epoch("2023-11-14T22:13:20Z") == to_epoch("2023-11-14T22:13:20") == 1_700_000_000
    assert to_epoch(datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)) == 1_700_000_000
    assert to_epoch("20240101") == 20_240_101  # a number is always epoch seconds
    assert to_epoch(None) is None and to_epoch(5) == 5
    for bad in ("yesterday", "nan", "inf", ""):
        with pytest.raises(ValueError, match="bad time"):
            to_epoch(bad)
