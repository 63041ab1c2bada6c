"""End to end: a LangChain ChatOpenAI conversation with a tool (model call → tool message → model call →
user → model call) through `tracegym serve --engine embedded --model tiny-random`, then its trajectory
from the gateway is one merged sequence whose sampled tokens are exactly the engine's output ids."""

from __future__ import annotations

import time
import uuid

import httpx
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.procs import ManagedProcess


@tool
def calculator(a: float, op: str, b: float) -> str:
    """Compute `a op b` for op in + - * /."""
    return str({"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op])


def _llm_spans(client: httpx.Client, rid: str, expected: int) -> list[dict]:
    """The rollout's LLM spans once all ``expected`` are recorded (the recorder exports in batches)."""
    deadline = time.monotonic() + 20
    while True:
        resp = client.get(f"/api/rollouts/{rid}/spans")
        spans = [s for s in resp.json()["spans"] if s.get("choices")] if resp.status_code == 200 else []
        if len(spans) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_langchain_tool_conversation_is_one_merged_sequence(gateway: ManagedProcess) -> None:
    rid = f"lc-{uuid.uuid4().hex[:12]}"
    llm = ChatOpenAI(
        model="tiny-random", base_url=f"{gateway.base_url}/rollouts/{rid}/v1", api_key="unused", max_tokens=8
    ).bind_tools([calculator])
    messages = [SystemMessage("Use the calculator tool, then answer."), HumanMessage("What is 2+3?")]
    first = llm.invoke(messages)
    messages.append(first)
    # tiny-random writes garbage, so the tool round is driven here: the tool's answer follows the reply
    call_id = first.tool_calls[0]["id"] if first.tool_calls else "call_0"
    messages.append(ToolMessage(calculator.invoke({"a": 2, "op": "+", "b": 3}), tool_call_id=call_id))
    messages.append(llm.invoke(messages))
    messages.append(HumanMessage("And 5*2?"))
    llm.invoke(messages)

    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        spans = _llm_spans(client, rid, 3)
        assert len(spans) == 3, gateway.log()
        resp = client.get(f"/api/rollouts/{rid}/trajectory")
        assert resp.status_code == 200, resp.text
        traj = resp.json()

    assert traj["rollout_id"] == rid and traj["excluded"] == []
    (seq,) = traj["sequences"]
    assert seq["call_ids"] == [s["call_id"] for s in spans]
    outputs = [s["choices"][0]["output_ids"] for s in spans]
    assert all(outputs)
    sampled = [t for t, m in zip(seq["token_ids"], seq["loss_mask"], strict=True) if m == 1]
    assert sampled == [t for out in outputs for t in out]
    engine_lps = [lp for s in spans for lp in s["choices"][0]["output_logprobs"]]
    assert [lp for lp, m in zip(seq["logprobs"], seq["loss_mask"], strict=True) if m == 1] == engine_lps
    assert all(lp is None for lp, m in zip(seq["logprobs"], seq["loss_mask"], strict=True) if m == 0)
    for span, out in zip(spans, outputs, strict=True):  # each call's prompt is the sequence so far
        p = span["prompt_ids"]
        assert seq["token_ids"][: len(p) + len(out)] == p + out
    # the tool result and the user turn are context, not trained
    tool_and_user = (
        len(spans[2]["prompt_ids"]) - len(spans[0]["prompt_ids"]) - len(outputs[0]) - len(outputs[1])
    )
    assert tool_and_user > 0
    assert len(seq["token_ids"]) - sum(seq["loss_mask"]) == len(spans[0]["prompt_ids"]) + tool_and_user
