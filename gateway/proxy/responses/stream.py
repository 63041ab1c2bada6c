"""The Responses stream: ``event: <type>`` / ``data: <json>`` server-sent events with a ``sequence_number``,
sent as the engine produces tokens (no ``[DONE]``; the stream ends with ``response.completed``,
``response.incomplete`` or ``response.failed``)::

    response.created, response.in_progress
    reasoning:  response.output_item.added, response.content_part.added (reasoning_text),
                response.reasoning_text.delta…, response.reasoning_text.done, response.content_part.done,
                response.output_item.done
    text:       response.output_item.added (message), response.content_part.added (output_text),
                response.output_text.delta…, response.output_text.done, response.content_part.done,
                response.output_item.done
    a call:     response.output_item.added (function_call), response.function_call_arguments.delta,
                response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete | response.failed (the whole Response)

A tool call is sent when its ``</tool_call>`` closes (its arguments in one delta). The message item stays
open while calls are added after it, so text the model writes around its calls is one message, as in the
non-stream Response."""

from __future__ import annotations

from typing import Any

import orjson

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.call_context import CallContext, Prompt
from tracegym.gateway.proxy.openai_replies import tracegym_field
from tracegym.gateway.proxy.reply_parts import TurnEvent, TurnWriter, reasoning_tokens, sse_event
from tracegym.gateway.proxy.responses.body import response_object, status_of, usage
from tracegym.gateway.proxy.responses.items import (
    function_call_item,
    item_ids,
    message_item,
    output_text_part,
    reasoning_item,
)
from tracegym.gateway.proxy.validation import ParsedRequest


class ResponsesStreamWriter(TurnWriter):
    def __init__(self, svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt) -> None:
        super().__init__(svc, parsed, ctx, prompt)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output as sent so far
        self.reasoning_at: int | None = None  # index of the open reasoning / message item
        self.message_at: int | None = None
        self.parts: list[str] = []  # deltas of the open reasoning / message item not yet joined into it
        self.delta_head = b""  # the open message item's text delta event up to the delta (``_text_delta``)
        self.rs_id, self.msg_id, _ = item_ids(ctx.call_id, 0)

    def _flush(self) -> None:
        """Join the open item's pending deltas into its text (once, not per token: ``+=`` on a string held
        by a dict copies the whole text each time)."""
        at = self.reasoning_at if self.reasoning_at is not None else self.message_at
        if at is not None and self.parts:
            self.items[at]["content"][0]["text"] += "".join(self.parts)
            self.parts.clear()

    def _ev(self, type: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse_event({"type": type, **fields, "sequence_number": self.seq - 1})

    def _text_delta(self, text: str) -> bytes:
        """``_ev("response.output_text.delta", ...)`` of the open message item, the same bytes from a head
        made when it opened (the one event sent per token)."""
        self.seq += 1
        return b"".join((self.delta_head, orjson.dumps(text), b',"logprobs":[],"sequence_number":',
                         str(self.seq - 1).encode(), b"}\n\n"))

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        self._flush()
        return response_object(response_id=self.ctx.call_id, created=self.ctx.created,
                               model=self.svc.served_model, source=(self.parsed.source or {})["request"], status=status,
                               output=kw.pop("output", self.items), usage=kw.pop("usage", None),
                               tracegym=tracegym_field(self.ctx, self.weight_version, self.prompt), **kw)

    def opening(self) -> list[bytes]:
        r = self._response("in_progress", output=[])
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def emit(self, events: list[TurnEvent]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if e.kind == "reasoning":
                out += self._reasoning(e.text)
            elif e.kind == "text":
                out += self._text(e.text)
            elif e.call is not None:
                out += self._call(e.call)
        return out

    def _open(self, item: dict[str, Any], part: dict[str, Any]) -> tuple[int, list[bytes]]:
        self.items.append(item)
        at = len(self.items) - 1
        out = [self._ev("response.output_item.added", output_index=at, item=item)]
        item["content"].append(part)
        out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                            part=part))
        return at, out

    def _reasoning(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.reasoning_at is None:
            item = reasoning_item(self.rs_id, None, "in_progress")
            self.reasoning_at, out = self._open(item, {"type": "reasoning_text", "text": ""})
        if text:
            self.parts.append(text)
            out.append(self._ev("response.reasoning_text.delta", item_id=self.rs_id, output_index=self.reasoning_at,
                                content_index=0, delta=text))
        return out

    def _close_reasoning(self, status: str = "completed") -> list[bytes]:
        if self.reasoning_at is None:
            return []
        self._flush()
        at, self.reasoning_at = self.reasoning_at, None
        item = self.items[at]
        part = item["content"][0]
        item["status"] = status
        return [self._ev("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                         text=part["text"]),
                self._ev("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                         part=part),
                self._ev("response.output_item.done", output_index=at, item=item)]

    def _text(self, text: str) -> list[bytes]:
        out = self._close_reasoning() if self.reasoning_at is not None else []
        if self.message_at is None:
            item = message_item(self.msg_id, None, "in_progress")
            self.message_at, opened = self._open(item, output_text_part(""))
            self.delta_head = b"".join((
                b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":',
                orjson.dumps(self.msg_id), b',"output_index":', str(self.message_at).encode(),
                b',"content_index":0,"delta":'))
            out += opened
        if text:
            self.parts.append(text)
            out.append(self._text_delta(text))
        return out

    def _close_message(self, status: str = "completed") -> list[bytes]:
        if self.message_at is None:
            return []
        self._flush()
        at, self.message_at = self.message_at, None
        item = self.items[at]
        part = item["content"][0]
        item["status"] = status
        return [self._ev("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                         text=part["text"], logprobs=[]),
                self._ev("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                         part=part),
                self._ev("response.output_item.done", output_index=at, item=item)]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out = self._close_reasoning()
        n = sum(1 for it in self.items if it["type"] == "function_call")
        item = function_call_item(item_ids(self.ctx.call_id, n + 1)[2][n], call, "in_progress", arguments=False)
        self.items.append(item)
        at = len(self.items) - 1
        args = call["function"]["arguments"]
        out.append(self._ev("response.output_item.added", output_index=at, item=item))
        out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                            delta=args))
        out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            name=item["name"], arguments=args))
        item["arguments"], item["status"] = args, "completed"
        out.append(self._ev("response.output_item.done", output_index=at, item=item))
        return out

    def closing(self) -> list[bytes]:
        status, incomplete, error = status_of(self.stream.finish_reason(), None)
        out = [] if self.items else self._text("")  # an empty reply is one empty message, as non-stream
        last = len(self.items) - 1
        cut = "incomplete" if status == "incomplete" else "completed"
        out += self._close_reasoning(cut if self.reasoning_at == last else "completed")
        out += self._close_message(cut if self.message_at == last else "completed")
        n = reasoning_tokens(self.svc, self.stream.choice.ids, self.stream.turn)
        r = self._response(status, usage=usage(self.input_tokens(), self.output_tokens(), n),
                           incomplete=incomplete, error=error)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status,
                                                                                           "response.failed")
        return [*out, self._ev(kind, response=r)]

    def error_events(self, e: OpenAIError) -> list[bytes]:
        error = {"code": e.code or e.type, "message": e.message}
        return [self._ev("error", code=error["code"], message=e.message, param=e.param),
                self._ev("response.failed", response=self._response("failed", error=error))]
