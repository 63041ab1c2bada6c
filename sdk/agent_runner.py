"""The ``Runner``: claims rollouts from the gateway's queue and runs an agent on each, with leases kept
alive by heartbeats. The call convention and the stop semantics are described in ``tracegym.runner``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tracegym.client import (
    RETRY_STATUSES,
    AsyncGatewayClient,
    GatewayError,
    GatewayUnreachableError,
    LeaseLostError,
    SDKConfig,
    config_for,
)
from tracegym.context import RolloutScope, enter_scope, validate_reward
from tracegym.progress import Progress, RunStats

log = logging.getLogger("tracegym.runner")
Agent = Callable[[Any, str], Any]


class StopEvent(Protocol):
    """``asyncio.Event`` or ``threading.Event``: anything with ``is_set()``."""

    def is_set(self) -> bool: ...


def is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def as_reward(result: Any) -> float | None:
    """The reward an agent's return value stands for (None: no reward). Anything but None or a finite
    real number raises (the runner then fails the rollout with that message)."""
    if result is None:
        return None
    try:
        return validate_reward(result)
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"the agent returned {type(result).__name__} {result!r} ({e}); expected a float or None"
        ) from None


def rollout_base_url(gateway: str, rollout_id: str) -> str:
    return f"{gateway}/rollouts/{rollout_id}/v1"


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Flight:
    rollout: dict[str, Any]
    task: asyncio.Task[None] | None = None
    lost: bool = False
    released: bool = False


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
        if isinstance(self.agent, str):
            from tracegym.runner import load_target

            self.fn: Agent = load_target(self.agent)
        else:
            self.fn = self.agent
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
            if free > 0:
                limit = free if remaining is None else min(free, remaining)
                claimed = await self._claim(limit)
                for r in claimed:
                    self._start(r)
                if not claimed and self.exit_when_idle and not self._flights:
                    return
            if bar:
                bar.update(self.stats)
            if not claimed:
                await self._wait_change(self.poll_interval)

    async def _claim(self, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` rollouts. An unreachable gateway is fatal until it has answered once
        (a wrong URL fails fast); after that the runner waits for it (a gateway restart). A claim is
        not retried inside the client once sent (a repeat would claim more), so a timeout or a 5xx
        answer is retried here, at the next poll."""
        try:
            claimed = await self._api.claim(self.worker_id or "", limit, self.lease_seconds)
        except GatewayError as e:
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
        if old is not None and not (old.lost or old.released):
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
        scope = RolloutScope(rid, flight.rollout.get("task_id"), None, self.config)
        try:
            try:
                reward = as_reward(await self._call(scope, flight.rollout.get("input")))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not (flight.lost or flight.released):
                    await self._finish(flight, "fail", error=f"{type(e).__name__}: {e}", tb=_format(e))
                return
            if not (flight.lost or flight.released):
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

    async def _call(self, scope: RolloutScope, task_input: Any) -> Any:
        base_url = rollout_base_url(scope.config.gateway_url, scope.rollout_id)
        if is_async(self.fn):
            with enter_scope(scope):
                return await self.fn(task_input, base_url)
        result = await _in_thread(scope, self.fn, task_input, base_url)
        if inspect.isawaitable(result):  # a sync callable that returned a coroutine
            with enter_scope(scope):
                result = await result
        return result

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
            flights = [f for f in self._flights.values() if not (f.lost or f.released)]
            await asyncio.gather(*(self._beat(f) for f in flights))

    async def _beat(self, flight: _Flight) -> None:
        rid = flight.rollout["rollout_id"]
        try:
            await self._api.heartbeat(rid, self.worker_id or "", self.lease_seconds)
        except LeaseLostError as e:
            log.warning("rollout %s: lease lost (%s); abandoning it", rid, e)
            flight.lost = True
            self.stats.lost += 1
            if flight.task is not None and is_async(self.fn):
                flight.task.cancel()
        except GatewayError as e:
            log.warning("rollout %s: heartbeat failed: %s", rid, e)

    async def _release_all(self) -> None:
        flights = list(self._flights.items())
        for _, flight in flights:
            flight.released = True
            if flight.task is not None:
                flight.task.cancel()
        await asyncio.gather(*(f.task for _, f in flights if f.task is not None), return_exceptions=True)
        for rid, _ in flights:
            try:
                await self._api.release(rid, self.worker_id or "")
                self.stats.released += 1
            except GatewayError as e:
                log.warning("could not release rollout %s: %s", rid, e)
        self._flights.clear()
        self.stats.running = 0


async def _in_thread(scope: RolloutScope, fn: Agent, task_input: Any, base_url: str) -> Any:
    """Run ``fn`` in a daemon thread inside ``scope`` (a daemon, so an abandoned agent never blocks the
    process from exiting)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        ok, value = True, None
        try:
            with enter_scope(scope):
                value = fn(task_input, base_url)
        except BaseException as e:  # handed to the awaiting task, which fails the rollout
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: the runner stopped and released this rollout
            log.info("rollout %s finished after the runner stopped; result dropped", scope.rollout_id)

    threading.Thread(target=work, name=f"tracegym-{scope.rollout_id}", daemon=True).start()
    return await fut


def _format(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))
