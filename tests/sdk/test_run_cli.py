"""``tracegym run`` against a real gateway (``tracegym serve``, SQLite; the agents make no LLM calls): by
default it ends once the queue is drained and its rollouts have finished, with a summary line; ``--follow``
keeps a worker waiting for rollouts enqueued later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ManagedProcess, free_port, run_command, start_process
from tracegym.client import GatewayClient, SDKConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gateway(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ManagedProcess]:
    """A gateway of its own per test: what one test leaves in the queue never reaches another."""
    port = free_port()
    args = ["tracegym", "serve", "--model", "tiny-random", "--port", str(port), "--upstream"]
    args += [f"http://127.0.0.1:{free_port()}", "--store", f"sqlite:///{tmp_path / 'tracegym.db'}"]
    with start_process(args, port=port, log_path=tmp_path / "gateway.log", health_path="/healthz") as gw:
        yield gw


@pytest.fixture
def client(gateway: ManagedProcess) -> Iterator[GatewayClient]:
    with GatewayClient(SDKConfig(gateway.base_url)) as c:
        yield c


def enqueue(client: GatewayClient, inputs: list[Any]) -> list[str]:
    return [rid for t in client.enqueue_tasks([{"input": i} for i in inputs]) for rid in t["rollout_ids"]]


def run(gateway: ManagedProcess, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tracegym.cli", "run", "tests.sdk.agents:echo_reward", "--gateway",
            gateway.base_url, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run_command(argv, cwd=ROOT, env=env, timeout=120)


def test_run_exits_once_the_queue_is_drained(client: GatewayClient, gateway: ManagedProcess) -> None:
    rids = enqueue(client, [{"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0}])
    res = run(gateway, "--concurrency", "2")
    assert res.returncode == 0, res.stderr
    assert [client.get_rollout(r)["status"] for r in rids] == ["completed"] * 3
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("tracegym run: queue drained: 3 rollouts done, 0 failed, mean reward 0.667"), last


def test_run_on_an_empty_queue_says_what_to_do(gateway: ManagedProcess) -> None:
    res = run(gateway)
    assert res.returncode == 0, res.stderr
    assert "the queue has no rollouts to run" in res.stderr and "--follow" in res.stderr


def test_follow_keeps_working_after_the_queue_drains(
    client: GatewayClient, gateway: ManagedProcess, tmp_path: Path
) -> None:
    argv = ["tracegym", "run", "tests.sdk.agents:echo_reward", "--gateway", gateway.base_url, "--follow"]
    with start_process(argv, port=None, log_path=tmp_path / "run.log", env={"PYTHONPATH": str(ROOT)},
                       cwd=ROOT) as worker:
        for reward in (1.0, 0.5):  # the second is enqueued after the first drained the queue
            (rid,) = enqueue(client, [{"reward": reward}])
            deadline = time.monotonic() + 60
            while client.get_rollout(rid)["status"] != "completed":
                assert worker.alive(), worker.log()
                assert time.monotonic() < deadline, worker.log()
                time.sleep(0.1)
        assert worker.alive(), worker.log()
        worker.proc.send_signal(signal.SIGTERM)
        returncode = worker.proc.wait(timeout=30)
        log = worker.log()
    assert returncode == 0, log
    assert "done 2 | failed 0" in log and "queue drained" not in log
