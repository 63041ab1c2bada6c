"""Weight hot-swaps around a live upstream. The gateway is the one owner of every swap sequence: the
trainer writes weights (or broadcasts them on its process group) and asks the gateway; it never pauses
the engine or calls its weight routes itself, so calls in flight are continued, never failed.

``SwapGate`` is the state the SGLang adapter reads to tell a *pause-abort* (a request cut short by a
swap, continued transparently, see ``continuation.py``) from any other abort. ``SwapCoordinator`` runs
one swap at a time — a second one of any kind, or a group init, is refused with 409 while one runs — and
is owned by the app's lifespan (``app.state.swap``). Both kinds run behind the gate, and both end with
``/continue_generation`` after a pause, also when they failed.

Disk (AReaL's order, SGLANG.md §4): gate → ``POST /pause_generation {"mode": "abort"}`` (in-flight
requests come back at once with partial output and finish_reason abort; new ones are held) → ``POST
/update_weights_from_disk {model_path, weight_version}`` (a failed load rolls back to the old weights) →
continue → release the gate → record the version in the store.

Distributed (slime's order, SGLANG.md §3–4), for a trainer that broadcasts from rank 0 of a group the
engine joined through ``init_group`` (``/init_weights_update_group``, which returns only once the
trainer has joined the rendezvous too): gate → pause → ``/flush_cache`` until it succeeds (SGLang
refuses while requests run) → ``/begin_weight_update {"selector": "all"}`` (SGLang ≥ 0.5.23 refuses
distributed updates outside it; a 404 is an older server without such sessions, which goes on without)
→ per bucket: tell the trainer to broadcast it (``notify``), then ``POST /update_weights_from_distributed
{names, dtypes, shapes, group_name, flush_cache: false}``, which returns once SGLang has received and
loaded the bucket → ``/end_weight_update`` whenever begin succeeded → continue → release → record.
The version is stamped once, with the last bucket, so the engine labels no half-loaded weights with it.
After a failed bucket the session ends with ``{"discard": true}``: the fleet (``fleet_swap``) makes that
all or none, per engine (an engine that stages the buckets drops them; one that loaded them as they came,
as SGLang does, loads its previous weights from disk or leaves the rotation); the swap reports failure and
the trainer pushes the whole model again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tracegym.gateway.openai_errors import OpenAIError, UpstreamUnavailable

if TYPE_CHECKING:
    from tracegym.gateway.proxy.upstream.sglang import SGLangUpstream

log = logging.getLogger("tracegym.gateway")

Notify = Callable[[dict[str, Any]], None]


class SwapGate:
    """Which swaps a request has lived through. A request takes a ``ticket()`` before it is posted; an
    abort it gets back is a pause-abort when a swap is running now or one started since that ticket
    (the counter closes the race where the swap finished before the aborted response was read)."""

    def __init__(self) -> None:
        self.generation = 0
        self.swapping = False
        self._idle = asyncio.Event()
        self._idle.set()

    def ticket(self) -> int:
        return self.generation

    def is_pause_abort(self, ticket: int) -> bool:
        return self.swapping or self.generation != ticket

    def begin(self) -> None:
        self.generation += 1
        self.swapping = True
        self._idle.clear()

    def end(self) -> None:
        self.swapping = False
        self._idle.set()

    async def wait_idle(self) -> None:
        """Returns once no swap is running (at once when none is)."""
        await self._idle.wait()


class SwapBusy(OpenAIError):
    def __init__(self, running: str) -> None:
        super().__init__(409, f"a weight swap is already running ({running}); one at a time",
                         code="swap_in_progress")


class _StepFailed(Exception):
    """An upstream step refused: the swap fails with this message (generation still continues)."""


@dataclass(slots=True, frozen=True)
class GroupSpec:
    """The ``/init_weights_update_group`` body: SGLang's ranks join as ``rank_offset + tp_rank`` of a
    ``world_size`` group whose rank 0 is the trainer."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(slots=True, frozen=True)
class Bucket:
    """Tensors broadcast in this order, one ``dist.broadcast(src=0)`` each."""

    names: list[str]
    dtypes: list[str]
    """torch dtype names (``bfloat16``), as SGLang reads them with ``getattr(torch, name)``."""
    shapes: list[list[int]]


@dataclass(slots=True, frozen=True)
class DistributedUpdate:
    weight_version: str
    buckets: list[Bucket]
    group_name: str = "weight_update_group"


def bucket_payload(bucket: Bucket, group_name: str, weight_version: str | None) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body (the cache was flushed once before the buckets)."""
    body: dict[str, Any] = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                            "group_name": group_name, "flush_cache": False}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


@dataclass(slots=True)
class SwapOutcome:
    success: bool
    message: str
    weight_version: str
    swap_seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class LastSwap:
    kind: str
    """``disk`` or ``distributed``."""
    weight_version: str
    model_path: str | None
    success: bool
    finished_at: float
    """Unix time."""
    swap_seconds: float


@dataclass(slots=True)
class DistributedSwap:
    """A distributed swap running as its own task (a client that goes away does not cut its cleanup
    short); ``events()`` yields ``{"event": "bucket", "index"}`` per bucket, then one ``{"event": "done",
    "success", "message", "weight_version", "swap_seconds"}``."""

    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[SwapOutcome] | None = None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev["event"] == "done":
                return


class SwapCoordinator:
    """One swap at a time against an SGLang-protocol upstream; records successful versions in ``store``
    (a ``tracegym.gateway.traces.store.Store`` or None when recording is off)."""

    def __init__(self, upstream: SGLangUpstream, store: Any = None, *, flush_retries: int = 60,
                 flush_interval_s: float = 1.0) -> None:
        self.upstream = upstream
        self.gate: SwapGate = upstream.gate
        self.store = store
        self.flush_retries, self.flush_interval_s = flush_retries, flush_interval_s
        self.last: LastSwap | None = None
        self.running: str | None = None
        """What holds the coordinator now (``disk swap``, ``distributed swap``, ``group init``)."""
        self._task: asyncio.Task[SwapOutcome] | None = None
        """The distributed swap's task, held here because the event loop keeps only a weak reference."""

    def _claim(self, what: str) -> None:
        """Synchronous (no await between the check and the claim), so two requests cannot both pass."""
        if self.running is not None:
            raise SwapBusy(self.running)
        self.running = what

    # --- disk -----------------------------------------------------------------------------------
    async def update(self, model_path: str, weight_version: str, *, pause: bool = True) -> SwapOutcome:
        """Load ``model_path`` as ``weight_version``. Upstream refusals come back as ``success=False``
        (the old weights stay current); an unreachable upstream raises the gateway's 502/504 errors."""
        if not model_path or not weight_version:
            raise ValueError("model_path and weight_version must be non-empty strings")
        self._claim("disk swap")
        try:
            sequence = self._disk(model_path, weight_version, pause)
            return await self._timed("disk", weight_version, model_path, sequence)
        finally:
            self.running = None

    async def _disk(self, model_path: str, weight_version: str, pause: bool) -> str:
        async with self._paused(pause):
            status, body = await self.upstream.post_control(
                "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})
            if status >= 400 or not body.get("success", False):
                raise _StepFailed(_message(body) or f"update_weights_from_disk: HTTP {status}")
            return _message(body) or f"HTTP {status}"

    # --- LoRA adapters ---------------------------------------------------------------------------
    async def update_lora(self, adapters: dict[str, str], weight_version: str, *,
                          per_agent: bool = False) -> SwapOutcome:
        """Serve ``adapters`` (logical name → PEFT directory) as ``weight_version``: gate → pause → per
        adapter ``/load_lora_adapter {lora_name: "<name>-v<version>", lora_path}`` → ``/update_weight_version``
        → route calls to the new names → unload the names they replace → continue. A refused load
        unloads what this swap loaded and keeps the old adapters serving (``success=False``)."""
        if not adapters or not weight_version:
            raise ValueError("a LoRA swap needs a weight_version and at least one adapter")
        self._claim("lora swap")
        try:
            where = ";".join(f"{n}={p}" for n, p in adapters.items())
            return await self._timed("lora", weight_version, where,
                                     self._lora(adapters, weight_version, per_agent))
        finally:
            self.running = None

    async def _lora(self, adapters: dict[str, str], weight_version: str, per_agent: bool) -> str:
        up, table = self.upstream, self.upstream.adapters
        async with self._paused(True):
            loaded: dict[str, str] = {}
            try:
                for name, path in adapters.items():
                    served = f"{name}-v{weight_version}"
                    if served in table.served.values():  # the same version again (a resumed run)
                        await self._unload_lora(served)
                    status, body = await up.post_control("/load_lora_adapter",
                                                         {"lora_name": served, "lora_path": path})
                    if status >= 400 or not body.get("success", False):
                        why = body.get("error_message") or _message(body) or f"HTTP {status}"
                        raise _StepFailed(f"load_lora_adapter {served}: {why}")
                    loaded[name] = served
                status, body = await up.post_control("/update_weight_version",
                                                     {"new_version": weight_version, "abort_all_requests": False})
                if status == 404:
                    log.warning("the upstream has no /update_weight_version: spans keep its old label")
                elif status >= 400 or body.get("success") is False:
                    raise _StepFailed(f"update_weight_version: {_message(body) or f'HTTP {status}'}")
            except BaseException:
                for served in loaded.values():
                    await self._unload_lora(served)
                raise
            for old in table.install(loaded, per_agent=per_agent).values():
                await self._unload_lora(old)
        return f"{len(loaded)} adapter(s) loaded: {', '.join(loaded.values())}"

    async def _unload_lora(self, served: str) -> None:
        """Best effort: an adapter left loaded costs memory, not correctness."""
        status, body = await self.upstream.post_control("/unload_lora_adapter", {"lora_name": served})
        if status >= 400 or body.get("success") is False:
            log.warning("unload_lora_adapter %s: %s", served, body.get("error_message") or _message(body))

    # --- distributed ----------------------------------------------------------------------------
    async def init_group(self, spec: GroupSpec) -> tuple[bool, str]:
        """``/init_weights_update_group`` (generation goes on meanwhile: no pause, no gate)."""
        self._claim("group init")
        try:
            status, body = await self.upstream.post_control("/init_weights_update_group", asdict(spec))
        finally:
            self.running = None
        ok = status < 400 and bool(body.get("success", False))
        log.info("weight update group %s (world size %d, %s): %s", spec.group_name, spec.world_size,
                 spec.backend, "ok" if ok else f"FAILED: {_message(body)}")
        return ok, _message(body) or f"HTTP {status}"

    def start_distributed(self, update: DistributedUpdate) -> DistributedSwap:
        """Claim the coordinator now (``SwapBusy`` if taken) and run the swap as a task."""
        if not update.weight_version or not update.buckets:
            raise ValueError("a distributed update needs a weight_version and at least one bucket")
        self._claim("distributed swap")
        swap = DistributedSwap()
        swap.task = self._task = asyncio.create_task(self._run_distributed(update, swap.queue.put_nowait))
        return swap

    async def _run_distributed(self, update: DistributedUpdate, notify: Notify) -> SwapOutcome:
        t0 = time.monotonic()
        try:
            outcome = await self._timed("distributed", update.weight_version, None,
                                        self._distributed(update, notify))
        except Exception as e:  # the stream's client must get its "done" whatever went wrong
            if not isinstance(e, OpenAIError):  # 502/504 (unreachable upstream) need no traceback
                log.exception("distributed weight swap to %s", update.weight_version)
            outcome = SwapOutcome(False, str(e), update.weight_version, time.monotonic() - t0)
        finally:
            self.running = None
        notify({"event": "done", **outcome.to_json()})
        return outcome

    async def _distributed(self, update: DistributedUpdate, notify: Notify) -> str:
        up, n = self.upstream, len(update.buckets)
        async with self._paused(True):
            await self._flush_cache()
            status, body = await up.post_control("/begin_weight_update", {"selector": "all"})
            session = status != 404
            if session and (status >= 400 or body.get("success") is False):
                raise _StepFailed(f"begin_weight_update: {_message(body) or f'HTTP {status}'}")
            try:
                for i, bucket in enumerate(update.buckets):
                    notify({"event": "bucket", "index": i})
                    version = update.weight_version if i == n - 1 else None
                    status, body = await up.post_control("/update_weights_from_distributed",
                                                         bucket_payload(bucket, update.group_name, version))
                    if status >= 400 or body.get("success") is False:
                        raise _StepFailed(f"update_weights_from_distributed, bucket {i + 1} of {n}: "
                                          f"{_message(body) or f'HTTP {status}'}")
            except Exception as e:
                note = await self._end_session(failing=e) if session else ""
                if note:
                    raise _StepFailed(f"{e}; {note}") from e
                raise
            except BaseException as e:  # cancelled: close the session all the same
                if session:
                    await self._end_session(failing=e)
                raise
            if session:
                await self._end_session(failing=None)
        return f"{n} bucket(s) loaded" + ("" if session else " (no begin/end_weight_update on this server)")

    async def _flush_cache(self) -> None:
        for attempt in range(self.flush_retries):
            status, body = await self.upstream.post_control("/flush_cache", {})
            if status < 400:
                return
            if attempt + 1 < self.flush_retries:
                await asyncio.sleep(self.flush_interval_s)
        raise _StepFailed(f"flush_cache did not succeed in {self.flush_retries} tries: {_message(body)}")

    async def _end_session(self, failing: BaseException | None) -> str:
        """``/end_weight_update``; after a failure it asks to discard what was received (``discard``,
        which the fleet sends only to engines that stage updates, see ``fleet_swap``) and returns what
        became of the engines' weights."""
        status, body = await self.upstream.post_control("/end_weight_update",
                                                        {} if failing is None else {"discard": True})
        if status < 400 and body.get("success") is not False:
            return "" if failing is None else _message(body)
        msg = f"end_weight_update: {_message(body) or f'HTTP {status}'}"
        if failing is None:
            raise _StepFailed(msg)
        log.warning("%s (after: %s)", msg, failing)
        return msg

    # --- shared ---------------------------------------------------------------------------------
    @asynccontextmanager
    async def _paused(self, pause: bool) -> AsyncIterator[None]:
        """The gate for the whole block; ``/pause_generation`` … ``/continue_generation`` around it."""
        up = self.upstream
        self.gate.begin()
        try:
            if pause:
                status, body = await up.post_control("/pause_generation", {"mode": "abort"})
                if status >= 400:
                    raise _StepFailed(f"pause_generation failed (HTTP {status}): {_message(body)}")
            yield
        finally:
            try:
                if pause:
                    status, body = await up.post_control("/continue_generation", {})
                    if status >= 400:
                        raise UpstreamUnavailable(f"continue_generation failed (HTTP {status}): "
                                                  f"{_message(body)}; the upstream may still be paused")
            finally:
                self.gate.end()

    async def _timed(self, kind: str, weight_version: str, model_path: str | None,
                     sequence: Coroutine[Any, Any, str]) -> SwapOutcome:
        """Run ``sequence`` (a coroutine returning the upstream's message), time it, remember it, record a
        successful version in the store."""
        t0 = time.monotonic()
        try:
            ok, message = True, await sequence
        except _StepFailed as e:
            ok, message = False, str(e)
        seconds = time.monotonic() - t0
        self.last = LastSwap(kind, weight_version, model_path, ok, time.time(), seconds)
        log.info("%s weight swap to %s%s: %s in %.2fs: %s", kind, weight_version,
                 f" ({model_path})" if model_path else "", "ok" if ok else "FAILED", seconds, message)
        if ok and self.store is not None:
            await asyncio.to_thread(self.store.add_weight_version, weight_version, path=model_path,
                                    swap_seconds=seconds)
        return SwapOutcome(ok, message, weight_version, seconds)

    async def close(self, timeout_s: float = 60.0) -> None:
        """At shutdown: let a distributed swap still running (its client may be gone) finish its
        sequence, so the engine is not left paused; wait ``timeout_s`` at most."""
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            log.warning("a distributed weight swap was still running at shutdown; the upstream may "
                        "stay paused")

    async def status(self) -> dict[str, Any]:
        """The upstream's current version (asked live) and the last swap this gateway ran."""
        info = await self.upstream.model_info()
        last = self.last
        return {"weight_version": info.weight_version, "swapping": self.gate.swapping,
                "last_swap": None if last is None else asdict(last), "lora": self.upstream.adapters.snapshot()}


def _message(body: dict[str, Any]) -> str:
    msg = body.get("message")
    if msg is None and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
    return str(msg) if msg is not None else ""
