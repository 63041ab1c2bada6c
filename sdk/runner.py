"""``tracegym run`` / ``tracegym enqueue``, and the in-process API ``run_agent`` / ``Runner``.

Call convention: the agent is ``def agent(task, base_url) -> float | None`` (or ``async def``).

- ``task`` is the rollout's input exactly as enqueued (usually a dict: a line of the JSONL dataset,
  or its ``"input"`` field when the line had one). Ids are in ``tg.current_rollout()``.
- ``base_url`` is ``{gateway}/rollouts/{rollout_id}/v1``: give it to the OpenAI client / framework.
- The call runs inside ``tg.rollout`` for that rollout, so ``tg.reward``/``tg.emit`` attach to it and
  httpx calls to the gateway are attributed even with another base_url.
- Returning a number completes the rollout with that reward; returning None completes it with the
  rewards sent through ``tg.reward`` (if any). Raising fails it with the traceback stored (the queue
  retries it up to its ``max_attempts``). Anything else returned fails it with a TypeError (a NaN or
  infinite number with a ValueError: the gateway stores finite rewards only).

Sync agents run in their own daemon threads, async ones on the runner's event loop; at most
``concurrency`` at once. While a rollout runs its lease is renewed every ``lease_seconds / 3``.
Stopping (SIGINT/SIGTERM, or ``stop_event``) stops claiming, lets in-flight rollouts finish for up to
``grace_seconds`` (a second signal skips the wait) and releases the rest back to the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from tracegym.agent_runner import Agent, Runner, StopEvent, as_reward, rollout_base_url
from tracegym.client import GatewayClient, GatewayError, config_for
from tracegym.progress import RunStats

__all__ = [
    "RunStats",
    "Runner",
    "StopEvent",
    "as_reward",
    "enqueue_main",
    "load_target",
    "main",
    "read_tasks",
    "rollout_base_url",
    "run_agent",
]

log = logging.getLogger("tracegym.runner")


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


async def run_agent(
    agent: Agent | str,
    gateway: str | None = None,
    concurrency: int = 4,
    *,
    stop_event: StopEvent | None = None,
    **options: Any,
) -> RunStats:
    """Run ``agent`` over the gateway's queue until ``stop_event`` is set (or ``exit_when_idle`` /
    ``max_rollouts``). ``options`` are ``Runner`` fields (lease_seconds, max_rollouts, exit_when_idle,
    worker_id, poll_interval, grace_seconds, api_key, progress). ``stop_event`` may be an
    ``asyncio.Event`` or a ``threading.Event``."""
    runner = Runner(agent, gateway, concurrency, **options)
    return await runner.run(stop_event)


# -- CLI ----------------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    runner = Runner(
        args.target,
        args.gateway,
        args.concurrency,
        lease_seconds=args.lease_seconds,
        max_rollouts=args.max_rollouts,
        exit_when_idle=args.exit_when_idle,
        worker_id=args.worker_id,
        progress=True,
    )
    try:
        return asyncio.run(_main(runner))
    except GatewayError as e:  # unreachable, or a 4xx from the queue: the message says which
        raise SystemExit(f"tracegym run: {e}") from None


async def _main(runner: Runner) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            runner.force_stop()
        else:
            log.warning(
                "%s: stopping (finishing in-flight rollouts; again to release them)",
                signal.Signals(signum).name,
            )
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    await runner.run(stop)
    return 0


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks of a JSONL file: a line with an ``"input"`` key is a task (``task_id``, ``input``,
    ``split``, ``metadata``); any other JSON value is the input itself. Blank lines are skipped."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON: {e}") from e
            tasks.append(_as_task(obj, f"{path}:{n}"))
    return tasks


def _as_task(obj: Any, where: str) -> dict[str, Any]:
    if not (isinstance(obj, dict) and "input" in obj):
        return {"input": obj}
    extra = set(obj) - {"task_id", "input", "split", "metadata"}
    if extra:
        raise ValueError(
            f"{where}: unknown task fields {sorted(extra)} (a task line has task_id, input, "
            "split, metadata; put anything else inside input or metadata)"
        )
    return {k: obj[k] for k in ("task_id", "input", "split", "metadata") if obj.get(k) is not None}


def enqueue_main(args: argparse.Namespace) -> int:
    tasks = read_tasks(args.dataset)
    if not tasks:
        raise SystemExit(f"{args.dataset}: no tasks")
    config = config_for(args.gateway)
    n_rollouts = 0
    with GatewayClient(config) as client:
        for i in range(0, len(tasks), 500):
            try:
                out = client.enqueue_tasks(
                    tasks[i : i + 500], group_size=args.group_size, max_attempts=args.max_attempts
                )
            except GatewayError as e:
                raise SystemExit(f"tracegym enqueue: {e} ({i} of {len(tasks)} tasks enqueued)") from None
            n_rollouts += sum(len(t["rollout_ids"]) for t in out)
    print(
        f"enqueued {len(tasks)} tasks, {n_rollouts} rollouts (group size {args.group_size}) "
        f"at {config.gateway_url}"
    )
    return 0
