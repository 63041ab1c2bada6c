"""Several upstream engines behind one gateway (``--upstream URL`` repeated): ``UpstreamFleet`` owns one
adapter per engine and is itself an ``Upstream``, so the call path does not know how many there are.

Routing. The calls of one rollout go to one engine: the live engine with the highest rendezvous score
``blake2b(rollout id, engine url)`` (highest-random-weight hashing: adding or removing an engine moves
only the rollouts whose top engine it is, so a rollout keeps its engine's prefix cache). Unattributed
calls (an ad-hoc rollout id minted for one call) go to the live engine with the fewest calls in flight.

Health. A background task asks every engine's ``/health`` each ``health_interval_s``; an engine that
does not answer leaves the rotation (its rollouts move to their next engine by score) and comes back
when it answers again, once its ``/model_info`` shows the fleet's model and weight version (an engine
that missed a disk swap while away is loaded with the fleet's current weights first). A call whose
engine fails (connection refused, reset, a stream cut off) is retried on the next engine when a health
probe confirms the engine is gone: a non-stream call from the start (nothing of it came back), a stream
with ``input_ids = prompt + output so far`` and the rest of its token budget, as a weight swap's
continuation does (``continuation.py``), so the client sees one uninterrupted stream. When no engine is
live the call fails with 503 (``no_healthy_upstream``).

Weight swaps (``fleet_swap.py``). The fleet offers ``swap.SwapCoordinator`` the one engine's interface
(``gate``, ``post_control``) and fans every step out to the engines in the rotation; a disk load that
fails on any engine is rolled back on those that loaded it, so all engines or none move to a version.

One engine: the adapter's ``generate``/``stream`` are called directly (no health task, no failover: an
unreachable engine answers 502, as before), with only the ``served_by`` stamp added."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from tracegym.gateway.openai_errors import OpenAIError, UpstreamUnavailable
from tracegym.gateway.proxy.upstream.adapter_table import AdapterTable
from tracegym.gateway.proxy.upstream.base import (
    GenChoice,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    StreamEvent,
    Upstream,
)
from tracegym.gateway.proxy.upstream.continuation import JoinedChoice, continuation_request
from tracegym.gateway.proxy.upstream.fleet_swap import FleetControl, FleetGate

log = logging.getLogger("tracegym.gateway")

MAX_FAILOVERS = 4
"""Engines one call may move through before it fails."""
ROUTE_CACHE = 65536
"""Rollouts whose engine ``pick`` remembers (all forgotten when full)."""


class NoHealthyUpstream(OpenAIError):
    def __init__(self, detail: str) -> None:
        super().__init__(503, f"no upstream engine is available: {detail}", code="no_healthy_upstream")


class FleetMismatch(ValueError):
    """Engines that serve different models: the gateway refuses to start."""


@dataclass(slots=True, eq=False)
class Engine:
    url: str
    adapter: Upstream
    healthy: bool = True
    inflight: int = 0
    calls: int = 0
    failovers: int = 0
    """Calls that left this engine for another because it went away."""
    model: str | None = None
    model_path: str | None = None
    weight_version: str | None = None
    error: str | None = None
    checked_at: float | None = None
    staged: bool = False
    """It stages a distributed update's buckets until ``/end_weight_update`` and can discard them
    (``/model_info``'s ``staged_weight_updates``, the embedded engine's extension; see ``fleet_swap``)."""
    key: bytes = field(default=b"")

    def __post_init__(self) -> None:
        self.key = self.url.encode()

    def report(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "inflight": self.inflight, "calls": self.calls,
                "failovers": self.failovers, "model": self.model, "weight_version": self.weight_version,
                "error": self.error, "checked_at": self.checked_at}


def rendezvous_score(route_key: bytes, engine_key: bytes) -> bytes:
    return hashlib.blake2b(route_key + b"\x00" + engine_key, digest_size=8).digest()


class UpstreamFleet(Upstream):
    def __init__(self, adapters: list[tuple[str, Upstream]], *, health_interval_s: float = 2.0,
                 health_timeout: float = 2.0) -> None:
        if not adapters:
            raise ValueError("a fleet needs at least one upstream")
        if len({url for url, _ in adapters}) != len(adapters):
            raise ValueError(f"an upstream URL is given twice: {[url for url, _ in adapters]}")
        first = adapters[0][1]
        self.kind, self.token_native = first.kind, first.token_native
        self.engines = [Engine(url, a) for url, a in adapters]
        self.single = len(self.engines) == 1
        self._one = self.engines[0]
        self.health_interval_s, self.health_timeout = health_interval_s, health_timeout
        self.served_model: str | None = None
        self.weight_version: str | None = None
        """The fleet's version: what every engine in the rotation serves."""
        self.weights_path: str | None = None
        """The directory of the fleet's current weights (None: the engines' own model, as started)."""
        self.swappable = all(hasattr(a, "post_control") and hasattr(a, "gate") for _, a in adapters)
        self.gate = FleetGate([a.gate for _, a in adapters]) if self.swappable else None  # type: ignore[attr-defined]
        self.control = FleetControl(self)
        self.adapters: AdapterTable | None = None
        """The LoRA routing table (``lora.py``), one for the fleet: a LoRA swap loads the same adapter names
        on every engine (``swap.SwapCoordinator.update_lora`` through ``post_control``), so each engine's
        adapter reads this one table. None when the engines serve no LoRA (not SGLang-protocol)."""
        if all(isinstance(getattr(a, "adapters", None), AdapterTable) for _, a in adapters):
            self.adapters = adapters[0][1].adapters  # type: ignore[attr-defined]
            for _, a in adapters:
                a.adapters = self.adapters  # type: ignore[attr-defined]
        self._watch: asyncio.Task[None] | None = None
        self._routes: dict[str, Engine] = {}

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the adapters, ask every engine what it serves (an engine that does not answer starts
        out of the rotation), refuse engines that serve different models, start the health checks."""
        await asyncio.gather(*(e.adapter.start() for e in self.engines))
        if self.single and self.kind == "litellm":
            return
        infos = await asyncio.gather(*(self._info(e) for e in self.engines))
        served = {e.url: (i.served_model_name, i.model_path) for e, i in zip(self.engines, infos, strict=True)
                  if i is not None}
        if len({name for name, _ in served.values()}) > 1:
            raise FleetMismatch("the upstream engines serve different models: " + ", ".join(
                f"{url} serves {name!r} ({path})" for url, (name, path) in served.items())
                + "; every --upstream must serve the same model")
        live = [e for e in self.engines if e.healthy]
        if live:
            self.served_model = live[0].model
            self.weight_version = live[0].weight_version
            if len({e.weight_version for e in live}) > 1:
                log.warning("the upstream engines start at different weight versions: %s",
                            {e.url: e.weight_version for e in live})
        for e in self.engines:
            if not e.healthy:
                log.warning("upstream %s did not answer at start (%s); serving without it until it does",
                            e.url, e.error)
        if not self.single:
            self._watch = asyncio.create_task(self._watch_health())

    async def _info(self, e: Engine) -> ModelInfo | None:
        """``/model_info`` of one engine into its entry; None (and the engine out) when it fails."""
        try:
            info = await asyncio.wait_for(e.adapter.model_info(), self.health_timeout)
        except Exception as err:  # kept as the engine's error (GET /api/upstreams), logged by the caller
            e.healthy, e.error, e.checked_at = False, _describe(err), time.time()
            return None
        e.model, e.model_path, e.weight_version = info.served_model_name, info.model_path, info.weight_version
        e.staged = info.raw.get("staged_weight_updates") is True
        e.healthy, e.error, e.checked_at = True, None, time.time()
        return info

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(*(e.adapter.close() for e in self.engines))

    # --- routing --------------------------------------------------------------------------------
    def pick(self, route_key: str | None, skip: list[Engine] | tuple[Engine, ...] = ()) -> Engine:
        """The engine for a call of rollout ``route_key`` (None: an unattributed call). A rollout's engine
        is remembered while it stays live and no engine rejoins (``_routes``, cleared then)."""
        if route_key is not None and not skip:
            hit = self._routes.get(route_key)
            if hit is not None and hit.healthy:
                return hit
        live = [e for e in self.engines if e.healthy and e not in skip]
        if not live:
            raise NoHealthyUpstream("; ".join(f"{e.url}: {e.error or 'left after a failed call'}"
                                              for e in self.engines))
        if route_key is None:
            return min(live, key=lambda e: e.inflight) if len(live) > 1 else live[0]
        k = route_key.encode()
        best = max(live, key=lambda e: rendezvous_score(k, e.key))
        if not skip:
            if len(self._routes) >= ROUTE_CACHE:
                self._routes.clear()
            self._routes[route_key] = best
        return best

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self.single:
            req.served_by = self._one.url
            return await self._one.adapter.generate(req)
        tried: list[Engine] = []
        while True:
            e = self.pick(req.route_key, tried)
            req.served_by = e.url
            e.inflight += 1
            e.calls += 1
            try:
                return await e.adapter.generate(req)
            except UpstreamUnavailable as err:
                if len(tried) >= MAX_FAILOVERS or not await self._gone(e, err):
                    raise
                tried.append(e)
            finally:
                e.inflight -= 1

    def stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        if self.single:
            req.served_by = self._one.url
            return self._one.adapter.stream(req)
        return self._stream(req)

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """Stream from the rollout's engine; if it goes away mid-stream, continue on the next one with
        the output so far (one-choice token-native streams; others restart only if nothing was sent)."""
        tried: list[Engine] = []
        joined = JoinedChoice(0)
        sent = False
        cur: GenerateRequest | None = req
        while cur is not None:
            e = self.pick(req.route_key, tried)
            req.served_by = e.url
            e.inflight += 1
            e.calls += 1
            try:
                async with aclosing(e.adapter.stream(cur)) as events:
                    async for ev in events:
                        if cur is not req:
                            _as_continuation(ev, joined)
                        elif ev.choice is not None:
                            joined.add(ev.choice, ev.weight_version)
                        sent = True
                        yield ev
                return
            except UpstreamUnavailable as err:
                resumable = not sent or (self.token_native and req.sampling.n <= 1)
                if not resumable or len(tried) >= MAX_FAILOVERS or not await self._gone(e, err):
                    raise
                tried.append(e)
                joined.continuations += 1
                cur = continuation_request(req, joined) if joined.ids else req
                if cur is not None and cur is not req:
                    log.info("call %s: engine %s went away after %d tokens; continuing on another", req.rid,
                             e.url, len(joined.ids))
            finally:
                e.inflight -= 1
        # the token budget was spent before the engine went away: end the stream as a length stop
        yield StreamEvent(choice=GenChoice(index=0, output_ids=[], logprobs=[], text="", finish_reason="length",
                                           weight_versions=list(joined.spans)))

    async def _gone(self, e: Engine, err: OpenAIError) -> bool:
        """After a failed call: True (and ``e`` out of the rotation) when the engine no longer answers."""
        health = await e.adapter.health()
        if health.get("reachable"):
            return False
        if e.healthy:
            log.warning("upstream %s went away (%s): out of the rotation; its rollouts move", e.url, err.message)
        e.healthy, e.error, e.checked_at = False, f"failed a call: {err.message}", time.time()
        e.failovers += 1
        return True

    # --- health ---------------------------------------------------------------------------------
    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await asyncio.gather(*(self.check(e) for e in self.engines))
            except Exception:  # the checks must go on whatever one of them hit
                log.exception("upstream health check")

    async def check(self, e: Engine) -> None:
        """One health check of ``e``: out of the rotation when unreachable; back in once it serves the
        fleet's model and version (never while a swap runs: it would miss it)."""
        health = await e.adapter.health()
        e.checked_at = time.time()
        if not health.get("reachable"):
            if e.healthy:
                log.warning("upstream %s is unreachable: out of the rotation", e.url)
            e.healthy, e.error = False, str(health.get("error") or f"health: HTTP {health.get('status_code')}")
            return
        if e.healthy or (self.gate is not None and self.gate.swapping):
            return
        info = await self._info(e)
        e.healthy = False
        if info is None:
            return
        if self.served_model is not None and info.served_model_name != self.served_model:
            e.error = f"serves {info.served_model_name!r}, the fleet serves {self.served_model!r}; not used"
            log.warning("upstream %s answers again but %s", e.url, e.error)
            return
        if self.served_model is None:  # no engine answered at start: the first to answer sets the model
            self.served_model, self.weight_version = info.served_model_name, info.weight_version
        if (self.weight_version is not None and info.weight_version != self.weight_version
                and not await self.control.catch_up(e)):
            return
        e.healthy, e.error = True, None
        self._routes.clear()  # the rollouts whose top engine it is go back to it
        log.info("upstream %s is back in the rotation (weight version %s)", e.url, e.weight_version)

    # --- the rest of the Upstream interface -------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        if self.single:
            return await self._one.adapter.model_info()
        e = self.pick(None)
        info = await e.adapter.model_info()
        info.weight_version = self.weight_version if self.weight_version is not None else info.weight_version
        return info

    async def health(self) -> dict[str, Any]:
        if self.single:
            return await self._one.adapter.health()
        live = [e.url for e in self.engines if e.healthy]
        return {"reachable": bool(live), "engines": len(self.engines), "healthy": live}

    async def abort(self, rid: str) -> None:
        await asyncio.gather(*(e.adapter.abort(rid) for e in self.engines if e.healthy))

    async def post_control(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A swap step on every engine of the rotation (``fleet_swap.FleetControl``)."""
        return await self.control.post(path, body)

    async def status(self) -> dict[str, Any]:
        """``GET /api/upstreams``: every engine's health, load and weight version, asked now."""
        await asyncio.gather(*(self._refresh(e) for e in self.engines))
        return {"kind": self.kind, "model": self.served_model, "weight_version": self.weight_version,
                "weights_path": self.weights_path, "swapping": bool(self.gate and self.gate.swapping),
                "engines": [e.report() for e in self.engines]}

    async def _refresh(self, e: Engine) -> None:
        if self.single:  # no health task: this is the only check
            health = await e.adapter.health()
            e.healthy, e.checked_at = bool(health.get("reachable")), time.time()
            e.error = None if e.healthy else str(health.get("error") or health.get("status_code"))
        if e.healthy and self.kind != "litellm":
            with suppress(OpenAIError, TimeoutError, OSError):
                info = await asyncio.wait_for(e.adapter.model_info(), self.health_timeout)
                e.weight_version = info.weight_version


def _as_continuation(ev: StreamEvent, joined: JoinedChoice) -> None:
    """An event of a stream continued on another engine, as the client's stream goes on: choice 0, the
    client's prompt unchanged, the joined weight-version spans on the last event."""
    ev.prompt_tokens, ev.prompt_ids = None, None
    ch = ev.choice
    if ch is None:
        return
    ch.index = joined.index
    joined.add(ch, ev.weight_version)
    if ch.finish_reason is not None:
        ch.weight_versions = list(joined.spans)


def _describe(err: BaseException) -> str:
    if isinstance(err, OpenAIError):
        return err.message
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
