"""The three inference APIs through their official clients (``openai``: chat and Responses; ``anthropic``:
Messages) against ``tracegym serve --engine embedded --model tiny-random`` (real processes, SQLite store).

Each runs a three-turn conversation in one rollout, with tool calls and tool results between turns,
streamed and not, and its trajectory must be one merged sequence whose mask-1 tokens and logprobs are
exactly the engine's output ids and logprobs recorded on the spans. tiny-random's weights are random, so
it never writes a tool call itself: the calls in these conversations are the agent's own turns (prompt
tokens, mask 0), and every sampled reply goes back as the client received it."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.gateway.app_support import check_one_merged_sequence
from tests.procs import ManagedProcess

MODEL = "tiny-random"
PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"]}
N = 8  # tokens per reply: tiny-random rarely stops on its own


def _drifts(spans: list[dict]) -> list[str]:
    return [s["attributes"]["tracegym.drift"] for s in spans]


def test_chat_completions_three_turns_with_tools(gateway: ManagedProcess) -> None:
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/e2e-chat/v1", api_key="unused", max_retries=0,
                      timeout=120)
    tools = [{"type": "function", "function": {"name": "add", "parameters": PARAMS}}]
    call = {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    msgs: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3? Use the tool."},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_a", "content": "5"}]
    one = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=N)
    msgs += [one.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And 3+4?"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=N, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    call_b = {**call, "id": "call_b", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Check it."},
             {"role": "assistant", "content": None, "tool_calls": [call_b]},
             {"role": "tool", "tool_call_id": "call_b", "content": "7"}]
    three = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=N)
    spans = check_one_merged_sequence(gateway.base_url, "e2e-chat", [one.id, chunks[0].id, three.id])
    assert {s["attributes"]["tracegym.api"] for s in spans} == {"chat"}
    assert "forked" not in _drifts(spans) and "none" not in _drifts(spans)[1:]


def test_responses_three_turns_with_tools_chained(gateway: ManagedProcess) -> None:
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/e2e-resp/v1", api_key="unused", max_retries=0,
                      timeout=120)
    kw = {"model": MODEL, "tools": [{"type": "function", "name": "add", "parameters": PARAMS}],
          "instructions": "Be brief.", "max_output_tokens": N}
    one = c.responses.create(input=[
        {"role": "user", "content": "2+3? Use the tool."},
        {"type": "function_call", "call_id": "call_a", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "5"}], **kw)
    assert one.status in ("completed", "incomplete") and one.output[0].type == "message"
    events = list(c.responses.create(previous_response_id=one.id, input="And 3+4?", stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                         "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    two = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert two.output[0].content[0].text == streamed
    three = c.responses.create(previous_response_id=two.id, input=[
        {"role": "user", "content": "Check it."},
        {"type": "function_call", "call_id": "call_b", "name": "add", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call_output", "call_id": "call_b", "output": "7"}], **kw)
    assert c.responses.retrieve(two.id).output == two.output
    spans = check_one_merged_sequence(gateway.base_url, "e2e-resp", [one.id, two.id, three.id])
    assert {s["attributes"]["tracegym.api"] for s in spans} == {"responses"}
    assert "forked" not in _drifts(spans) and "none" not in _drifts(spans)[1:]
    assert three.usage.input_tokens == len(spans[-1]["prompt_ids"])
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(previous_response_id="resp_unknown", input="x", **kw)
    assert e.value.code == "previous_response_not_found"


def test_messages_three_turns_with_tools(gateway: ManagedProcess) -> None:
    c = anthropic.Anthropic(base_url=f"{gateway.base_url}/rollouts/e2e-msg", api_key="unused", max_retries=0,
                            timeout=120)
    kw = {"model": MODEL, "max_tokens": N, "system": "Be brief.",
          "tools": [{"name": "add", "description": "Add", "input_schema": PARAMS}]}

    def tool_exchange(use_id: str, a: int, b: int) -> list[dict]:
        return [{"role": "assistant", "content": [{"type": "tool_use", "id": use_id, "name": "add",
                                                   "input": {"a": a, "b": b}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": str(a + b)},
                                             {"type": "text", "text": "Go on."}]}]

    msgs: list = [{"role": "user", "content": "2+3? Use the tool."}, *tool_exchange("toolu_a", 2, 3)]
    one = c.messages.create(messages=msgs, **kw)
    assert one.stop_reason in ("end_turn", "max_tokens") and one.content[0].type == "text"
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in one.content]},
             {"role": "user", "content": "And 3+4?"}]
    with c.messages.stream(messages=msgs, **kw) as s:
        streamed = "".join(s.text_stream)
        two = s.get_final_message()
    assert two.content[0].text == streamed
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in two.content]},
             {"role": "user", "content": "Check it."}, *tool_exchange("toolu_b", 3, 4)]
    three = c.messages.create(messages=msgs, **kw)
    spans = check_one_merged_sequence(gateway.base_url, "e2e-msg", [one.id, two.id, three.id])
    assert {s["attributes"]["tracegym.api"] for s in spans} == {"messages"}
    assert "forked" not in _drifts(spans) and "none" not in _drifts(spans)[1:]
    assert c.messages.count_tokens(model=MODEL, messages=msgs, system="Be brief.",
                                   tools=kw["tools"]).input_tokens > 0
    # the client itself refuses to send a request without max_tokens
    r = httpx.post(f"{gateway.base_url}/rollouts/e2e-msg/v1/messages", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "1"}]}], **kw)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert len(check_one_merged_sequence(gateway.base_url, "e2e-msg", [one.id, two.id, three.id])) == 3
