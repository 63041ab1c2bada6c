"""What a request handler may use, built once by the app's lifespan (no globals), and the FastAPI
``Annotated`` dependency aliases that hand it out."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tracegym.gateway.proxy.upstream.base import Upstream
from tracegym.gateway.settings import GatewaySettings
from tracegym.gateway.traces.store.repo import Store
from tracegym.types import CallRecord

if TYPE_CHECKING:
    from tracegym.gateway.proxy.prefix_lookup import PrefixLookup
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache
    from tracegym.gateway.proxy.prompt.templating import ChatTokenizer


class Recorder(Protocol):
    """What the routes need from ``traces.recorder.TraceRecorder``: non-blocking ``record``;
    ``record_durably``, whose future (of the running loop) becomes True once the span is committed (False:
    lost); flushing ``shutdown``."""

    def record(self, rec: CallRecord) -> None: ...

    def record_durably(self, rec: CallRecord) -> asyncio.Future[bool]: ...

    def shutdown(self) -> None: ...


class GatewayMetrics:
    """Prometheus collectors on the app's own registry (``app.state.metrics_registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "tracegym_gateway_requests", "HTTP requests by route and status", ["route", "method", "status"],
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "tracegym_gateway_upstream_latency_seconds", "Upstream call latency (whole call, or until the "
            "stream ends)", ["kind", "operation", "stream"], registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.gc_frozen = Gauge(
            "tracegym_gateway_gc_frozen_objects", "Objects moved out of the garbage collector's generations at "
            "startup (GatewaySettings.freeze_gc)", registry=registry,
        )
        self.gc_frozen.set_function(gc.get_freeze_count)
        self._request_children: dict[tuple[str, str, int], Any] = {}
        self._latency_children: dict[tuple[str, str, str], Any] = {}
        self.upstream_errors = Counter(
            "tracegym_gateway_upstream_errors", "Upstream calls that failed, by HTTP status answered",
            ["kind", "status"], registry=registry,
        )
        self.prefix_lookups = Counter(
            "tracegym_gateway_prefix_lookups", "Store lookups of prefix parents on a prefix-cache miss "
            "(proxy/prefix_lookup.py), by outcome: found, none, timeout, error, busy", ["result"], registry=registry,
        )
        self.prefix_lookup_latency = Histogram(
            "tracegym_gateway_prefix_lookup_seconds", "Store lookups of prefix parents: read and re-plan",
            registry=registry, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )

    def count_request(self, route: str, method: str, status: int) -> None:
        """``requests.labels(...).inc()`` with the labelled child cached (labels() takes a lock)."""
        key = (route, method, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, method, str(status))
        child.inc()

    def count_prefix_lookup(self, result: str, seconds: float) -> None:
        self.prefix_lookups.labels(result).inc()
        if result in ("found", "none"):
            self.prefix_lookup_latency.observe(seconds)

    def observe_upstream(self, kind: str, operation: str, stream: bool, seconds: float) -> None:
        """``upstream_latency.labels(...).observe(seconds)`` with the labelled child cached."""
        key = (kind, operation, "true" if stream else "false")
        child = self._latency_children.get(key)
        if child is None:
            child = self._latency_children[key] = self.upstream_latency.labels(*key)
        child.observe(seconds)


@dataclass(slots=True)
class Services:
    settings: GatewaySettings
    upstream: Upstream
    served_model: str
    tokenizer: ChatTokenizer | None
    prefix: PrefixCache | None
    recorder: Recorder | None
    metrics: GatewayMetrics
    created: int = 0
    """Unix time the app started (``/v1/models`` ``created``)."""
    store: Store | None = None
    """The trace store (None when recording is off): where stored Responses are looked up
    (``GET /v1/responses/{id}``, ``previous_response_id``)."""
    prefix_lookup: PrefixLookup | None = None
    """Prefix parents read from the store on a prefix-cache miss (None: no store, or the lookup is off)."""


# ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a thread pool (a thread hop per
# request on the hot path).
async def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_store(request: Request) -> Store:
    """The app's trace store (the store routers are mounted only on a gateway that has one)."""
    return request.app.state.store


def get_recorder(request: Request) -> Recorder | None:
    return getattr(request.app.state, "recorder", None)


def get_body_limit(request: Request) -> int:
    """The most bytes a request body (inflated, for OTLP) may have (``GatewaySettings.max_body_bytes``)."""
    return request.app.state.max_body_bytes


StoreDep = Annotated[Store, Depends(get_store)]
BodyLimitDep = Annotated[int, Depends(get_body_limit)]
RecorderDep = Annotated["Recorder | None", Depends(get_recorder)]
