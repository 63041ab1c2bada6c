"""One choice's reply split into its parts as the Responses and Messages APIs present it (a ``Turn``:
reasoning, text, tool calls), whole or streamed, and the record of the call, which is the same whichever API made it.

The reply is split in a fixed order: the reasoning block first (``prompt/reasoning.py``), then tool calls
in the text after it (``prompt/tools.py``), so tool-call syntax inside the reasoning stays reasoning. The
record keeps the reply as the chat assistant message it stands for (``Turn.chat_message``): the message
a client's history items for this turn translate back to, so prefix reuse finds the turn the same way for
every API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from tracegym.gateway.deps import Services
from tracegym.gateway.proxy.call_context import (
    CallContext,
    Prompt,
    build_record,
    choice_record,
    finish_call,
    prompt_token_count,
)
from tracegym.gateway.proxy.openai_replies import (
    choice_text,
    family_of,
    openai_finish_reason,
    opens_in_reasoning,
)
from tracegym.gateway.proxy.prompt.reasoning import CLOSE, ReasoningDelta, join_reasoning, split_reasoning
from tracegym.gateway.proxy.streaming import ChoiceStream, IncrementalDecoder, TextBuilder, absorb
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateResult, StreamEvent
from tracegym.gateway.proxy.validation import ParsedRequest
from tracegym.types import CallRecord


@dataclass(slots=True)
class Turn:
    reasoning: str | None
    """The reasoning text, or None when the reply had no reasoning block ("" for an empty block)."""
    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI chat ``tool_calls`` (``id``, ``type``, ``function: {name, arguments}``)."""
    tool_parse: str | None = None
    """How the parse of the text's tool-call syntax went (``CallRecord.tool_parse``; None: not parsed)."""

    def chat_message(self) -> dict[str, Any]:
        """The chat assistant message this turn stands for (recorded, and compared by prefix reuse)."""
        msg: dict[str, Any] = {"role": "assistant", "content": join_reasoning(self.reasoning, self.text) or None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    @classmethod
    def of_message(cls, msg: dict[str, Any] | None) -> Turn:
        """The turn a recorded chat message stands for (inverts ``chat_message``)."""
        msg = msg or {}
        reasoning, text = split_reasoning(msg.get("content") or "")
        return cls(reasoning, text, list(msg.get("tool_calls") or []))


def reasoning_tokens(svc: Services, output_ids: list[int] | None, turn: Turn) -> int:
    """How many output tokens the reasoning block took: up to the one that completes ``</think>`` (all of
    them for a reply cut off inside it); 0 without reasoning or without ids."""
    if turn.reasoning is None or not output_ids or svc.tokenizer is None:
        return 0
    decoder, text = IncrementalDecoder(svc.tokenizer), ""
    for i, token in enumerate(output_ids):
        seen = max(0, len(text) - len(CLOSE) + 1)  # only the newest text can complete the tag
        text += decoder.push([token])
        if CLOSE in text[seen:]:
            return i + 1
    return len(output_ids)


def _renamed(call: dict[str, Any], id_prefix: str) -> dict[str, Any]:
    """A parsed call with the API's id prefix (``call_…`` as parsed; Anthropic's are ``toolu_…``)."""
    if id_prefix != "call_" and isinstance(call.get("id"), str) and call["id"].startswith("call_"):
        call["id"] = id_prefix + call["id"][len("call_"):]
    return call


def parse_turn(svc: Services, parsed: ParsedRequest, ch: GenChoice, *, opens: bool,
               tool_id_prefix: str = "call_") -> Turn:
    if ch.message is not None:  # message-based upstream: its own tool-call parse, maybe its reasoning
        reasoning, text = split_reasoning(ch.message.get("content") or "")
        if reasoning is None:
            reasoning = ch.message.get("reasoning_content") or ch.message.get("reasoning") or None
        return Turn(reasoning, text, list(ch.message.get("tool_calls") or []))
    family = family_of(svc)
    reasoning, rest = family.split_reasoning(choice_text(svc, ch), opens)
    if not parsed.parse_tools and not family.framed_replies:
        return Turn(reasoning, rest)
    tp = family.parse_tools(rest, parsed.tool_names if parsed.parse_tools else ())
    return Turn(reasoning, tp.content or "", [_renamed(c, tool_id_prefix) for c in tp.calls],
                tp.status if parsed.parse_tools else None)


@dataclass(slots=True)
class TurnResult:
    """A whole (non-stream) call's reply and record."""

    turn: Turn
    finish: str
    """The chat finish reason: ``stop`` | ``length`` | ``tool_calls`` | ``abort``."""
    stop_matched: str | None
    input_tokens: int
    output_tokens: int
    record: CallRecord


def turn_result(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt,
                result: GenerateResult, *, tool_id_prefix: str = "call_") -> TurnResult:
    (ch,) = result.choices  # these APIs take no ``n``
    turn = parse_turn(svc, parsed, ch, opens=opens_in_reasoning(svc, prompt), tool_id_prefix=tool_id_prefix)
    msg = turn.chat_message()
    finish = openai_finish_reason(ch, msg)
    ptoks = prompt_token_count(result.prompt_tokens, prompt)
    rec = build_record(svc, parsed, ctx, prompt, [choice_record(ch, finish, msg, result.weight_version)],
                       weight_version=result.weight_version, prompt_tokens=ptoks,
                       retokenized=result.retokenized, upstream_prompt_ids=result.prompt_ids,
                       reported_output_tokens=result.completion_tokens, tool_parse=turn.tool_parse)
    return TurnResult(turn, finish, ch.stop_matched, ptoks, rec.output_tokens, rec)


@dataclass(slots=True)
class TurnEvent:
    """A streamed piece of the turn: reasoning text (the first, possibly empty, opens the reasoning),
    text, or one whole tool call."""

    kind: Literal["reasoning", "text", "tool_call"]
    text: str = ""
    call: dict[str, Any] | None = None


class TurnStream:
    """One streamed choice as ``TurnEvent``s: ``ChoiceStream``'s decoding and stop-string hold-back, then
    the reasoning split, then tool-call parsing of the text. ``turn`` is what was sent, at every point."""

    def __init__(self, svc: Services, parsed: ParsedRequest, *, opens: bool, tool_id_prefix: str = "call_"
                 ) -> None:
        self.tool_id_prefix = tool_id_prefix
        self.choice = ChoiceStream(svc, parsed, 0, parse_tools=False)
        family = family_of(svc)
        self.reasoning = family.stream_reasoning(opens)
        native = self.choice.decoder is not None
        reads = parsed.parse_tools or family.framed_replies
        self.tools = (family.stream_tools(parsed.tool_names if parsed.parse_tools else ())
                      if reads and native else None)
        self._records_parse = parsed.parse_tools
        self._turn = Turn(None, "")
        self._sent_text = TextBuilder()  # the turn's text and reasoning, joined when ``turn`` is read
        self._reasoning: TextBuilder | None = None

    @property
    def turn(self) -> Turn:
        """What was sent so far."""
        self._turn.text = self._sent_text.value()
        self._turn.reasoning = None if self._reasoning is None else self._reasoning.value()
        return self._turn

    @property
    def finished(self) -> bool:
        return self.choice.finish is not None

    def push(self, ch: GenChoice) -> list[TurnEvent]:
        deltas, _ = self.choice.push(ch)
        out: list[TurnEvent] = []
        for d in deltas:  # upstream tool-call deltas are merged by ChoiceStream and sent whole at the end
            text = d.get("content")
            if not text:
                continue
            if self.tools is None and self.reasoning.state == "text":  # the usual token: plain text
                self._sent_text.add(text)
                out.append(TurnEvent("text", text))
            else:
                out += self._split(self.reasoning.feed(text), final=False)
        if self.finished:
            out += self._split(self.reasoning.finish(), final=True)
            if self.choice.decoder is None:
                for i in sorted(self.choice.upstream_tool_calls):
                    out.append(self._call(self.choice.upstream_tool_calls[i]))
        return out

    def _split(self, deltas: list[ReasoningDelta], *, final: bool) -> list[TurnEvent]:
        out: list[TurnEvent] = []
        if self.reasoning.started and self._reasoning is None:
            self._reasoning = TextBuilder()
            out.append(TurnEvent("reasoning"))
        for d in deltas:
            if d.kind == "reasoning":
                if self._reasoning is None:
                    self._reasoning = TextBuilder()
                self._reasoning.add(d.text)
                out.append(TurnEvent("reasoning", d.text))
            else:
                out += self._text(d.text)
        if final and self.tools is not None:
            out += self._tool_events(self.tools.finish())
            self._turn.tool_parse = self.tools.status if self._records_parse else None
        return out

    def _text(self, text: str) -> list[TurnEvent]:
        if self.tools is None:
            self._sent_text.add(text)
            return [TurnEvent("text", text)]
        return self._tool_events(self.tools.feed(text))

    def _tool_events(self, events: list[Any]) -> list[TurnEvent]:
        out = []
        for ev in events:
            if ev.kind == "tool_call":
                call = ev.to_delta()["tool_calls"][0]
                out.append(self._call({k: v for k, v in call.items() if k != "index"}))
            elif ev.text:
                self._sent_text.add(ev.text)
                out.append(TurnEvent("text", ev.text))
        return out

    def _call(self, call: dict[str, Any]) -> TurnEvent:
        call = _renamed(call, self.tool_id_prefix)
        self._turn.tool_calls.append(call)
        return TurnEvent("tool_call", call=call)

    @property
    def tool_parse(self) -> str | None:
        """The tool-call parse so far (also of a stream the client left before it finished)."""
        return self.tools.status if self.tools is not None and self._records_parse else None

    def finish_reason(self) -> str | None:
        """The chat finish reason (None while unfinished)."""
        if self.choice.finish is None:
            return None
        return "tool_calls" if self._turn.tool_calls else self.choice.finish


def sse_event(obj: dict[str, Any]) -> bytes:
    """A named server-sent event (``event: <type>``), as the Responses and Messages streams send them."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class TurnWriter:
    """The part of a Responses or Messages stream writer (``streaming.EventWriter``) that is the same for
    both: upstream events → ``TurnEvent``s (``emit`` turns them into the API's SSE events), token counts,
    and the call's record when the stream ends."""

    tool_id_prefix = "call_"

    def __init__(self, svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> None:
        self.svc, self.parsed, self.ctx, self.prompt = svc, parsed, ctx, prompt
        self.stream = TurnStream(svc, parsed, opens=opens_in_reasoning(svc, prompt),
                                 tool_id_prefix=self.tool_id_prefix)
        self.weight_version: str | None = None
        self.prompt_tokens = 0
        self.prompt_ids: list[int] | None = None
        self.completion_tokens = 0
        self.first_token_ns: int | None = None
        self.on_done: Callable[[], None] | None = None

    def emit(self, events: list[TurnEvent]) -> list[bytes]:
        raise NotImplementedError

    def on_event(self, ev: StreamEvent) -> list[bytes]:
        if not absorb(self, ev):
            return []
        assert ev.choice is not None
        return self.emit(self.stream.push(ev.choice))

    def input_tokens(self) -> int:
        return self.prompt_tokens or (len(self.prompt_ids) if self.prompt_ids else
                                      prompt_token_count(0, self.prompt))

    def output_tokens(self) -> int:
        return len(self.stream.choice.ids) or self.completion_tokens

    def record(self, error: str | None) -> Awaitable[bool] | None:
        ch = self.stream.choice.final_choice()
        choice = choice_record(ch, self.stream.finish_reason(), self.stream.turn.chat_message(),
                               self.weight_version)
        exact = self.prompt_ids is not None and bool(self.stream.choice.ids)
        rec = build_record(self.svc, self.parsed, self.ctx, self.prompt, [choice],
                           weight_version=self.weight_version, prompt_tokens=self.input_tokens(),
                           retokenized=not self.svc.upstream.token_native and not exact,
                           first_token_ns=self.first_token_ns, error=error, upstream_prompt_ids=self.prompt_ids,
                           reported_output_tokens=self.completion_tokens, tool_parse=self.stream.tool_parse)
        ack = finish_call(self.svc, self.ctx, rec)
        if self.on_done is not None:
            self.on_done()
        return ack
