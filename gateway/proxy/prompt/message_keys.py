"""What makes two chat messages, or two calls' render settings, the same for prefix reuse
(``prefix_reuse``): message keys compared by value, and the context key of everything besides the messages
that changes the render."""

from __future__ import annotations

import json
from typing import Any

from tracegym.gateway.proxy.prompt.reasoning import join_reasoning, split_reasoning
from tracegym.gateway.proxy.prompt.templating import (
    check_template_kwargs,
    check_tool_choice,
    check_tools,
    content_text,
)
from tracegym.gateway.proxy.prompt.tools import parse_arguments

MsgKey = tuple[str, str, tuple[tuple[str, str], ...], str | None]
"""``(role, content with any reasoning written in as <think>, tool calls, tool_call_id)``."""


def _canonical_arguments(arguments: Any) -> str:
    parsed = parse_arguments(arguments)
    if isinstance(arguments, str) and parsed is arguments:  # not JSON: compared as sent
        return "raw:" + arguments
    return json.dumps(parsed, sort_keys=True, ensure_ascii=False)


def message_key(m: dict[str, Any]) -> MsgKey:
    """What must be equal for two messages to count as the same: role, content (with a
    ``reasoning_content`` written in as ``<think>``), calls, tool_call_id."""
    role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
    text = content if isinstance(content, str) else content_text(content)
    reasoning = m.get("reasoning_content")
    return (
        "system" if role == "developer" else str(role),
        text if not isinstance(reasoning, str) else join_reasoning(reasoning, text),
        tuple(_call_key(c) for c in calls) if calls else (),
        m.get("tool_call_id"),
    )


def bare_key(m: dict[str, Any]) -> MsgKey | None:
    """The key of reply ``m`` sent back without its reasoning; None when it has none."""
    if isinstance(m.get("reasoning_content"), str):
        return message_key({**m, "reasoning_content": None})
    role, content, calls, tool_call_id = message_key(m)
    reasoning, text = split_reasoning(content)
    return None if reasoning is None else (role, text, calls, tool_call_id)


def _call_key(call: dict[str, Any]) -> tuple[str, str]:
    fn = call.get("function") or {}
    return str(fn.get("name")), _canonical_arguments(fn.get("arguments"))


_PLAIN_CONTEXT = json.dumps([None, "auto", {}], sort_keys=True)
"""``context_key`` of a call without tools, tool_choice or template kwargs (most calls: no JSON work)."""


def context_key(tools: Any, tool_choice: Any, kwargs: dict[str, Any]) -> str:
    """Everything besides the messages that changes the render: tools, tool_choice, template kwargs."""
    if not tools and not kwargs and (tool_choice is None or tool_choice == "auto"):
        return _PLAIN_CONTEXT
    return json.dumps(
        [check_tools(tools), check_tool_choice(tool_choice), kwargs], sort_keys=True, default=str
    )


def request_args(request: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """``(messages, tools, template kwargs)`` of an OpenAI chat body, as ``plan_chat`` takes them."""
    kwargs = check_template_kwargs(request.get("chat_template_kwargs"))
    kwargs["tool_choice"] = request.get("tool_choice")
    return request["messages"], request.get("tools"), kwargs
