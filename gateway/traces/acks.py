"""Commit acknowledgements for the span recorder (``recorder.TraceRecorder.record_durably``).

A call that must not be answered before its span is committed hands the recorder an ``asyncio.Future``
made on its event loop (an ``Ack``); the record travels the recorder's queue with it, the build thread
keeps the acks of each encoded batch next to the batch (``Built``), and the write thread settles them once
the transaction holding the batch committed (``True``) or was given up (``False``). Many calls share one
commit (group commit), and each batch costs one ``call_soon_threadsafe`` per event loop, not one per call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from tracegym.gateway.traces.store.span_rows import SpanBatch

Ack = asyncio.Future
"""``Future[bool]``: True once the span is committed, False when it was lost (counted as dropped)."""


@dataclass(slots=True)
class Built:
    """An encoded batch and the acks of the spans in it (in the recorder's write queue)."""

    batch: SpanBatch
    acks: list[Ack] = field(default_factory=list)


def _resolve(acks: list[Ack], ok: bool) -> None:
    for a in acks:
        if not a.done():  # a caller that went away cancelled its wait
            a.set_result(ok)


def settle(acks: Iterable[Ack], ok: bool) -> None:
    """Resolve ``acks`` from any thread, one callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Ack]] = {}
    for a in acks:
        by_loop.setdefault(a.get_loop(), []).append(a)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, group, ok)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            continue


def settle_now(ack: Ack | None, ok: bool) -> None:
    """Resolve one ack on its own loop's thread (a span refused as it is queued)."""
    if ack is not None and not ack.done():
        ack.set_result(ok)
