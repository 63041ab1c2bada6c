"""DeepSeek V3: ``<｜User｜>`` / ``<｜Assistant｜>`` turns and tool calls written in its tool-call special
tokens, rendered by DeepSeek V3's own template (shipped in its ``tokenizer_config.json``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGUMENTS}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The template reads ``tool_calls`` (arguments as a JSON string, content null) but never the tool
definitions, so they are written into the system prompt (``tool_system_section``). It renders a message's
calls only when its content is null, omits ``<｜tool▁calls▁end｜>`` after a single call, and renders a later
turn's calls without ``<｜Assistant｜>`` (it never resets its first-call flag): replies sampled in the
complete syntax then re-render differently, which prefix reuse reports as ``realigned``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import BufferedToolParser, Family
from tracegym.gateway.proxy.prompt.tools import ToolParse, _openai_call, parse_status

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(?P<type>[^<\n]*)" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n(?P<args>.*?)\n```"
    + re.escape(CALL_END), re.DOTALL)


def _recognise(template: str, tokens: Collection[str]) -> bool:
    return CALLS_BEGIN in tokens or CALLS_BEGIN in template


def format_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def tool_system_section(tools: list[dict[str, Any]], tool_choice: Any = None) -> str:
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = ("## Tools\n\nYou have access to the following functions:\n\n" + sigs + "\n\n"
            "To call a function, reply with:\n" + CALLS_BEGIN + format_call("NAME", "{ARGUMENTS}") + CALLS_END)
    if tool_choice == "required":
        text += "\n\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        text += f"\n\nYou must call the function {tool_choice['function']['name']}."
    return text


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    start = text.find(CALLS_BEGIN)
    if start < 0:
        if CALL_BEGIN in text:
            return ToolParse(text or None, [], parse_status(0, [f"{CALL_BEGIN} outside {CALLS_BEGIN}"]))
        return ToolParse(text or None, [], "none")
    pos, calls, failures = start + len(CALLS_BEGIN), [], []
    while True:
        rest = text[pos:].lstrip("\n")
        pos = len(text) - len(rest)
        m = _CALL.match(text, pos)
        if m is None:
            break
        name = m["name"].strip()
        if not name:
            failures.append("empty tool name")
        elif names is not None and name not in names:
            failures.append(f"unknown tool {name[:80]!r}")
        else:
            try:
                args = json.loads(m["args"])
            except ValueError as e:
                failures.append(f"arguments are not JSON ({getattr(e, 'msg', e)})")
            else:
                if isinstance(args, dict):
                    calls.append((name, m["args"]))
                else:
                    failures.append(f"arguments are not an object ({type(args).__name__})")
        pos = m.end()
    tail = text[pos:]
    if tail.startswith(CALLS_END):
        tail = tail[len(CALLS_END):]
    if tail.strip():
        failures.append("unterminated or malformed tool call" if CALL_BEGIN in tail or not calls
                        else "text after the tool calls")
    if failures:
        return ToolParse(text, [], parse_status(0, failures))
    content = text[:start].strip() or None
    return ToolParse(content, [_openai_call(n, a) for n, a in calls], parse_status(len(calls), []))


def prepare(messages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[dict[str, Any]], list | None]:
    from tracegym.gateway.proxy.prompt.templating import check_tool_choice, prepare_messages

    tools, choice = kwargs.pop("tools", None), kwargs.get("tool_choice")
    kwargs["native_tools"] = True
    out, _ = prepare_messages(messages, tools=None, **kwargs)
    for src, msg in zip(messages, out, strict=True):
        if not msg.get("tool_calls"):
            continue
        calls = []
        for orig, call in zip(src["tool_calls"], msg["tool_calls"], strict=True):
            raw = orig["function"].get("arguments", {})
            args = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
            calls.append({**call, "type": call.get("type") or "function",
                          "function": {**call["function"], "arguments": args}})
        msg["tool_calls"] = calls
        if not msg["content"]:
            msg["content"] = None
    if tools and check_tool_choice(choice) != "none":
        section = tool_system_section(tools, check_tool_choice(choice))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


FAMILY = Family(
    name="deepseek_v3",
    summary="DeepSeek V3 turns; tool calls in its tool-call special tokens with ```json arguments",
    recognise=_recognise,
    tool_syntax=f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}NAME\\n```json\\n{{...}}\\n```{CALL_END}...{CALLS_END}",
    stop_tokens=("<｜end▁of▁sentence｜>",),
    history_rewrites="a message with both text and calls renders its text only; the template's call "
                     "markup differs from the sampled one (see the module docstring)",
    prepare=prepare,
    parse_tools=parse_tools,
    stream_tools=lambda names: BufferedToolParser(parse_tools, (CALLS_BEGIN, CALL_BEGIN), names),
)
