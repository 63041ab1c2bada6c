"""OpenAI's Responses routes: ``POST /v1/responses`` (a handler the ASGI front serves,
``front.INFERENCE_ROUTES``) and ``GET /v1/responses/{id}`` (a FastAPI route), both also under
``/rollouts/{rollout_id}/v1/`` (and attributed with ``X-Rollout-Id``). Errors in OpenAI's shape."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from tracegym.gateway.deps import Services, ServicesDep
from tracegym.gateway.openai_errors import error_responses
from tracegym.gateway.proxy.call_context import new_context
from tracegym.gateway.proxy.call_path import read_body, run_call
from tracegym.gateway.proxy.responses.body import non_stream_body, stored_body
from tracegym.gateway.proxy.responses.chain import check_not_resent, find_response, load_previous, not_found
from tracegym.gateway.proxy.responses.request import chat_request, parse_responses
from tracegym.gateway.proxy.responses.stream import ResponsesStreamWriter
from tracegym.gateway.proxy.validation import load_json_object

router = APIRouter()


async def create_response(request: Request, svc: Services, rollout_id: str | None) -> Response:
    req = parse_responses(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    ctx = new_context("chat", rollout_id, request.headers, id_prefix="resp_")
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = await load_previous(svc, req.previous_response_id, ctx)
        check_not_resent(req.input.messages, req.input.item_ids, prev)
        history = prev.history
    parsed = chat_request(req, history)
    return await run_call(svc, parsed, ctx, non_stream_body, ResponsesStreamWriter, client=request)


async def _get(svc: Services, response_id: str, rollout_id: str | None) -> Response:
    rec = await find_response(svc, response_id)
    if rec is None or (rollout_id is not None and rec.rollout_id != rollout_id):
        raise not_found(response_id)
    return Response(orjson.dumps(stored_body(svc, rec)), media_type="application/json")


@router.get("/v1/responses/{response_id}", responses=error_responses(404))
async def get_response(response_id: str, request: Request, svc: ServicesDep) -> Response:
    return await _get(svc, response_id, request.headers.get("x-rollout-id") or None)


@router.get("/rollouts/{rollout_id}/v1/responses/{response_id}", responses=error_responses(404))
async def get_rollout_response(rollout_id: str, response_id: str, svc: ServicesDep) -> Response:
    return await _get(svc, response_id, rollout_id)
