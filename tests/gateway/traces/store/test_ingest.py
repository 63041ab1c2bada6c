"""The span insert path: a call ingested from its span attributes is stored as the gateway stores it,
batched inserts (SQLite multi-row INSERT, PostgreSQL COPY with its duplicate fallback) count exactly,
storage settings of the spans table."""

from __future__ import annotations

import orjson
import pytest

from tests.gateway.helpers import make_record, span_row
from tracegym.gateway.traces.call_spans import call_record_store_row, insert_call_records
from tracegym.gateway.traces.codec import decode, encode_floats, encode_ints
from tracegym.gateway.traces.reads import list_call_records
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.db import SQLITE_PAGE_SIZE
from tracegym.gateway.traces.store.span_rows import COLUMNS, JSON_COLUMNS, SpanBatch, encode_row


def _records():
    recs = [
        make_record(0),
        make_record(1, n=3),
        make_record(2, status="error", error="client disconnected", first_token_time_ns=None),
        make_record(3, prompt_ids=None, retokenized=True, weight_version=None, task_id=None, agent_name=None),
        make_record(4, request={"model": "m", "prompt": "hi", "max_completion_tokens": 9, "seed": 3,
                                "temperature": None, 1: "non-str key"}),
    ]
    recs[3].choices[0].output_ids = None
    recs[3].choices[0].output_logprobs = None
    return recs


def test_a_call_ingested_from_its_span_attributes_is_stored_as_the_gateway_stores_it():
    """The gateway encodes a call's row straight from its record; a span dict of the same call (OTLP
    ingest: the span attributes split into columns) must give the same stored values."""
    resource = {"service.name": "tracegym-gateway"}
    for rec in _records():
        direct = call_record_store_row(rec, trace_id="a" * 32, span_id="b" * 16,
                                       resource_json=orjson.dumps(resource).decode(),
                                       start_time_ns=rec.start_time_ns, end_time_ns=rec.end_time_ns)
        via_dict = encode_row(span_row(rec, trace_id="a" * 32, span_id="b" * 16, resource=resource))
        assert len(direct) == len(COLUMNS)
        for col, d, v in zip(COLUMNS, direct, via_dict, strict=True):
            if col in JSON_COLUMNS:
                assert orjson.loads(d) == orjson.loads(v), col
            else:
                assert d == v, col
    assert via_dict[COLUMNS.index("attributes")].startswith("{")
    assert orjson.loads(direct[COLUMNS.index("attributes")])["gen_ai.request.max_tokens"] == 9


def test_codec_edge_cases():
    assert encode_floats([1e300])[:1] == b"d" and decode(encode_floats([1e300])) == [1e300]  # > float32
    assert encode_floats([-0.0])[:1] == b"f" and str(decode(encode_floats([-0.0]))[0]) == "-0.0"
    assert decode(encode_ints([True, 2])) == [1, 2]
    blob = encode_ints(list(range(300)))
    assert len(blob) == 1 + 4 * 300 and blob[1:5] == (0).to_bytes(4, "little")
    for bad in ([1.5], ["7"], [2**70]):
        with pytest.raises(ValueError, match="integers"):
            encode_ints(bad)
    with pytest.raises(ValueError, match="numbers"):
        encode_floats(["x"])


def _batch(recs, prefix: str) -> SpanBatch:
    return SpanBatch.from_dicts(
        span_row(r, trace_id=f"{prefix}{i:031x}", span_id=f"{i:016x}") for i, r in enumerate(recs)
    )


def test_batches_insert_once_and_count_exactly(store: Store):
    recs = [make_record(i, rollout_id=f"ro-b{i % 3}", weight_version=f"v{i}") for i in range(50)]
    first = _batch(recs[:30], "a")
    assert len(first) == 30 and store.insert_spans(first) == 30
    # re-sent rows mixed with new ones (and a duplicate inside the batch): only the new ones count
    again = _batch(recs, "a")
    again.rows.append(again.rows[-1])
    assert store.insert_spans(again) == 20
    assert store.insert_spans(again) == 0
    assert store.insert_spans(SpanBatch()) == 0
    stored = {c.call_id for ro in ("ro-b0", "ro-b1", "ro-b2") for c in list_call_records(store, ro)}
    assert stored == {r.call_id for r in recs}
    assert list_call_records(store, "ro-b1")[0].to_dict() == recs[1].to_dict()
    # the rollout follows the weight version of its latest span, also across batches
    assert store.get_rollout("ro-b2")["weight_version"] == "v47"
    later = make_record(99, rollout_id="ro-b2", weight_version="v99")
    assert store.insert_spans([span_row(later, trace_id="c" * 32, span_id="d" * 16)]) == 1
    assert store.get_rollout("ro-b2")["weight_version"] == "v99"
    with pytest.raises(ValueError, match="lacks"):
        SpanBatch.from_dicts([{"trace_id": "x"}])


def test_spans_table_storage_settings(store: Store):
    with store.db.engine.connect() as conn:
        if store.dialect == "sqlite":
            assert conn.exec_driver_sql("PRAGMA page_size").scalar() == SQLITE_PAGE_SIZE
        else:
            opts = conn.exec_driver_sql("SELECT reloptions FROM pg_class WHERE relname = 'spans'").scalar()
            assert "toast_tuple_target=8160" in opts
            long_chat = {"model": "m", "messages": [{"role": "user", "content": "count sheep " * 300}]}
            insert_call_records(store, [make_record(0, rollout_id="ro-toast", request=long_chat)])
            compressed = conn.exec_driver_sql(
                "SELECT pg_column_size(attributes) < octet_length(attributes::text) FROM spans").scalar()
            # a ~4 KB row stays inline, uncompressed (PostgreSQL's default compresses beyond 2 KB)
            assert compressed is False


def test_rows_postgresql_would_refuse_are_refused_alike(store: Store):
    """One value PostgreSQL refuses (too long for its VARCHAR, a NUL, beyond BIGINT) fails the insert of the
    whole batch there, while SQLite stores it: ``SpanBatch.add`` refuses it on both, before any write."""
    from tracegym.gateway.traces.store.schema import ID_MAX_LENGTH, check_id_length

    good = span_row(make_record(0, rollout_id="ro-len"), trace_id="a" * 32, span_id="b" * 16)
    assert len(SpanBatch.from_dicts([good | {"rollout_id": "r" * ID_MAX_LENGTH}])) == 1
    bad_rows = [
        ({"rollout_id": "r" * (ID_MAX_LENGTH + 1)}, "rollout_id is 201 characters"),
        ({"call_id": "c" * 201}, "call_id"),
        ({"name": "n" * 501}, "name"),
        ({"span_id": "b" * 17}, "span_id"),
        ({"name": "a\x00b"}, "NUL"),
        ({"status_message": "x\x00"}, "NUL"),
        ({"call_id": 7}, "must be a string"),
        ({"source": None}, "must not be null"),
        ({"end_time_ns": 2**64 - 1}, "int64"),
        ({"attributes": good["attributes"] | {"tracegym.task_id": "t" * 201}}, "task_id"),
        ({"attributes": good["attributes"] | {"tracegym.weight_version": "v" * 201}}, "weight_version"),
    ]
    for change, message in bad_rows:
        with pytest.raises(ValueError, match=message):
            SpanBatch.from_dicts([good, good | change])
    batch = SpanBatch()
    with pytest.raises(ValueError):
        batch.add(encode_row(good | {"rollout_id": "r" * 201}), None, None)
    assert len(batch) == 0 and not batch.tasks  # nothing half-added
    assert store.insert_spans([good]) == 1 and store.get_rollout("ro-len")["status"] == "adhoc"
    check_id_length("X-Rollout-Id", "r" * 200)
    with pytest.raises(ValueError, match="X-Rollout-Id"):
        check_id_length("X-Rollout-Id", "r" * 201)
    # records go through the same checks (those of the columns a call row takes from its record)
    for bad, message in (({"call_id": "c" * 201}, "call_id"), ({"rollout_id": "r" * 201}, "rollout_id"),
                         ({"task_id": "t" * 201}, "task_id"), ({"status": "error", "error": "x\x00"}, "NUL")):
        with pytest.raises(ValueError, match=message):
            insert_call_records(store, [make_record(1, rollout_id="ro-len2"), make_record(2, **bad)])
    assert store.get_rollout("ro-len2") is None  # nothing of a refused batch was written


def test_store_writes_refuse_overlong_ids(store: Store):
    long = "x" * 201
    for write in (
        lambda: store.add_event(long, kind="event", idempotency_key="k"),
        lambda: store.add_event("ro", kind="event", idempotency_key=long),
        lambda: store.add_event("ro", kind="event", idempotency_key="k", name=long),
        lambda: store.complete(long),
        lambda: store.complete("ro", worker_id=long),
        lambda: store.claim(long),
        lambda: store.enqueue_tasks([{"task_id": long, "input": 1}]),
        lambda: store.enqueue_tasks([{"input": 1, "split": "s" * 101}]),
        lambda: store.ensure_rollout("ro", task_id=long),
        lambda: store.add_weight_version(long),
        lambda: store.add_metrics(long, 1, {}),
    ):
        with pytest.raises(ValueError, match=r"(201|101) characters"):
            write()
    assert store.list_rollouts()[0] == []
