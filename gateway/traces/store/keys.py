"""Time-ordered ids for the rows the gateway creates: calls, their trace ids, ad-hoc and queued rollouts.

The store finds spans by trace id, call id and rollout, and rollouts by id, through B-tree indexes. A random
id puts each new row's key on a random leaf page of each index, and SQLite writes every page a transaction
touched, whole, to its write-ahead log at commit: a group commit of eight calls with random ids touched some
thirty pages. Ids that begin with the time in milliseconds (as UUIDv7 does) are appended to the last leaf
of each index instead, so a commit writes a few pages however many calls it holds. The other 80 bits stay
random: ids remain unguessable and unique across gateways (a trace id's low 64 bits are what OpenTelemetry's
ratio sampler reads, and W3C trace context asks for its right-most 56 bits to be random).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

RANDOM_BITS = 80
"""Random low bits of an ordered 128-bit id, below 48 bits of Unix time in milliseconds."""


def ordered_id(getrandbits: Callable[[int], int] = random.getrandbits) -> int:
    """A 128-bit id: Unix time in milliseconds, then ``RANDOM_BITS`` random bits (never 0)."""
    return (time.time_ns() // 1_000_000) << RANDOM_BITS | getrandbits(RANDOM_BITS)


def ordered_hex() -> str:
    """``ordered_id`` as 32 hex digits: sorts as it was made, to the millisecond."""
    return f"{ordered_id():032x}"
