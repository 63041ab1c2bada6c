"""What an untrained model does with an example agent's tasks, through the whole product: does GRPO get
a signal from them?

    python -m benchmarks.example_probe examples/openai [--tasks eval.jsonl] [--n 32] [--group 4]
                                       [--model smollm2-135m] [--concurrency 32] [--max-tokens N] [--show 8]

It serves the model (``tracegym serve --engine embedded``, a store of its own in a temporary directory),
queues ``--n`` tasks of the example's task file (``eval.jsonl`` by default, else ``tasks.jsonl``) with
``--group`` rollouts each, runs the example's ``agent.py:agent`` over them (``tracegym.runner.run_agent``,
``$TRACEGYM_MODEL`` set, and ``$TRACEGYM_MAX_TOKENS`` with ``--max-tokens``) and prints, as one JSON object: the mean reward,
the share of groups whose rewards differ (the groups a GRPO step trains on), the mean of each number the
agent emits (``tg.emit``), the LLM calls per rollout, failed rollouts, and the wall time. A task set is
worth training on when some groups succeed and most do not: the reward can rise, and GRPO has groups to
learn from at the start (docs/agents.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def read_tasks(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(rollouts: list[dict[str, Any]], calls: dict[str, int]) -> dict[str, Any]:
    """The probe's figures from the finished rollouts (``GET /api/rollouts``) and LLM calls per rollout."""
    from tracegym.trainer.run.build_batch import emitted_means

    done = [r for r in rollouts if r["status"] == "completed"]
    groups: dict[str, list[float]] = {}
    for r in done:
        groups.setdefault(r["group_id"], []).append(float(r["reward"] or 0.0))
    rewards = [x for g in groups.values() for x in g]
    return {
        "rollouts": len(rollouts),
        "failed": len(rollouts) - len(done),
        "reward_mean": round(statistics.fmean(rewards), 4) if rewards else None,
        "groups_with_signal": round(sum(len(set(g)) > 1 for g in groups.values()) / max(len(groups), 1), 4),
        "groups_all_success": round(sum(min(g) > 0 for g in groups.values()) / max(len(groups), 1), 4),
        "calls_per_rollout": round(statistics.fmean(calls.values()), 2) if calls else None,
        **{k: round(v, 4) for k, v in emitted_means(done).items()},
    }


def probe(args: argparse.Namespace) -> dict[str, Any]:
    from tracegym.client import GatewayClient, SDKConfig
    from tracegym.procs import free_port, start_process
    from tracegym.runner import run_agent

    example = Path(args.example).resolve()
    task_file = example / args.tasks if args.tasks else next(
        p for p in (example / "eval.jsonl", example / "tasks.jsonl") if p.is_file())
    tasks = read_tasks(task_file)
    random.Random(args.seed).shuffle(tasks)
    tasks = tasks[: args.n]
    os.environ["TRACEGYM_MODEL"] = args.model
    if args.max_tokens is not None:
        os.environ["TRACEGYM_MAX_TOKENS"] = str(args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="tracegym-probe-") as tmp:
        port = free_port()
        gateway = start_process(
            ["tracegym", "serve", "--engine", "embedded", "--model", args.model, "--port", str(port),
             "--store", f"sqlite:///{tmp}/probe.db", "--log-level", "warning"],
            port=port, log_path=Path(tmp) / "serve.log", health_path="/healthz", timeout=600)
        try:
            t0 = time.monotonic()
            with GatewayClient(SDKConfig(gateway.base_url)) as client:
                client.enqueue_tasks(tasks, group_size=args.group, max_attempts=1)
                sys.path.insert(0, str(example))
                asyncio.run(run_agent(f"{example / 'agent.py'}:agent", gateway.base_url,
                                      concurrency=args.concurrency, exit_when_idle=True))
                wall = time.monotonic() - t0
                rollouts = [client.get_rollout(r["rollout_id"]) for r in client.iter_rollouts()]  # with events
                replies = {r["rollout_id"]: [s["choices"][0].get("message") for s in client.rollout_spans(r["rollout_id"])
                                             if s.get("choices")] for r in rollouts}
                calls = {rid: len(msgs) for rid, msgs in replies.items()}
                for r in rollouts[: args.show]:  # what the model wrote, call by call
                    print(json.dumps({"reward": r["reward"], "replies": replies[r["rollout_id"]]}), file=sys.stderr)
        finally:
            gateway.stop()
    shown = task_file.relative_to(REPO) if task_file.is_relative_to(REPO) else task_file
    return {"example": example.name, "tasks": str(shown), "model": args.model,
            "group": args.group, "max_tokens": args.max_tokens, **summarise(rollouts, calls),
            "wall_s": round(wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("example", help="an example's directory, e.g. examples/openai")
    p.add_argument("--tasks", default=None, help="task file in that directory (default eval.jsonl, else tasks.jsonl)")
    p.add_argument("--n", type=int, default=32, help="tasks to sample")
    p.add_argument("--group", type=int, default=4, help="rollouts per task")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None, help="$TRACEGYM_MAX_TOKENS (default: the agent's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="print the replies of this many rollouts (stderr)")
    print(json.dumps(probe(p.parse_args())))


if __name__ == "__main__":
    main()
