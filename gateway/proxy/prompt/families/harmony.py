"""OpenAI's harmony format read incrementally: a gpt-oss reply (which continues the prompt's
``<|start|>assistant``) is a sequence of messages ``{header}<|message|>{body}<|end|>``, each after the first
opened by ``<|start|>``; the header names the channel (``<|channel|>analysis``, ``commentary``, ``final``)
and, for a tool call, the recipient (``to=functions.NAME``). A body ends at ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the last two are stop tokens, gone from decoded text) or where the next message starts.

Two readers, each fed text deltas, each deciding a message when its header is complete:

- ``HarmonyReasoning`` (the family's ``split_reasoning``/``stream_reasoning``): the bodies of analysis
  messages without a recipient are the reasoning (joined by a newline), streamed as they come; the rest of
  the text passes through as written (the analysis messages cut out) for the tool reader.
- ``HarmonyTools`` (``parse_tools``/``stream_tools``): final and commentary bodies without a recipient are
  the content (non-empty ones joined by a newline), streamed as they come; a message to ``functions.NAME``
  is a call once it ends (its body must be a JSON object, the tool one the request offered); one that does
  not parse stays in the content as written (its markup included) and fails the parse.

A reply with no ``<|message|>`` or ``<|channel|>`` at all is not harmony: it is held to its end, then read
as plain text (``<think>`` reasoning, no calls).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Generic, TypeVar

from tracegym.gateway.proxy.prompt.families.base import partial_marker
from tracegym.gateway.proxy.prompt.reasoning import ReasoningDelta
from tracegym.gateway.proxy.prompt.reasoning import split_reasoning as split_think
from tracegym.gateway.proxy.prompt.tools import ToolStreamDelta, arguments_error, new_call_id, parse_status

START, CHANNEL, MESSAGE, END, CALL, RETURN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
STOPS = (END, CALL, RETURN)
_TO = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL_END = re.compile(r"[\s<]")


def channel(header: str) -> str:
    return _CHANNEL_END.split(header.split(CHANNEL, 1)[1], maxsplit=1)[0] if CHANNEL in header else ""


def recipient(header: str) -> str | None:
    to = _TO.search(header)
    return to.group(1) if to else None


_HEADER_ENDS = (MESSAGE, START)
_BODY_ENDS = (*STOPS, START)
_TAIL_ENDS = (START,)
_FIND = {ms: re.compile("|".join(map(re.escape, ms))).search for ms in (_HEADER_ENDS, _BODY_ENDS, _TAIL_ENDS)}
"""Per tuple of markers above: ``search(text, pos)`` for the earliest of them."""


D = TypeVar("D")


class _Messages(Generic[D]):
    """The message machine both readers share, fed text deltas (``feed``, ``finish``), each answered with the
    deltas of type ``D`` the subclass put in ``_out`` meanwhile. ``_buf`` holds the text not read yet;
    subclasses say what a message is once its header is known (``_opened``), what to do with its body text
    (``_body``), with its end (``_closed``: the stop marker, ``<|start|>`` when the next message begins, or
    "" at the reply's end), with text between its stop marker and the next message (``_tail``), with
    text outside any message (``_passed``: the reply's leading whitespace) and with a whole reply that
    turned out not to be harmony (``_not_harmony``)."""

    def __init__(self) -> None:
        self._buf = ""
        self._markup = False  # a <|message|> or <|channel|> was seen: the reply is harmony
        self._state = "header"  # header | body | tail (after a stop marker, up to the next message)
        self._prefix = ""  # how the current message began: "" (the reply's first) or <|start|>
        self._header = ""
        self._out: list[D] = []

    def feed(self, delta: str) -> list[D]:
        self._buf += delta
        self._out = []
        if self._decided():
            self._read(final=False)
        return self._out

    def finish(self) -> list[D]:
        self._out = []
        if self._decided():
            self._read(final=True)
        else:
            self._not_harmony()
        return self._out

    def read(self, text: str) -> list[D]:
        """A whole reply, fed and finished in one pass: the deltas ``feed(text)`` and ``finish()`` give, in
        fewer pieces (``_read`` holds back no partial marker when it reads to the end)."""
        self._buf += text
        return self.finish()

    def _decided(self) -> bool:
        """Whether the reply is known to be harmony (until then it is held whole)."""
        if not self._markup and (MESSAGE in self._buf or CHANNEL in self._buf):
            self._markup = True
        return self._markup

    def _read(self, final: bool) -> None:
        """Read ``_buf`` from its start (``at``), and keep what is not read yet: at the end (``final``) nothing,
        else what may be the start of a marker."""
        buf, at, end = self._buf, 0, len(self._buf)
        while True:
            if self._state == "header":
                m = _FIND[_HEADER_ENDS](buf, at)
                if m is None:
                    stop = end if final else end - partial_marker(buf[at:], _HEADER_ENDS)
                    self._header += buf[at:stop]
                    self._buf = buf[stop:]
                    if final:
                        self._header_only()
                    return
                self._header += buf[at : m.start()]
                at = m.end()
                if m.group() == START:
                    self._header_only()
                    self._prefix, self._header = START, ""
                    continue
                self._opened(self._prefix, self._header, True)
                self._state = "body"
                continue
            body = self._state == "body"
            markers = _BODY_ENDS if body else _TAIL_ENDS
            m = _FIND[markers](buf, at)
            if m is None:
                stop = end if final else end - partial_marker(buf[at:], markers)
                text, self._buf = buf[at:stop], buf[stop:]
                if body:
                    self._body(text)
                    if final:
                        self._closed("")
                else:
                    self._tail(text)
                return
            text, marker, at = buf[at : m.start()], m.group(), m.end()
            if body:
                self._body(text)
                self._closed(marker)
            else:
                self._tail(text)
            if marker == START:
                self._state, self._prefix, self._header = "header", START, ""
            else:
                self._state = "tail"

    def _header_only(self) -> None:
        """A header that no ``<|message|>`` followed (the reply's leading whitespace is no message)."""
        if self._prefix or self._header.strip():
            self._opened(self._prefix, self._header, False)
            self._closed("")
        else:
            self._passed(self._header)

    def _opened(self, prefix: str, header: str, has_body: bool) -> None:
        raise NotImplementedError

    def _body(self, text: str) -> None:
        raise NotImplementedError

    def _closed(self, marker: str) -> None:
        raise NotImplementedError

    def _tail(self, text: str) -> None:
        """Text after a message's stop marker, before the next message: dropped unless a reader keeps it."""

    def _passed(self, text: str) -> None:
        """Text outside any message: dropped unless a reader keeps it."""

    def _not_harmony(self) -> None:
        """The reply ended without harmony markup: ``_buf`` holds it whole."""
        raise NotImplementedError


class HarmonyReasoning(_Messages[ReasoningDelta]):
    """Analysis bodies as reasoning deltas (joined by a newline), everything else as text deltas as written,
    as they come (``feed``, ``finish``); ``started``: an analysis message was seen. ``opens``: the prompt
    ended inside ``<think>`` (for a reply that turns out not to be harmony)."""

    def __init__(self, opens: bool = False) -> None:
        super().__init__()
        self._opens = opens
        self.state = "start"
        self.started = False
        self._analysis = False  # the current message is analysis

    def finish(self) -> list[ReasoningDelta]:
        out = super().finish()
        self.state = "text"
        return out

    def _not_harmony(self) -> None:
        reasoning, text = split_think(self._buf, opens_in_reasoning=self._opens)
        self._buf = ""
        if reasoning is not None:
            self.started = True
            self._out.append(ReasoningDelta("reasoning", reasoning))
        self._emit("text", text)

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._out.append(ReasoningDelta(kind, text))  # type: ignore[arg-type]

    def _opened(self, prefix: str, header: str, has_body: bool) -> None:
        self._analysis = channel(header) == "analysis" and recipient(header) is None
        if self._analysis:
            if self.started:
                self._emit("reasoning", "\n")
            self.started = True
        else:
            self._emit("text", prefix + header + (MESSAGE if has_body else ""))

    def _body(self, text: str) -> None:
        self._emit("reasoning" if self._analysis else "text", text)

    def _closed(self, marker: str) -> None:
        if not self._analysis and marker != START:
            self._emit("text", marker)

    def _tail(self, text: str) -> None:
        if not self._analysis:
            self._emit("text", text)

    def _passed(self, text: str) -> None:
        self._emit("text", text)


class HarmonyTools(_Messages[ToolStreamDelta]):
    """Content deltas and calls as they come (``feed``, ``finish``, ``status``), ``StreamTools``' protocol;
    ``names``: the offered tools (None: any)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__()
        self._names = names
        self._kind = "skip"  # the current message: text (content) | call | skip (another channel)
        self._sent_text = False  # content was sent (a later piece starts with a newline)
        self._piece_started = False  # the current message's content has begun
        self._to: str | None = None
        self._raw = ""  # a call message as written
        self._args = ""
        self._calls = 0
        self._failures: list[str] = []

    @property
    def status(self) -> str:
        return parse_status(self._calls, self._failures)

    def _not_harmony(self) -> None:
        if self._buf:
            self._out.append(ToolStreamDelta("content", self._buf))
            self._buf = ""

    def _content(self, text: str) -> None:
        if not text:
            return
        if not self._piece_started:
            self._piece_started = True
            if self._sent_text:
                text = "\n" + text
        self._sent_text = True
        self._out.append(ToolStreamDelta("content", text))

    def _opened(self, prefix: str, header: str, has_body: bool) -> None:
        self._to, self._piece_started = recipient(header), False
        if self._to is not None:
            self._kind, self._raw, self._args = "call", prefix + header + (MESSAGE if has_body else ""), ""
        else:
            self._kind = "text" if channel(header) in ("final", "commentary", "analysis", "") else "skip"

    def _body(self, text: str) -> None:
        if self._kind == "text":
            self._content(text)
        elif self._kind == "call":
            self._args += text
            self._raw += text

    def _closed(self, marker: str) -> None:
        if self._kind != "call":
            return
        self._kind = "skip"
        call = self._call(self._to or "", self._args)
        if isinstance(call, str):
            self._failures.append(call)
            self._content(self._raw + (marker if marker != START else ""))
            return
        self._out.append(ToolStreamDelta("tool_call", index=self._calls, id=new_call_id(), name=call[0],
                                         arguments=call[1]))
        self._calls += 1

    def _call(self, to: str, body: str) -> tuple[str, str] | str:
        """``(name, arguments as sampled)`` of a message to ``to``, or why it is not a call."""
        if not to.startswith("functions."):
            return f"recipient {to[:80]!r} is not a function"
        name = to[len("functions."):]
        if self._names is not None and name not in self._names:
            return f"unknown tool {name[:80]!r}"
        if (why := arguments_error(body)) is not None:
            return why
        return name, body.strip()
