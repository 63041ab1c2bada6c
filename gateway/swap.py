"""Weight hot-swap around a live upstream: pause generation, load the new weights, continue.

``SwapGate`` is the state the SGLang adapter reads to tell a *pause-abort* (a request cut short by a
swap, to be continued transparently) from any other abort. ``SwapCoordinator`` runs one swap at a time
and is owned by the app's lifespan (``app.state.swap``).

Sequence of one swap (AReaL's disk update, SGLANG.md §4): mark the gate → ``POST /pause_generation
{"mode": "abort"}`` (in-flight requests come back at once with partial output and finish_reason abort;
new ones are held) → ``POST /update_weights_from_disk {model_path, weight_version}`` → always ``POST
/continue_generation`` (also when the update failed: the old weights stay, generation resumes on them)
→ release the gate → record the version in the store."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tracegym.gateway.errors import OpenAIError
from tracegym.gateway.upstream.base import GenChoice, GenerateRequest, TopLogprob
from tracegym.types import WeightVersionSpan

if TYPE_CHECKING:
    from tracegym.gateway.upstream.sglang import SGLangUpstream

log = logging.getLogger("tracegym.gateway")

MAX_CONTINUATIONS = 8
"""Swap-aborts one choice may be continued through before the call fails (503)."""
DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's (and the embedded engine's) ``max_new_tokens`` when a request sets none: the budget a
continuation of such a request shares."""


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
    weight_version: str
    model_path: str
    success: bool
    finished_at: float
    """Unix time."""
    swap_seconds: float


class SwapCoordinator:
    """One swap at a time against an SGLang-protocol upstream; records successful versions in ``store``
    (a ``tracegym.gateway.store.Store`` or None when recording is off)."""

    def __init__(self, upstream: SGLangUpstream, store: Any = None) -> None:
        self.upstream = upstream
        self.gate: SwapGate = upstream.gate
        self.store = store
        self.last: LastSwap | None = None
        self._lock = asyncio.Lock()

    async def update(self, model_path: str, weight_version: str, *, pause: bool = True) -> SwapOutcome:
        """Load ``model_path`` as ``weight_version``. Upstream refusals come back as ``success=False``
        (the old weights stay current); an unreachable upstream raises the gateway's 502/504 errors."""
        if not model_path or not weight_version:
            raise ValueError("model_path and weight_version must be non-empty strings")
        async with self._lock:
            t0 = time.monotonic()
            ok, message = await self._swap(model_path, weight_version, pause)
            seconds = time.monotonic() - t0
            self.last = LastSwap(weight_version, model_path, ok, time.time(), seconds)
        log.info("weight swap to %s (%s): %s in %.2fs: %s", weight_version, model_path,
                 "ok" if ok else "FAILED", seconds, message)
        if ok and self.store is not None:
            await asyncio.to_thread(self.store.add_weight_version, weight_version, path=model_path,
                                    swap_seconds=seconds)
        return SwapOutcome(ok, message, weight_version, seconds)

    async def _swap(self, model_path: str, weight_version: str, pause: bool) -> tuple[bool, str]:
        up = self.upstream
        self.gate.begin()
        try:
            if pause:
                status, body = await up.post_control("/pause_generation", {"mode": "abort"})
                if status >= 400:
                    return False, f"pause_generation failed (HTTP {status}): {_message(body)}"
            status, body = await up.post_control(
                "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})
            ok = status < 400 and bool(body.get("success", False))
            return ok, _message(body) or f"HTTP {status}"
        finally:
            try:
                if pause:
                    status, body = await up.post_control("/continue_generation", {})
                    if status >= 400:
                        raise RuntimeError(f"continue_generation failed (HTTP {status}): {_message(body)}; "
                                           "the upstream may still be paused")
            finally:
                self.gate.end()

    async def status(self) -> dict[str, Any]:
        """The upstream's current version (asked live) and the last swap this gateway ran."""
        info = await self.upstream.model_info()
        last = self.last
        return {
            "weight_version": info.weight_version, "swapping": self.gate.swapping,
            "last_swap": None if last is None else {
                "weight_version": last.weight_version, "model_path": last.model_path, "success": last.success,
                "finished_at": last.finished_at, "swap_seconds": last.swap_seconds},
        }


def _message(body: dict[str, Any]) -> str:
    msg = body.get("message")
    if msg is None and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
    return str(msg) if msg is not None else ""


# --- continuation of swap-aborted choices (used by upstream/sglang.py) ---------------------------

def extend_spans(spans: list[WeightVersionSpan], version: str | None, start: int, end: int) -> None:
    """Record output tokens ``[start, end)`` as sampled with ``version`` (adjacent equal versions merge)."""
    if end <= start or version is None:
        return
    if spans and spans[-1].version == version and spans[-1].end == start:
        spans[-1].end = end
    else:
        spans.append(WeightVersionSpan(version, start, end))


@dataclass(slots=True)
class JoinedChoice:
    """One choice assembled from the segments of its continuations."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[TopLogprob]] | None = None
    text: str = ""
    spans: list[WeightVersionSpan] = field(default_factory=list)
    continuations: int = 0

    def add(self, ch: GenChoice, version: str | None) -> None:
        start = len(self.ids)
        self.ids.extend(ch.output_ids or ())
        self.logprobs.extend(ch.logprobs or ())
        if ch.top_logprobs:
            if self.tops is None:
                self.tops = []
            self.tops.extend(ch.top_logprobs)
        self.text += ch.text or ""
        extend_spans(self.spans, version, start, len(self.ids))

    def final(self, finish: str | None, stop_matched: str | None) -> GenChoice:
        return GenChoice(index=self.index, output_ids=self.ids, logprobs=self.logprobs or None,
                         top_logprobs=self.tops, text=self.text, finish_reason=finish, stop_matched=stop_matched,
                         weight_versions=list(self.spans))


def continuation_request(req: GenerateRequest, joined: JoinedChoice) -> GenerateRequest | None:
    """The re-post of an aborted choice (None when its token budget is already spent)."""
    if req.input_ids is None:
        raise ValueError("the sglang upstream needs input_ids")
    budget = req.sampling.max_tokens if req.sampling.max_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    remaining = budget - len(joined.ids)
    if remaining <= 0:
        return None
    sampling = dataclasses.replace(req.sampling, max_tokens=remaining, n=1,
                                   stop=list(req.sampling.stop), stop_token_ids=list(req.sampling.stop_token_ids))
    suffix = f"-c{joined.continuations}" if req.sampling.n <= 1 else f"-{joined.index}-c{joined.continuations}"
    return dataclasses.replace(req, rid=req.rid + suffix, sampling=sampling,
                               input_ids=[*req.input_ids, *joined.ids])


def too_many_continuations(rid: str) -> OpenAIError:
    return OpenAIError(503, f"request {rid} was interrupted by {MAX_CONTINUATIONS} weight swaps in a row and "
                            "not continued further", code="weight_swap_interrupted")
