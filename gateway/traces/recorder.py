"""Recording gateway calls as OpenTelemetry spans and writing them into the trace store.

``TraceRecorder.record(rec)`` only enqueues the record (request path); a build thread encodes store rows
straight from the records (``call_spans.call_record_store_row``) into ``SpanBatch``es and a write thread
inserts them (``Store.insert_spans``) while the next batch is encoded (``StoreSpanProcessor``). Extra span
processors (``add_span_processor``, e.g. OTLP) get each call as a finished ``CallSpan``. Every lost span is
counted in ``tracegym_spans_dropped_total{reason=...}`` and logged; ``force_flush`` and ``shutdown`` wait
for what was queued; ``record_durably`` also returns an ``acks.Ack`` that is settled once the span's
transaction committed (group commit: the calls waiting share one transaction; on SQLite the calls' event
loop commits them itself when nothing else is writing). Unlike
``BatchSpanProcessor``, which drops with only an OpenTelemetry-metrics counter and drops a failed batch
after logging, this retries the store and reports losses in Prometheus.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import random
import threading
import time
from collections.abc import Callable

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from tracegym.gateway.traces.acks import Ack, Built, CommitGroup, settle, settle_now
from tracegym.gateway.traces.call_spans import (
    CALL_ROW_TEXT,
    call_record_store_row,
    json_safe,
)
from tracegym.gateway.traces.exporter import CallSpan, SpanMetrics, StoreSpanExporter
from tracegym.gateway.traces.store.keys import ordered_id
from tracegym.gateway.traces.store.span_rows import SpanBatch, json_text
from tracegym.types import CallRecord

log = logging.getLogger(__name__)

SCOPE = "tracegym.gateway"


class _Flush:
    """A ``force_flush`` marker: it travels the record queue and the batch queue behind everything queued
    before it, and the write thread sets ``done`` when it gets there."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


QueueItem = ReadableSpan | tuple[CallRecord, int, int, Ack | None] | _Flush


class StoreSpanProcessor(SpanProcessor):
    """Bounded queue + a two-stage export pipeline; drops (counted, logged) instead of blocking when full.

    The queue holds finished SDK spans (``on_end``) and ``(CallRecord, start_ns, end_ns)`` tuples
    (``enqueue_call``). The build thread takes up to ``max_batch_size`` of them at a time and encodes their
    store rows into a ``SpanBatch`` (making ``CallSpan``s for the ``extra_processors`` when there are any);
    the write thread inserts the batches. The database work of one batch (mostly outside the GIL: SQLite's
    C code, PostgreSQL's server) thus overlaps the Python encoding of the next; at most ``pipeline_depth``
    encoded batches wait for the writer, which then takes all of them into one transaction (``_write_loop``:
    the per-transaction statements, and their GIL re-acquisitions, are paid once for all). Each time the
    write thread wants the GIL back while the build thread encodes, it waits up to the switch interval
    (``GatewaySettings.switch_interval_s``), hence few statements per transaction (``store.span_insert``).

    Spans that calls wait for (``enqueue_call`` with an ack) are committed by the calls' event loop once its
    turn ran, when the store can write without waiting (SQLite) and both threads are idle (``_commit_here``).
    Else they gather in the build thread's ``CommitGroup`` until it is due (``commit_delay_s``,
    ``in_flight``: see ``acks``); then the build thread commits the group itself when the writer is idle (a
    thread hand-off sooner) or, on PostgreSQL, busy (the two transactions side by side), else queues it for
    the writer.
    """

    def __init__(self, exporter: StoreSpanExporter, metrics: SpanMetrics, *, max_queue_size: int = 50_000,
                 max_batch_size: int = 2_000, schedule_delay_s: float = 0.1, warn_every_s: float = 5.0,
                 resource: Resource | None = None, pipeline_depth: int = 2, commit_delay_s: float = 0.0,
                 in_flight: Callable[[], int] | None = None) -> None:
        self.exporter = exporter
        self.metrics = metrics
        self.max_queue_size = max_queue_size
        self.max_batch_size = max_batch_size
        self.schedule_delay_s = schedule_delay_s
        self.warn_every_s = warn_every_s
        self.extra_processors: list[SpanProcessor] = []
        self.resource = resource if resource is not None else Resource.create({})
        self._resource_json = json_text(json_safe(dict(self.resource.attributes)))
        self._scope = InstrumentationScope(SCOPE)
        self._rng = random.Random()  # ids of call spans (RandomIdGenerator's draws, the trace id time-ordered)
        self.group = CommitGroup(commit_delay_s, in_flight)
        self._queue: collections.deque[QueueItem] = collections.deque()
        self._batches: queue.Queue[Built | _Flush | None] = queue.Queue(maxsize=pipeline_depth)
        self._wake = threading.Event()
        self._kicks: set[asyncio.AbstractEventLoop] = set()  # loops with a wake-up scheduled
        self._build_lock = threading.Lock()
        # One export at a time (the write thread's, or the builder's), but for a commit group written beside
        # the writer's transaction where the store allows (``_commit_group``).
        self._write_lock = threading.Lock()
        self._flushes = 0  # _Flush markers in ``_queue`` (under ``_flush_lock``)
        self._flush_lock = threading.Lock()
        self._shutdown = False
        self._dropped_since_warning = 0
        self._last_warning = 0.0
        metrics.queue_size.set_function(lambda: len(self._queue))
        self._writer = threading.Thread(target=self._write_loop, name="tracegym-span-write", daemon=True)
        self._builder = threading.Thread(target=self._build_loop, name="tracegym-span-build", daemon=True)
        self._writer.start()
        self._builder.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self._enqueue(span)

    def enqueue_call(self, rec: CallRecord, start_ns: int, end_ns: int, ack: Ack | None = None) -> None:
        """Queue a finished call (non-blocking; dropped and counted when the queue is full). ``ack`` (made on
        the calling thread's event loop) is settled once the span is committed or lost; a call with one
        wakes the build thread at once (instead of waiting for a full batch or the schedule delay) unless a
        commit group is open and other calls are still on their way (the group's deadline wakes it)."""
        self._enqueue((rec, start_ns, end_ns, ack), ack)

    def _enqueue(self, item: QueueItem, ack: Ack | None = None) -> None:
        if self._shutdown:
            self._drop("shutdown")
            settle_now(ack, False)
            return
        q = self._queue
        if len(q) >= self.max_queue_size:
            self._drop("queue_full")
            settle_now(ack, False)
            return
        q.append(item)
        if ack is not None:
            self.group.queued += 1
            self._wake_after_this_turn(ack.get_loop())
        elif len(q) >= self.max_batch_size and not self._wake.is_set():
            self._wake.set()

    def _wake_after_this_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the build thread once the event loop has run the callbacks it is running now (called on the
        loop's thread): every call that finishes in this turn of the loop (a burst of upstream replies read
        in one poll) is queued by then and joins one commit, and a call alone waits one turn, microseconds."""
        if loop in self._kicks:
            return
        self._kicks.add(loop)
        try:
            loop.call_soon(self._kick, loop)
        except RuntimeError:  # the loop is closing: wake now
            self._kick(loop)

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._kicks.discard(loop)
        if self._commit_here(loop) and not self._queue:
            return
        if not self._wake.is_set():
            self._wake.set()

    def _commit_here(self, loop: asyncio.AbstractEventLoop) -> bool:
        """On the event ``loop``, once its turn ran: write what is queued in this thread, in one transaction,
        and settle the acks of this loop directly, when the store can write without waiting (SQLite) and neither
        the build thread nor the write thread is busy. The calls' event loop holds the GIL for most of their
        life, so a hand-off to the threads and back costs two thread wake-ups and, for the write thread, a
        wait for the GIL after each statement; here the loop waits only for SQLite's own work. True when it
        took the queue (a batch the store was too busy for goes to the write thread, which waits for it)."""
        if not self.exporter.can_export_now or self._shutdown or self._flushes:
            return False
        if not self._build_lock.acquire(blocking=False):
            return False
        try:
            if self.group.built is not None or not self._batches.empty():
                return False
            if not self._write_lock.acquire(blocking=False):
                return False
            try:
                built = self._build(self._take(self.max_batch_size))
                if not built.batch:
                    return True
                if self.exporter.export_now(built.batch):
                    self.group.add_settled(len(built.acks))
                    settle(built.acks, True, here=loop)
                else:
                    self._batches.put(built)  # the writer takes it once this thread lets go of the write lock
                return True
            finally:
                self._write_lock.release()
        finally:
            self._build_lock.release()

    def _take(self, n: int) -> list[QueueItem]:
        """Up to ``n`` queued items, stopping before a ``force_flush`` marker (left at the queue's head)."""
        q, items = self._queue, []
        while q and len(items) < n:
            item = q.popleft()
            if type(item) is _Flush:
                q.appendleft(item)
                break
            items.append(item)
        return items

    def _drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()
        self._dropped_since_warning += 1
        now = time.monotonic()
        if now - self._last_warning >= self.warn_every_s:
            log.warning("span queue %s: dropped %d spans (queue size %d, limit %d)", reason,
                        self._dropped_since_warning, len(self._queue), self.max_queue_size)
            self._dropped_since_warning = 0
            self._last_warning = now

    def _add_call(self, batch: SpanBatch, rec: CallRecord, start: int, end: int) -> bool:
        rng = self._rng
        span_id = rng.getrandbits(64)
        while not span_id:  # 0 is OpenTelemetry's invalid id
            span_id = rng.getrandbits(64)
        trace_id = ordered_id(rng.getrandbits)  # time-ordered (see store.keys), never 0
        span = None
        try:
            if self.extra_processors:
                span = CallSpan(rec, trace_id=trace_id, span_id=span_id, start_time=start,
                                end_time=end, resource=self.resource, resource_json=self._resource_json,
                                scope=self._scope)
                row = span.store_row
            else:  # nobody else wants the span object: encode the row alone
                ids = f"{trace_id:032x}{span_id:016x}"
                row = call_record_store_row(rec, trace_id=ids[:32], span_id=ids[32:],
                                            resource_json=self._resource_json, start_time_ns=start,
                                            end_time_ns=end)
            # ValueError: e.g. an id too long to store. Only the columns taken from the record are checked:
            # the ids above are 32 and 16 hex digits, the other columns constants (CALL_ROW_TEXT).
            batch.add(row, rec.task_id, rec.weight_version, CALL_ROW_TEXT)
        except (TypeError, ValueError):  # e.g. a request body orjson cannot serialize: count, log, go on
            log.exception("dropping the span of call %r: it cannot be encoded", getattr(rec, "call_id", None))
            self.metrics.dropped.labels("encode_error").inc()
            return False
        if span is not None:
            for p in self.extra_processors:
                try:
                    p.on_end(span)
                except Exception:  # the store has the span; another exporter's failure is its own
                    log.exception("span processor %r failed on a call span", p)
        return True

    def _build(self, items: list[QueueItem]) -> Built:
        built = Built(SpanBatch())
        batch, acks, lost = built.batch, built.acks, []
        add_call, add_span = self._add_call, self.exporter.add_span
        for item in items:
            ack = None
            try:
                if type(item) is tuple:
                    rec, start, end, ack = item
                    if add_call(batch, rec, start, end):
                        if ack is not None:
                            acks.append(ack)
                    elif ack is not None:
                        lost.append(ack)
                else:
                    add_span(batch, item)  # type: ignore[arg-type]
            except Exception:  # a bug, or an extra processor failing: lose this span only, counted
                log.exception("dropping a span: unexpected error while encoding it")
                self.metrics.dropped.labels("internal_error").inc()
                if ack is not None and (not acks or acks[-1] is not ack):
                    lost.append(ack)
        if lost:
            self.group.lost += len(lost)
            settle(lost, False)
        return built

    def _drain(self) -> None:
        """Encode queued spans into batches for the writer: one batch (possibly partial), then more while a
        full batch is queued or a ``force_flush`` marker waits in the queue (everything up to it is sent,
        then the marker itself, behind the last batch). Batches with acks join the open commit group, which
        is committed once due."""
        with self._build_lock:
            q = self._queue
            group = self.group
            first = True
            while q and (first or self._flushes or len(q) >= self.max_batch_size):
                first = False
                items = self._take(self.max_batch_size)
                marker = q.popleft() if q and type(q[0]) is _Flush else None
                if items:
                    built = self._build(items)
                    if built.acks or group.built is not None:
                        group.add(built)
                    else:
                        self._batches.put(built)
                if marker is not None:
                    self._commit_group()  # what came before the marker is written before it
                    with self._flush_lock:
                        self._flushes -= 1
                    self._batches.put(marker)
            if group.built is not None and (self._shutdown or group.due(self.max_batch_size)):
                self._commit_group()

    def _commit_group(self) -> None:
        built = self.group.take()
        if built is None:
            return
        # The writer is idle: write the group here, a thread hand-off sooner (ordering between span batches
        # does not matter; markers still queue behind). The writer is busy and the store commits two
        # transactions side by side (PostgreSQL): write it here too, beside the writer's, instead of after
        # it (a transaction there spends most of its time waiting for the server and its WAL flush).
        if self._batches.empty() and self._write_lock.acquire(blocking=False):
            try:
                self._export(built)
            finally:
                self._write_lock.release()
        elif self.exporter.writes_side_by_side and self._batches.empty():
            self._export(built)
        else:
            self._batches.put(built)

    def _build_loop(self) -> None:
        while not self._shutdown:
            self._wake.wait(self.group.wait_s(self.schedule_delay_s))
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # never let the build thread die: later spans would silently pile up
                log.exception("span build thread: unexpected error (continuing)")

    def _write_loop(self) -> None:
        while True:
            items = [self._batches.get()]
            try:
                if type(items[0]) is Built:
                    # Behind the build thread: the batches already waiting go into the same transaction (one
                    # rollouts statement and one commit for all of them; each statement costs this thread a
                    # GIL re-acquisition, up to the switch interval while the build thread runs). A
                    # marker ends the merge; it is handled after the write, as if it came alone.
                    while type(items[-1]) is Built:
                        try:
                            items.append(self._batches.get_nowait())
                        except queue.Empty:
                            break
                    first, *more = [b for b in items if type(b) is Built]
                    for b in more:
                        first.batch.extend(b.batch)  # type: ignore[union-attr]
                        first.acks += b.acks  # type: ignore[union-attr]
                    with self._write_lock:
                        self._export(first)  # type: ignore[arg-type]
                tail = items[-1]
                if tail is None:
                    return
                if type(tail) is _Flush:
                    tail.done.set()
            except Exception:  # export_batch never raises; keep the writer alive regardless
                log.exception("span write thread: unexpected error (continuing)")
                acks = [a for b in items if type(b) is Built for a in b.acks]  # type: ignore[union-attr]
                self.group.add_settled(len(acks))
                settle(acks, False)
            finally:
                for _ in items:
                    self._batches.task_done()

    def _export(self, built: Built) -> None:
        ok = self.exporter.export_batch(built.batch) is SpanExportResult.SUCCESS
        if built.acks:
            self.group.add_settled(len(built.acks))
            settle(built.acks, ok)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Wait until every span queued before this call is stored (or counted as dropped): True, or False
        when that takes longer than ``timeout_millis``. Spans queued meanwhile are not waited for, so this
        returns promptly under steady traffic."""
        timeout = max(timeout_millis, 0) / 1000
        if self._shutdown:  # shutdown() writes everything and then stops the writer
            self._writer.join(timeout)
            return not self._writer.is_alive()
        marker = _Flush()
        with self._flush_lock:
            self._flushes += 1
        self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout)
    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._wake.set()
        self._builder.join()
        while self._queue:  # everything, partial batches included (and the markers of pending flushes)
            self._drain()
        self._commit_group()
        self._batches.put(None)
        self._writer.join()
        self.exporter.shutdown()


class TraceRecorder:
    """Turns ``CallRecord``s into spans (``record``) and gets them into the store.

    Owned by the app's lifespan: ``TraceRecorder(store, registry=app.state.metrics_registry)``, then
    ``shutdown()`` on exit (flushes). Extra exporters (e.g. OTLP to a collector) can be attached with
    ``add_span_processor``: they receive every call span (from the export thread) and the spans started
    on ``tracer``.
    """

    def __init__(self, store: object, *, registry: CollectorRegistry | None = None,
                 service_name: str = "tracegym-gateway", max_queue_size: int = 50_000,
                 max_batch_size: int = 2_000, schedule_delay_s: float = 0.1, commit_delay_s: float = 0.0,
                 in_flight: Callable[[], int] | None = None) -> None:
        self.metrics = SpanMetrics(registry if registry is not None else CollectorRegistry())
        resource = Resource.create({"service.name": service_name})
        self.exporter = StoreSpanExporter(store, self.metrics)
        self.processor = StoreSpanProcessor(self.exporter, self.metrics, max_queue_size=max_queue_size,
                                            max_batch_size=max_batch_size, schedule_delay_s=schedule_delay_s,
                                            resource=resource, commit_delay_s=commit_delay_s,
                                            in_flight=in_flight)
        self.provider = TracerProvider(
            resource=resource,
            span_limits=SpanLimits(max_span_attributes=256, max_attribute_length=None),
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(SCOPE)

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Also send every span to ``processor`` (flushed and shut down after the store's processor)."""
        self.processor.extra_processors.append(processor)
        self.provider.add_span_processor(processor)

    def record(self, rec: CallRecord) -> None:
        """Record one finished call as a span with the call's own start/end times. Never blocks: the
        record is queued (do not mutate it afterwards) and becomes a span in the export thread."""
        start = rec.start_time_ns or time.time_ns()
        end = rec.end_time_ns or time.time_ns()
        self.processor.enqueue_call(rec, start, end if end > start else start)
        self.metrics.recorded.inc()

    def record_durably(self, rec: CallRecord) -> Ack:
        """``record``, and a future (of the running event loop) that becomes True once the span is committed
        to the store, False if it was lost (counted in ``tracegym_spans_dropped_total``)."""
        ack: Ack = asyncio.get_running_loop().create_future()
        start = rec.start_time_ns or time.time_ns()
        end = rec.end_time_ns or time.time_ns()
        self.processor.enqueue_call(rec, start, end if end > start else start, ack)
        self.metrics.recorded.inc()
        return ack

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Write everything recorded so far: True once it is stored (or counted as dropped), False when that
        takes longer than ``timeout_s`` (later calls are not waited for)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the export thread (idempotent)."""
        self.provider.shutdown()
