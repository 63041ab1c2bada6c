"""Torch work besides a process's one compute thread runs in threads that end with it (``in_own_thread``).

On the CPU torch computes in OpenMP parallel regions, and GNU OpenMP (the runtime torch's wheels ship) keeps a
pool of worker threads for every thread that has run one. Once the process holds more of those threads than it
has CPUs, OpenMP throttles their waiting: a worker no longer spins between regions but sleeps, and each small
region (a decode step or a training step of a small model is hundreds of small matrix products) waits for its
workers to be woken. Measured on 2 vCPUs, the engine's decode step of SmolLM2 over 32 rows took 103 ms with a
second pool in the process (the model loaded on another thread that lived on) and 68 ms without. A pool ends
with its thread, so the engine loads its model, and reads and checks checkpoints, adapters and weight buckets,
in threads that end once done: never on the event loop's thread, nor in the default executor's threads, which
live on. A thread per call suits such occasional work; it is not meant for a stream of calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a new thread that ends when it returns; its result (or its exception) here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the caller went away (cancelled)
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the caller, raised there
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=f"torch-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return await done
