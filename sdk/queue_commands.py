"""The two commands that work the rollout queue: ``tracegym enqueue FILE.jsonl`` fills it from a task file
(``tracegym.tasks``), ``tracegym run MODULE:FUNCTION`` runs an agent over it (``tracegym.runner``, with
signal handling and a progress line). Their arguments are parsed in ``tracegym.cli``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from tracegym.agent import Agent, load_target
from tracegym.cli_gateway import check_gateway, lost_gateway
from tracegym.client import GatewayClient, GatewayError, GatewayUnreachableError, SDKConfig, config_for
from tracegym.errors import UserError
from tracegym.progress import RunStats
from tracegym.runner import Runner
from tracegym.tasks import read_tasks

log = logging.getLogger("tracegym.runner")  # the runner's name: one logger for everything a run prints

ENQUEUE_BATCH = 500
"""Tasks per enqueue request (a large file becomes several requests)."""


def main(args: argparse.Namespace) -> int:
    """``tracegym run``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_third_party_loggers()
    agent = load_agent(args.target)
    try:
        runner = Runner(
            agent,
            args.gateway,
            args.concurrency,
            lease_seconds=args.lease_seconds,
            max_rollouts=args.max_rollouts,
            exit_when_idle=not args.follow,
            worker_id=args.worker_id,
            progress=True,
        )
    except ValueError as e:  # a bad --gateway URL, --concurrency or --lease-seconds
        raise UserError(str(e), "see tracegym run --help") from None
    if not args.follow:  # a worker that follows the queue may start before its gateway
        check_gateway(runner.config.gateway_url if runner.config else "", args.gateway)
    try:
        stats, stopped = asyncio.run(_run_until_signalled(runner))
    except GatewayError as e:  # unreachable, or a 4xx from the queue: the message says which
        raise SystemExit(f"tracegym run: {e}") from None
    if not args.follow and not stopped:
        print(_summary(stats), file=sys.stderr)
    return 0


def _summary(stats: RunStats) -> str:
    """The line ``tracegym run`` ends with once the queue is drained."""
    if stats.done + stats.failed + stats.lost == 0:
        return ("tracegym run: the queue has no rollouts to run; enqueue tasks first (tracegym enqueue "
                "FILE.jsonl), or pass --follow to wait for them")
    mean = "-" if stats.mean_reward is None else f"{stats.mean_reward:.3f}"
    return (f"tracegym run: queue drained: {stats.done} rollouts done, {stats.failed} failed, mean reward "
            f"{mean} (--follow keeps a worker waiting for new rollouts)")


async def _run_until_signalled(runner: Runner) -> tuple[RunStats, bool]:
    """The first SIGINT/SIGTERM stops claiming and lets in-flight rollouts finish (up to the grace
    period); a second one releases them at once."""
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
    stats = await runner.run(stop)
    return stats, stop.is_set()


def load_agent(target: str) -> Agent:
    """``load_target``, with the mistakes a user makes in MODULE:FUNCTION as ``UserError``s. An error
    raised by the agent module's own code (other than a missing import) keeps its traceback."""
    fix = ("pass MODULE:FUNCTION (MODULE importable from the current directory) or path/to/file.py:FUNCTION, "
           "e.g. examples/openai/agent.py:agent")
    module = target.rpartition(":")[0]
    try:
        return load_target(target)
    except ModuleNotFoundError as e:
        if e.name and module.replace("/", ".").removesuffix(".py").startswith(e.name):
            raise UserError(f"agent {target!r}: no module named {e.name!r} (cwd {os.getcwd()})", fix) from None
        raise UserError(
            f"agent {target!r}: its module imports {e.name!r}, which is not installed",
            f"install it (pip install {e.name}) in this environment",
        ) from None
    except (ValueError, FileNotFoundError, AttributeError, TypeError) as e:
        raise UserError(str(e) if repr(target) in str(e) else f"agent {target!r}: {e}", fix) from None


def load_task_file(path: str) -> list[dict[str, Any]]:
    """``read_tasks``, with a missing, unreadable, malformed or empty file as a ``UserError``."""
    fix = 'a task file is JSONL: one JSON value per line, e.g. {"task_id": "t1", "input": {"question": "2+2?"}}'
    try:
        tasks = read_tasks(path)
    except FileNotFoundError:
        raise UserError(f"task file not found: {os.path.abspath(path)}", fix) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason})", fix) from None
    except OSError as e:
        raise UserError(f"cannot read the task file {path}: {e.strerror or e}", fix) from None
    except ValueError as e:
        raise UserError(str(e), fix) from None
    if not tasks:
        raise UserError(f"{path}: no tasks (the file is empty)", fix)
    return tasks


def _quiet_third_party_loggers() -> None:
    """Agent frameworks log at INFO what a runner's console should not show: a line per HTTP request
    (httpx), every AutoGen message as a multi-KB event (autogen_core.events). Warnings still show."""
    for name in ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "anthropic", "autogen_core", "autogen_agentchat",
                 "autogen_ext", "langchain", "langsmith", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def gateway_config(gateway: str | None) -> SDKConfig:
    """``config_for(gateway)``, with a malformed ``--gateway`` URL as a ``UserError``."""
    try:
        return config_for(gateway)
    except ValueError as e:
        raise UserError(str(e), "pass --gateway http://HOST:PORT (or set $TRACEGYM_GATEWAY)") from None


def enqueue_main(args: argparse.Namespace) -> int:
    """``tracegym enqueue``."""
    tasks = load_task_file(args.dataset)
    config = gateway_config(args.gateway)
    check_gateway(config.gateway_url, args.gateway)
    n_rollouts = 0
    with GatewayClient(config) as client:
        for i in range(0, len(tasks), ENQUEUE_BATCH):
            try:
                out = client.enqueue_tasks(
                    tasks[i : i + ENQUEUE_BATCH], group_size=args.group_size, max_attempts=args.max_attempts
                )
            except GatewayUnreachableError as e:
                raise lost_gateway(f"the enqueue ({i} of {len(tasks)} tasks enqueued)", config.gateway_url, e,
                                   args.gateway) from None
            except GatewayError as e:
                raise SystemExit(f"tracegym enqueue: {e} ({i} of {len(tasks)} tasks enqueued)") from None
            n_rollouts += sum(len(t["rollout_ids"]) for t in out)
    print(
        f"enqueued {len(tasks)} tasks, {n_rollouts} rollouts (group size {args.group_size}) "
        f"at {config.gateway_url}"
    )
    return 0
