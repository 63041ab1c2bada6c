"""Stored responses: a Responses call is kept by the trace store as its span (the record holds the whole
chat conversation it was translated to, its reply and the body as received), so ``GET /v1/responses/{id}``
and ``previous_response_id`` read it back from there: no second copy, and it survives restarts and serves
every gateway on the same store.

A chained call continues the previous response's rollout (its named rollout, or the ad-hoc rollout the
first call was given) and its conversation; the previous call is handed to prefix reuse as the parent, so
the new prompt starts with its exact prompt and sampled ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.call_context import CallContext
from tracegym.gateway.proxy.prompt.message_keys import message_key
from tracegym.gateway.proxy.responses.items import item_ids
from tracegym.gateway.traces.reads import call_record
from tracegym.types import CallRecord

FLUSH_TIMEOUT_S = 5.0


async def find_response(svc: Services, response_id: str) -> CallRecord | None:
    """The stored record of a Responses call (None: unknown, another API's call, or kept with
    ``store: false``)."""
    if svc.store is None or not response_id.startswith("resp_"):
        return None
    rec = await run_in_threadpool(call_record, svc.store, response_id)
    flush = getattr(svc.recorder, "force_flush", None)  # TraceRecorder's; test recorders may lack it
    if rec is None and flush is not None:
        # Spans are written in the background: a response answered a moment ago may still be queued.
        await run_in_threadpool(flush, FLUSH_TIMEOUT_S)
        rec = await run_in_threadpool(call_record, svc.store, response_id)
    if rec is None or rec.api != "responses" or source_request(rec).get("store") is False:
        return None
    return rec


def source_request(rec: CallRecord) -> dict[str, Any]:
    """The Responses body the call was made with."""
    return (rec.request.get("tracegym_source") or {}).get("request") or {}


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error")


def previous_not_found(response_id: str, why: str = "") -> OpenAIError:
    return OpenAIError(400, f"Previous response with id '{response_id}' not found.{why}",
                       type="invalid_request_error", param="previous_response_id",
                       code="previous_response_not_found")


@dataclass(slots=True)
class Previous:
    record: CallRecord
    history: list[dict[str, Any]]
    """Its conversation without its instructions, then its reply (as chat messages)."""
    output_ids: set[str]


async def load_previous(svc: Services, response_id: str, ctx: CallContext) -> Previous:
    """The response a call continues; the call joins its rollout. 400 when it cannot be continued."""
    if svc.store is None:
        raise previous_not_found(response_id, " This gateway runs without a trace store (--store), where "
                                 "responses are kept.")
    rec = await find_response(svc, response_id)
    if rec is None:
        raise previous_not_found(response_id)
    if not ctx.adhoc and rec.rollout_id != ctx.rollout_id:
        raise previous_not_found(response_id, f" It belongs to rollout '{rec.rollout_id}', not to "
                                 f"'{ctx.rollout_id}'; a conversation stays within one rollout.")
    if rec.status == "error" or not rec.choices:
        raise OpenAIError(400, f"Previous response '{response_id}' failed ({rec.error}); it cannot be continued.",
                          param="previous_response_id", code="invalid_value")
    ctx.rollout_id, ctx.adhoc = rec.rollout_id, False  # continue its conversation in its rollout
    if ctx.task_id is None:
        ctx.task_id = rec.task_id
    messages = list(rec.request.get("messages") or [])
    if source_request(rec).get("instructions"):  # instructions do not carry over to the next response
        messages = messages[1:]
    reply = {k: v for k, v in (rec.choices[0].message or {}).items() if v is not None}
    rs, msg, fcs = item_ids(rec.call_id, len(reply.get("tool_calls") or ()))
    if svc.prefix is not None and not rec.retokenized and rec.prompt_ids is not None:
        svc.prefix.remember(rec.rollout_id, rec)  # the parent of this call's prompt (a no-op when known)
    return Previous(rec, [*messages, reply], {rs, msg, *fcs})


def check_not_resent(messages: list[dict[str, Any]], item_ids: set[str], prev: Previous) -> None:
    """With ``previous_response_id`` the input holds only the new items: the stored conversation is
    prepended, so history sent again would appear twice in the prompt."""
    again = sorted(item_ids & prev.output_ids)
    n = len(prev.history)
    if again or (len(messages) >= n and [message_key(m) for m in messages[:n]]
                 == [message_key(m) for m in prev.history]):
        what = f"output items {again} of" if again else "the whole conversation of"
        raise OpenAIError(400, f"input repeats {what} previous response '{prev.record.call_id}': with "
                          "previous_response_id send only the new items (or send the full history without "
                          "previous_response_id)", param="input", code="invalid_value")
