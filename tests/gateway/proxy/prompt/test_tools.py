"""Tool-call parsing: hermes ``<tool_call>`` blocks → OpenAI tool_calls, whole and streamed."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from tracegym.gateway.proxy.prompt.tools import (
    StreamingToolParser,
    combine_status,
    format_assistant_content,
    format_tool_call,
    parse_tool_calls,
    parse_tools,
)

CALL_A = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL_B = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def _calls(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def test_plain_text_is_returned_unchanged() -> None:
    assert parse_tool_calls("  Hello there.\n") == ("  Hello there.\n", [])
    assert parse_tool_calls("") == (None, [])


def test_single_call_has_openai_shape() -> None:
    content, calls = parse_tool_calls(CALL_A)
    assert content is None
    assert len(calls) == 1
    call = calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_content_and_several_calls() -> None:
    content, calls = parse_tool_calls(f"Let me check.\n{CALL_A}\n{CALL_B}")
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls[0]["id"] != calls[1]["id"]


def test_qwen_style_newlines_inside_block_and_text_after() -> None:
    text = 'Sure\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone  '
    assert parse_tool_calls(text)[0] == "Sure\nDone  "
    assert _calls(parse_tool_calls(text)[1]) == [("f", {})]
    assert _stream(list(text))[:2] == ("Sure\nDone  ", [("f", "{}")])


def test_malformed_blocks_stay_in_content() -> None:
    bad = '<tool_call>{"name": "f", "arguments": {oops}</tool_call>'
    assert parse_tool_calls(f"x {bad} y") == (f"x {bad} y", [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(no_name) == (no_name, [])
    not_obj = "<tool_call>[1, 2]</tool_call>"
    assert parse_tool_calls(not_obj) == (not_obj, [])
    bad_args = '<tool_call>{"name": "f", "arguments": 3}</tool_call>'
    assert parse_tool_calls(bad_args) == (bad_args, [])
    # a good call next to a bad one: the bad one is kept verbatim, the good one parsed
    content, calls = parse_tool_calls(f"{bad}\n{CALL_A}")
    assert content == bad and _calls(calls) == [("get_weather", {"city": "Paris"})]


def test_unterminated_last_block() -> None:
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": [1]}}')
    assert content == "ok" and _calls(calls) == [("f", {"x": [1]})]
    cut = 'ok <tool_call>{"name": "f", "argum'
    assert parse_tool_calls(cut) == (cut, [])


def test_argument_variants() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q": "é"}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q": 1}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0]["function"]["arguments"] == "{}"


def test_format_is_inverted_by_parse() -> None:
    tool_calls = [
        {
            "id": "1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
    ]
    text = format_assistant_content("Let me check.", tool_calls)
    assert text == f"Let me check.\n{CALL_A}\n{CALL_B}"
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and _calls(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert format_tool_call("f", "") == '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert (
        format_tool_call("f", "not json") == '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'
    )


def _stream(deltas: list[str], names: frozenset[str] | None = None
            ) -> tuple[str | None, list[tuple[str, str]], list]:
    parser = StreamingToolParser(names)
    events = []
    for d in deltas:
        events += parser.feed(d)
    events += parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [(e.name, e.arguments) for e in events if e.kind == "tool_call"]
    return content or None, calls, events


def _whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_stream_holds_back_partial_tag_and_releases_it() -> None:
    parser = StreamingToolParser()
    assert [e.text for e in parser.feed("Hello <tool")] == ["Hello"]
    assert [e.text for e in parser.feed("box>")] == [" <toolbox>"]
    assert parser.feed("<tool_call>") == []
    assert parser.feed('{"name": "f", "arguments": {}}') == []
    events = parser.feed("</tool_call>")
    assert [(e.kind, e.index, e.name, e.arguments) for e in events] == [("tool_call", 0, "f", "{}")]
    assert events[0].to_delta()["tool_calls"][0] == {
        "index": 0,
        "id": events[0].id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    assert parser.finish() == []


def test_stream_events_and_indices() -> None:
    text = f"Let me check.\n{CALL_A}\n{CALL_B}"
    content, calls, events = _stream(list(text))
    assert (content, calls) == _whole(text)
    assert [e.index for e in events if e.kind == "tool_call"] == [0, 1]
    assert events[0].to_delta() == {"content": events[0].text}


FRAGMENTS = [
    CALL_A,
    CALL_B,
    CALL_A,
    CALL_B,
    "text",
    "more text",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "</tool",
    "<",
    ">",
    "call",
    "\n",
    " ",
    "  \n",
    '{"name": "f", "arguments": {"x": 1}}',
    '{"name": "g"}',
    '{"name": ',
    '"arguments": {}}',
    "{bad}",
    "hello",
    "é日本",
    "[1]",
    '"',
    "}",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_any_split_matches_whole_parse(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    content, calls, _ = _stream(deltas)
    assert (content, calls) == _whole(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='<>/_toolcan {}"\n:', max_size=60), st.integers(min_value=1, max_value=7))
def test_any_chunk_size_matches_whole_parse(text: str, size: int) -> None:
    deltas = [text[i : i + size] for i in range(0, len(text), size)]
    content, calls, _ = _stream(deltas)
    assert (content, calls) == _whole(text)


# ------------------------------------------------------------------ malformed output: text plus a reason

NAMES = frozenset({"get_weather", "add"})
MALFORMED = [  # (model output, what the status says)
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b"', "failed: invalid JSON"),  # cut off mid-JSON
    ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "failed: invalid JSON"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "failed: unknown tool 'rm_rf'"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "failed: empty tool name"),
    ('<tool_call>{"arguments": {}}</tool_call>', "failed: no tool name"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "failed: arguments are not an object (list)"),
    ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', "failed: arguments are not an object (str)"),
    ('<tool_call>{"name": "add", "arguments": 3}</tool_call>', "failed: arguments are not an object (int)"),
    ("<tool_call>[1, 2]</tool_call>", "failed: not a JSON object (list)"),
    ("<tool_call></tool_call>", "failed: invalid JSON"),
]


def test_malformed_calls_are_text_with_a_reason() -> None:
    for text, status in MALFORMED:
        reply = f"Let me see. {text}"
        parsed = parse_tools(reply, NAMES)
        assert (parsed.content, parsed.calls) == (reply, []), text
        assert parsed.status.startswith(status), (text, parsed.status)
        content, calls, events = _stream(list(reply), NAMES)
        assert (content, calls) == (reply, []) and events[-1].kind == "content"
        parser = StreamingToolParser(NAMES)
        for ch in reply:
            parser.feed(ch)
        parser.finish()
        assert parser.status == parsed.status
    assert parse_tools(MALFORMED[0][0], NAMES).status.endswith("in an unterminated block")


def test_status_ok_none_and_mixed() -> None:
    assert parse_tools("plain text", NAMES).status == "none"
    assert parse_tools(f"x {CALL_A}", NAMES).status == "ok"
    assert parse_tools(CALL_A, None).status == "ok"  # no names: any name is a call
    rm = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tools(rm, None).calls and not parse_tools(rm, NAMES).calls
    mixed = parse_tools(f"{CALL_A}\n{rm}\n<tool_call>oops</tool_call>", NAMES)
    assert [c["function"]["name"] for c in mixed.calls] == ["get_weather"]
    assert mixed.content == f"{rm}\n<tool_call>oops</tool_call>"
    assert mixed.status == "failed: unknown tool 'rm_rf' (+1 more)"
    assert combine_status([None, "none", "ok"]) == "ok" and combine_status([None]) is None
    assert combine_status(["ok", "failed: x", "none"]) == "failed: x" and combine_status(["none"]) == "none"
    # a JSON string holding an object is a call; its text is kept as the arguments
    nested = parse_tools('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', NAMES)
    assert nested.status == "ok" and nested.calls[0]["function"]["arguments"] == '{"a": 1}'


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([*FRAGMENTS, *(m for m, _ in MALFORMED)]), max_size=10).map("".join),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_stream_status_matches_whole_parse(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    parser = StreamingToolParser(NAMES)
    for d in deltas:
        parser.feed(d)
    parser.finish()
    assert parser.status == parse_tools(text, NAMES).status
