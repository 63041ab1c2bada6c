"""OpenAI's Chat Completions and Completions routes (``POST /v1/chat/completions``, ``POST
/v1/completions``: handlers the ASGI front serves, ``front.INFERENCE_ROUTES``) and the model list
(``GET /v1/models``, a FastAPI route); all of them also under ``/rollouts/{rollout_id}/v1/`` (calls
attributed to that rollout).

Handlers take the raw ``Request`` and parse the body with orjson (validated by hand in
``validation.py``); the response is pre-serialized bytes. That keeps the per-call overhead small."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from tracegym.gateway.deps import Services, ServicesDep
from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.proxy.call_context import new_context
from tracegym.gateway.proxy.call_path import read_body, run_call
from tracegym.gateway.proxy.openai_replies import chat_response, completion_response
from tracegym.gateway.proxy.validation import load_json_object, parse_chat, parse_completion

router = APIRouter()


async def create_chat_completion(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_chat(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    return await run_call(svc, parsed, new_context("chat", rollout_id, request.headers), chat_response,
                          client=request)


async def create_completion(request: Request, svc: Services, rollout_id: str | None) -> Response:
    parsed = parse_completion(load_json_object(await read_body(request, svc.settings.max_body_bytes)))
    if isinstance(parsed.prompt, str) and svc.upstream.token_native and svc.tokenizer is None:
        raise bad_request("this gateway has no tokenizer: send the prompt as token ids", "prompt")
    if parsed.prompt_logprobs is not None and not svc.upstream.token_native:
        raise bad_request("'prompt_logprobs' needs a token-native upstream (sglang or the embedded engine); "
                          f"this gateway's is {svc.upstream.kind}", "prompt_logprobs")
    ctx = new_context("text_completion", rollout_id, request.headers)
    return await run_call(svc, parsed, ctx, completion_response, client=request)


def _models(svc: Services) -> Response:
    data = [{"id": svc.served_model, "object": "model", "created": svc.created, "owned_by": "tracegym"}]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models")
async def models(svc: ServicesDep) -> Response:
    return _models(svc)


@router.get("/rollouts/{rollout_id}/v1/models")
async def rollout_models(rollout_id: str, svc: ServicesDep) -> Response:
    return _models(svc)
