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

from tracegym.gateway.proxy.prompt.families.base import Family, parse_whole, partial_marker
from tracegym.gateway.proxy.prompt.tools import (
    ToolParse,
    ToolStreamDelta,
    arguments_error,
    new_call_id,
    parse_status,
)

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


class StreamingToolParser:
    """DeepSeek V3 replies, incrementally. Text before ``<｜tool▁calls▁begin｜>`` is content, streamed as it
    comes (its trailing whitespace is dropped when calls follow); each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``
    is a call as soon as its end token arrives; whitespace between calls is dropped and
    ``<｜tool▁calls▁end｜>`` closes them (optional: the template leaves it out after a single call). The
    first call that does not parse, or text after the calls, ends them: from there the text is content as
    written (the whole reply when no call came before it), and the status says why. A
    ``<｜tool▁call▁begin｜>`` before any ``<｜tool▁calls▁begin｜>`` fails the parse and stays in the content."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._names = names
        self._mode = "content"  # content | calls (between calls) | call (inside one) | after | text
        self._buf = ""  # content: text not sent yet (whitespace, a marker's start); else: text not read yet
        self._raw = ""  # the calls' text as written, until one is sent (content if the first one fails)
        self._began = self._sent_content = False
        self._calls = 0
        self._failure: str | None = None

    @property
    def status(self) -> str:
        if not self._began and self._failure is None:
            return "none"
        return parse_status(self._calls, [self._failure] if self._failure else [])

    def feed(self, delta: str) -> list[ToolStreamDelta]:
        if self._mode == "text":
            return [ToolStreamDelta("content", delta)] if delta else []
        self._buf += delta
        if self._mode != "content":
            return self._read_calls()
        i, k = self._buf.find(CALLS_BEGIN), self._buf.find(CALL_BEGIN)
        if k >= 0 and (i < 0 or k < i):
            return self._fail(f"{CALL_BEGIN} outside {CALLS_BEGIN}", "", self._buf)
        cut = i if i >= 0 else len(self._buf) - partial_marker(self._buf, (CALLS_BEGIN, CALL_BEGIN))
        body = self._buf[:cut].rstrip()  # whitespace before the calls is dropped: held until decided
        out = self._content(body)
        if i < 0:
            self._buf = self._buf[len(body):]
            return out
        self._raw, self._buf = self._buf[len(body) : i + len(CALLS_BEGIN)], self._buf[i + len(CALLS_BEGIN):]
        self._mode, self._began = "calls", True
        return out + self._read_calls()

    def finish(self) -> list[ToolStreamDelta]:
        if self._mode == "content":
            out, self._buf, self._mode = self._content(self._buf), "", "text"
            return out
        if self._mode == "call" or (self._mode == "calls" and self._buf):
            return self._fail("unterminated or malformed tool call", self._buf, "")
        return []

    def _read_calls(self) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        while True:
            if self._mode == "call":
                j = self._buf.find(CALL_END)
                if j < 0:
                    return out
                block, self._buf = self._buf[: j + len(CALL_END)], self._buf[j + len(CALL_END):]
                call = _block_call(block, self._names)
                if isinstance(call, str):
                    return out + self._fail(call, block, self._buf)
                out.append(ToolStreamDelta("tool_call", index=self._calls, id=new_call_id(), name=call[0],
                                           arguments=call[1]))
                self._calls, self._raw, self._mode = self._calls + 1, "", "calls"
                continue
            body = self._buf.lstrip()
            if self._calls == 0:
                self._raw += self._buf[: len(self._buf) - len(body)]
            self._buf = body
            if not body:
                return out
            if self._mode == "after":
                return out + self._fail("text after the tool calls", "", body)
            if body.startswith(CALL_BEGIN):
                self._mode = "call"
            elif body.startswith(CALLS_END):
                if self._calls == 0:
                    self._raw += CALLS_END
                self._mode, self._buf = "after", body[len(CALLS_END):]
            elif CALL_BEGIN.startswith(body) or CALLS_END.startswith(body):
                return out  # a marker's start
            else:
                return out + self._fail("malformed tool call", "", body)

    def _content(self, text: str) -> list[ToolStreamDelta]:
        if not text:
            return []
        self._sent_content = True
        return [ToolStreamDelta("content", text)]

    def _fail(self, reason: str, segment: str, rest: str) -> list[ToolStreamDelta]:
        """The calls end here: the failed part (with all the calls' text before it when no call was sent)
        and ``rest`` are content."""
        if self._calls:
            text = segment + rest
            text = "\n" + text.lstrip() if self._sent_content and text.strip() else text
        else:
            text = self._raw + segment + rest
        self._mode, self._failure, self._buf, self._raw = "text", reason, "", ""
        return self._content(text)


def _block_call(block: str, names: Collection[str] | None) -> tuple[str, str] | str:
    """``(name, arguments as sampled)`` of one ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` block, or why it
    is not a call."""
    m = _CALL.fullmatch(block)
    if m is None:
        return "malformed tool call"
    name = m["name"].strip()
    if not name:
        return "empty tool name"
    if names is not None and name not in names:
        return f"unknown tool {name[:80]!r}"
    if (why := arguments_error(m["args"])) is not None:
        return why
    return name, m["args"]


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    """The whole reply read by ``StreamingToolParser`` (streamed and whole parses agree by construction)."""
    return parse_whole(StreamingToolParser(names), text)


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
    stream_tools=StreamingToolParser,
)
