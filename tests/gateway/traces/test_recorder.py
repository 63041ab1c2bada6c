"""TraceRecorder: CallRecord -> OpenTelemetry span -> exporter -> store, exactly; bounded queue with counted
drops; flush on shutdown."""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.reads import list_call_records, list_spans
from tracegym.gateway.traces.recorder import TraceRecorder
from tracegym.gateway.traces.store import Store


def _metric(registry: CollectorRegistry, line_start: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_recorded_calls_reach_the_store_exactly(store: Store):
    registry = CollectorRegistry()
    rec = TraceRecorder(store, registry=registry, schedule_delay_s=0.05)
    calls = [make_record(i, rollout_id="ro-t", n=1 + i % 3) for i in range(30)]
    calls.append(make_record(30, rollout_id="ro-t", status="error", error="upstream reset"))
    for c in calls:
        rec.record(c)
    rec.shutdown()
    got = list_call_records(store, "ro-t")
    assert [g.to_dict() for g in got] == [c.to_dict() for c in calls]
    spans = list_spans(store, "ro-t")
    s0, last = spans[0], spans[-1]
    assert s0["name"] == "chat tiny-random" and s0["kind"] == "client" and s0["status"] == "ok"
    a = s0["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny-random"
    assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.max_tokens"] == 16
    assert a["gen_ai.response.id"] == calls[0].call_id and a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.output_tokens"] == 7 and a["tracegym.drift"] == "clean"
    assert a["tracegym.time_to_first_token_s"] == pytest.approx(1e-4)
    assert s0["start_time_ns"] == calls[0].start_time_ns and s0["end_time_ns"] == calls[0].end_time_ns
    assert s0["resource"]["service.name"] == "tracegym-gateway"
    assert last["status"] == "error" and last["status_message"] == "upstream reset"
    assert _metric(registry, "tracegym_spans_exported_total") == 31
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="queue_full"}') == 0


def test_force_flush_writes_what_was_queued(store: Store):
    rec = TraceRecorder(store, schedule_delay_s=60)  # the worker would wait a minute
    rec.record(make_record(0, rollout_id="ro-f"))
    assert rec.force_flush()
    assert len(list_call_records(store, "ro-f")) == 1
    rec.shutdown()
    rec.shutdown()  # idempotent


class GatedStore:
    """The real store behind a gate, to hold the export thread while the queue fills."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gate = threading.Event()

    def insert_spans(self, rows: list[dict]) -> int:
        self.gate.wait(30)
        return self.store.insert_spans(rows)


def test_full_queue_drops_are_counted_and_logged(store: Store, caplog):
    registry = CollectorRegistry()
    gated = GatedStore(store)
    rec = TraceRecorder(gated, registry=registry, max_queue_size=10, max_batch_size=5, schedule_delay_s=0.01)
    with caplog.at_level(logging.WARNING, logger="tracegym.gateway.traces.recorder"):
        for i in range(60):
            rec.record(make_record(i, rollout_id="ro-d"))
    gated.gate.set()
    rec.shutdown()
    stored = len(list_call_records(store, "ro-d"))
    dropped = _metric(registry, 'tracegym_spans_dropped_total{reason="queue_full"}')
    assert dropped > 0 and stored + dropped == 60
    assert _metric(registry, "tracegym_spans_exported_total") == stored
    assert any("dropped" in r.message for r in caplog.records)


class FailingStore:
    def insert_spans(self, rows: list[dict]) -> int:
        raise RuntimeError("database is gone")


def test_store_failures_are_counted_not_silent(caplog):
    registry = CollectorRegistry()
    rec = TraceRecorder(FailingStore(), registry=registry)
    rec.exporter.retries = 1
    for i in range(3):
        rec.record(make_record(i))
    with caplog.at_level(logging.ERROR, logger="tracegym.gateway.traces.recorder"):
        rec.shutdown()
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="export_error"}') == 3
    assert any("dropping 3 spans" in r.message for r in caplog.records)
    rec.record(make_record(9))  # after shutdown: counted too
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="shutdown"}') == 1


def test_extra_processors_see_genai_spans_and_the_store_gets_the_same_calls(store: Store):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracegym.gateway.traces.codec import decode

    memory = InMemorySpanExporter()
    rec = TraceRecorder(store, schedule_delay_s=0.05)
    rec.add_span_processor(SimpleSpanProcessor(memory))
    calls = [make_record(i, rollout_id="ro-x", n=1 + i % 2) for i in range(5)]
    for c in calls:
        rec.record(c)
    with rec.tracer.start_as_current_span("tool search") as span:  # a span of the app's own tracer
        span.set_attribute("tracegym.rollout_id", "ro-x")
    rec.shutdown()
    seen = sorted(memory.get_finished_spans(), key=lambda s: s.start_time)
    assert [s.name for s in seen] == ["chat tiny-random"] * 5 + ["tool search"]
    s0 = seen[0]
    assert s0.kind.name == "CLIENT" and s0.status.status_code.name == "OK"
    assert s0.start_time == calls[0].start_time_ns and s0.end_time == calls[0].end_time_ns
    assert s0.resource.attributes["service.name"] == "tracegym-gateway"
    a = s0.attributes
    assert a["gen_ai.response.id"] == calls[0].call_id and a["gen_ai.request.temperature"] == 0.7
    assert decode(a["tracegym.prompt_token_ids"]) == calls[0].prompt_ids
    assert decode(a["tracegym.output_token_ids"]) == calls[0].choices[0].output_ids
    assert s0.dropped_attributes == 0 and len(s0.attributes) > 20
    otlp = encode_spans(seen[:1]).resource_spans[0].scope_spans[0]  # what an OTLP exporter would send
    assert otlp.scope.name == "tracegym.gateway"
    sent = {kv.key: kv.value for kv in otlp.spans[0].attributes}
    assert sent["gen_ai.operation.name"].string_value == "chat"
    assert decode(sent["tracegym.output_logprobs"].bytes_value) == calls[0].choices[0].output_logprobs
    stored = list_spans(store, "ro-x")
    assert [s["name"] for s in stored] == [s.name for s in seen]
    assert [s["span_id"] for s in stored[:5]] == [format(s.context.span_id, "016x") for s in seen[:5]]
    assert [c.to_dict() for c in list_call_records(store, "ro-x")] == [c.to_dict() for c in calls]


def test_unencodable_records_are_counted_not_silent(store: Store, caplog):
    registry = CollectorRegistry()
    rec = TraceRecorder(store, registry=registry)
    bad = make_record(1, rollout_id="ro-e", request={"model": "m", "messages": object()})
    with caplog.at_level(logging.ERROR, logger="tracegym.gateway.traces.recorder"):
        for c in (make_record(0, rollout_id="ro-e"), bad, make_record(2, rollout_id="ro-e")):
            rec.record(c)  # never raises on the request path
        rec.shutdown()
    assert [c.call_id for c in list_call_records(store, "ro-e")] == ["chatcmpl-0-0", "chatcmpl-0-2"]
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="encode_error"}') == 1
    assert _metric(registry, "tracegym_spans_exported_total") == 2
    assert any("chatcmpl-0-1" in r.getMessage() for r in caplog.records)


def test_calls_without_times_get_the_recording_time(store: Store):
    rec = TraceRecorder(store)
    rec.record(make_record(0, rollout_id="ro-now", start_time_ns=0, end_time_ns=0, first_token_time_ns=None))
    rec.shutdown()
    (span,) = list_spans(store, "ro-now")
    assert span["start_time_ns"] > 1_700_000_000 * 10**9 and span["end_time_ns"] >= span["start_time_ns"]


def test_an_overlong_id_drops_only_its_own_span(store: Store):
    """PostgreSQL refuses an id longer than its VARCHAR(200) column, and with it the whole transaction: the
    recorder checks lengths while encoding, so only the bad span is lost (counted), not its batch."""
    registry = CollectorRegistry()
    rec = TraceRecorder(store, registry=registry, schedule_delay_s=60)
    calls = [make_record(i, rollout_id="ro-ok") for i in range(4)]
    calls.insert(2, make_record(9, rollout_id="r" * 201))
    calls.append(make_record(10, rollout_id="ro-ok2", task_id="t" * 201))
    for c in calls:
        rec.record(c)
    assert rec.force_flush()
    want = [c.call_id for c in calls if c.rollout_id == "ro-ok"]
    assert [c.call_id for c in list_call_records(store, "ro-ok")] == want
    assert store.get_rollout("r" * 201) is None and store.get_rollout("ro-ok2") is None
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="encode_error"}') == 2
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="export_error"}') == 0
    assert _metric(registry, "tracegym_spans_exported_total") == 4
    rec.shutdown()


class RejectingStore:
    """A store refusing every batch the way PostgreSQL refuses bad data."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def insert_spans(self, rows) -> int:
        self.calls += 1
        raise self.error


def test_deterministic_store_rejections_are_not_retried():
    import sqlalchemy.exc as sa_exc

    for error, tries in ((sa_exc.DataError("INSERT", {}, Exception("value too long")), 1),
                         (sa_exc.IntegrityError("INSERT", {}, Exception("null value")), 1),
                         (sa_exc.OperationalError("INSERT", {}, Exception("connection reset")), 2)):
        registry = CollectorRegistry()
        store = RejectingStore(error)
        rec = TraceRecorder(store, registry=registry)
        rec.exporter.retries = 2
        rec.record(make_record(0))
        rec.shutdown()
        assert store.calls == tries, error
        assert _metric(registry, 'tracegym_spans_dropped_total{reason="export_error"}') == 1


def test_force_flush_honours_its_timeout(store: Store):
    """force_flush waits only for what was queued before it, and at most its timeout (it runs on every
    /complete and /fail): a stuck store makes it return False in time, not hang."""
    import time

    gated = GatedStore(store)
    rec = TraceRecorder(gated, schedule_delay_s=60)
    rec.record(make_record(0, rollout_id="ro-slow"))
    t0 = time.monotonic()
    assert rec.force_flush(timeout_s=0.3) is False
    assert time.monotonic() - t0 < 5
    gated.gate.set()
    assert rec.force_flush(timeout_s=30) is True
    assert len(list_call_records(store, "ro-slow")) == 1
    rec.shutdown()
    assert rec.force_flush(timeout_s=1) is True  # after shutdown: everything is written


def test_force_flush_does_not_wait_for_later_traffic(store: Store):
    rec = TraceRecorder(store, schedule_delay_s=60, max_batch_size=50)
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            rec.record(make_record(i, rollout_id="ro-busy"))
            i += 1

    rec.record(make_record(0, rollout_id="ro-mine"))
    t = threading.Thread(target=traffic)
    t.start()
    try:
        assert rec.force_flush(timeout_s=20) is True
        assert len(list_call_records(store, "ro-mine")) == 1
    finally:
        stop.set()
        t.join()
        rec.shutdown()


def test_the_build_thread_survives_unexpected_errors(store: Store, caplog):
    registry = CollectorRegistry()
    rec = TraceRecorder(store, registry=registry, schedule_delay_s=0.01)
    processor = rec.processor
    real = processor._add_call

    def flaky(batch, r, start, end):
        if r.call_id == "chatcmpl-0-1":
            raise RuntimeError("bug")
        return real(batch, r, start, end)

    processor._add_call = flaky
    with caplog.at_level(logging.ERROR, logger="tracegym.gateway.traces.recorder"):
        for i in range(3):
            rec.record(make_record(i, rollout_id="ro-bug"))
        assert rec.force_flush()
    assert processor._builder.is_alive()
    rec.record(make_record(3, rollout_id="ro-bug"))  # still working afterwards
    assert rec.force_flush()
    stored = [c.call_id for c in list_call_records(store, "ro-bug")]
    assert stored == ["chatcmpl-0-0", "chatcmpl-0-2", "chatcmpl-0-3"]
    assert _metric(registry, 'tracegym_spans_dropped_total{reason="internal_error"}') == 1
    assert any("unexpected error" in r.getMessage() for r in caplog.records)
    rec.shutdown()
