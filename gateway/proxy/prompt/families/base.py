"""What a model family is, as data: how its chat template is fed, how its replies are read back.

A ``Family`` holds pure functions and constants only; one module per family builds one. The gateway picks
the family of a model directory once (``families.detect``) and dispatches through it:

- ``prepare``: OpenAI-shaped messages → the messages (and tools) its chat template expects;
- ``split_reasoning``: a reply's reasoning off its text (``<think>`` blocks, harmony's analysis channel);
- ``parse_tools``: the text's tool calls → OpenAI ``tool_calls`` with a parse status (never silent:
  ``ok`` | ``none`` | ``failed: <reason>``);
- ``stream_tools``: the same, fed text deltas;
- ``stop_tokens``, ``keep_tokens``: how a reply ends, and the special tokens its decoded text keeps;
- ``framed_replies``: every reply is read by the tool reader, which also gives the content (harmony);
- ``history_rewrites``: what its template drops or rewrites in earlier turns (so prefix reuse reports
  ``realigned`` there instead of drifting silently), written for people (docs/model-families.md);
- ``written_back``: how its template writes a reply back where it knows that rewrite (prefix reuse
  then needs no second render to find where the new turns start);
- ``renderer``: its official template written in Python, for that template's exact source (the tests prove
  the two render alike).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from tracegym.gateway.proxy.prompt.reasoning import ReasoningDelta, StreamingReasoningParser, split_reasoning
from tracegym.gateway.proxy.prompt.tools import (
    StreamingToolParser,
    ToolParse,
    ToolStreamDelta,
    _openai_call,
    parse_tools,
)


class StreamTools(Protocol):
    """Incremental tool-call parsing (``tools.StreamingToolParser`` is one)."""

    def feed(self, delta: str) -> list[ToolStreamDelta]: ...

    def finish(self) -> list[ToolStreamDelta]: ...

    @property
    def status(self) -> str: ...


class Renderer(Protocol):
    """A chat template written in Python (``Family.renderer``)."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, context: dict[str, Any]) -> str | None:
        """The template's text for the prepared ``messages`` and ``tools`` and the template variables
        ``context``, or None for inputs it leaves to the template (which then renders them, or raises)."""
        ...


Prepare = Callable[..., tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]
"""``prepare(messages, tools=, tool_choice=, native_tools=, tool_role=, reasoning_field=)`` →
``(template messages, tools the template sees)`` (``templating.prepare_messages`` is the default)."""


def _split_think(text: str, opens: bool) -> tuple[str | None, str]:
    return split_reasoning(text, opens_in_reasoning=opens)


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    """One line: the chat format and tool-call syntax."""
    recognise: Callable[[str, Collection[str]], bool]
    """``(chat template sources joined, the tokenizer's added-token strings)`` → whether this is the family."""
    tool_syntax: str
    reasoning: str | None = None
    """How reasoning is written (None: the family has none)."""
    parallel_calls: bool = True
    stop_tokens: tuple[str, ...] = ()
    history_rewrites: str = "nothing: earlier turns render as they were sampled"
    keep_tokens: tuple[str, ...] = ()
    """Special tokens kept when a reply is decoded (its syntax is made of them); others are skipped."""
    framed_replies: bool = False
    """Every reply is written in the family's syntax (harmony's channels), so its tool reader also gives
    the content: replies are read by it with or without tools offered (with none, a call is an unknown
    tool and stays in the content as written; no parse status is recorded then)."""
    prepare: Prepare | None = None
    """None: ``templating.prepare_messages``."""
    written_back: Callable[[str], tuple[str, str] | None] | None = None
    """``(a reply's text as sampled)`` → ``(the text the template writes for it once later turns follow, from
    where the reply's prompt ended to where its end-of-turn token starts; that token)`` for a reply the
    template rewrites in a way the family knows (harmony: a final answer's analysis dropped, its
    ``<|return|>`` written as ``<|end|>``), else None. Prefix reuse finds that text in the re-render where the
    reply was and appends what follows it, instead of rendering the conversation a second time to find it
    (the same new part: tested on the family's corpus). None: the family has no such rewrite."""
    renderer: Callable[[str], Renderer | None] | None = None
    """``(a chat template's source)`` → a renderer of it written in Python, for the template sources it was
    proven equal to (else None, as is the field for families without one: the template renders itself).
    Each tokenizer builds its own (a renderer keeps memos)."""
    split_reasoning: Callable[[str, bool], tuple[str | None, str]] = _split_think
    parse_tools: Callable[[str, Collection[str] | None], ToolParse] = parse_tools
    stream_tools: Callable[[Collection[str] | None], StreamTools] = StreamingToolParser
    stream_reasoning: Callable[[bool], Any] = StreamingReasoningParser
    """``(opens_in_reasoning)`` → a parser with ``feed``/``finish`` (``ReasoningDelta`` lists), ``state`` and
    ``started``, as ``reasoning.StreamingReasoningParser``."""


def partial_marker(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers`` (text to hold
    back while streaming: the next delta may complete the marker)."""
    best = 0
    for m in markers:
        i = buf.find(m[0], max(len(buf) - len(m) + 1, 0))
        while i >= 0:  # the earliest start that ``m`` continues is the longest partial marker
            if m.startswith(buf[i:]):
                best = max(best, len(buf) - i)
                break
            i = buf.find(m[0], i + 1)
    return best


def parse_whole(parser: StreamTools, text: str) -> ToolParse:
    """A whole reply read by a streaming parser: its content events joined, its calls, its status (so a family
    whose ``parse_tools`` is this streams exactly what it parses)."""
    events = [*parser.feed(text), *parser.finish()] if text else parser.finish()
    return tool_parse(events, parser.status)


def tool_parse(events: list[ToolStreamDelta], status: str) -> ToolParse:
    """A whole reply's parse from its stream events: the content events joined, the calls, the status."""
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [_openai_call(e.name, e.arguments, e.id) for e in events if e.kind == "tool_call"]
    return ToolParse(content or None, calls, status)


class BufferedToolParser:
    """Streaming for syntaxes without an incremental parser: text passes through until one of ``markers``
    may have started; from there it is held and parsed whole at ``finish`` (so the events equal
    ``parse`` of the whole text: content first, then the calls). ``at_start``: the syntax can only open
    the reply (after whitespace), so the reply is held until that is decided."""

    def __init__(self, parse: Callable[[str, Collection[str] | None], ToolParse], markers: tuple[str, ...],
                 names: Collection[str] | None, *, at_start: bool = False) -> None:
        self._parse, self._markers, self._names, self._at_start = parse, markers, names, at_start
        self._sent = ""  # content already emitted
        self._held = ""
        self._holding = False
        self._status = "none"

    def feed(self, delta: str) -> list[ToolStreamDelta]:
        self._held += delta
        if self._holding:
            return []
        if self._at_start:
            body = self._held.lstrip()
            if not body or any(m.startswith(body) for m in self._markers):
                return []  # undecided
            if any(body.startswith(m) for m in self._markers):
                self._holding = True
                return []
            self._at_start, self._markers = False, ()  # decided: the reply is plain text
        cut = len(self._held)
        for m in self._markers:
            i = self._held.find(m)
            if i >= 0:
                self._holding, cut = True, min(cut, i)
                continue
            for n in range(min(len(m) - 1, len(self._held)), 0, -1):
                if self._held.endswith(m[:n]):
                    cut = min(cut, len(self._held) - n)
                    break
        body = self._held[:cut].rstrip()  # whitespace before a call is dropped by the parse: hold it
        out, self._held = body, self._held[len(body):]
        self._sent += out
        return [ToolStreamDelta("content", out)] if out else []

    def finish(self) -> list[ToolStreamDelta]:
        whole = self._sent + self._held
        parsed = self._parse(whole, self._names)
        self._status = parsed.status
        out: list[ToolStreamDelta] = []
        content = parsed.content or ""
        # what was emitted is a prefix of the parsed content (held text is where the syntax may start)
        if content.startswith(self._sent):
            if len(content) > len(self._sent):
                out.append(ToolStreamDelta("content", content[len(self._sent):]))
        elif not parsed.calls and len(whole) > len(self._sent):
            out.append(ToolStreamDelta("content", whole[len(self._sent):]))
        for i, c in enumerate(parsed.calls):
            out.append(ToolStreamDelta("tool_call", index=i, id=c["id"], name=c["function"]["name"],
                                       arguments=c["function"]["arguments"]))
        return out

    @property
    def status(self) -> str:
        return self._status


class BufferedReasoning:
    """Streaming reasoning for formats without an incremental splitter: the reply is held and split whole
    by ``split`` at ``finish`` (reasoning first, then the text)."""

    def __init__(self, split: Callable[[str, bool], tuple[str | None, str]], opens: bool = False) -> None:
        self._split, self._opens, self._buf = split, opens, ""
        self.state = "start"
        self.started = False

    def feed(self, delta: str) -> list[ReasoningDelta]:
        self._buf += delta
        return []

    def finish(self) -> list[ReasoningDelta]:
        reasoning, text = self._split(self._buf, self._opens)
        self._buf, self.state = "", "text"
        out = []
        if reasoning is not None:
            self.started = True
            out.append(ReasoningDelta("reasoning", reasoning))
        if text:
            out.append(ReasoningDelta("text", text))
        return out
