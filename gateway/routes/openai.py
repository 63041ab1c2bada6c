"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
and the same under ``/rollouts/{rollout_id}/v1/`` (calls attributed to that rollout).

Handlers take the raw ``Request`` and parse the body with orjson (validated by hand in
``validation.py``); the response is pre-serialized bytes. That keeps the per-call overhead small."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from tracegym.gateway.calls import (
    CallContext,
    Prompt,
    build_record,
    chat_response,
    completion_response,
    finish_call,
    generate_request,
    new_context,
    plan_prompt,
)
from tracegym.gateway.deps import Services, ServicesDep
from tracegym.gateway.errors import OpenAIError, bad_request
from tracegym.gateway.routes.streaming import StreamWriter, sse_stream
from tracegym.gateway.upstream.base import GenerateResult
from tracegym.gateway.validation import ParsedRequest, load_json_object, parse_chat, parse_completion

router = APIRouter()

Builder = Callable[[Services, ParsedRequest, CallContext, Prompt, GenerateResult], tuple[dict, Any]]
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without reading it all. Reads the
    ASGI messages directly (Starlette's ``Request.body``/``stream`` layers cost more than the read)."""
    declared = next((v for k, v in request.scope["headers"] if k == b"content-length"), None)
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise OpenAIError(413, f"request body of {declared.decode()} bytes exceeds the limit of {limit} "
                              "bytes", code="request_too_large")
    parts, size = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        parts.append(part)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def check_model(svc: Services, model: str) -> None:
    if model != svc.served_model:
        raise OpenAIError(404, f"The model '{model}' does not exist; this gateway serves '{svc.served_model}'",
                          param="model", code="model_not_found")


def _plan(svc: Services, parsed: ParsedRequest, ctx: CallContext) -> Prompt:
    try:
        return plan_prompt(svc, parsed, ctx)
    except ValueError as e:  # templating.TemplateRenderError and bad message/tool shapes are ValueErrors
        raise bad_request(f"could not render these messages with the chat template: {e}", "messages") from e


def _record_failure(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt,
                    err: OpenAIError) -> None:
    svc.metrics.upstream_errors.labels(svc.upstream.kind, str(err.status)).inc()
    rec = build_record(svc, parsed, ctx, prompt, [], weight_version=None,
                       prompt_tokens=len(prompt.ids or ()), retokenized=not svc.upstream.token_native,
                       error=err.message)
    finish_call(svc, ctx, rec)


async def run_call(svc: Services, parsed: ParsedRequest, ctx: CallContext, build: Builder) -> Response:
    check_model(svc, parsed.model)
    prompt = _plan(svc, parsed, ctx)
    req = generate_request(svc, parsed, ctx, prompt)
    started = time.perf_counter()
    if parsed.stream:
        return await _start_stream(svc, parsed, ctx, prompt, req, started)
    try:
        result = await svc.upstream.generate(req)
    except OpenAIError as e:
        _record_failure(svc, parsed, ctx, prompt, e)
        raise
    svc.metrics.observe_upstream(svc.upstream.kind, parsed.operation, False, time.perf_counter() - started)
    body, rec = build(svc, parsed, ctx, prompt, result)
    finish_call(svc, ctx, rec)
    return Response(orjson.dumps(body), media_type="application/json")


async def _start_stream(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, req: Any,
                        started: float) -> Response:
    events = svc.upstream.stream(req)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except OpenAIError as e:
        _record_failure(svc, parsed, ctx, prompt, e)
        raise
    writer = StreamWriter(svc, parsed, ctx, prompt)
    writer.on_done = lambda: svc.metrics.observe_upstream(svc.upstream.kind, parsed.operation, True,
                                                          time.perf_counter() - started)
    return StreamingResponse(sse_stream(writer, first, events), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


async def _chat(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_chat(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    return await run_call(svc, parsed, new_context("chat", rollout_id, request.headers), chat_response)


async def _completion(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_completion(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    if isinstance(parsed.prompt, str) and svc.upstream.token_native and svc.tokenizer is None:
        raise bad_request("this gateway has no tokenizer: send the prompt as token ids", "prompt")
    ctx = new_context("text_completion", rollout_id, request.headers)
    return await run_call(svc, parsed, ctx, completion_response)


def _models(svc: Services) -> Response:
    data = [{"id": svc.served_model, "object": "model", "created": svc.created, "owned_by": "tracegym"}]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


# Served by ``fastpath.GatewayMiddleware`` without the framework's per-request layers; the FastAPI
# routes below are the same handlers (and what a test app without that middleware uses).
HOT_ROUTES = {"/v1/chat/completions": _chat, "/v1/completions": _completion}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _chat(request, request.app.state.services, None)


@router.post("/rollouts/{rollout_id}/v1/chat/completions")
async def rollout_chat_completions(rollout_id: str, request: Request) -> Response:
    return await _chat(request, request.app.state.services, rollout_id)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _completion(request, request.app.state.services, None)


@router.post("/rollouts/{rollout_id}/v1/completions")
async def rollout_completions(rollout_id: str, request: Request) -> Response:
    return await _completion(request, request.app.state.services, rollout_id)


@router.get("/v1/models")
async def models(svc: ServicesDep) -> Response:
    return _models(svc)


@router.get("/rollouts/{rollout_id}/v1/models")
async def rollout_models(rollout_id: str, svc: ServicesDep) -> Response:
    return _models(svc)
