"""The Message object of a Messages call: content blocks of the reply's ``Turn`` (``thinking``, ``text``,
``tool_use``), the stop reason, usage, and the ``tracegym`` field every gateway response carries."""

from __future__ import annotations

from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.proxy.call_context import CallContext, Prompt
from tracegym.gateway.proxy.openai_replies import tracegym_field
from tracegym.gateway.proxy.prompt.tools import parse_arguments
from tracegym.gateway.proxy.reply_parts import Turn, turn_result
from tracegym.gateway.proxy.upstream.base import GenerateResult
from tracegym.gateway.proxy.validation import ParsedRequest
from tracegym.types import CallRecord

TOOL_ID_PREFIX = "toolu_"


def stop_reason(finish: str | None, stop_matched: str | None, parsed: ParsedRequest) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat finish reason. ``abort`` (the upstream aborted the
    generation and the swap path could not continue it) has no Anthropic name and is passed as is."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and stop_matched is not None and stop_matched in parsed.sampling.stop:
        return "stop_sequence", stop_matched
    if finish == "stop":
        return "end_turn", None
    return finish, None


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = parse_arguments(fn.get("arguments", ""))
    return {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
            "input": args if isinstance(args, dict) else {"arguments": args}}


def content_blocks(turn: Turn, signature: str) -> list[dict[str, Any]]:
    """thinking, text (when there is text or no call), tool_use blocks. ``signature``: opaque to
    clients (the call id); ignored when the block comes back."""
    blocks: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": signature})
    if turn.text or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.text})
    blocks += [tool_use_block(c) for c in turn.tool_calls]
    return blocks


def message_object(svc: Services, ctx: CallContext, content: list[dict[str, Any]], *, stop: str | None,
                   stop_sequence: str | None, input_tokens: int, output_tokens: int,
                   tracegym: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": ctx.call_id, "type": "message", "role": "assistant", "model": svc.served_model,
            "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}, "tracegym": tracegym}


def non_stream_body(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt,
                    result: GenerateResult) -> tuple[dict, CallRecord]:
    """``call_path.Builder`` of ``POST /v1/messages``."""
    tr = turn_result(svc, parsed, ctx, prompt, result, tool_id_prefix=TOOL_ID_PREFIX)
    stop, seq = stop_reason(tr.finish, tr.stop_matched, parsed)
    body = message_object(svc, ctx, content_blocks(tr.turn, ctx.call_id), stop=stop, stop_sequence=seq,
                          input_tokens=tr.input_tokens, output_tokens=tr.output_tokens,
                          tracegym=tracegym_field(ctx, result.weight_version, prompt))
    return body, tr.record
