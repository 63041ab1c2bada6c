"""Prefix lookup: on a prefix-cache miss, a call's parents are read from the store. That makes prefix
reuse work across gateways.

The prefix cache (``prompt/prefix_reuse.py``) lives in one process's memory. With several gateways on one
store (PostgreSQL) behind a load balancer that does not keep a rollout on one gateway, a rollout's next call
may reach a gateway that never saw the call it extends; so may a call after a restart, or after the cache
evicted its rollout. Rendering the conversation whole would re-tokenize the sampled replies (not
necessarily into the ids the engine sampled), and the rollout would no longer merge into one sequence. So
when a plan says a call recorded elsewhere may be its parent (``PromptPlan.lookup``: an assistant turn
after the reused part that no call in memory explains), the gateway reads the rollout's latest calls from
the store (one query on the spans' ``(rollout_id, start_time_ns)`` index, in a thread of its own, never on
the event loop) and plans again with them (``PrefixCache.replan``), exactly as if this gateway had served
them. With ``--durability commit`` (the default) a call's span is committed before its answer is sent, so
the call that follows it, on any gateway, finds it.

A lookup never fails a call: a store that errs or does not answer within ``prefix_lookup_timeout_s`` leaves
the plan from memory (the call renders whole or reuses an older parent, and its drift says so), with a
warning in the log and the outcome counted in ``tracegym_gateway_prefix_lookups_total``. When more than
``MAX_WAITING`` lookups are already waiting (a store that fell behind), a miss does not queue behind them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tracegym.gateway.traces.reads import recent_call_records

if TYPE_CHECKING:
    from tracegym.gateway.deps import GatewayMetrics
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache, PromptPlan
    from tracegym.gateway.traces.store import Store
    from tracegym.types import CallRecord

log = logging.getLogger(__name__)

THREADS = 4
"""Threads that run lookups (each holds one store connection while its query runs)."""
CALLS_READ = 16
"""The rollout's latest calls a lookup reads. A call's parent is nearly always its rollout's latest call (with
several agents in one rollout, its agent's latest); each row holds its whole conversation, so reading more
costs more on long rollouts."""
MAX_WAITING = 64
"""Lookups started and not yet finished (running or queued for a thread) beyond which a miss skips it."""


class PrefixLookup:
    """Reads a rollout's recorded calls from the store for the prefix cache on a miss. Owned by the app's
    lifespan (which calls ``close``); ``replan`` is called from the event loop only."""

    def __init__(self, store: Store, metrics: GatewayMetrics, *, timeout_s: float, limit: int = CALLS_READ) -> None:
        self.store = store
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.limit = limit
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="tracegym-prefix-lookup")
        self._waiting = 0

    async def replan(self, prefix: PrefixCache, rollout_id: str, plan: PromptPlan) -> PromptPlan:
        """``plan`` again with the rollout's stored calls (``plan.lookup``); ``plan`` itself when the store
        fails, is slow or holds no parent it lacked."""
        started = time.perf_counter()
        records = await self._read(rollout_id)
        if records is None:
            plan.lookup = False
            return plan
        better = prefix.replan(rollout_id, plan, records)
        self.metrics.count_prefix_lookup("found" if better is not plan else "none",
                                         time.perf_counter() - started)
        return better

    async def _read(self, rollout_id: str) -> list[CallRecord] | None:
        if self._waiting >= MAX_WAITING:
            self.metrics.count_prefix_lookup("busy", 0.0)
            return None
        self._waiting += 1
        started = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, recent_call_records, self.store, rollout_id, self.limit)
        future.add_done_callback(self._done)
        try:  # a timeout cancels the future: a lookup still queued is dropped, a running query finishes
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            log.warning("prefix lookup of rollout %s took over %.2f s: its call is planned without it",
                        rollout_id, self.timeout_s)
            self.metrics.count_prefix_lookup("timeout", time.perf_counter() - started)
        except Exception as e:  # any store failure (driver, network, a bad row): the call goes on
            log.warning("prefix lookup of rollout %s failed (%s: %s): its call is planned without it",
                        rollout_id, type(e).__name__, e)
            self.metrics.count_prefix_lookup("error", time.perf_counter() - started)
        return None

    def _done(self, future: asyncio.Future) -> None:
        self._waiting -= 1
        if not future.cancelled():
            future.exception()  # retrieved (and logged by ``_read``): no "never retrieved" report

    def close(self) -> None:
        """Stop the lookup threads (queued lookups are dropped; a running query finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
