"""The tracing exporter's encode/write pipeline: the encoded call row is exactly what the straightforward
encoding gives (same bytes, same JSON text), orjson's fast path serializes like its option path, call span
ids are valid, and a write thread that is behind merges the waiting batches into one transaction (flush
markers and shutdown still in order)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.call_spans import CALL_ID, CHOICES, ROLLOUT_ID, call_record_store_row
from tracegym.gateway.traces.codec import encode_floats, encode_ints
from tracegym.gateway.traces.reads import list_call_records, list_spans
from tracegym.gateway.traces.recorder import SpanMetrics, StoreSpanExporter, StoreSpanProcessor, TraceRecorder
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.keys import RANDOM_BITS
from tracegym.gateway.traces.store.span_rows import COLUMNS, SpanBatch, json_text
from tracegym.types import CallRecord

_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _reference_row(rec: CallRecord, trace_id: str, span_id: str, resource_json: str, start: int,
                   end: int) -> tuple:
    """The encoding as first written (loops, one orjson mode): what the optimized one must reproduce."""
    ids: list = []
    lps: list = []
    id_lens, lp_lens = [], []
    for c in rec.choices:
        id_lens.append(None if c.output_ids is None else len(c.output_ids))
        lp_lens.append(None if c.output_logprobs is None else len(c.output_logprobs))
        ids.extend(c.output_ids or [])
        lps.extend(c.output_logprobs or [])
    req = rec.request
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": rec.operation, "gen_ai.system": rec.upstream_kind,
        "gen_ai.request.model": rec.model, "gen_ai.response.model": rec.model,
        "gen_ai.response.id": rec.call_id,
        "gen_ai.response.finish_reasons": tuple(c.finish_reason or "" for c in rec.choices),
        "gen_ai.usage.input_tokens": rec.input_tokens, "gen_ai.usage.output_tokens": rec.output_tokens,
        CALL_ID: rec.call_id, ROLLOUT_ID: rec.rollout_id, "tracegym.upstream_kind": rec.upstream_kind,
        "tracegym.drift": rec.drift, "tracegym.prefix_len": rec.prefix_len,
        "tracegym.retokenized": rec.retokenized,
        CHOICES: [{"index": c.index, "finish_reason": c.finish_reason, "message": c.message,
                   "weight_versions": [[w.version, w.start, w.end] for w in c.weight_versions],
                   "n_output_ids": id_lens[i], "n_output_logprobs": lp_lens[i]}
                  for i, c in enumerate(rec.choices)],
    }
    for key, attr in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                      ("seed", "gen_ai.request.seed")):
        if isinstance(req.get(key), int | float):
            attrs[attr] = req[key]
    max_tokens = req.get("max_tokens") if req.get("max_tokens") is not None else req.get("max_completion_tokens")
    if isinstance(max_tokens, int):
        attrs["gen_ai.request.max_tokens"] = max_tokens
    for name in ("task_id", "agent_name", "weight_version", "first_token_time_ns", "error"):
        if getattr(rec, name) is not None:
            attrs[f"tracegym.{name}"] = getattr(rec, name)
    if rec.first_token_time_ns is not None and rec.start_time_ns:
        attrs["tracegym.time_to_first_token_s"] = (rec.first_token_time_ns - rec.start_time_ns) / 1e9
    error = rec.status == "error"
    return (trace_id, span_id, None, rec.rollout_id, rec.call_id, "gateway", f"{rec.operation} {rec.model}",
            "client", start, end, "error" if error else "ok", rec.error if error else None,
            orjson.dumps(attrs, option=_OPTS).decode(), resource_json, "null",
            None if rec.prompt_ids is None else encode_ints(rec.prompt_ids), encode_ints(ids), encode_floats(lps),
            orjson.dumps(req, option=_OPTS).decode())  # the request body: a column of its own (migration 0003)


def _records() -> list[CallRecord]:
    recs = [
        make_record(0),
        make_record(1, n=3),
        make_record(2, n=2, status="error", error="client disconnected", first_token_time_ns=None),
        make_record(3, prompt_ids=None, retokenized=True, weight_version=None, task_id=None, agent_name=None),
        make_record(4, request={"model": "m", "prompt": "hi", "max_completion_tokens": 9, "seed": 3,
                                "temperature": None, "top_p": True, 1: "non-str key"}),
        make_record(5, request={"model": "m", "messages": [], "max_tokens": 2.5, "temperature": np.float32(0.5)}),
        make_record(6, start_time_ns=0, upstream_kind="litellm", drift="forked", prompt_ids=[2**40, 7]),
        make_record(7, n=0),
    ]
    recs[3].choices[0].output_ids = None
    recs[3].choices[0].output_logprobs = None
    recs[1].choices[1].output_logprobs = None
    recs[1].choices[2].weight_versions = []
    return recs


def test_encoded_call_rows_are_exactly_the_reference_encoding():
    for rec in _records():
        got = call_record_store_row(rec, trace_id="a" * 32, span_id="b" * 16, resource_json='{"r":1}',
                                    start_time_ns=5, end_time_ns=9)
        want = _reference_row(rec, "a" * 32, "b" * 16, '{"r":1}', 5, 9)
        assert len(got) == len(COLUMNS)
        for col, g, w in zip(COLUMNS, got, want, strict=True):
            assert type(g) is type(w) and g == w, (rec.call_id, col)


def test_json_text_fast_path_matches_the_option_path():
    values = [
        {"a": 1, "b": [1.5, None, "x\u2713"], "c": {"d": True}},
        {"model": "m", 1: "int key", None: "none key"},
        {"v": np.float32(0.25), "arr": np.arange(3)},
        [1, {"k": (1, 2)}],
        None,
        "plain",
    ]
    for v in values:
        assert json_text(v) == orjson.dumps(v, option=_OPTS).decode()
    with pytest.raises(TypeError):
        json_text({"x": object()})


def test_call_spans_get_valid_distinct_ids(store: Store):
    rec = TraceRecorder(store, registry=CollectorRegistry(), schedule_delay_s=0.01)
    before_ms = time.time_ns() // 1_000_000
    for i in range(200):
        rec.record(make_record(i, rollout_id="ro-ids"))
    rec.shutdown()
    after_ms = time.time_ns() // 1_000_000
    spans = list_spans(store, "ro-ids")
    assert len(spans) == 200
    assert all(len(s["trace_id"]) == 32 and len(s["span_id"]) == 16 for s in spans)
    assert all(int(s["trace_id"], 16) and int(s["span_id"], 16) for s in spans)
    assert len({s["trace_id"] for s in spans}) == len({s["span_id"] for s in spans}) == 200
    # trace ids begin with the milliseconds they were made in (store.keys: new keys go to the indexes' ends)
    assert all(before_ms <= int(s["trace_id"], 16) >> RANDOM_BITS <= after_ms for s in spans)


class _SlowStore:
    """Delegates to a store; the first insert waits until released (the write thread falls behind)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.entered = threading.Event()
        self.release = threading.Event()
        self.sizes: list[int] = []

    def insert_spans(self, batch: SpanBatch) -> int:
        if not self.sizes:
            self.entered.set()
            self.release.wait(10)
        self.sizes.append(len(batch))
        return self.store.insert_spans(batch)


def _wait_for(condition, timeout: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_a_write_thread_behind_merges_waiting_batches(store: Store):
    slow = _SlowStore(store)
    registry = CollectorRegistry()
    metrics = SpanMetrics(registry)
    proc = StoreSpanProcessor(StoreSpanExporter(slow, metrics), metrics, max_batch_size=10,
                              schedule_delay_s=0.01, pipeline_depth=3)
    calls = [make_record(i, rollout_id="ro-merge", weight_version=f"v{i}") for i in range(45)]
    try:
        for c in calls[:10]:
            proc.enqueue_call(c, c.start_time_ns, c.end_time_ns)
        assert slow.entered.wait(10)  # the first batch waits in the store ...
        for c in calls[10:40]:
            proc.enqueue_call(c, c.start_time_ns, c.end_time_ns)
        _wait_for(lambda: proc._batches.qsize() == 3)  # ... while three more queue up behind it
        flushed: list[bool] = []
        flusher = threading.Thread(target=lambda: flushed.append(proc.force_flush(10_000)))
        flusher.start()
        _wait_for(lambda: not proc._queue)  # the flush marker went to the build thread
        for c in calls[40:]:  # queued after the marker
            proc.enqueue_call(c, c.start_time_ns, c.end_time_ns)
        slow.release.set()
        flusher.join(10)
        assert flushed == [True]
        assert sum(slow.sizes) >= 40 and slow.sizes[:2] == [10, 30]  # the three waiting batches went in together
    finally:
        proc.shutdown()
    assert sum(slow.sizes) == 45
    assert [c.to_dict() for c in list_call_records(store, "ro-merge")] == [c.to_dict() for c in calls]
    assert store.get_rollout("ro-merge")["weight_version"] == "v44"
    assert registry.get_sample_value("tracegym_spans_exported_total") == 45
