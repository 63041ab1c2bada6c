"""Prefix parents from the store (``proxy/prefix_lookup.py``): a miss finds the call another gateway recorded; a
store that fails, is slow or is swamped leaves the plan from memory and never fails the call."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.gateway.proxy.prompt.test_prefix_reuse import END, Rollout, user
from tracegym.gateway.deps import GatewayMetrics
from tracegym.gateway.proxy import prefix_lookup as prefix_lookup_module
from tracegym.gateway.proxy.prefix_lookup import PrefixLookup
from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.store import Store


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


class FailingStore:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.release = threading.Event()

    def recent_call_rows(self, rollout_id: str, columns: tuple[str, ...], limit: int) -> list[tuple]:
        if self.delay_s:
            self.release.wait(self.delay_s)
            return []
        raise RuntimeError("connection refused")


def _count(metrics: GatewayMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("tracegym_gateway_prefix_lookups_total", {"result": result}) or 0.0


def _two_turns(tok: ChatTokenizer) -> tuple[Rollout, list[dict]]:
    """A rollout whose first call one gateway served (non-canonical ids), and the messages of its next."""
    first = Rollout(PrefixCache(tok))
    out = [i for ch in "Hello there" for i in tok.encode(ch)] + tok.encode(END)
    _, (reply,) = first.call({"messages": [user("hi")]}, out)
    return first, [user("hi"), reply, user("more")]


def test_a_miss_reads_the_parent_another_gateway_stored(tok, store: Store) -> None:
    first, msgs = _two_turns(tok)
    insert_call_records(store, first.records)
    expected = first.cache.plan_request("r1", {"messages": msgs})
    metrics = GatewayMetrics(CollectorRegistry())
    parents = PrefixLookup(store, metrics, timeout_s=5.0, limit=32)
    cache = PrefixCache(tok)
    plan = cache.plan_request("r1", {"messages": msgs})
    assert plan.lookup and plan.prompt_ids != expected.prompt_ids
    try:
        plan = asyncio.run(parents.replan(cache, "r1", plan))
    finally:
        parents.close()
    assert (plan.prompt_ids, plan.drift, plan.parent_call_id) == (
        expected.prompt_ids, expected.drift, first.records[0].call_id)
    assert _count(metrics, "found") == 1 and not plan.lookup
    hist = "tracegym_gateway_prefix_lookup_seconds_count"
    assert metrics.registry.get_sample_value(hist) == 1


def test_a_failing_or_slow_store_leaves_the_plan_from_memory(tok) -> None:
    _, msgs = _two_turns(tok)
    metrics = GatewayMetrics(CollectorRegistry())
    cache = PrefixCache(tok)

    async def replan(store: object, timeout_s: float) -> tuple[object, object, float]:
        parents = PrefixLookup(store, metrics, timeout_s=timeout_s, limit=32)  # type: ignore[arg-type]
        plan = cache.plan_request("r1", {"messages": msgs})
        t = time.perf_counter()
        try:
            return plan, await parents.replan(cache, "r1", plan), time.perf_counter() - t
        finally:
            parents.close()

    plan, got, _ = asyncio.run(replan(FailingStore(), 5.0))
    assert got is plan and plan.drift == "none" and plan.prompt_ids == tok.apply(msgs) and not plan.lookup
    assert _count(metrics, "error") == 1
    slow = FailingStore(delay_s=10.0)
    plan, got, waited = asyncio.run(replan(slow, 0.05))
    slow.release.set()
    assert got is plan and plan.drift == "none" and waited < 1.0
    assert _count(metrics, "timeout") == 1
    # not looked up as absent: a failed lookup is tried again by the next miss
    assert cache.plan_request("r1", {"messages": msgs}).lookup


def test_a_swamped_store_is_not_queued_behind(tok, monkeypatch: pytest.MonkeyPatch) -> None:
    _, msgs = _two_turns(tok)
    metrics = GatewayMetrics(CollectorRegistry())
    cache = PrefixCache(tok)
    monkeypatch.setattr(prefix_lookup_module, "MAX_WAITING", 2)
    slow = FailingStore(delay_s=10.0)

    async def many() -> list[object]:
        parents = PrefixLookup(slow, metrics, timeout_s=0.2, limit=32)  # type: ignore[arg-type]
        try:
            plans = [cache.plan_request(f"r{i}", {"messages": msgs}) for i in range(4)]
            return await asyncio.gather(*(parents.replan(cache, f"r{i}", p) for i, p in enumerate(plans)))
        finally:
            slow.release.set()
            parents.close()

    asyncio.run(many())
    assert (_count(metrics, "busy"), _count(metrics, "timeout")) == (2, 2)
