"""`tracegym export` against the fake gateway: trajectories pass-through and chat records from spans."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.sdk.fake_gateway import FakeGateway
from tracegym.export import chat_example, main


def _span(messages: list[dict], reply: dict, status: str = "ok", tools: list | None = None) -> dict:
    request = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    return {
        "name": "chat m",
        "status": status,
        "attributes": {"tracegym.request": request},
        "choices": [{"index": 0, "message": reply, "output_ids": [1, 2]}],
    }


def test_chat_example_takes_last_good_chat_call() -> None:
    u1 = {"role": "user", "content": "2+2?"}
    a1 = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    t1 = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    final = {"role": "assistant", "content": "4", "refusal": None}
    spans = [
        _span([u1], a1),
        {"name": "tool calc", "status": "ok", "attributes": {}, "choices": None},  # not an LLM span
        _span([u1, a1, t1], final, tools=[{"type": "function"}]),
        _span([u1, a1, t1, final], {"role": "assistant", "content": ""}, status="error"),
    ]
    got = chat_example(spans)
    assert got == {
        "messages": [
            u1,
            {"role": "assistant", "tool_calls": a1["tool_calls"]},
            t1,
            {"role": "assistant", "content": "4"},
        ],
        "tools": [{"type": "function"}],
    }
    assert chat_example([spans[1]]) is None
    # OTLP-ingested spans may carry the request as a JSON string
    as_text = {**spans[0], "attributes": {"tracegym.request": json.dumps({"messages": [u1]})}}
    assert chat_example([as_text]) == {
        "messages": [u1, {"role": "assistant", "tool_calls": a1["tool_calls"]}]
    }


def _fill(gw: FakeGateway) -> list[str]:
    from tracegym.client import GatewayClient

    with GatewayClient() as c:
        out = c.enqueue_tasks([{"input": i} for i in range(5)])
    rids = [t["rollout_ids"][0] for t in out]
    for i, rid in enumerate(rids):
        gw.state.rollouts[rid].update(status="completed", reward=i / 10)
        if i != 2:  # rollout 2 has no chat call
            gw.state.spans[rid] = [
                _span([{"role": "user", "content": f"q{i}"}], {"role": "assistant", "content": "a"})
            ]
    return rids


def _args(gw: FakeGateway, out: Path, fmt: str, limit: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        gateway=gw.url, out=str(out), format=fmt, status="completed", since=None, limit=limit
    )


def test_export_trajectories(gw: FakeGateway, tmp_path: Path) -> None:
    rids = _fill(gw)
    out = tmp_path / "traj.jsonl"
    assert main(_args(gw, out, "trajectories")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["rollout_id"] for r in rows) == sorted(rids)
    assert not (tmp_path / "traj.jsonl.part").exists()


def test_export_chat(gw: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rids = _fill(gw)
    out = tmp_path / "chat.jsonl"
    assert main(_args(gw, out, "chat")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rids[2] not in {r["rollout_id"] for r in rows}
    by_id = {r["rollout_id"]: r for r in rows}
    assert by_id[rids[3]]["messages"] == [
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a"},
    ]
    assert by_id[rids[3]]["reward"] == 0.3
    assert "1 rollouts without a chat call skipped" in capsys.readouterr().err
    assert main(_args(gw, out, "chat", limit=2)) == 0
    assert len(out.read_text().splitlines()) == 2
