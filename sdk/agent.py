"""The user's agent function, as the runner sees it: loaded from a ``MODULE:FUNCTION`` target
(``load_target``), called inside its rollout's scope (``call_agent``: a sync agent in a daemon thread, an
async one on the event loop), its return value read as a reward (``as_reward``). The call convention
itself is documented in ``tracegym.runner``."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracegym.context import RolloutScope, enter_scope, validate_reward

# one logger name for everything a run prints, so `tracegym.runner` filters all of it
log = logging.getLogger("tracegym.runner")
Agent = Callable[[Any, str], Any]
"""``agent(task_input, base_url)``, sync or async; see ``tracegym.runner`` for what it may return."""


def load_target(target: str) -> Agent:
    """``package.module:function`` (imported with the current directory on sys.path) or
    ``path/to/file.py:function``; ``function`` may be dotted (``module:obj.method``)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"expected MODULE:FUNCTION or path/to/file.py:FUNCTION, got {target!r}")
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"agent file not found: {path}")
        name = f"_tracegym_agent_{path.stem}_{uuid.uuid4().hex[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_part)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{target!r}: {module_part} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target!r} is not callable")
    return obj


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


async def call_agent(fn: Agent, scope: RolloutScope, task_input: Any) -> Any:
    """``fn(task_input, base_url)`` inside ``scope``: awaited on this loop when async, else run in a daemon
    thread (and a coroutine it returns awaited here). Returns what the agent returned."""
    base_url = rollout_base_url(scope.config.gateway_url, scope.rollout_id)
    if is_async(fn):
        with enter_scope(scope):
            return await fn(task_input, base_url)
    result = await _in_thread(scope, fn, task_input, base_url)
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine
        with enter_scope(scope):
            result = await result
    return result


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


def format_traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))
