"""Gemma 3: ``<start_of_turn>user|model ... <end_of_turn>`` turns from Gemma 3's own template, which knows
no tools, no system role (the system prompt is prefixed to the first user turn) and requires the roles to
alternate user/model. Tools are injected hermes-style into the system prompt (so they reach the first user
turn), calls are written as ``<tool_call>`` JSON text, and the results of one round of calls become a single
user turn (each wrapped in ``<tool_response>``, joined by a newline), which a user message right after them
joins too, so the roles still alternate."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import Family


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return "<start_of_turn>" in tokens or "<start_of_turn>" in template


def prepare(messages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[dict[str, Any]], list | None]:
    from tracegym.gateway.proxy.prompt.templating import prepare_messages

    kwargs["tool_role"] = "user"
    tool_result = [isinstance(m, dict) and m.get("role") == "tool" for m in messages]
    out, tools = prepare_messages(messages, **kwargs)
    offset = len(out) - len(messages)  # a system message inserted for the tools comes first
    merged: list[dict[str, Any]] = []
    for i, msg in enumerate(out):
        src = i - offset
        prev = src - 1
        if src >= 1 and tool_result[prev] and (tool_result[src] or msg["role"] == "user") and merged:
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n" + msg["content"]}
        else:
            merged.append(msg)
    return merged, tools


FAMILY = Family(
    name="gemma3",
    summary="Gemma turns (user/model, system folded into the first user turn); hermes <tool_call> JSON",
    recognise=_recognise,
    tool_syntax='<tool_call>{"name": ..., "arguments": {...}}</tool_call> (injected: the template has no tools)',
    stop_tokens=("<end_of_turn>", "<eos>"),
    history_rewrites="turn contents are trimmed of surrounding whitespace; one round of tool results (and a "
                     "user message right after it) is one user turn",
    prepare=prepare,
)
