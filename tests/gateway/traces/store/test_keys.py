"""Time-ordered ids: the time in the high bits, random low bits."""

from __future__ import annotations

import random

from tracegym.gateway.proxy.call_context import new_context
from tracegym.gateway.traces.store import keys
from tracegym.gateway.traces.store.keys import RANDOM_BITS, ordered_hex, ordered_id


def test_ids_sort_in_the_order_they_were_made(monkeypatch):
    clock = iter(range(1_700_000_000_000_000_000, 1_700_000_000_000_000_000 + 10**9 * 50, 10**6))
    monkeypatch.setattr(keys.time, "time_ns", lambda: next(clock))  # one millisecond a call
    made = [ordered_hex() for _ in range(50)]
    assert sorted(made) == made and len(set(made)) == 50
    assert all(len(h) == 32 and int(h, 16) >> RANDOM_BITS == 1_700_000_000_000 + i for i, h in enumerate(made))


def test_ids_of_one_millisecond_differ_in_their_random_bits(monkeypatch):
    monkeypatch.setattr(keys.time, "time_ns", lambda: 1_700_000_000_000_123_456)
    ids = {ordered_id(random.Random(seed).getrandbits) for seed in range(200)} | {ordered_id() for _ in range(200)}
    assert len(ids) == 400
    assert {i >> RANDOM_BITS for i in ids} == {1_700_000_000_000}


def test_call_and_adhoc_rollout_ids_are_time_ordered():
    first = new_context("chat", None, {})
    second = new_context("chat", None, {})
    assert first.call_id.startswith("chatcmpl-") and first.rollout_id.startswith("adhoc-")
    assert len(first.call_id) == len("chatcmpl-") + 32 and first.call_id != second.call_id
    stamp = int(first.call_id.removeprefix("chatcmpl-"), 16) >> RANDOM_BITS
    assert abs(stamp - int(keys.time.time() * 1000)) < 60_000
    assert first.call_id[9:21] <= second.call_id[9:21]  # the millisecond prefix never goes back here
