"""The runner, in process: ``run_agent`` / ``Runner`` claim rollouts from the gateway's queue and run an
agent on each, with leases kept alive by heartbeats. ``tracegym run`` (``tracegym.queue_commands``) wraps it.

Call convention: the agent is ``def agent(task, base_url) -> float | None`` (or ``async def``).

- ``task`` is the rollout's input exactly as enqueued (usually a dict: a line of the JSONL dataset,
  or its ``"input"`` field when the line had one). Ids are in ``tg.current_rollout()``.
- ``base_url`` is ``{gateway}/rollouts/{rollout_id}/v1``: give it to the OpenAI client / framework.
- The call runs inside ``tg.rollout`` for that rollout, so ``tg.reward``/``tg.emit`` attach to it and
  httpx calls to the gateway are attributed even with another base_url.
- On a gateway with keys, the scope holds the rollout's token (from the claim) in place of the runner's
  key: ``tg.reward``/``tg.emit`` send it, and the agent's requests to the gateway carry it as
  ``X-Tracegym-Key`` whatever API key its client was built with (``"unused"`` is fine). An agent that
  calls from another process passes ``tg.current_rollout().config.api_key`` as its API key.
- Returning a number completes the rollout with that reward; returning None completes it with the
  rewards sent through ``tg.reward`` (if any). Raising fails it with the traceback stored (the queue
  retries it up to its ``max_attempts``). Anything else returned fails it with a TypeError (a NaN or
  infinite number with a ValueError: the gateway stores finite rewards only).

Sync agents run in their own daemon threads, async ones on the runner's event loop; at most
``concurrency`` at once. While a rollout runs its lease is renewed every ``lease_seconds / 3``. With
nothing queued, a claim waits at the gateway up to ``claim_wait_s`` for a rollout to be enqueued (long
polling: it starts the moment one is), then the runner claims again.
Stopping (SIGINT/SIGTERM, or ``stop_event``) stops claiming, lets in-flight rollouts finish for up to
``grace_seconds`` (a second signal skips the wait) and releases the rest back to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tracegym.agent import Agent, as_reward, call_agent, format_traceback, is_async, load_target
from tracegym.client import (
    RETRY_STATUSES,
    AsyncGatewayClient,
    GatewayError,
    GatewayUnreachableError,
    LeaseLostError,
    SDKConfig,
    config_for,
    refused_field,
)
from tracegym.context import RolloutScope
from tracegym.progress import Progress, RunStats

__all__ = ["Agent", "RunStats", "Runner", "StopEvent", "run_agent"]

log = logging.getLogger("tracegym.runner")


class StopEvent(Protocol):
    """``asyncio.Event`` or ``threading.Event``: anything with ``is_set()``."""

    def is_set(self) -> bool: ...


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Flight:
    """One run of the agent on a claimed rollout."""

    rollout: dict[str, Any]
    task: asyncio.Task[None] | None = None
    lost: bool = False
    """A heartbeat found the lease lost: the result is dropped."""
    released: bool = False
    """The runner stopped and handed the rollout back to the queue."""
    finishing: bool = False
    """The result is being reported. Heartbeats go on (a report retried for a while keeps its lease), but a
    409 to one says nothing now: it may have crossed the report and reached a rollout the gateway has
    already finished. The report's own answer says whether the lease was lost."""

    @property
    def abandoned(self) -> bool:
        return self.lost or self.released


@dataclass
class Runner:
    """Runs ``agent`` over rollouts claimed from the gateway's queue. ``await runner.run()``."""

    agent: Agent | str
    gateway: str | None = None
    concurrency: int = 4
    lease_seconds: float = 120.0
    max_rollouts: int | None = None
    exit_when_idle: bool = False
    worker_id: str | None = None
    poll_interval: float = 0.5
    """The least time between two claims that found nothing (or failed)."""
    claim_wait_s: float = 2.0
    """How long a claim that finds nothing queued waits at the gateway for a rollout to be (0: it answers at
    once; not with ``exit_when_idle``, which claims once more to see the queue empty)."""
    grace_seconds: float = 30.0
    api_key: str | None = None
    progress: bool = False
    config: SDKConfig | None = None
    stats: RunStats = field(default_factory=RunStats)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        self.fn: Agent = load_target(self.agent) if isinstance(self.agent, str) else self.agent
        base = config_for(self.gateway, self.config)
        self.config = replace(base, api_key=self.api_key or base.api_key)
        self.worker_id = self.worker_id or default_worker_id()
        self._flights: dict[str, _Flight] = {}
        self._changed = asyncio.Event()
        self._force = False
        self._claimed = 0
        self._gateway_seen = False

    def force_stop(self) -> None:
        """Skip the grace period: release in-flight rollouts now (the second Ctrl-C)."""
        self._force = True
        self._changed.set()

    async def run(self, stop_event: StopEvent | None = None) -> RunStats:
        stop = stop_event or asyncio.Event()
        assert self.config is not None
        bar = Progress(sys.stderr) if self.progress else None
        async with AsyncGatewayClient(self.config) as api:
            self._api = api
            beat = asyncio.create_task(self._heartbeats())
            try:
                await self._claim_loop(stop, bar)
                await self._drain(stop, bar)
            finally:
                beat.cancel()
                await self._release_all()
                if bar:
                    bar.close(self.stats)
        return self.stats

    # -- main loop -------------------------------------------------------------------------------
    def _remaining(self) -> int | None:
        return None if self.max_rollouts is None else self.max_rollouts - self._claimed

    async def _claim_loop(self, stop: StopEvent, bar: Progress | None) -> None:
        while not stop.is_set() and not self._force:
            self._changed.clear()  # before claiming, so a rollout finishing meanwhile wakes the wait
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                return
            free = self.concurrency - len(self._flights)
            claimed: list[dict[str, Any]] = []
            loop = asyncio.get_running_loop()
            started = loop.time()
            if free > 0:
                limit = free if remaining is None else min(free, remaining)
                claimed = await self._claim(limit)
                if claimed and (stop.is_set() or self._force):  # stopped while the claim waited
                    await self._release([r["rollout_id"] for r in claimed])
                    return
                for r in claimed:
                    self._start(r)
                if not claimed and self.exit_when_idle and not self._flights:
                    return
            if bar:
                bar.update(self.stats)
            if not claimed:  # a claim that waited at the gateway has waited its poll
                await self._wait_change(max(0.0, self.poll_interval - (loop.time() - started)))

    async def _claim(self, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` rollouts. An unreachable gateway is fatal until it has answered once
        (a wrong URL fails fast); after that the runner waits for it (a gateway restart). A claim is
        not retried inside the client once sent (a repeat would claim more), so a timeout or a 5xx
        answer is retried here, at the next poll."""
        wait_s = 0.0 if self.exit_when_idle else self.claim_wait_s
        try:
            claimed = await self._api.claim(self.worker_id or "", limit, self.lease_seconds, wait_s)
        except GatewayError as e:
            if wait_s and refused_field(e, "wait_s"):  # a gateway older than held claims
                log.warning("the gateway does not hold claims (%s): polling every %.1fs", e, self.poll_interval)
                self.claim_wait_s = 0.0
                return []
            transient = isinstance(e, GatewayUnreachableError) or e.status in RETRY_STATUSES
            if not (transient and self._gateway_seen):
                raise
            log.warning("claim failed, will retry: %s", e)
            return []
        self._gateway_seen = True
        return claimed

    async def _drain(self, stop: StopEvent, bar: Progress | None) -> None:
        """Wait for in-flight rollouts: all of them after a normal end, up to the grace period after a
        stop (the rest are released by ``run``)."""
        stopping = stop.is_set() or self._force
        if stopping and self._flights:
            log.warning(
                "stopping: waiting up to %.0fs for %d in-flight rollouts (again to release them)",
                self.grace_seconds,
                len(self._flights),
            )
        deadline = asyncio.get_running_loop().time() + self.grace_seconds
        while self._flights and not self._force:
            self._changed.clear()
            if not stopping and stop.is_set():
                stopping = True
                deadline = asyncio.get_running_loop().time() + self.grace_seconds
            if stopping and asyncio.get_running_loop().time() >= deadline:
                return
            await self._wait_change(0.2)
            if bar:
                bar.update(self.stats)

    async def _wait_change(self, timeout: float) -> None:
        """Until a rollout finishes (``_changed`` is set) or ``timeout`` seconds pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # -- one rollout -----------------------------------------------------------------------------
    def _start(self, r: dict[str, Any]) -> None:
        old = self._flights.get(r["rollout_id"])
        if old is not None and not old.abandoned:
            # our lease expired (e.g. heartbeats could not reach the gateway) and we claimed the rollout
            # back: the run in progress holds the new lease, so do not start a second one
            log.warning("rollout %s: lease expired while running; re-claimed, continuing", r["rollout_id"])
            old.rollout = r
            return
        self._claimed += 1
        flight = _Flight(r)
        self._flights[r["rollout_id"]] = flight
        flight.task = asyncio.create_task(self._execute(flight), name=f"rollout-{r['rollout_id']}")
        self.stats.running = len(self._flights)

    async def _execute(self, flight: _Flight) -> None:
        rid = flight.rollout["rollout_id"]
        assert self.config is not None
        # the agent (its LLM calls, tg.reward, tg.emit) holds its rollout's token, not the runner's key
        token = flight.rollout.get("token")
        scope = RolloutScope(rid, flight.rollout.get("task_id"), None,
                             replace(self.config, api_key=token) if token else self.config)
        try:
            try:
                reward = as_reward(await call_agent(self.fn, scope, flight.rollout.get("input")))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not flight.abandoned:
                    error = f"{type(e).__name__}: {e}"
                    await self._finish(flight, "fail", error=error, tb=format_traceback(e))
                return
            if not flight.abandoned:
                await self._finish(flight, "complete", reward=reward)
        except Exception:  # a bug here must not vanish into an un-awaited task
            log.exception("rollout %s: the runner failed to finish it; counted as failed", rid)
            self.stats.failed += 1
        finally:
            # a rollout re-claimed after this run lost its lease has a new flight: leave that one alone
            if self._flights.get(rid) is flight:
                del self._flights[rid]
            self.stats.running = len(self._flights)
            self._changed.set()

    async def _finish(
        self,
        flight: _Flight,
        how: str,
        *,
        reward: float | None = None,
        error: str = "",
        tb: str | None = None,
    ) -> None:
        """Report the result. Never raises: a result the gateway refuses (4xx on complete) fails the
        rollout with the gateway's message; one that cannot be reported at all is logged and counted as
        failed (the rollout stays running until its lease expires, then the gateway requeues it)."""
        rid = flight.rollout["rollout_id"]
        worker = self.worker_id or ""
        flight.finishing = True
        try:
            if how == "complete":
                try:
                    done = await self._api.complete(rid, worker, reward)
                except LeaseLostError:
                    raise
                except GatewayError as e:
                    if e.status is None or not 400 <= e.status < 500:
                        raise
                    error, tb = f"the gateway refused to complete the rollout: {e}", None
                else:
                    # the gateway's reward: the one passed here, else the last one sent with tg.reward
                    self.stats.record_done(done.get("reward", reward) if isinstance(done, dict) else reward)
                    return
            log.warning("rollout %s failed: %s", rid, error.splitlines()[0] if error else "")
            await self._api.fail(rid, worker, error, tb)
            self.stats.failed += 1
        except LeaseLostError as e:
            log.warning("rollout %s: lease lost before it finished (%s); result dropped", rid, e)
            self.stats.lost += 1
        except GatewayError as e:
            log.error(
                "rollout %s: could not report its result to the gateway (%s); counted as failed, the "
                "gateway requeues it when its lease expires",
                rid,
                e,
            )
            self.stats.failed += 1

    async def _heartbeats(self) -> None:
        interval = max(0.2, self.lease_seconds / 3)
        while True:
            await asyncio.sleep(interval)
            flights = [f for f in self._flights.values() if not f.abandoned]
            await asyncio.gather(*(self._beat(f) for f in flights))

    async def _beat(self, flight: _Flight) -> None:
        rid = flight.rollout["rollout_id"]
        try:
            await self._api.heartbeat(rid, self.worker_id or "", self.lease_seconds)
        except LeaseLostError as e:
            if flight.finishing:  # crossed the rollout's own complete/fail; that answer counts instead
                log.debug("rollout %s: heartbeat answered 409 after its result was sent", rid)
                return
            log.warning("rollout %s: lease lost (%s); abandoning it", rid, e)
            flight.lost = True
            self.stats.lost += 1
            if flight.task is not None and is_async(self.fn):
                flight.task.cancel()
        except GatewayError as e:
            log.warning("rollout %s: heartbeat failed: %s", rid, e)

    async def _release(self, rollout_ids: list[str]) -> None:
        """Give rollouts back to the queue (a failed release is logged: the lease expires instead)."""
        for rid in rollout_ids:
            try:
                await self._api.release(rid, self.worker_id or "")
                self.stats.released += 1
            except GatewayError as e:
                log.warning("could not release rollout %s: %s", rid, e)

    async def _release_all(self) -> None:
        flights = list(self._flights.items())
        for _, flight in flights:
            flight.released = True
            if flight.task is not None:
                flight.task.cancel()
        await asyncio.gather(*(f.task for _, f in flights if f.task is not None), return_exceptions=True)
        await self._release([rid for rid, _ in flights])
        self._flights.clear()
        self.stats.running = 0


async def run_agent(
    agent: Agent | str,
    gateway: str | None = None,
    concurrency: int = 4,
    *,
    stop_event: StopEvent | None = None,
    **options: Any,
) -> RunStats:
    """Run ``agent`` over the gateway's queue until ``stop_event`` is set (or ``exit_when_idle`` /
    ``max_rollouts``). ``options`` are ``Runner`` fields (lease_seconds, max_rollouts, exit_when_idle,
    worker_id, poll_interval, claim_wait_s, grace_seconds, api_key, progress). ``stop_event`` may be an
    ``asyncio.Event`` or a ``threading.Event``."""
    runner = Runner(agent, gateway, concurrency, **options)
    return await runner.run(stop_event)
