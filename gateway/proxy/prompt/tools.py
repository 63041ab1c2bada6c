"""Tool-call syntax, both ways: hermes/qwen ``<tool_call>{json}</tool_call>`` text ⇄ OpenAI ``tool_calls``.

Formatting (used by the chat templating for templates that know nothing of tools) and parsing (model
output → OpenAI message, whole or streamed) agree on one canonical form::

    <content>\\n<tool_call>{"name": "f", "arguments": {...}}</tool_call>\\n<tool_call>...</tool_call>

so that a reply which follows the instruction re-renders to exactly the text the model sampled.

Parsing rules (``parse_tool_calls`` and ``StreamingToolParser`` implement the same ones):
- a block is ``<tool_call>`` up to the first ``</tool_call>`` after it; an unterminated block at the end
  of the text counts too. A block is a call when its inner text is a JSON object with a non-empty string
  ``name`` (one of the request's tools, when their names are given) and ``arguments`` that are an object
  or a JSON string holding one (``parameters`` is accepted as an alias; missing arguments are ``{}``).
- a block that is not a call stays in the content verbatim, tags included (nothing is dropped), and the
  parse says why (``ToolParse.status``: ``ok`` | ``none`` | ``failed: <reason>``, recorded on the span as
  ``tracegym.tool_parse``), so malformed model output is a successful text reply that can be found.
- whitespace touching a call (between content and a call, between calls) is removed; the content pieces
  around calls are joined with ``\\n``. Without calls the content is returned unchanged.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_arguments(arguments: Any) -> Any:
    """A tool call's ``arguments`` as a value: a blank string is ``{}``, a JSON string its value, any other
    string itself (rendered as the client sent it; also when it nests too deep to parse), a non-string
    unchanged. The one reading of arguments for rendering and for comparing calls."""
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return arguments


def format_tool_call(name: str, arguments: Any) -> str:
    """The canonical text of one call. ``arguments`` is a dict or a JSON string (parsed when it is JSON)."""
    body = json.dumps({"name": name, "arguments": parse_arguments(arguments)}, ensure_ascii=False)
    return f"{OPEN_TAG}{body}{CLOSE_TAG}"


def format_assistant_content(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's content followed by its calls, in the canonical form the parser inverts."""
    parts = [content] if content else []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"tool_calls entries must look like {{'function': {{'name', 'arguments'}}}}: {call!r}"
            )
        parts.append(format_tool_call(fn["name"], fn.get("arguments", {})))
    return "\n".join(parts)


def tool_system_section(tools: list[dict[str, Any]], tool_choice: Any = None) -> str:
    """Hermes-style instructions listing the function signatures (for templates without tool support)."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{sigs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags, one call per tag:\n"
        '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    )
    if tool_choice == "required":
        text += "\n\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        text += f"\n\nYou must call the function {tool_choice['function']['name']}."
    return text


def named_call(obj: Any, names: Collection[str] | None, arg_keys: tuple[str, str]) -> tuple[str, Any] | str:
    """``(name, arguments as given)`` of a JSON call object (its arguments under the first of ``arg_keys``
    it has; ``{}`` under neither), or why it is not a call of an offered tool (``names``; None = any)."""
    if not isinstance(obj, dict):
        return f"not a JSON object ({type(obj).__name__})"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "empty tool name" if name == "" else "no tool name"
    if names is not None and name not in names:
        return f"unknown tool {name[:80]!r}"
    first, second = arg_keys
    return name, obj.get(first, obj.get(second, {}))


def _loads(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` for JSON ``text``, else ``(None, why it does not parse)``."""
    try:
        return json.loads(text), None
    except ValueError as e:  # JSONDecodeError is a ValueError
        return None, str(getattr(e, "msg", e))
    except RecursionError:
        return None, "nested too deeply"


def arguments_error(text: str) -> str | None:
    """Why ``text`` is not a JSON object of call arguments, or None when it is."""
    args, why = _loads(text)
    if why is not None:
        return f"arguments are not JSON ({why})"
    if not isinstance(args, dict):
        return f"arguments are not an object ({type(args).__name__})"
    return None


def _as_call(inner: str, names: Collection[str] | None) -> tuple[str, str] | str:
    """``(name, arguments JSON string)`` when ``inner`` is a well-formed call, else why it is not."""
    obj, why = _loads(inner)
    if why is not None:
        return f"invalid JSON ({why})"
    named = named_call(obj, names, ("arguments", "parameters"))
    if isinstance(named, str):
        return named
    name, args = named
    if isinstance(args, dict):
        return name, json.dumps(args, ensure_ascii=False)
    if isinstance(args, str) and isinstance(parse_arguments(args), dict):
        return name, args
    return f"arguments are not an object ({type(args).__name__})"


def parse_status(calls: int, failures: list[str]) -> str:
    """``ok`` (calls, no failed block), ``none`` (no block at all) or ``failed: <first reason>``."""
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return f"failed: {failures[0]}{more}"
    return "ok" if calls else "none"


def combine_status(statuses: list[str | None]) -> str | None:
    """One status for a call's choices: the first failure, else ``ok`` if any choice called, else ``none``;
    None when no choice was parsed."""
    known = [s for s in statuses if s is not None]
    if not known:
        return None
    return next((s for s in known if s.startswith("failed")), "ok" if "ok" in known else "none")


def _openai_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass(slots=True)
class ToolParse:
    content: str | None
    calls: list[dict[str, Any]]
    """OpenAI ``tool_calls``."""
    status: str
    """``ok`` | ``none`` | ``failed: <reason>`` (``parse_status``)."""


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into ``(content or None, OpenAI tool_calls)``. Never raises on bad blocks."""
    parsed = parse_tools(text, names)
    return parsed.content, parsed.calls


def parse_tools(text: str, names: Collection[str] | None = None) -> ToolParse:
    """``parse_tool_calls`` with the parse's status; ``names``: the request's tools (None: any name)."""
    segments: list[str | tuple[str, str]] = []  # content text, or (name, arguments) for a call
    failures: list[str] = []
    pos = 0
    while True:
        i = text.find(OPEN_TAG, pos)
        if i < 0:
            segments.append(text[pos:])
            break
        segments.append(text[pos:i])
        j = text.find(CLOSE_TAG, i + len(OPEN_TAG))
        inner = text[i + len(OPEN_TAG) : j if j >= 0 else len(text)]
        call = _as_call(inner, names)
        raw = text[i : j + len(CLOSE_TAG)] if j >= 0 else text[i:]
        if isinstance(call, str):
            failures.append(call if j >= 0 else f"{call} in an unterminated block")
        segments.append(call if isinstance(call, tuple) else raw)
        if j < 0:
            break
        pos = j + len(CLOSE_TAG)
    calls = [s for s in segments if isinstance(s, tuple)]
    status = parse_status(len(calls), failures)
    if not calls:
        return ToolParse(text or None, [], status)
    pieces: list[str] = []
    current: list[str] = []
    after_call = False
    for seg in [*segments, ("", "")]:  # a sentinel call closes the last piece
        if isinstance(seg, str):
            current.append(seg)
            continue
        piece = "".join(current)
        piece = piece.lstrip() if after_call else piece
        piece = piece.rstrip() if seg != ("", "") else piece
        if piece:
            pieces.append(piece)
        current, after_call = [], True
    content = "\n".join(pieces)
    return ToolParse(content or None, [_openai_call(n, a) for n, a in calls], status)


@dataclass(slots=True)
class ToolStreamDelta:
    """Either content text or one whole tool call, ready for an OpenAI streaming chunk's ``delta``."""

    kind: Literal["content", "tool_call"]
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""
    arguments: str = ""

    def to_delta(self) -> dict[str, Any]:
        if self.kind == "content":
            return {"content": self.text}
        call = _openai_call(self.name, self.arguments, self.id)
        return {"tool_calls": [{"index": self.index, **call}]}


def _partial_tag_len(buf: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN_TAG) - 1, len(buf)), 0, -1):
        if buf.endswith(OPEN_TAG[:n]):
            return n
    return 0


class StreamingToolParser:
    """Incremental ``parse_tool_calls``: feed text deltas, get content and whole tool calls as they close.

    Holds back a possible partial ``<tool_call>`` tag and whitespace that would be removed if a call
    followed; the concatenated content events and the calls equal ``parse_tool_calls`` of the whole text.
    """

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._names = names
        self._failures: list[str] = []
        self._buf = ""  # unprocessed text (content state) or the open block's inner text (block state)
        self._in_block = False
        self._ws_hold = ""  # trailing whitespace of the content, dropped if a call follows
        self._after_call = False  # whitespace is being skipped after a call
        self._emitted = False  # some content was emitted (a later piece needs a "\n" separator)
        self._calls = 0

    def feed(self, delta: str) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        self._buf += delta
        while True:
            if self._in_block:
                j = self._buf.find(CLOSE_TAG)
                if j < 0:
                    return out
                inner, self._buf = self._buf[:j], self._buf[j + len(CLOSE_TAG) :]
                self._in_block = False
                self._close_block(inner, OPEN_TAG + inner + CLOSE_TAG, out)
                continue
            i = self._buf.find(OPEN_TAG)
            if i >= 0:
                self._content(self._buf[:i], out)
                self._buf, self._in_block = self._buf[i + len(OPEN_TAG) :], True
                continue
            keep = _partial_tag_len(self._buf)
            self._content(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        if self._in_block:
            self._in_block = False
            self._close_block(self._buf, OPEN_TAG + self._buf, out, terminated=False)
        else:
            self._content(self._buf, out)
        self._buf = ""
        if self._ws_hold:
            out.append(ToolStreamDelta("content", self._ws_hold))
            self._ws_hold = ""
        return out

    @property
    def status(self) -> str:
        """The parse's status so far (``parse_status``; final after ``finish``)."""
        return parse_status(self._calls, self._failures)

    def _close_block(self, inner: str, raw: str, out: list[ToolStreamDelta], *, terminated: bool = True) -> None:
        call = _as_call(inner, self._names)
        if isinstance(call, str):
            self._failures.append(call if terminated else f"{call} in an unterminated block")
            self._content(raw, out)
            return
        out.append(
            ToolStreamDelta("tool_call", index=self._calls, id=new_call_id(), name=call[0], arguments=call[1])
        )
        self._calls += 1
        self._ws_hold, self._after_call = "", True

    def _content(self, seg: str, out: list[ToolStreamDelta]) -> None:
        if self._after_call:
            seg = seg.lstrip()
            if not seg:
                return
            self._after_call = False
            if self._emitted:
                seg = "\n" + seg
        full = self._ws_hold + seg
        body = full.rstrip()
        self._ws_hold = full[len(body) :]
        if body:
            out.append(ToolStreamDelta("content", body))
            self._emitted = True
