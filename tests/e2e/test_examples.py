"""The framework examples run by `tracegym run` against a real `tracegym serve --engine embedded
--model tiny-random` (one gateway for the module): every rollout completes, every LLM call is a span
under its rollout id, and the reward the agent sent is stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, run_command
from tracegym.client import GatewayClient, SDKConfig
from tracegym.tasks import read_tasks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["openai", "langchain", "autogen", "openai_agents", "anthropic"]
API = {"openai_agents": "responses", "anthropic": "messages"}  # the others call Chat Completions


def run_example(name: str, gateway_url: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TRACEGYM_MODEL": "tiny-random",
        "TRACEGYM_MAX_TOKENS": "8",  # tiny-random writes garbage: keep the calls short
    }
    argv = [sys.executable, "-m", "tracegym.cli", "run", f"examples/{name}/agent.py:agent"]
    argv += ["--gateway", gateway_url, "--concurrency", "3"]
    return run_command(argv, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example(name: str, gateway: ManagedProcess) -> None:
    tasks = read_tasks(ROOT / "examples" / name / "tasks.jsonl")
    with GatewayClient(SDKConfig(gateway.base_url)) as client:
        enqueued = client.enqueue_tasks(tasks)
        rids = {rid: t["task_id"] for t in enqueued for rid in t["rollout_ids"]}
        res = run_example(name, gateway.base_url)
        assert res.returncode == 0, res.stderr[-4000:] + gateway.log()
        assert f"done {len(rids)} | failed 0 | running 0" in res.stderr, res.stderr[-4000:]
        # the runner's console: no INFO line per request or per framework event (AutoGen's are KBs each)
        assert not [line for line in res.stderr.splitlines() if line.startswith("INFO ")], res.stderr[-4000:]
        for rid, task_id in rids.items():
            rollout = client.get_rollout(rid)
            assert (rollout["status"], rollout["task_id"]) == ("completed", task_id), rollout
            assert rollout["reward"] in (0.0, 1.0)
            assert [r["value"] for r in rollout["rewards"]] == [rollout["reward"]]  # sent once, stored once
            spans = client.rollout_spans(rid)
            llm = [s for s in spans if s.get("choices")]
            assert 1 <= len(llm) <= 3, spans  # MAX_TURNS bounds the tool loop
            for span in llm:
                assert span["rollout_id"] == rid and span["status"] == "ok"
                assert span["name"] == "chat tiny-random"
                assert span["attributes"]["tracegym.api"] == API.get(name, "chat")
                assert span["prompt_ids"] and span["choices"][0]["output_ids"]
                assert span["attributes"]["tracegym.request"]["messages"][-1]["role"] in ("user", "tool")


def test_export_after_examples(gateway: ManagedProcess, tmp_path: Path) -> None:
    """`tracegym export` in both formats over the rollouts the examples left (runs one if alone)."""
    from tracegym.types import Trajectory

    with GatewayClient(SDKConfig(gateway.base_url)) as client:
        if not list(client.iter_rollouts(status="completed")):
            client.enqueue_tasks(read_tasks(ROOT / "examples" / "openai" / "tasks.jsonl"))
            assert run_example("openai", gateway.base_url).returncode == 0
        completed = {r["rollout_id"]: r for r in client.iter_rollouts(status="completed")}
    for fmt in ("trajectories", "chat"):
        out = tmp_path / f"{fmt}.jsonl"
        argv = [sys.executable, "-m", "tracegym.cli", "export", "--gateway", gateway.base_url]
        argv += ["--out", str(out), "--format", fmt]
        res = run_command(argv, cwd=ROOT, timeout=120)
        assert res.returncode == 0, res.stderr
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert {r["rollout_id"] for r in rows} == set(completed), fmt
        for row in rows:
            assert row["reward"] == completed[row["rollout_id"]]["reward"]
            if fmt == "chat":
                assert row["messages"][0]["role"] == "system" and row["messages"][-1]["role"] == "assistant"
            else:
                traj = Trajectory.from_dict(row)
                assert traj.sequences and all(1 in s.loss_mask for s in traj.sequences)
