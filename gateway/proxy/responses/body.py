"""The Response object, for a call just made (``POST``, and the events of a stream) and for a stored one
(``GET``): one builder, so both answer the same fields."""

from __future__ import annotations

from typing import Any

from tracegym.gateway.deps import Services
from tracegym.gateway.proxy.call_context import CallContext, Prompt
from tracegym.gateway.proxy.openai_replies import tracegym_field
from tracegym.gateway.proxy.reply_parts import Turn, TurnResult, reasoning_tokens, turn_result
from tracegym.gateway.proxy.responses.chain import source_request
from tracegym.gateway.proxy.responses.items import output_items
from tracegym.gateway.proxy.upstream.base import GenerateResult
from tracegym.gateway.proxy.validation import ParsedRequest
from tracegym.types import CallRecord


def status_of(finish: str | None, error: str | None) -> tuple[str, dict | None, dict | None]:
    """``(status, incomplete_details, error)`` of a response from its chat finish reason."""
    if error is not None:
        return "failed", None, {"code": "server_error", "message": error}
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish == "abort":
        return "failed", None, {"code": "server_error", "message": "the upstream aborted the generation"}
    return "completed", None, None


def usage(input_tokens: int, output_tokens: int, reasoning: int) -> dict[str, Any]:
    # cached_tokens stays 0: the engine's cache hits do not reach the gateway.
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def response_object(*, response_id: str, created: int, model: str, source: dict[str, Any], status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    incomplete: dict | None = None, error: dict | None = None,
                    tracegym: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response; ``source`` is the request body as received (echoed fields)."""
    get = source.get
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": incomplete, "instructions": get("instructions"),
        "max_output_tokens": get("max_output_tokens"), "model": model, "output": output,
        "parallel_tool_calls": get("parallel_tool_calls", True),
        "previous_response_id": get("previous_response_id"),
        "reasoning": get("reasoning") or {"effort": None, "summary": None}, "store": get("store", True),
        "temperature": get("temperature", 1.0), "text": get("text") or {"format": {"type": "text"}},
        "tool_choice": get("tool_choice") or "auto", "tools": get("tools") or [], "top_p": get("top_p", 1.0),
        "truncation": get("truncation") or "disabled", "usage": usage, "user": get("user"),
        "metadata": get("metadata") or {}, "tracegym": tracegym,
    }


def created_body(svc: Services, parsed: ParsedRequest, ctx: CallContext, result: TurnResult, *,
                 reasoning: int, weight_version: str | None, prompt: Prompt) -> dict[str, Any]:
    """The Response of a whole (non-stream) call."""
    status, incomplete, error = status_of(result.finish, None)
    return response_object(
        response_id=ctx.call_id, created=ctx.created, model=svc.served_model, source=(parsed.source or {})["request"],
        status=status, output=output_items(ctx.call_id, result.turn, incomplete=status == "incomplete"),
        usage=usage(result.input_tokens, result.output_tokens, reasoning), incomplete=incomplete, error=error,
        tracegym=tracegym_field(ctx, weight_version, prompt),
    )


def non_stream_body(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt,
                    result: GenerateResult) -> tuple[dict, CallRecord]:
    """``call_path.Builder`` of ``POST /v1/responses``."""
    tr = turn_result(svc, parsed, ctx, prompt, result)
    n = reasoning_tokens(svc, tr.record.choices[0].output_ids, tr.turn)
    return created_body(svc, parsed, ctx, tr, reasoning=n, weight_version=result.weight_version,
                        prompt=prompt), tr.record


def stored_body(svc: Services, rec: CallRecord) -> dict[str, Any]:
    """The Response of a stored call (``GET /v1/responses/{id}``)."""
    choice = rec.choices[0] if rec.choices else None
    turn = Turn.of_message(choice.message) if choice is not None else None
    status, incomplete, error = status_of(choice.finish_reason if choice else None, rec.error)
    output = [] if turn is None else output_items(rec.call_id, turn, incomplete=status == "incomplete")
    n = reasoning_tokens(svc, choice.output_ids, turn) if choice is not None and turn is not None else 0
    return response_object(
        response_id=rec.call_id, created=rec.start_time_ns // 1_000_000_000, model=rec.model,
        source=source_request(rec), status=status, output=output,
        usage=usage(rec.input_tokens, rec.output_tokens, n), incomplete=incomplete, error=error,
        tracegym={"rollout_id": rec.rollout_id, "call_id": rec.call_id, "weight_version": rec.weight_version,
                  "drift": rec.drift},
    )
