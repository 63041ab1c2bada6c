"""The inference routes' table: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(``responses/``) and ``POST /v1/messages`` (``anthropic/``) are ``HOT_ROUTES``, served by the ASGI front in
``front.py``; ``GET /v1/models`` here, and all of them also under ``/rollouts/{rollout_id}/v1/`` (calls
attributed to that rollout).

Handlers take the raw ``Request`` and parse the body with orjson (validated by hand in
``validation.py``); the response is pre-serialized bytes. That keeps the per-call overhead small."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from tracegym.gateway.deps import Services, ServicesDep
from tracegym.gateway.errors import bad_request
from tracegym.gateway.proxy.anthropic.routes import Handler, count_tokens, create_message
from tracegym.gateway.proxy.calls import chat_response, completion_response, new_context
from tracegym.gateway.proxy.hot_schemas import HOT_OPERATIONS
from tracegym.gateway.proxy.responses.routes import create_response
from tracegym.gateway.proxy.serving import read_body, run_call
from tracegym.gateway.proxy.validation import load_json_object, parse_chat, parse_completion

router = APIRouter()


async def _chat(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_chat(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    return await run_call(svc, parsed, new_context("chat", rollout_id, request.headers), chat_response,
                          client=request)


async def _completion(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_completion(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    if isinstance(parsed.prompt, str) and svc.upstream.token_native and svc.tokenizer is None:
        raise bad_request("this gateway has no tokenizer: send the prompt as token ids", "prompt")
    ctx = new_context("text_completion", rollout_id, request.headers)
    return await run_call(svc, parsed, ctx, completion_response, client=request)


def _models(svc: Services) -> Response:
    data = [{"id": svc.served_model, "object": "model", "created": svc.created, "owned_by": "tracegym"}]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


# The inference routes, served by ``front.GatewayMiddleware`` (and ``front.HotFront`` under ``tracegym
# serve``) without the framework's per-request layers; their FastAPI stand-ins (``_add_stand_ins``)
# document them and answer other methods with 405.
HOT_ROUTES = {
    "/v1/chat/completions": _chat, "/v1/completions": _completion, "/v1/responses": create_response,
    "/v1/messages": create_message, "/v1/messages/count_tokens": count_tokens,
}


def _stand_in(handler: Handler) -> Callable[..., Awaitable[Response]]:
    async def route(request: Request, svc: ServicesDep) -> Response:
        return await handler(request, svc, request.path_params.get("rollout_id"))

    return route


def _add_stand_ins() -> None:
    """Each hot route also as a FastAPI route, which declares it in ``/openapi.json`` (request body and
    statuses from ``hot_schemas``) and answers a method it does not take with 405 and ``Allow: POST``. The
    front answers POSTs before they get here; these serve one only when the front is not in the stack."""
    for path, handler in HOT_ROUTES.items():
        declared = HOT_OPERATIONS[path]
        name = path.strip("/").replace("/", "_")
        for prefix in ("", "/rollouts/{rollout_id}"):
            extra = declared["openapi_extra"]
            if prefix:
                extra = extra | {"summary": extra["summary"] + " (calls attributed to the rollout)",
                                 "parameters": [{"name": "rollout_id", "in": "path", "required": True,
                                                 "schema": {"type": "string", "minLength": 1}}]}
            router.add_api_route(prefix + path, _stand_in(handler), methods=["POST"], openapi_extra=extra,
                                 responses=declared["responses"], tags=["inference"],
                                 operation_id=f"{name}{'_rollout' if prefix else ''}")


_add_stand_ins()


@router.get("/v1/models")
async def models(svc: ServicesDep) -> Response:
    return _models(svc)


@router.get("/rollouts/{rollout_id}/v1/models")
async def rollout_models(rollout_id: str, svc: ServicesDep) -> Response:
    return _models(svc)
