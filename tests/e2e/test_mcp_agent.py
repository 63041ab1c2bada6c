"""The MCP example (``examples/mcp_agent``: an OpenAI-SDK tool loop whose tools come from a local MCP server
over stdio) run by ``tracegym run`` against ``tracegym serve --engine embedded`` on the scripted Qwen3
(``scripted_qwen3.py``: it always writes ``<think>I add.</think>`` and an ``add`` call with a=2, b=3), so the
model really samples tool calls, the MCP server really answers them, and the rollout must assemble into one
token-exact sequence: mask 1 exactly on the engine's sampled ids (with their logprobs), the MCP tool
results in the prompt between them with mask 0."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.scripted_qwen3 import THINKING_REPLY, build_scripted_qwen3
from tests.gateway.app_support import check_one_merged_sequence
from tests.procs import ManagedProcess, free_port, run_command, start_process
from tracegym.client import GatewayClient, SDKConfig

ROOT = Path(__file__).resolve().parents[2]
MAX_TURNS = 3  # examples/mcp_agent/agent.py: the scripted model calls `add` on every turn


@pytest.fixture(scope="module")
def scripted(qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    dest = tmp_path_factory.mktemp("scripted-qwen3-mcp")
    return dest, build_scripted_qwen3(qwen3_model_dir, dest)


@pytest.fixture(scope="module")
def gateway(scripted: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    tmp, port = tmp_path_factory.mktemp("mcp-gateway"), free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", str(scripted[0]), "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    with start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240) as gw:
        yield gw


def test_mcp_agent_through_tracegym_run(gateway: ManagedProcess, scripted: tuple[Path, dict]) -> None:
    from tokenizers import Tokenizer

    model, replies = str(scripted[0]), scripted[1]
    task = {"task_id": "mcp-add", "input": {"question": "What is 2+3?", "answer": "5"}}
    with GatewayClient(SDKConfig(gateway.base_url)) as client:
        (enqueued,) = client.enqueue_tasks([task])
        (rid,) = enqueued["rollout_ids"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACEGYM_MODEL": model, "TRACEGYM_MAX_TOKENS": "64",
               "MCP_AGENT_FUNCTION_TOOLS": "1"}  # the scripted model writes function calls
        argv = [sys.executable, "-m", "tracegym.cli", "run", "examples/mcp_agent/agent.py:agent",
                "--gateway", gateway.base_url, "--concurrency", "1", "--exit-when-idle"]
        res = run_command(argv, cwd=ROOT, env=env, timeout=180)
        assert res.returncode == 0, res.stderr[-4000:] + gateway.log()
        assert "done 1 | failed 0 | running 0" in res.stderr, res.stderr[-4000:]
        rollout = client.get_rollout(rid)
        assert rollout["status"] == "completed" and rollout["reward"] == 0.0  # it never stops calling `add`
        spans = [s for s in client.rollout_spans(rid) if s.get("choices")]

    assert len(spans) == MAX_TURNS, spans
    for span in spans:
        attrs = span["attributes"]
        assert attrs["tracegym.tool_parse"] == "ok"
        assert [t["function"]["name"] for t in attrs["tracegym.request"]["tools"]] == ["add", "capital"]
        assert span["choices"][0]["output_ids"] == replies[THINKING_REPLY]
    # every later prompt carries the MCP server's answers to the earlier calls, as tool messages
    tool_results = [m for m in spans[-1]["attributes"]["tracegym.request"]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_results] == ["5"] * (MAX_TURNS - 1)

    # one merged sequence: mask 1 exactly on the sampled ids with the engine's logprobs (checked against
    # the spans), the rest of the prompt, the MCP results included, mask 0
    check_one_merged_sequence(gateway.base_url, rid, [s["call_id"] for s in spans])
    r = httpx.get(f"{gateway.base_url}/api/trajectories", params={"ids": rid, "check": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    (traj,) = [json.loads(line) for line in r.text.splitlines()]
    (seq,) = traj["sequences"]
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    masked = [t for t, m in zip(seq["token_ids"], seq["loss_mask"], strict=True) if not m]
    sampled = [t for t, m in zip(seq["token_ids"], seq["loss_mask"], strict=True) if m]
    untrained = tok.decode(masked, skip_special_tokens=False)
    assert untrained.count("<tool_response>\n5\n</tool_response>") == MAX_TURNS - 1, untrained
    assert "<tool_response>" not in tok.decode(sampled, skip_special_tokens=False)
    assert all(lp is None for lp, m in zip(seq["logprobs"], seq["loss_mask"], strict=True) if not m)
