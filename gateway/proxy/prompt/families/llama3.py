"""Llama 3.1 / 3.2 / 3.3: ``<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>`` turns, JSON tool
calls and the ``ipython`` role for tool results, all rendered by Meta's own template.

The template (``modelfiles/templates/llama3_1.jinja``) is the chat template of meta-llama/Llama-3.1-8B-Instruct as
published in its ``tokenizer_config.json`` (the same text as Llama-3.3-70B-Instruct's), read from the
public copy in ggml-org/llama.cpp ``models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja`` (that
folder is fetched from the hub by its ``scripts/get_chat_template.py``). It is model data: the
``llama3-tiny`` builder writes it into the model directory as the real checkpoints carry it.

Tool calls: a reply that is a call is ``{"name": NAME, "parameters": {...}}`` (the template's instruction;
``arguments`` is accepted too), optionally after ``<|python_tag|>`` (a special token, gone from decoded
text). Several calls separated by ``;`` are parsed, but the template renders one call per assistant
message and raises otherwise, so a history message with several calls is rendered as consecutive
assistant messages of one call each (a rewrite: prefix reuse reports it as ``realigned``). Tool results
render in the ``ipython`` role (the template JSON-encodes their content).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import BufferedToolParser, Family
from tracegym.gateway.proxy.prompt.tools import ToolParse, _openai_call, named_call, parse_status

PYTHON_TAG = "<|python_tag|>"


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return "<|start_header_id|>" in tokens or "<|start_header_id|>" in template


def _one_call(obj: Any, names: Collection[str] | None) -> tuple[str, str] | str:
    named = named_call(obj, names, ("parameters", "arguments"))
    if isinstance(named, str):
        return named
    name, args = named
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return "arguments are not JSON"
    if not isinstance(args, dict):
        return f"arguments are not an object ({type(args).__name__})"
    return name, json.dumps(args, ensure_ascii=False)


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    """The reply is calls when, after whitespace and an optional ``<|python_tag|>``, it starts with ``{``;
    then it must be JSON call objects separated by ``;`` and nothing else, or the parse fails (the text
    stays the content)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ToolParse(text or None, [], "none")
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError as e:
            return ToolParse(text, [], parse_status(0, [f"invalid JSON ({getattr(e, 'msg', e)})"]))
        except RecursionError:
            return ToolParse(text, [], parse_status(0, ["invalid JSON (nested too deeply)"]))
        call = _one_call(obj, names)
        if isinstance(call, str):
            return ToolParse(text, [], parse_status(0, [call]))
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ToolParse(None, [_openai_call(n, a) for n, a in calls], "ok")


def prepare(messages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[dict[str, Any]], list | None]:
    from tracegym.gateway.proxy.prompt.templating import prepare_messages

    out, tools = prepare_messages(messages, **kwargs)
    split: list[dict[str, Any]] = []
    for msg in out:
        calls = msg.get("tool_calls") or []
        if len(calls) > 1:
            split += [{**msg, "tool_calls": [c]} for c in calls]
        else:
            split.append(msg)
    return split, tools


FAMILY = Family(
    name="llama3",
    summary="Llama 3.x header turns; JSON tool calls ({\"name\", \"parameters\"}), results in the ipython role",
    recognise=_recognise,
    tool_syntax='[<|python_tag|>]{"name": ..., "parameters": {...}} as the whole reply (";" between calls)',
    parallel_calls=False,
    stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    history_rewrites="turn contents are trimmed; a message with several calls becomes one message per call; "
                     "the system prompt gains the template's date header",
    prepare=prepare,
    parse_tools=parse_tools,
    stream_tools=lambda names: BufferedToolParser(parse_tools, ("{", PYTHON_TAG), names, at_start=True),
)
