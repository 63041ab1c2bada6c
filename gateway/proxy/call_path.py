"""The one call path every inference API (Chat Completions, Completions, Responses, Messages) runs over
HTTP: read the body, run a parsed call upstream (``run_call``: the steps of ``call_context.py``), answer
JSON bytes or an SSE stream.

An API differs only in its handler (an ``InferenceHandler``: parse its body into a ``ParsedRequest``), its
``Builder`` (the non-stream body) and its stream writer (``EventWriter``); prompt planning with prefix
reuse, the upstream request, failure recording and the call's record are the same for all of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import OpenAIError, bad_request
from tracegym.gateway.proxy.call_context import (
    CallContext,
    Prompt,
    acknowledge,
    build_record,
    finish_call,
    generate_request,
    plan_prompt,
    settled,
)
from tracegym.gateway.proxy.sse_response import SseResponse, cancel_on_disconnect
from tracegym.gateway.proxy.streaming import EventWriter, StreamWriter, sse_stream
from tracegym.gateway.proxy.upstream.base import GenerateResult
from tracegym.gateway.proxy.validation import ParsedRequest

InferenceHandler = Callable[[Request, Services, "str | None"], Awaitable[Response]]
"""An inference route's handler (``front.INFERENCE_ROUTES``): the request, the services and the rollout id
of a ``/rollouts/{rollout_id}/v1/...`` path."""
Builder = Callable[[Services, ParsedRequest, CallContext, Prompt, GenerateResult], tuple[dict, Any]]
WriterFactory = Callable[[Services, ParsedRequest, CallContext, Prompt], EventWriter]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


async def plan(svc: Services, parsed: ParsedRequest, ctx: CallContext) -> Prompt:
    try:
        return await plan_prompt(svc, parsed, ctx)
    except ValueError as e:  # templating.TemplateRenderError and bad message/tool shapes are ValueErrors
        raise bad_request(f"could not render these messages with the chat template: {e}", "messages") from e


def record_failure(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt,
                   err: OpenAIError | str) -> Any:
    """Record a call that failed before its answer; returns ``finish_call``'s ack."""
    if isinstance(err, OpenAIError):
        svc.metrics.upstream_errors.labels(svc.upstream.kind, str(err.status)).inc()
    rec = build_record(svc, parsed, ctx, prompt, [], weight_version=None,
                       prompt_tokens=len(prompt.ids or ()), retokenized=not svc.upstream.token_native,
                       error=err.message if isinstance(err, OpenAIError) else err)
    return finish_call(svc, ctx, rec)


MAX_TOKENS_PARAM = {"responses": "max_output_tokens"}
"""The request field that asked for the new tokens, by API (``max_tokens`` for the others)."""


def cap_max_tokens(svc: Services, parsed: ParsedRequest) -> None:
    """``GatewaySettings.max_tokens_cap``, on the call's whole output (``n`` choices × their new tokens): a
    request asking for more is a 400 (what OpenAI and Anthropic answer to a ``max_tokens`` above a model's
    limit, rather than a silent clamp that would cut replies the client believes it allowed); a request
    that asks for none gets the cap shared among its choices."""
    cap = svc.settings.max_tokens_cap
    if cap is None:
        return
    n = parsed.sampling.n or 1
    asked = parsed.sampling.max_tokens
    if asked is None:
        if n > cap:
            raise OpenAIError(400, f"n is too large: {n}. This gateway allows at most {cap} new tokens per "
                              "call (--max-tokens-cap), at least one per choice.", param="n", code="invalid_value")
        parsed.sampling.max_tokens = cap // n
    elif asked * n > cap:
        param = MAX_TOKENS_PARAM.get(parsed.api, "max_tokens")
        if parsed.api == "chat" and "max_completion_tokens" in parsed.body:
            param = "max_completion_tokens"
        asked_all = f"{asked}" if n == 1 else f"{asked} × n={n} = {asked * n}"
        raise OpenAIError(400, f"{param} is too large: {asked_all}. This gateway allows at most {cap} new tokens "
                          "per call, over all its choices (--max-tokens-cap).", param=param, code="invalid_value")


async def run_call(svc: Services, parsed: ParsedRequest, ctx: CallContext, build: Builder,
                   writer: WriterFactory = StreamWriter, *, client: Request | None = None) -> Response:
    """Plan, call upstream and answer: ``build`` makes the JSON body and the record of a whole result,
    ``writer`` the SSE stream of a streamed one. ``client``: the request, watched while a non-stream call
    waits for the upstream so that a client that goes away aborts the generation (as a stream's does).
    The answer goes out once the call's span is committed (``GatewaySettings.durability``)."""
    check_model(svc, parsed.model)
    cap_max_tokens(svc, parsed)
    prompt = await plan(svc, parsed, ctx)
    req = generate_request(svc, parsed, ctx, prompt)
    started = time.perf_counter()
    if parsed.stream:
        return await _start_stream(svc, parsed, ctx, prompt, req, started, writer)
    try:
        result = await _generate(svc, req, client)
    except OpenAIError as e:
        await settled(record_failure(svc, parsed, ctx, prompt, e), svc.settings.commit_timeout_s)
        raise
    except ClientDisconnect:
        record_failure(svc, parsed, ctx, prompt, "client disconnected")
        raise
    svc.metrics.observe_upstream(svc.upstream.kind, parsed.operation, False, time.perf_counter() - started)
    body, rec = build(svc, parsed, ctx, prompt, result)
    await acknowledge(finish_call(svc, ctx, rec), svc.settings.commit_timeout_s)
    return Response(orjson.dumps(body), media_type="application/json")


async def _generate(svc: Services, req: Any, client: Request | None) -> GenerateResult:
    """The upstream call, cancelled (``ClientDisconnect``) if ``client`` disconnects meanwhile; cancelling
    it closes the upstream connection and the adapter aborts the generation (``SGLangUpstream.generate``)."""
    if client is None:
        return await svc.upstream.generate(req)
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.get_running_loop().create_task(cancel_on_disconnect(client.receive, task))
    try:
        return await svc.upstream.generate(req)
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise
        task.uncancel()
        raise ClientDisconnect() from None
    finally:
        watcher.cancel()


async def _start_stream(svc: Services, parsed: ParsedRequest, ctx: CallContext, prompt: Prompt, req: Any,
                        started: float, make_writer: WriterFactory) -> Response:
    events = svc.upstream.stream(req)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except OpenAIError as e:
        await settled(record_failure(svc, parsed, ctx, prompt, e), svc.settings.commit_timeout_s)
        raise
    writer = make_writer(svc, parsed, ctx, prompt)
    writer.on_done = lambda: svc.metrics.observe_upstream(svc.upstream.kind, parsed.operation, True,
                                                          time.perf_counter() - started)
    return SseResponse(sse_stream(writer, first, events, svc.settings.commit_timeout_s), headers=SSE_HEADERS)
