"""``GET /api/inspect/system``: the queue (tasks and rollouts by status, lease holders, failed rollouts
with their tracebacks), the recorder's span counters, and the upstream (each engine of a fleet) with its weight version."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry

from tracegym.gateway.proxy.upstream.fleet import UpstreamFleet
from tracegym.gateway.traces.store import ui_reads
from tracegym.gateway.traces.store.db import iso

log = logging.getLogger("tracegym.gateway")

SPAN_COUNTERS = ("tracegym_spans_recorded", "tracegym_spans_exported", "tracegym_spans_dropped",
                 "tracegym_span_queue_size")
UPSTREAM_TIMEOUT_S = 2.0
"""The system page waits at most this long for the upstream's health and weight version."""


def span_counters(registry: CollectorRegistry | None) -> dict[str, Any]:
    """``{"recorded", "exported", "queue_size", "dropped": {reason: n}}`` from the app's Prometheus
    registry (the values ``GET /metrics`` shows); zeros for counters the recorder has not created."""
    out: dict[str, Any] = {"recorded": 0.0, "exported": 0.0, "queue_size": 0.0, "dropped": {}}
    if registry is None:
        return out
    for family in registry.collect():
        if family.name not in SPAN_COUNTERS:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if family.name == "tracegym_spans_dropped":
                reason = sample.labels.get("reason", "")
                out["dropped"][reason] = out["dropped"].get(reason, 0.0) + sample.value
            else:
                key = family.name.removeprefix("tracegym_spans_").removeprefix("tracegym_span_")
                out[key] = sample.value
    return out


def queue_report(store: Any) -> dict[str, Any]:
    """The store's half of the page (run in a worker thread)."""
    failed = ui_reads.failed_rollouts(store.db)
    for r in failed:
        r["finished_at"] = iso(r["finished_at"])
    leases = ui_reads.lease_holders(store.db)
    for w in leases:
        w["lease_expires_min"], w["lease_expires_max"] = iso(w["lease_expires_min"]), iso(w["lease_expires_max"])
    return {"queue": ui_reads.queue_counts(store.db), "leases": leases, "failed": failed,
            "store": {"dialect": store.dialect}}


async def upstream_report(services: Any, swap: Any) -> dict[str, Any]:
    """The upstream's kind, URL, model, health and current weight version (``error`` says why a part is
    missing: an unreachable upstream must not fail the page), and each engine of a fleet as its health
    checks last saw it (``GET /api/upstreams`` asks them live)."""
    settings = services.settings
    engines = services.upstream.engines if isinstance(services.upstream, UpstreamFleet) else []
    out: dict[str, Any] = {"kind": services.upstream.kind, "url": settings.upstream_url,
                           "model": services.served_model, "weight_version": None, "swapping": None,
                           "last_swap": None, "health": None, "error": None,
                           "engines": [e.report() for e in engines]}
    try:
        out["health"] = await asyncio.wait_for(services.upstream.health(), UPSTREAM_TIMEOUT_S)
        if swap is not None:
            status = await asyncio.wait_for(swap.status(), UPSTREAM_TIMEOUT_S)
            out.update({k: status.get(k) for k in ("weight_version", "swapping", "last_swap")})
    except Exception as e:  # reported on the page, and logged: the rest of the page still answers
        log.warning("system page: the upstream did not answer: %r", e)
        out["error"] = f"{type(e).__name__}: {e}"
    return out
