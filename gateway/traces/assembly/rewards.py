"""Rewards on sequences: step rewards kept with the call they were emitted at, per-sequence discount."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from tracegym.gateway.traces.token_calls import TokenCall
from tracegym.types import CallRecord


def time_ns(value: Any) -> int:
    """An event time (datetime, ISO-8601 string, or epoch seconds) in epoch nanoseconds."""
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=UTC)
        return int(dt.timestamp() * 1e9)
    if isinstance(value, str):
        return time_ns(datetime.fromisoformat(value.replace("Z", "+00:00")))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value * 1e9) if value < 1e12 else int(value)
    raise ValueError(f"event time must be a datetime, an ISO-8601 string or epoch seconds; got {value!r}")


def step_rewards_by_call(calls: list[CallRecord] | list[TokenCall], events: Iterable[dict[str, Any]]
                         ) -> dict[int, list[dict]]:
    """Reward events keyed by the index of the call (in ``calls``) they belong to.

    An event with an integer ``call_index`` belongs to that call; otherwise to the last call that started
    at or before the event's ``created_at`` (the first call when it precedes them all). An event whose
    ``call_index`` is outside the rollout's calls is not attached to any call (it stays in the rollout's
    events).
    """
    out: dict[int, list[dict]] = {}
    if not calls:
        return out
    starts: list[int] = []  # the calls' start times, made for the first event placed by time
    for ev in events:
        idx = ev.get("call_index")
        if idx is None:
            when = ev.get("created_at")
            if when is None:
                raise ValueError(f"reward event has neither call_index nor created_at: {ev!r}")
            starts = starts or [c.start_time_ns for c in calls]
            idx = max(bisect.bisect_right(starts, time_ns(when)) - 1, 0)
        elif not isinstance(idx, int) or isinstance(idx, bool):
            raise ValueError(f"reward event call_index must be an integer; got {idx!r}")
        if 0 <= idx < len(calls):
            out.setdefault(idx, []).append(
                {"value": ev.get("value"), "name": ev.get("name"), "call_index": idx}
            )
    return out


def discount_distances(end_positions: list[int]) -> list[int]:
    """For each sequence (given the call index it ends at), how many distinct later end points follow."""
    later = sorted(set(end_positions))
    return [len(later) - 1 - bisect.bisect_left(later, p) for p in end_positions]


def discounted(reward: float | None, gamma: float, distance: int) -> float | None:
    if reward is None:
        return None
    return reward if gamma == 1.0 else reward * gamma**distance
