"""The gateway's ``/openapi.json``, made to say what the gateway does (``tests/e2e/test_openapi_fuzz.py``
fuzzes the running gateway against it with schemathesis).

FastAPI's generated schema is kept, with two corrections applied to every operation:

- its default 422 "Validation Error" is never answered (``openai_errors.py`` turns validation failures into
  400s in the gateway's error shape), so it becomes a 400 with ``ErrorBody``;
- an operation that takes a request body also answers 413 (the front's body limit, ``--max-body-bytes``);
- an optional query parameter may be empty, which counts as absent (``params.QueryModel``).

and what the front's checks (``proxy/auth.py``) answer: 415 for a request body that is not JSON (OTLP
ingest aside); with an admin key, 401, 403 and 429 (too many wrong keys) on every route but the open ones,
409 on the routes a rollout token writes to (its rollout has ended), and the two ways to send a key as
security schemes; with a Host allow-list, 421 everywhere.

Every other status a route answers is declared on the route itself (``responses=error_responses(...)``).
The inference routes, which the ASGI front serves without FastAPI, are added from their declarations
(``proxy/inference_openapi.py``) and corrected like the rest."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tracegym.gateway.openai_errors import ErrorBody, error_responses
from tracegym.gateway.proxy.auth import AGENT, NO_JSON_RULE, OPEN, classify
from tracegym.gateway.proxy.inference_openapi import SERVED_MODEL, inference_paths

_FASTAPI_ONLY = ("HTTPValidationError", "ValidationError")


def _error(status: int) -> dict[str, Any]:
    return error_responses(status)[status]


def _correct(operation: dict[str, Any]) -> None:
    for param in operation.get("parameters", []):
        if param.get("in") == "query" and not param.get("required"):
            param["schema"] = {"anyOf": [param["schema"], {"const": ""}]}
    responses = operation.setdefault("responses", {})
    if responses.pop("422", None) is not None:
        responses.setdefault("400", _error(400))
    if "requestBody" in operation:
        responses.setdefault("413", _error(413))


_SECURITY = {"bearer": {"type": "http", "scheme": "bearer",
                        "description": "the admin key, or a rollout's token (POST /api/rollouts/claim)"},
             "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                        "description": "the same key as Anthropic clients send it"}}


def _guarded(operation: dict[str, Any], method: str, path: str, guard: Any) -> None:
    responses = operation.setdefault("responses", {})
    if "requestBody" in operation and path not in NO_JSON_RULE:
        responses.setdefault("415", _error(415))
    if guard is None:
        return
    kind = classify(method.upper(), path)[0] if guard.keyed else OPEN
    if kind != OPEN:
        responses.setdefault("401", _error(401))
        responses.setdefault("403", _error(403))
        responses.setdefault("429", _error(429))  # too many wrong keys from this address (proxy/admission.py)
        if kind == AGENT and method.upper() == "POST":
            responses.setdefault("409", _error(409))  # a rollout token's write into its ended rollout
        operation["security"] = [{"bearer": []}, {"apiKey": []}]
    if guard.checks_host:
        responses.setdefault("421", _error(421))


def _name_the_model(operation: dict[str, Any], served: str | None) -> None:
    """The inference examples name the model this gateway serves (known once it has started)."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    example = body.get("example")
    if served and isinstance(example, dict) and example.get("model") == SERVED_MODEL:
        body["example"] = example | {"model": served}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="tracegym's gateway: OpenAI/Anthropic-compatible inference routes that "
                         "record every call, and the control API of its trace store (docs/api.md).")
    schema["paths"] = inference_paths() | schema.get("paths", {})
    served = getattr(getattr(app.state, "services", None), "served_model", None)
    guard = getattr(app.state, "guard", None)
    for path, path_item in schema.get("paths", {}).items():
        for method, operation in path_item.items():
            _correct(operation)
            _guarded(operation, method, path, guard)
            _name_the_model(operation, served)
    if guard is not None and guard.keyed:
        schema.setdefault("components", {})["securitySchemes"] = _SECURITY
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPI_ONLY:
        schemas.pop(name, None)
    error = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in error.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault("ErrorBody", error)
    return schema


def install(app: FastAPI) -> None:
    """Serve ``build_openapi``'s schema at ``/openapi.json`` (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
