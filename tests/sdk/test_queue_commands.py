"""``tracegym enqueue`` and ``tracegym run`` (the latter as a real process against the fake gateway)."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, start_process
from tests.sdk.fake_gateway import FakeGateway, enqueue, status
from tracegym.queue_commands import enqueue_main

REPO = Path(__file__).resolve().parents[2]


def test_enqueue_main(gw: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"task_id": "a", "input": 1}\n{"q": 2}\n')
    args = argparse.Namespace(dataset=str(f), gateway=gw.url, group_size=3, max_attempts=2)
    assert enqueue_main(args) == 0
    assert "enqueued 2 tasks, 6 rollouts" in capsys.readouterr().out
    assert [r["task_id"] for r in gw.state.queue].count("a") == 3 and len(gw.state.queue) == 6


def _cli(args: list[str], tmp_path: Path) -> ManagedProcess:
    """``tracegym ARGS`` in its own process group, output in a log: ``with`` kills it whatever happens."""
    log = tmp_path / f"cli-{time.monotonic_ns()}.log"
    env = {"PYTHONPATH": str(REPO)}
    return start_process(["tracegym", *args], port=None, log_path=log, env=env, cwd=REPO)


def test_cli_run_ends_when_the_queue_is_drained(gw: FakeGateway, tmp_path: Path) -> None:
    rids = enqueue(gw, [{"reward": 1.0}, {"reward": 0.0}])
    args = ["run", "tests/sdk/agents.py:echo_reward", "--gateway", gw.url]
    with _cli(args, tmp_path) as run:
        returncode = run.proc.wait(timeout=60)
        err = run.log()
    assert returncode == 0, err
    assert status(gw, rids) == [("completed", 1.0), ("completed", 0.0)]
    assert "done 2 | failed 0 | running 0 | mean reward 0.500" in err  # the final progress line


def test_cli_sigint_releases_in_flight(gw: FakeGateway, tmp_path: Path) -> None:
    rids = enqueue(gw, [{"sleep": 30}])
    with _cli(["run", "tests.sdk.agents:slow", "--gateway", gw.url, "--follow"], tmp_path) as run:
        deadline = time.monotonic() + 30
        while gw.state.rollouts[rids[0]]["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        run.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        run.proc.send_signal(signal.SIGINT)  # the second one skips the grace period
        returncode = run.proc.wait(timeout=20)
        err = run.log()
    assert returncode == 0, err
    assert status(gw, rids) == [("queued", None)]
    assert "released 1" in err
