"""Responses items and Messages blocks ⇄ chat messages: the translations, their 400s, and the round trip
prefix reuse depends on (a reply sent back as items or blocks translates to the message the gateway
recorded for it)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.anthropic.body import content_blocks, stop_reason
from tracegym.gateway.proxy.anthropic.request import chat_request as messages_chat_request
from tracegym.gateway.proxy.anthropic.request import parse_messages
from tracegym.gateway.proxy.prompt.message_keys import message_key
from tracegym.gateway.proxy.reply_parts import Turn
from tracegym.gateway.proxy.responses.items import check_tool_outputs, input_items, output_items
from tracegym.gateway.proxy.responses.request import chat_request, parse_responses

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def _bad(fn, *args, **kw) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


# ------------------------------------------------------------------------------------------- Responses


def test_string_input_is_one_user_message() -> None:
    assert input_items("hi").messages == [{"role": "user", "content": "hi"}]


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3?"},
                                                        {"type": "input_text", "text": "Use the tool."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "done"}]},
        {"role": "assistant", "content": "It is 5."},
    ]
    got = input_items(items)
    assert got.item_ids == {"rs_1", "msg_1", "fc_1"}
    assert got.messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "2+3?\nUse the tool."},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\nLet me add.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "<think>\ndone\n</think>\n\nIt is 5."},
    ]
    check_tool_outputs(got.messages)


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
    (["just a string"], "input[0]"),
    ([], "input"),
])
def test_bad_items_name_the_parameter(items: list, param: str) -> None:
    assert _bad(input_items, items).param == param


def test_output_for_an_unknown_call_is_refused() -> None:
    msgs = input_items([{"role": "user", "content": "x"},
                        {"type": "function_call_output", "call_id": "call_9", "output": "5"}]).messages
    assert "call_9" in _bad(check_tool_outputs, msgs).message


def test_body_is_checked_and_translated() -> None:
    body = {"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "add"}, "metadata": {"k": "v"}}
    parsed = chat_request(parse_responses(body), history=[])
    assert parsed.api == "responses" and parsed.operation == "chat" and parsed.source == {"api": "responses",
                                                                                            "request": body}
    assert parsed.body == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "hi"}],
                           "tools": [{"type": "function", "function": {"name": "add",
                                                                        "parameters": {"type": "object"}}}],
                           "tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 9,
                           "temperature": 0.5}
    assert parsed.sampling.max_tokens == 9 and parsed.parse_tools


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"instructions": ["x"]}, "instructions"),
])
def test_unsupported_fields_are_refused(extra: dict, param: str) -> None:
    assert _bad(parse_responses, {"model": "m", "input": "hi", **extra}).param == param


TURNS = st.builds(
    Turn,
    st.one_of(st.none(), st.text(st.sampled_from("ab \n"), max_size=6).map(str.strip)),
    st.text(st.sampled_from("xy \n"), max_size=6).map(str.lstrip),
    st.lists(st.builds(lambda i, a: {"id": f"call_{i}", "type": "function",
                                     "function": {"name": "add", "arguments": json.dumps({"a": a})}},
                       st.integers(0, 9), st.integers()), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(TURNS)
def test_a_reply_sent_back_translates_to_its_recorded_message(turn: Turn) -> None:
    recorded = turn.chat_message()
    items = output_items("resp_x", turn, incomplete=False)
    back = input_items([{"role": "user", "content": "q"}, *items]).messages[-1]
    assert message_key(back) == message_key(recorded)
    blocks = content_blocks(turn, "sig")
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": blocks},
                                                        {"role": "user", "content": "next"}]}
    assert message_key(parse_messages(body).messages[1]) == message_key(recorded)
    assert Turn.of_message(recorded) == turn  # what GET /v1/responses/{id} rebuilds from the record


def test_output_items_order_and_ids() -> None:
    turn = Turn("plan", "Let me add.", [CALL])
    items = output_items("resp_abc", turn, incomplete=False)
    assert [(i["type"], i["id"]) for i in items] == [("reasoning", "rs_abc"), ("message", "msg_abc"),
                                                     ("function_call", "fc_abc_0")]
    assert items[2]["call_id"] == "call_1" and items[2]["arguments"] == CALL["function"]["arguments"]
    cut = output_items("resp_abc", Turn(None, "partial"), incomplete=True)
    assert cut[0]["status"] == "incomplete"


# ---------------------------------------------------------------------------------------------- Messages


def test_messages_become_chat_messages() -> None:
    body = {"model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["###"], "tool_choice": {"type": "any"},
            "tools": [{"name": "add", "description": "Add", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "add", "signature": "s"},
                    {"type": "text", "text": "Let me add."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                             {"type": "text", "text": "Thanks."}]},
            ]}
    parsed = messages_chat_request(parse_messages(body))
    assert parsed.api == "messages" and parsed.sampling.stop == ["###"] and parsed.tool_choice == "required"
    assert parsed.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\nLet me add.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "user", "content": "Thanks."},
    ]
    assert parsed.tools == [{"type": "function", "function": {"name": "add", "description": "Add",
                                                               "parameters": {"type": "object"}}}]


Q = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": Q}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "5"}]}]}, "messages.0.content.0"),
    ({"max_tokens": 5, "messages": [*Q, {"role": "assistant", "content": "prefill"}]}, "messages"),
    ({"max_tokens": 5, "messages": Q, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"max_tokens": 5, "messages": Q, "top_k": 5}, "top_k"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": Q, "tool_choice": {"type": "auto"}}, "tool_choice"),
])
def test_bad_messages_name_the_parameter(body: dict, param: str) -> None:
    assert _bad(parse_messages, {"model": "m", **body}).param == param


def test_count_tokens_body_needs_no_max_tokens() -> None:
    assert parse_messages({"model": "m", "messages": Q}, count_only=True).sampling.max_tokens is None


def test_stop_reasons() -> None:
    parsed = messages_chat_request(parse_messages({"model": "m", "max_tokens": 5, "messages": Q,
                                                   "stop_sequences": ["###"]}))
    assert stop_reason("tool_calls", None, parsed) == ("tool_use", None)
    assert stop_reason("length", None, parsed) == ("max_tokens", None)
    assert stop_reason("stop", "###", parsed) == ("stop_sequence", "###")
    assert stop_reason("stop", None, parsed) == ("end_turn", None)
