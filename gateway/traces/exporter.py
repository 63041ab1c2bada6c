"""The span recorder's store side: store rows of spans (``readable_span_to_row``; ``CallSpan``, a call's
span that brings its encoded row), the pipeline's Prometheus counters (``SpanMetrics``) and the exporter
that writes an encoded batch in one transaction, retrying transient failures (``StoreSpanExporter``); the
recorder (``recorder.py``) drives them."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.exc import DataError, IntegrityError

from tracegym.gateway.traces.call_spans import (
    attributes_to_row_fields,
    call_record_attributes,
    call_record_store_row,
    json_safe,
    span_name,
)
from tracegym.gateway.traces.store.span_rows import SpanBatch, encode_row
from tracegym.types import CallRecord

log = logging.getLogger("tracegym.gateway.traces.recorder")

_STATUS = {StatusCode.UNSET: "unset", StatusCode.OK: "ok", StatusCode.ERROR: "error"}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.OK)


def readable_span_to_row(span: ReadableSpan, *, source: str = "gateway") -> dict:
    """A store row from a finished SDK span."""
    ctx = span.context
    parent = span.parent
    events = [
        {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
    ]
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "source": source,
        "name": span.name,
        "kind": span.kind.name.lower(),
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "status": _STATUS[span.status.status_code],
        "status_message": span.status.description,
        "resource": dict(span.resource.attributes),
        "events": json_safe(events) or None,
        **attributes_to_row_fields(dict(span.attributes or {})),
    }


class CallSpan(ReadableSpan):
    """The finished span of one gateway call, built directly from its ``CallRecord``.

    ``store_row`` is its ``spans`` value tuple (encoded once, here); ``attributes`` (the OpenTelemetry
    GenAI attributes of ``call_spans.call_record_attributes``) are computed on first access, so the
    store path never pays for them while other exporters still see proper spans.
    """

    def __init__(self, rec: CallRecord, *, trace_id: int, span_id: int, start_time: int, end_time: int,
                 resource: Resource, resource_json: str, scope: InstrumentationScope) -> None:
        self.record = rec
        self.store_row = call_record_store_row(
            rec, trace_id=f"{trace_id:032x}", span_id=f"{span_id:016x}", resource_json=resource_json,
            start_time_ns=start_time, end_time_ns=end_time,
        )
        super().__init__(
            name=span_name(rec), context=SpanContext(trace_id, span_id, False, _SAMPLED), parent=None,
            resource=resource, attributes=None, kind=SpanKind.CLIENT,
            status=Status(StatusCode.ERROR, rec.error) if rec.status == "error" else _OK,
            start_time=start_time, end_time=end_time, instrumentation_scope=scope,
        )

    @property
    def _attributes(self) -> dict[str, Any]:  # type: ignore[override]
        if self._lazy_attributes is None:
            self._lazy_attributes = call_record_attributes(self.record)
        return self._lazy_attributes

    @_attributes.setter
    def _attributes(self, value: dict[str, Any] | None) -> None:
        self._lazy_attributes = value


class SpanMetrics:
    """Prometheus counters of the span pipeline, registered in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.recorded = Counter("tracegym_spans_recorded", "Spans handed to the recorder", registry=registry)
        self.exported = Counter("tracegym_spans_exported", "Spans written to the store", registry=registry)
        self.dropped = Counter(
            "tracegym_spans_dropped",
            "Spans lost (queue_full, encode_error, export_error, internal_error, shutdown)", ["reason"],
            registry=registry,
        )
        self.queue_size = Gauge("tracegym_span_queue_size", "Spans waiting for export", registry=registry)


class StoreSpanExporter(SpanExporter):
    """Writes span batches into the store (one transaction per batch), retrying transient failures.
    ``CallSpan``s bring their encoded row; any other span is converted from its attributes."""

    def __init__(self, store: object, metrics: SpanMetrics, *, retries: int = 3, source: str = "gateway"):
        self.store = store
        self.metrics = metrics
        self.retries = retries
        self.source = source
        self.can_export_now = getattr(store, "dialect", None) == "sqlite" and hasattr(store, "insert_spans_now")
        """The store can take a batch without waiting (``export_now``): SQLite."""
        self.writes_side_by_side = getattr(store, "dialect", None) == "postgresql"
        """Two span batches can be in their transactions at once, on connections of their own (PostgreSQL;
        SQLite has one writer)."""

    def add_span(self, batch: SpanBatch, span: ReadableSpan) -> None:
        """Append ``span``'s row to ``batch`` (an unstorable span is counted as dropped and logged)."""
        try:
            if isinstance(span, CallSpan):
                batch.add(span.store_row, span.record.task_id, span.record.weight_version)
                return
            row = readable_span_to_row(span, source=self.source)
            attrs = row["attributes"]
            batch.add(encode_row(row), attrs.get("tracegym.task_id"), attrs.get("tracegym.weight_version"))
        except (TypeError, ValueError):  # unstorable attribute values: count, log, go on
            log.exception("dropping span %r: it cannot be encoded for the store", span.name)
            self.metrics.dropped.labels("encode_error").inc()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        batch = SpanBatch()
        for s in spans:
            self.add_span(batch, s)
        return self.export_batch(batch)

    def export_batch(self, batch: SpanBatch) -> SpanExportResult:
        """Insert an encoded batch; after ``retries`` failures count it as dropped (never raises). A
        rejection that would only repeat (bad data, a violated constraint) is not retried."""
        if not batch:
            return SpanExportResult.SUCCESS
        for attempt in range(1, self.retries + 1):
            try:
                self.store.insert_spans(batch)  # type: ignore[attr-defined]
                self.metrics.exported.inc(len(batch))
                return SpanExportResult.SUCCESS
            except Exception as e:  # any store failure: retry, then count the loss loudly
                if attempt == self.retries or isinstance(e, DataError | IntegrityError | ValueError):
                    log.exception("dropping %d spans: the store rejected them %d times", len(batch), attempt)
                    self.metrics.dropped.labels("export_error").inc(len(batch))
                    return SpanExportResult.FAILURE
                time.sleep(0.1 * 2**attempt)
        return SpanExportResult.FAILURE

    def export_now(self, batch: SpanBatch) -> bool:
        """Insert a non-empty ``batch`` at once if the store can without waiting for its write lock (SQLite's
        ``insert_spans_now``, on the caller's thread): True once stored; False when it cannot now (another
        writer holds the lock, no such path, or the write failed), nothing written or counted: the caller
        then hands the batch to ``export_batch``, which waits, retries and counts."""
        if not self.can_export_now:
            return False
        try:
            self.store.insert_spans_now(batch)  # type: ignore[attr-defined]
        except Exception:  # StoreBusy mostly; anything else is export_batch's to retry, log and count
            log.debug("span batch not written at once; handed to the write thread", exc_info=True)
            return False
        self.metrics.exported.inc(len(batch))
        return True

    def shutdown(self) -> None:
        pass
