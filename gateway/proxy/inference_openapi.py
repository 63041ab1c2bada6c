"""OpenAPI declarations of the inference routes (``front.INFERENCE_ROUTES``), which the ASGI front serves
without FastAPI, so FastAPI cannot describe them: their request bodies as JSON Schemas of the fields the
gateway checks (``validation.py``, ``responses/request.py``, ``anthropic/request.py``; any other property
is allowed, as OpenAI and Anthropic allow them) and the statuses they answer. ``inference_paths`` gives
their path items, which ``api/openapi.py`` adds to ``/openapi.json`` beside FastAPI's routes.

A body the schema accepts may still be refused with a 400 by a check a schema cannot say (a tool call
id that answers no call, a chat template that refuses the conversation): the schema is what the gateway
checks field by field, not a promise that every conversation renders."""

from __future__ import annotations

import copy
from typing import Any

from tracegym.gateway.openai_errors import ERROR_REF

Schema = dict[str, Any]

_NUMBER = {"type": "number"}
_TEXT_OR_PARTS: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}},
                                    {"type": "null"}]}
_COMMON: Schema = {
    "model": {"type": "string", "minLength": 1, "description": "must be the served model's name (else 404)"},
    "stream": {"type": "boolean"},
    "temperature": _NUMBER | {"minimum": 0, "maximum": 2},
    "top_p": _NUMBER | {"minimum": 0, "maximum": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
}
_SAMPLING: Schema = {
    **_COMMON,
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16},
                       {"type": "null"}]},
    "frequency_penalty": _NUMBER | {"minimum": -2, "maximum": 2},
    "presence_penalty": _NUMBER | {"minimum": -2, "maximum": 2},
    "return_token_ids": {"type": "boolean"},
    "return_tokens_as_token_ids": {"type": "boolean", "description": "logprob entries name tokens token_id:{id}"},
}

_TOKEN_IDS: Schema = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
CHAT: Schema = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_SAMPLING,
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
                           "content": _TEXT_OR_PARTS, "tool_calls": {"type": ["array", "null"]}}}},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "needs logprobs"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}},
        "tool_choice": {"description": "none | auto | required | a named function; needs tools"},
        "stream_options": {"type": "object", "description": "only with stream: true"},
        "chat_template_kwargs": {"type": "object"},
    },
}
COMPLETION: Schema = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string"}, _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
                                 {"type": "string"}, _TOKEN_IDS]}}],
                   "description": "a string (needs the gateway's tokenizer) or token ids, or a batch of one"},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20,
                            "description": "choices[i].prompt_logprobs with this many top alternatives per prompt "
                                           "token (vLLM's); not with stream"},
        "echo": {"const": False, "description": "not supported"},
        "suffix": {"description": "not supported"},
        "stream_options": {"type": "object", "description": "only with stream: true"},
    },
}
RESPONSES: Schema = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        **{k: v for k, v in _COMMON.items() if k != "max_tokens"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": ["string", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string", "minLength": 1}}}},
        "tool_choice": {"description": "none | auto | required | {type: function, name}; needs tools"},
        "store": {"type": "boolean"},
    },
}
_ANTHROPIC_MESSAGES: Schema = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant"]},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}}
MESSAGES: Schema = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        **_COMMON,
        "temperature": _NUMBER | {"minimum": 0, "maximum": 1},
        "messages": _ANTHROPIC_MESSAGES,
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"},
    },
}
COUNT_TOKENS: Schema = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {"model": _COMMON["model"], "messages": _ANTHROPIC_MESSAGES,
                   "system": MESSAGES["properties"]["system"], "tools": MESSAGES["properties"]["tools"]},
}
ANTHROPIC_ERROR: Schema = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
OPENAI_ERROR: Schema = ERROR_REF

# Statuses: 400 (a field fails its check, or the body is not JSON), 404 (another model's name), 413 (body
# over the limit), 415 (a Content-Type that is not JSON, ``auth.Guard``), 429/502/503/504 (the upstream's
# failures and timeouts, as ``openai_errors.py`` maps them).
CALL_ERRORS = (400, 404, 413, 415, 429, 502, 503, 504)
COUNT_ERRORS = (400, 404, 413, 415)
_MEANINGS = {
    400: "A field fails its check", 404: "Not the served model", 413: "Request body over the limit",
    415: "The Content-Type is not application/json", 429: "The upstream asks to slow down",
    502: "The upstream failed", 503: "The upstream is unavailable", 504: "The upstream timed out",
}


SERVED_MODEL = "served-model"
"""The model of the examples: ``api/openapi.py`` puts the served model's name in its place."""
_ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def _nulls_are_absent(body: Schema) -> Schema:
    """``body`` with each optional property also taking null, which the gateway reads as absent (as
    OpenAI's and Anthropic's APIs do)."""
    required = set(body.get("required", ()))
    props = {k: v if k in required else {"anyOf": [v, {"type": "null"}]} for k, v in body["properties"].items()}
    return body | {"properties": props}


def operation(summary: str, body: Schema, example: dict[str, Any], *, error: Schema = OPENAI_ERROR,
              stream: bool = True, errors: tuple[int, ...] = CALL_ERRORS) -> dict[str, Any]:
    """The OpenAPI operation of one inference route: its request body (with an example) and its answers."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        ok["text/event-stream"] = {"schema": {"description": "each event's data: a JSON chunk (Chat Completions "
                                              "and Completions end with data: [DONE])"}}
    responses: dict[str, dict[str, Any]] = {"200": {"description": "The reply (an SSE stream with stream: true)"
                                                    if stream else "The count", "content": ok}}
    for status in errors:
        responses[str(status)] = {"description": _MEANINGS[status],
                                  "content": {"application/json": {"schema": error}}}
    return {"tags": ["inference"], "summary": summary, "responses": responses,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _nulls_are_absent(body), "example": {"model": SERVED_MODEL, **example}}}}}


OPERATIONS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": operation("Chat Completions", CHAT, {"messages": _ASK, "max_tokens": 8}),
    "/v1/completions": operation("Completions", COMPLETION, {"prompt": "2 + 3 =", "max_tokens": 8}),
    "/v1/responses": operation("Responses", RESPONSES, {"input": "What is 2 + 3?", "max_output_tokens": 8}),
    "/v1/messages": operation("Anthropic Messages", MESSAGES, {"messages": _ASK, "max_tokens": 8},
                              error=ANTHROPIC_ERROR),
    "/v1/messages/count_tokens": operation("Anthropic Messages token count", COUNT_TOKENS, {"messages": _ASK},
                                           error=ANTHROPIC_ERROR, stream=False, errors=COUNT_ERRORS),
}
"""Per inference route, its ``POST`` operation."""
_ROLLOUT_ID = {"name": "rollout_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}


def inference_paths() -> dict[str, dict[str, Any]]:
    """The ``paths`` entries of the inference routes, each with its ``/rollouts/{rollout_id}`` form (fresh
    dicts: the caller may amend them)."""
    paths = {}
    for path, op in OPERATIONS.items():
        name = path.strip("/").replace("/", "_")
        paths[path] = {"post": copy.deepcopy(op) | {"operationId": name}}
        paths["/rollouts/{rollout_id}" + path] = {"post": copy.deepcopy(op) | {
            "operationId": f"{name}_rollout", "summary": op["summary"] + " (calls attributed to the rollout)",
            "parameters": [copy.deepcopy(_ROLLOUT_ID)]}}
    return paths
