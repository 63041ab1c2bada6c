"""The runner against the real gateway (`tracegym serve`, SQLite store; no inference upstream is needed
since these agents make no LLM calls): success, reward, exception, lease and Ctrl-C paths."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ManagedProcess, free_port, start_process
from tests.sdk import agents
from tracegym.client import GatewayClient, SDKConfig
from tracegym.runner import run_agent

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    tmp = tmp_path_factory.mktemp("gw")
    port = free_port()
    args = ["tracegym", "serve", "--model", "tiny-random", "--port", str(port), "--upstream"]
    args += [f"http://127.0.0.1:{free_port()}", "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    with start_process(args, port=port, log_path=tmp / "gateway.log", health_path="/healthz") as gw:
        yield gw


@pytest.fixture
def client(gateway: ManagedProcess) -> Iterator[GatewayClient]:
    with GatewayClient(SDKConfig(gateway.base_url)) as c:
        yield c


def enqueue(client: GatewayClient, inputs: list[Any], **kw: Any) -> list[str]:
    return [
        rid for t in client.enqueue_tasks([{"input": i} for i in inputs], **kw) for rid in t["rollout_ids"]
    ]


async def test_returned_rewards(client: GatewayClient, gateway: ManagedProcess) -> None:
    rids = enqueue(client, [{"reward": 1.0}, {"reward": 0.0}], group_size=2)
    stats = await run_agent(agents.echo_reward, gateway.base_url, 4, exit_when_idle=True, poll_interval=0.1)
    assert (stats.done, stats.failed, stats.mean_reward) == (4, 0, 0.5)
    got = sorted((r["status"], r["reward"]) for r in map(client.get_rollout, rids))
    assert got == [("completed", 0.0)] * 2 + [("completed", 1.0)] * 2


async def test_tg_reward_and_events(client: GatewayClient, gateway: ManagedProcess) -> None:
    (rid,) = enqueue(client, [{"reward": 0.75}])
    stats = await run_agent(
        agents.rewards_and_events, gateway.base_url, exit_when_idle=True, poll_interval=0.1
    )
    assert stats.done == 1 and stats.mean_reward == 0.75  # the gateway's reward, reported back by complete
    r = client.get_rollout(rid)
    assert (r["status"], r["reward"]) == ("completed", 0.75)
    assert [(e["name"], e["value"]) for e in r["rewards"]] == [("format", 0.1), (None, 0.75)]
    assert [(e["name"], e["attributes"]) for e in r["events"]] == [("turns", {"n": 2})]


async def test_exception_fails_after_attempts(client: GatewayClient, gateway: ManagedProcess) -> None:
    (rid,) = enqueue(client, ["boom"], max_attempts=2)
    stats = await run_agent(agents.raises, gateway.base_url, exit_when_idle=True, poll_interval=0.1)
    assert stats.failed == 2 and stats.done == 0  # requeued once, then failed for good
    r = client.get_rollout(rid)
    assert r["status"] == "failed" and "ValueError: agent broke on 'boom'" in r["error"]


async def test_heartbeats_keep_the_lease(client: GatewayClient, gateway: ManagedProcess) -> None:
    (rid,) = enqueue(client, [{"sleep": 2.5}])
    stats = await run_agent(
        agents.async_slow, gateway.base_url, 2, lease_seconds=1.0, exit_when_idle=True, poll_interval=0.1
    )
    r = client.get_rollout(rid)
    assert stats.done == 1 and stats.lost == 0
    assert (r["status"], r["attempt"], r["reward"]) == ("completed", 1, 1.0)


async def test_an_idle_runner_starts_a_rollout_the_moment_it_is_enqueued(
    client: GatewayClient, gateway: ManagedProcess
) -> None:
    assert client.get("/api/rollouts", "list rollouts", {"status": "queued"})["rollouts"] == []
    # claims 30 s apart: only a claim held at the gateway takes the rollout within the bound below
    run = asyncio.create_task(run_agent(agents.echo_reward, gateway.base_url, max_rollouts=1,
                                        poll_interval=30, claim_wait_s=10))
    await asyncio.sleep(0.5)  # the runner's first claim waits at the gateway
    (rid,) = await asyncio.to_thread(enqueue, client, [{"reward": 1.0}])
    t0 = time.monotonic()
    stats = await asyncio.wait_for(run, 60)
    assert stats.done == 1 and time.monotonic() - t0 < 8
    assert client.get_rollout(rid)["status"] == "completed"


def test_sigterm_releases(client: GatewayClient, gateway: ManagedProcess, tmp_path: Path) -> None:
    (rid,) = enqueue(client, [{"sleep": 60}])
    argv = ["tracegym", "run", "tests.sdk.agents:slow", "--gateway", gateway.base_url, "--follow"]
    log = tmp_path / "run.log"
    # in its own process group, killed with it when the block ends (even on a failed assert)
    with start_process(argv, port=None, log_path=log, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT) as run:
        deadline = time.monotonic() + 30
        while client.get_rollout(rid)["status"] != "running":
            assert time.monotonic() < deadline, "the runner never claimed the rollout"
            time.sleep(0.1)
        attempt = client.get_rollout(rid)["attempt"]
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        run.proc.send_signal(signal.SIGTERM)  # the second one releases without waiting for the agent
        returncode = run.proc.wait(timeout=30)
        err = run.log()
    assert returncode == 0, err
    r = client.get_rollout(rid)
    assert (r["status"], r["attempt"]) == ("queued", attempt), r  # released: no attempt used
