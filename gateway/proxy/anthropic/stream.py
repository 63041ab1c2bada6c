"""The Messages stream: ``event: <type>`` / ``data: <json>`` server-sent events, sent as the engine
produces tokens::

    message_start (the Message, empty content, input usage)
    per block:  content_block_start, content_block_delta… (thinking_delta | text_delta | input_json_delta;
                a thinking block ends with a signature_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, output usage), message_stop

A ``tool_use`` block is sent when the model's ``</tool_call>`` closes (its input in one
``input_json_delta``). An error after the stream started is an ``error`` event in Anthropic's shape."""

from __future__ import annotations

from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.anthropic.anthropic_errors import error_body, error_message
from tracegym.gateway.proxy.anthropic.body import TOOL_ID_PREFIX, message_object, stop_reason, tool_use_block
from tracegym.gateway.proxy.call_context import CallContext, Prompt
from tracegym.gateway.proxy.openai_replies import tracegym_field
from tracegym.gateway.proxy.reply_parts import TurnEvent, TurnWriter, sse_event
from tracegym.gateway.proxy.validation import ParsedRequest


class MessagesStreamWriter(TurnWriter):
    tool_id_prefix = TOOL_ID_PREFIX

    def __init__(self, svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> None:
        super().__init__(svc, parsed, ctx, prompt)
        self.blocks = 0  # content blocks started so far
        self.open_kind: str | None = None  # type of the block still open

    def opening(self) -> list[bytes]:
        msg = message_object(self.svc, self.ctx, [], stop=None, stop_sequence=None,
                             input_tokens=self.input_tokens(), output_tokens=0,
                             tracegym=tracegym_field(self.ctx, self.weight_version, self.prompt))
        return [sse_event({"type": "message_start", "message": msg})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.open_kind = block["type"]
        self.blocks += 1
        return [*out, sse_event({"type": "content_block_start", "index": self.blocks - 1, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _stop(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self.ctx.call_id}))
        self.open_kind = None
        return [*out, sse_event({"type": "content_block_stop", "index": self.blocks - 1})]

    def emit(self, events: list[TurnEvent]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if e.kind == "tool_call" and e.call is not None:
                block = tool_use_block(e.call)
                out += self._start({**block, "input": {}})
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.call["function"]["arguments"]}))
                out += self._stop()
                continue
            kind = "thinking" if e.kind == "reasoning" else "text"
            if self.open_kind != kind:
                out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""})
            if e.text:
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text} if kind == "thinking"
                                       else {"type": "text_delta", "text": e.text}))
        return out

    def closing(self) -> list[bytes]:
        out = [] if self.blocks else self._start({"type": "text", "text": ""})  # as non-stream: one text block
        out += self._stop()
        ch = self.stream.choice
        stop, seq = stop_reason(self.stream.finish_reason(), ch.stop_matched, self.parsed)
        usage = {"input_tokens": self.input_tokens(), "output_tokens": self.output_tokens()}
        # ``tracegym`` again: the weight version is known only now (message_start went out before).
        return [*out, sse_event({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                                 "usage": usage,
                                 "tracegym": tracegym_field(self.ctx, self.weight_version, self.prompt)}),
                sse_event({"type": "message_stop"})]

    def error_events(self, e: OpenAIError) -> list[bytes]:
        return [sse_event(error_body(e.status, error_message(e)))]
