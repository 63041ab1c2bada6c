"""A small store for the inspector's tests (no tests here): two runs, two GRPO groups of two, and
rollouts that exercise every view: a clean multi-turn tool loop, a forked rollout with an errored
(excluded) call, a realigned call whose output spans two weight versions, and a failed rollout."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from tracegym.gateway.api import ui
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.store import Store
from tracegym.types import CallRecord, ChoiceRecord, WeightVersionSpan

SYSTEM = {"role": "system", "content": "You add numbers."}
USER = {"role": "user", "content": "What is 2+3? Use the add tool."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@dataclass
class Scenario:
    store: Store
    clean: str
    forked: str
    realigned: str
    failed: str
    groups: list[dict[str, Any]]


def call(rid: str, i: int, prompt: list[int], out: list[int] | None, messages: list[dict], reply: dict | None, *,
         drift: str = "clean", status: str = "ok", version: str = "v1",
         versions: list[WeightVersionSpan] | None = None, tools: bool = True) -> CallRecord:
    request: dict[str, Any] = {"messages": messages, "max_tokens": 16}
    if tools:
        request["tools"] = TOOLS
    lps = None if out is None else [-0.25 * (k + 1) for k in range(len(out))]
    return CallRecord(
        call_id=f"{rid}-c{i}", rollout_id=rid, operation="chat", model="m", upstream_kind="sglang",
        request=request, choices=[ChoiceRecord(0, out, lps, "stop", reply, versions or [])],
        prompt_ids=prompt, agent_name="solver", weight_version=version, drift=drift,  # type: ignore[arg-type]
        start_time_ns=1_000_000_000 * (i + 1), end_time_ns=1_000_000_000 * (i + 1) + 250_000_000,
        status=status, error="upstream reset" if status == "error" else None,  # type: ignore[arg-type]
    )


def _clean_calls(rid: str) -> list[CallRecord]:
    """Three calls, each extending the last: tool result, then a user turn between them."""
    reply0 = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    reply1 = {"role": "assistant", "content": 'The sum.\n<tool_call>{"name": "add", broken</tool_call>'}
    more = {"role": "user", "content": "Anything else?"}
    return [
        call(rid, 0, [1, 2, 3], [10, 11], [SYSTEM, USER], reply0, drift="none"),
        call(rid, 1, [1, 2, 3, 10, 11, 50, 51], [12, 13, 14], [SYSTEM, USER, reply0, tool], reply1),
        call(rid, 2, [1, 2, 3, 10, 11, 50, 51, 12, 13, 14, 60], [15], [SYSTEM, USER, reply0, tool, reply1, more],
             {"role": "assistant", "content": "No, 5."}, tools=False),
    ]


def _forked_calls(rid: str) -> list[CallRecord]:
    a = {"role": "assistant", "content": "4"}
    return [
        call(rid, 0, [1, 2], [20], [USER], a, drift="none"),
        call(rid, 1, [1, 2, 99], [21], [USER, {"role": "assistant", "content": "5"}], a, drift="forked"),
        call(rid, 2, [1, 2, 99, 21, 5], [22], [USER, a, USER], a, status="error"),
    ]


def _realigned_calls(rid: str) -> list[CallRecord]:
    a = {"role": "assistant", "content": "5"}
    spans = [WeightVersionSpan("v1", 0, 1), WeightVersionSpan("v2", 1, 2)]
    return [
        call(rid, 0, [7], [30, 31], [USER], a, drift="none", version="v2", versions=spans),
        call(rid, 1, [7, 30, 31, 8], [32], [USER, a, USER], a, drift="realigned", version="v2"),
    ]


def make_scenario(url: str) -> Scenario:
    store = Store.open(url)
    g1 = store.enqueue_tasks([{"task_id": "t-one", "input": {"q": 1}, "split": "train"}], group_size=2,
                             max_attempts=1)
    store.add_metrics("run-a", 1, {"train/reward_mean": 0.5, "train/loss": 0.1})
    time.sleep(0.02)  # run-b's rollouts are created after run-a's last metrics
    g2 = store.enqueue_tasks([{"task_id": "t-two", "input": {"q": 2}, "split": "eval"}], group_size=2,
                             max_attempts=1)
    clean, forked = g1[0]["rollout_ids"]
    realigned, failed = g2[0]["rollout_ids"]
    store.claim("worker-1", limit=4, lease_seconds=600)
    insert_call_records(store, _clean_calls(clean) + _forked_calls(forked) + _realigned_calls(realigned))
    insert_call_records(store, [call(failed, 0, [4], [40], [USER], {"role": "assistant", "content": "?"},
                                    drift="none")])
    store.complete(clean, worker_id="worker-1", reward=1.0)
    store.complete(forked, worker_id="worker-1", reward=0.0)
    store.complete(realigned, worker_id="worker-1", reward=1.0)
    store.fail(failed, worker_id="worker-1", error="ValueError: bad tool", traceback="Traceback ...\nValueError")
    time.sleep(0.02)
    store.add_metrics("run-b", 1, {"train/reward_mean": 0.7})
    store.add_metrics("run-b", 2, {"train/reward_mean": 0.9, "eval/reward_mean": 0.8})
    return Scenario(store, clean, forked, realigned, failed, g1 + g2)


class FakeUpstream:
    kind = "sglang"

    async def health(self) -> dict[str, Any]:
        return {"reachable": True}


class FakeSettings:
    upstream_url = "http://upstream:30000"


class FakeServices:
    """What the inspector's routes read of ``deps.Services``."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.settings = FakeSettings()
        self.upstream = FakeUpstream()
        self.served_model = "m"
        self.tokenizer = tokenizer


def inspector_app(store: Store, services: Any = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    ui.install(app)
    app.state.store = store
    app.state.services = services or FakeServices()
    return app
