"""Anthropic's Messages routes, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (handlers the
ASGI front serves, ``front.INFERENCE_ROUTES``), also under ``/rollouts/{rollout_id}/v1/`` (so
``anthropic.Anthropic(base_url=f"{gateway}/rollouts/{rid}")`` attributes its calls) and with
``X-Rollout-Id``. ``x-api-key`` and ``anthropic-version`` are accepted (this gateway checks no key of its
own here). Every failure is answered in Anthropic's error shape."""

from __future__ import annotations

import logging

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError, bad_request, store_unavailable
from tracegym.gateway.proxy.anthropic.anthropic_errors import error_body, error_response
from tracegym.gateway.proxy.anthropic.body import non_stream_body
from tracegym.gateway.proxy.anthropic.request import chat_request, parse_messages
from tracegym.gateway.proxy.anthropic.stream import MessagesStreamWriter
from tracegym.gateway.proxy.call_context import new_context
from tracegym.gateway.proxy.call_path import InferenceHandler, check_model, read_body, run_call
from tracegym.gateway.proxy.validation import load_json_object

log = logging.getLogger("tracegym.gateway")


def anthropic_errors(handler: InferenceHandler) -> InferenceHandler:
    """``handler`` answering its errors in Anthropic's shape (the front answers OpenAI's)."""

    async def wrapped(request: Request, svc: Services, rollout_id: str | None) -> Response:
        try:
            return await handler(request, svc, rollout_id)
        except OpenAIError as e:
            return error_response(e)
        except ClientDisconnect:
            raise
        except Exception as e:
            down = store_unavailable(e)
            if down is not None:
                return error_response(down)
            log.exception("unhandled error in %s", request.url.path)
            return Response(orjson.dumps(error_body(500, f"internal error: {type(e).__name__}: {e}")),
                            status_code=500, media_type="application/json")

    return wrapped


@anthropic_errors
async def create_message(request: Request, svc: Services, rollout_id: str | None) -> Response:
    req = parse_messages(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    ctx = new_context("chat", rollout_id, request.headers, id_prefix="msg_")
    return await run_call(svc, chat_request(req), ctx, non_stream_body, MessagesStreamWriter, client=request)


@anthropic_errors
async def count_tokens(request: Request, svc: Services, rollout_id: str | None) -> Response:
    """The prompt's length as this gateway renders it whole (a call that continues an earlier one of its
    rollout reuses that call's ids and may differ by the few tokens prefix reuse realigns)."""
    req = parse_messages(load_json_object(await read_body(request, svc.settings.max_body_bytes)), count_only=True)
    check_model(svc, req.model)
    if svc.tokenizer is None:
        raise bad_request("this gateway has no tokenizer to count tokens with")
    parsed = chat_request(req)
    try:
        ids = svc.tokenizer.apply(parsed.messages, parsed.tools, tool_choice=parsed.tool_choice)
    except ValueError as e:
        raise bad_request(f"could not render these messages with the chat template: {e}", "messages") from e
    return Response(orjson.dumps({"input_tokens": len(ids)}), media_type="application/json")
