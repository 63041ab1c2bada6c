"""Multi-turn chats with reasoning on Qwen3's real chat template, sampled by the embedded engine: ``tracegym
serve --engine embedded`` on a scripted ``qwen3-tiny`` (``scripted_qwen3.py``: it writes ``<think>I
add.</think>`` and an ``add`` call, or ``It is 5.`` after an empty think block), through the official
``openai`` (chat, Responses) and ``anthropic`` (Messages) clients.

Qwen3's template drops the reasoning of turns before the last user message and writes tool calls in its
own whitespace, so every later prompt re-renders the sampled turns differently. Whatever it does, each
rollout must be one merged sequence whose mask-1 tokens and logprobs are exactly the engine's output ids
(reasoning included) and logprobs, with the template's rewrites recorded as ``realigned`` drift."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.e2e.scripted_qwen3 import PLAIN_REPLY, THINKING_REPLY, build_scripted_qwen3
from tests.gateway.app_support import check_one_merged_sequence, spans_of
from tests.procs import ManagedProcess, free_port, start_process

PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


@pytest.fixture(scope="module")
def scripted(qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    dest = tmp_path_factory.mktemp("scripted-qwen3")
    return dest, build_scripted_qwen3(qwen3_model_dir, dest)


@pytest.fixture(scope="module")
def gateway(scripted: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    tmp, port = tmp_path_factory.mktemp("qwen3-gateway"), free_port()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", str(scripted[0]), "--port", str(port),
            "--store", f"sqlite:///{tmp / 'tracegym.db'}"]
    with start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz", timeout=240) as gw:
        yield gw


def _outputs(spans: list[dict]) -> list[list[int]]:
    return [s["choices"][0]["output_ids"] for s in spans]


def _drifts(spans: list[dict]) -> list[str]:
    return [s["attributes"]["tracegym.drift"] for s in spans]


def test_chat_tool_loop_then_a_new_turn(gateway: ManagedProcess, scripted: tuple[Path, dict]) -> None:
    model, replies = str(scripted[0]), scripted[1]
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/q3-chat/v1", api_key="unused", max_retries=0,
                      timeout=120)
    tools = [{"type": "function", "function": {"name": "add", "parameters": PARAMS}}]
    msgs: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    one = c.chat.completions.create(model=model, messages=msgs, tools=tools)
    reply = one.choices[0].message
    assert reply.model_extra["reasoning_content"] == "I add." and not reply.content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in reply.tool_calls] == [
        ("add", {"a": 2, "b": 3})]
    msgs += [reply.model_dump(exclude_none=True),  # reasoning_content goes back (the SDK keeps extra fields)
             {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
    chunks = list(c.chat.completions.create(model=model, messages=msgs, tools=tools, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "I add."
    call = next(t for d in deltas for t in d.tool_calls or [])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude={"index"})]},
             {"role": "tool", "tool_call_id": call.id, "content": "5"},  # reasoning dropped this time
             {"role": "user", "content": "Thanks. Again?"}]
    three = c.chat.completions.create(model=model, messages=msgs, tools=tools)
    spans = check_one_merged_sequence(gateway.base_url, "q3-chat", [one.id, chunks[0].id, three.id])
    assert _outputs(spans) == [replies[THINKING_REPLY]] * 3
    assert _drifts(spans) == ["none", "realigned", "realigned"]
    assert [s["attributes"]["tracegym.tool_parse"] for s in spans] == ["ok"] * 3


def test_chat_enable_thinking_false(gateway: ManagedProcess, scripted: tuple[Path, dict]) -> None:
    model, replies = str(scripted[0]), scripted[1]
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/q3-plain/v1", api_key="unused", max_retries=0,
                      timeout=120)
    kw = {"model": model, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    msgs: list = [{"role": "user", "content": "2+3?"}]
    one = c.chat.completions.create(messages=msgs, **kw)
    assert one.choices[0].message.content == PLAIN_REPLY
    assert "reasoning_content" not in (one.choices[0].message.model_extra or {})
    msgs += [one.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    two = c.chat.completions.create(messages=msgs, **kw)
    spans = check_one_merged_sequence(gateway.base_url, "q3-plain", [one.id, two.id])
    assert _outputs(spans) == [replies[PLAIN_REPLY]] * 2
    assert _drifts(spans) == ["none", "realigned"]  # the template drops the empty think from history


def test_responses_chain_with_reasoning_items(gateway: ManagedProcess, scripted: tuple[Path, dict]) -> None:
    model, replies = str(scripted[0]), scripted[1]
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/q3-resp/v1", api_key="unused", max_retries=0,
                      timeout=120)
    kw = {"model": model, "tools": [{"type": "function", "name": "add", "parameters": PARAMS}]}
    one = c.responses.create(input="2+3?", **kw)
    assert [o.type for o in one.output] == ["reasoning", "function_call"]
    assert one.output[0].content[0].text == "I add." and one.usage.output_tokens_details.reasoning_tokens > 0
    fc = one.output[1]
    events = list(c.responses.create(previous_response_id=one.id, stream=True, input=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": "5"}], **kw))
    two = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I add."
    # the whole history sent back as items (no previous_response_id), with a new user turn
    history = [{"role": "user", "content": "2+3?"}, *[o.model_dump(exclude_none=True) for o in one.output],
               {"type": "function_call_output", "call_id": fc.call_id, "output": "5"},
               *[o.model_dump(exclude_none=True) for o in two.output],
               {"type": "function_call_output", "call_id": two.output[1].call_id, "output": "5"},
               {"role": "user", "content": "Thanks. Again?"}]
    three = c.responses.create(input=history, **kw)
    spans = check_one_merged_sequence(gateway.base_url, "q3-resp", [one.id, two.id, three.id])
    assert _outputs(spans) == [replies[THINKING_REPLY]] * 3
    assert _drifts(spans) == ["none", "realigned", "realigned"]


def test_messages_with_thinking_blocks(gateway: ManagedProcess, scripted: tuple[Path, dict]) -> None:
    model, replies = str(scripted[0]), scripted[1]
    c = anthropic.Anthropic(base_url=f"{gateway.base_url}/rollouts/q3-msg", api_key="unused", max_retries=0,
                            timeout=120)
    kw = {"model": model, "max_tokens": 64, "tools": [{"name": "add", "input_schema": PARAMS}]}
    msgs: list = [{"role": "user", "content": "2+3?"}]
    one = c.messages.create(messages=msgs, **kw)
    assert [b.type for b in one.content] == ["thinking", "tool_use"] and one.stop_reason == "tool_use"
    assert one.content[0].thinking == "I add." and one.content[1].input == {"a": 2, "b": 3}

    def result(m: anthropic.types.Message, *extra: dict) -> list[dict]:
        use = next(b for b in m.content if b.type == "tool_use")
        return [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"},
                                             *extra]}]

    msgs += result(one)
    with c.messages.stream(messages=msgs, **kw) as s:
        thinking = "".join(e.thinking for e in s if e.type == "thinking")
        two = s.get_final_message()
    assert thinking == "I add." and [b.type for b in two.content] == ["thinking", "tool_use"]
    msgs += result(two, {"type": "text", "text": "Thanks. Again?"})
    three = c.messages.create(messages=msgs, **kw)
    spans = check_one_merged_sequence(gateway.base_url, "q3-msg", [one.id, two.id, three.id])
    assert _outputs(spans) == [replies[THINKING_REPLY]] * 3
    assert _drifts(spans) == ["none", "realigned", "realigned"]


def test_openai_agents_tool_loop_sends_reasoning_items_back(gateway: ManagedProcess,
                                                            scripted: tuple[Path, dict]) -> None:
    """The Agents SDK runs the model's call, returns the result with the reasoning and call items of each
    turn as input, and the scripted model calls again until ``max_turns``: three calls, one sequence."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/rollouts/q3-agents/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        agent = Agent(name="calc", instructions="Use add.", tools=[add],
                      model=OpenAIResponsesModel(model=str(scripted[0]), openai_client=client))
        try:
            with pytest.raises(MaxTurnsExceeded):
                await Runner.run(agent, "2+3?", max_turns=3)
        finally:
            await client.close()

    asyncio.run(run())
    assert seen == [(2, 3)] * 3
    spans = spans_of(gateway.base_url, "q3-agents", 3)
    spans = check_one_merged_sequence(gateway.base_url, "q3-agents", [s["call_id"] for s in spans])
    assert _outputs(spans) == [scripted[1][THINKING_REPLY]] * 3
    assert _drifts(spans) == ["none", "realigned", "realigned"]
    sent = spans[-1]["attributes"]["tracegym.request"]["tracegym_source"]["request"]["input"]
    assert [i.get("type", "message") for i in sent] == ["message", *["reasoning", "function_call",
                                                                     "function_call_output"] * 2]


@pytest.mark.parametrize("client", ["openai-responses", "anthropic"])
def test_langchain_tool_loops(gateway: ManagedProcess, scripted: tuple[Path, dict], client: str) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    rollout = f"q3-lc-{client}"
    if client == "anthropic":
        llm = ChatAnthropic(model=str(scripted[0]), base_url=f"{gateway.base_url}/rollouts/{rollout}",
                            api_key="unused", max_tokens=64, max_retries=0)
    else:
        llm = ChatOpenAI(model=str(scripted[0]), base_url=f"{gateway.base_url}/rollouts/{rollout}/v1",
                         api_key="unused", use_responses_api=True, max_retries=0)
    llm = llm.bind_tools([add])
    messages: list = [HumanMessage("2+3?")]
    for _ in range(3):
        reply = llm.invoke(messages)
        assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("add", {"a": 2, "b": 3})]
        messages += [reply, *(add.invoke(c) for c in reply.tool_calls)]
    spans = spans_of(gateway.base_url, rollout, 3)
    spans = check_one_merged_sequence(gateway.base_url, rollout, [s["call_id"] for s in spans])
    assert _outputs(spans) == [scripted[1][THINKING_REPLY]] * 3
    assert "forked" not in _drifts(spans)
