"""Llama 3.1 / 3.2 / 3.3: ``<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>`` turns, JSON tool
calls and the ``ipython`` role for tool results, all rendered by Meta's own template.

The template (``modelfiles/templates/llama3_1.jinja``) is the chat template of meta-llama/Llama-3.1-8B-Instruct as
published in its ``tokenizer_config.json`` (the same text as Llama-3.3-70B-Instruct's), read from the
public copy in ggml-org/llama.cpp ``models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja`` (that
folder is fetched from the hub by its ``scripts/get_chat_template.py``). It is model data: the
``llama3-tiny`` builder writes it into the model directory as the real checkpoints carry it.

Tool calls: a reply that is a call is ``{"name": NAME, "parameters": {...}}`` (the template's instruction;
``arguments`` is accepted too), optionally after ``<|python_tag|>`` (a special token, gone from decoded
text). Replies are read incrementally (``StreamingToolParser``): a stream sends each call as its closing
brace arrives. Several calls separated by ``;`` are parsed, but the template renders one call per assistant
message and raises otherwise, so a history message with several calls is rendered as consecutive
assistant messages of one call each (a rewrite: prefix reuse reports it as ``realigned``). Tool results
render in the ``ipython`` role (the template JSON-encodes their content).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from tracegym.gateway.proxy.prompt.families.base import Family, parse_whole
from tracegym.gateway.proxy.prompt.tools import (
    ToolParse,
    ToolStreamDelta,
    named_call,
    new_call_id,
    parse_status,
)

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


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


class JsonObjectEnd:
    """Where a JSON object that starts a text ends, fed piece by piece: ``{`` to its matching ``}``, brackets
    in strings (and escaped quotes) skipped. Whether the object is valid JSON is ``json.loads``' to say."""

    __slots__ = ("_depth", "_escaped", "_in_string")
    _SPECIAL = re.compile(r'[{}\[\]"\\]')

    def __init__(self) -> None:
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, chunk: str) -> int:
        """The index in ``chunk`` just past the object's end, or -1 while it is still open."""
        skip = 0 if self._escaped else -1  # the character after a backslash is escaped
        self._escaped = False
        for m in self._SPECIAL.finditer(chunk):
            i, ch = m.start(), m.group()
            if i == skip:
                continue
            if self._in_string:
                if ch == "\\":
                    skip = i + 1
                    self._escaped = skip == len(chunk)
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1


class StreamingToolParser:
    """Llama 3 replies, incrementally: the reply is calls when, after whitespace and an optional
    ``<|python_tag|>``, it starts with ``{``; each JSON call object is a call as soon as its closing brace
    arrives, ``;`` and whitespace between calls are dropped. The first thing that is not a well-formed call
    of an offered tool (invalid JSON, arguments that are not an object, an unknown tool, other text after a
    call) ends the calls: from there the text is content as written (the whole reply when no call came
    before it), and the status says why. Any other reply is content, unchanged."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._names = names
        self._mode = "start"  # start (undecided) | calls | text (the rest is content)
        self._held = ""  # start: the undecided text; calls: everything since the reply began, until a call
        self._object: JsonObjectEnd | None = None  # the call object being read
        self._segment = ""  # its text so far
        self._calls = 0
        self._failure: str | None = None

    @property
    def status(self) -> str:
        if self._mode == "start" or (self._mode == "text" and self._failure is None):
            return "none"
        return parse_status(self._calls, [self._failure] if self._failure else [])

    def feed(self, delta: str) -> list[ToolStreamDelta]:
        if self._mode == "text":
            return [ToolStreamDelta("content", delta)] if delta else []
        if self._mode == "calls":
            return self._read_calls(delta)
        self._held += delta
        body = self._held.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(body):
            return []  # whitespace, or what may become the tag
        if not body:
            return []
        if body[0] != "{":
            self._mode, held, self._held = "text", self._held, ""
            return [ToolStreamDelta("content", held)]
        self._mode = "calls"
        self._held = self._held[: len(self._held) - len(body)]  # the text before the first call object
        return self._read_calls(body)

    def finish(self) -> list[ToolStreamDelta]:
        if self._mode == "start":
            self._mode, held, self._held = "text", self._held, ""
            return [ToolStreamDelta("content", held)] if held else []
        if self._mode == "calls" and self._object is not None:
            try:
                json.loads(self._segment)
                reason = "unterminated call object"
            except ValueError as e:
                reason = f"invalid JSON ({getattr(e, 'msg', e)})"
            except RecursionError:
                reason = "invalid JSON (nested too deeply)"
            return self._fail(reason, "")
        return []

    def _read_calls(self, chunk: str) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        while chunk:
            if self._object is None:  # between calls
                body = chunk.lstrip(_SEPARATORS)
                if self._calls == 0:
                    self._held += chunk[: len(chunk) - len(body)]
                if not body:
                    return out
                if body[0] != "{":
                    return out + self._fail("text after the tool calls", body)
                chunk, self._object, self._segment = body, JsonObjectEnd(), ""
            end = self._object.feed(chunk)
            if end < 0:
                self._segment += chunk
                return out
            self._segment += chunk[:end]
            chunk, self._object = chunk[end:], None
            call = _parse_call(self._segment, self._names)
            if isinstance(call, str):
                return out + self._fail(call, chunk)
            out.append(ToolStreamDelta("tool_call", index=self._calls, id=new_call_id(), name=call[0],
                                       arguments=call[1]))
            self._calls, self._held, self._segment = self._calls + 1, "", ""
        return out

    def _fail(self, reason: str, rest: str) -> list[ToolStreamDelta]:
        """The calls end here: the failed call (with all that came before it when no call did) and ``rest``
        are content."""
        text = (self._held + self._segment if self._calls == 0 else self._segment) + rest
        self._mode, self._failure, self._object, self._held, self._segment = "text", reason, None, "", ""
        return [ToolStreamDelta("content", text)] if text else []


def _parse_call(segment: str, names: Collection[str] | None) -> tuple[str, str] | str:
    try:
        obj = json.loads(segment)
    except ValueError as e:
        return f"invalid JSON ({getattr(e, 'msg', e)})"
    except RecursionError:
        return "invalid JSON (nested too deeply)"
    return _one_call(obj, names)


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    """The whole reply read by ``StreamingToolParser`` (streamed and whole parses agree by construction)."""
    return parse_whole(StreamingToolParser(names), text)


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
    stream_tools=StreamingToolParser,
)
