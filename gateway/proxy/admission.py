"""What the gateway lets in under heavy or hostile traffic (docs/security.md, Limits), as objects the app
owns (``create_app``: ``app.state.admission``, and the ``auth.Guard``'s ``FailureLimiter``):

- ``Admission.enter``/``leave``: a bound on the inference calls in flight on this gateway
  (``max_concurrent_calls``) and per rollout token (``max_concurrent_calls_per_rollout``); past it a 429
  with ``Retry-After``, at once (no queue: a client that retries later is cheaper than one that waits
  holding a connection).
- ``RolloutStates``: whether a token's rollout has ended (completed or failed), so the token stops writing
  (409) while its reads still work. This gateway knows at once of the rollouts it completes or fails; any
  other is looked up in the store at most once per ``rollout_state_ttl_s`` per rollout.
- ``FailureLimiter``: requests with a missing or wrong key per client address (a token bucket of
  ``auth_failures_per_minute``); past it, the address's keyed requests are 429s until the bucket refills.
- ``ByteBudget``: the bytes of OTLP bodies being inflated and parsed at once (``otlp_inflight_bytes``).

Every check is a few dictionary operations on the event loop (no lock: one loop owns them); only a
token's rollout state, when not known, costs a store read in a thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tracegym.gateway.settings import GatewaySettings

ENDED = frozenset({"completed", "failed"})
"""Rollout statuses after which a rollout's token no longer writes."""
MAX_TRACKED = 100_000
"""Entries kept per table (addresses, rollouts); the oldest goes first."""


def _bounded_put(table: dict, key: Any, value: Any, limit: int = MAX_TRACKED) -> None:
    table.pop(key, None)
    table[key] = value
    if len(table) > limit:
        del table[next(iter(table))]


class FailureLimiter:
    """A token bucket of ``per_minute`` failures per client address, refilled continuously."""

    __slots__ = ("_buckets", "_capacity", "_clock", "_limit", "_rate")

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic,
                 max_addresses: int = MAX_TRACKED) -> None:
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}
        self._clock = clock
        self._limit = max_addresses

    def _level(self, address: str, now: float) -> float | None:
        bucket = self._buckets.get(address)
        if bucket is None:
            return None
        tokens, at = bucket
        return min(self._capacity, tokens + (now - at) * self._rate)

    def wait(self, address: str) -> float | None:
        """Seconds until ``address`` may try a key again (None: now)."""
        if not self._buckets:
            return None
        now = self._clock()
        tokens = self._level(address, now)
        if tokens is None:
            return None
        if tokens >= self._capacity:
            del self._buckets[address]  # refilled: forgotten
            return None
        return None if tokens >= 1.0 else (1.0 - tokens) / self._rate

    def failed(self, address: str) -> None:
        now = self._clock()
        tokens = self._level(address, now)
        _bounded_put(self._buckets, address, ((self._capacity if tokens is None else tokens) - 1.0, now),
                     self._limit)


class RolloutStates:
    """Which rollouts have ended, as far as a token's writes need to know (see the module docstring)."""

    __slots__ = ("_clock", "_ended", "_open_until", "_ttl")

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_s
        self._ended: dict[str, str] = {}
        self._open_until: dict[str, float] = {}
        self._clock = clock

    def ended(self, rollout_id: str, status: str) -> None:
        """Record that ``rollout_id`` ended with ``status`` (the control API, when it completes or fails
        one); a status that is not an end (a release that requeues it) forgets what was known."""
        self._open_until.pop(rollout_id, None)
        if status in ENDED:
            _bounded_put(self._ended, rollout_id, status)
        else:
            self._ended.pop(rollout_id, None)

    async def ended_status(self, store: Any, rollout_id: str) -> str | None:
        """``completed``/``failed`` if the rollout has ended, else None (also for an unknown rollout)."""
        status = self._ended.get(rollout_id)
        if status is not None or store is None:
            return status
        now = self._clock()
        if self._open_until.get(rollout_id, 0.0) > now:
            return None
        row = await asyncio.to_thread(store.get_rollout, rollout_id)
        status = row.get("status") if row else None
        if status in ENDED:
            self.ended(rollout_id, status)
            return status
        _bounded_put(self._open_until, rollout_id, now + self._ttl)
        return None


class ByteBudget:
    """Bytes reserved by requests in flight, at most ``limit`` together."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes (False, nothing reserved: over the budget). A single request larger than the
        whole budget is let in when nothing else holds any, so a budget below the body limit still serves."""
        if self.used and self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Admission:
    """The per-gateway state of the limits above (``app.state.admission``)."""

    __slots__ = ("active", "by_rollout", "max_calls", "max_per_rollout", "otlp", "retry_after", "rollouts")

    def __init__(self, settings: GatewaySettings) -> None:
        self.max_calls = settings.max_concurrent_calls
        self.max_per_rollout = settings.max_concurrent_calls_per_rollout
        self.retry_after = settings.retry_after_s
        self.active = 0
        self.by_rollout: dict[str, int] = {}
        self.rollouts = RolloutStates(settings.rollout_state_ttl_s)
        self.otlp = ByteBudget(settings.otlp_inflight_bytes)

    def enter(self, token_rollout: str | None) -> str | None:
        """Admit one call (None), else the reason it is refused; ``token_rollout``: the rollout of the token
        it came with (None for the admin key or a keyless gateway: only the gateway's bound applies)."""
        if self.active >= self.max_calls:
            return f"this gateway is serving its limit of {self.max_calls} calls at once: retry shortly"
        if token_rollout is not None:
            n = self.by_rollout.get(token_rollout, 0)
            if n >= self.max_per_rollout:
                return (f"this rollout has its limit of {self.max_per_rollout} calls in flight at once: "
                        "retry shortly")
            self.by_rollout[token_rollout] = n + 1
        self.active += 1
        return None

    def leave(self, token_rollout: str | None) -> None:
        self.active -= 1
        if token_rollout is not None:
            n = self.by_rollout[token_rollout] - 1
            if n:
                self.by_rollout[token_rollout] = n
            else:
                del self.by_rollout[token_rollout]
