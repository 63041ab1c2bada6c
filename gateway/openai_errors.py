"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` for every failure, and the
exception handlers that produce it (validation failures are 400, never 422; a store whose database is
out of reach is 503)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

log = logging.getLogger("tracegym.gateway")

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "server_error",
    504: "upstream_timeout",
}


class OpenAIError(Exception):
    """An error answered to the client in OpenAI's shape with ``status``."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


class UpstreamUnavailable(OpenAIError):
    def __init__(self, message: str) -> None:
        super().__init__(502, message, code="upstream_unavailable")


class UpstreamTimeout(OpenAIError):
    def __init__(self, message: str) -> None:
        super().__init__(504, message, code="upstream_timeout")


class UpstreamRejected(OpenAIError):
    """The upstream answered with an error status: 429 passes through (a client's SDK backs off and
    retries it), 408 → 504, other 4xx → 400, 5xx → 502."""

    def __init__(self, upstream_status: int, message: str) -> None:
        if upstream_status in (408, 429):
            status = 504 if upstream_status == 408 else 429
        else:
            status = 400 if 400 <= upstream_status < 500 else 502
        super().__init__(status, f"upstream returned HTTP {upstream_status}: {message}", code="upstream_error")
        self.upstream_status = upstream_status


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error this gateway answers (the Messages routes answer Anthropic's shape instead)."""

    error: ErrorDetail


ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
"""``ErrorBody`` in ``/openapi.json`` (``api/openapi.py`` puts it there)."""
_MEANINGS = {
    400: "The request is malformed or a value is out of range",
    401: "No key, or a wrong one: the admin key, or for agent routes and a rollout's own routes its token",
    403: "A rollout token used for another rollout or an admin route; or a path outside the weights root",
    404: "Not found",
    409: "Conflicts with the current state",
    413: "The request body is larger than the gateway's limit (--max-body-bytes)",
    415: "Unsupported Content-Type or Content-Encoding",
    421: "The Host header is not one this gateway answers (--allowed-host)",
    429: "The upstream asks to slow down",
    502: "The upstream failed or could not be reached",
    503: "The upstream is unavailable",
    504: "The upstream timed out",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that answers these error statuses (in ``ErrorBody``'s shape)."""
    return {status: {"description": _MEANINGS[status], "content": {"application/json": {"schema": ERROR_REF}}}
            for status in statuses}


class NDJSONResponse(Response):
    """JSON lines (the ``response_class`` that documents a streamed route's media type)."""

    media_type = "application/x-ndjson"


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status, exc.body())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = 400 if exc.status_code == 422 else exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else orjson.dumps(exc.detail).decode()
    response = error_response(status, error_body(detail, type=_TYPES.get(status, "invalid_request_error")))
    response.headers.update(exc.headers or {})
    if status == 405:
        response.headers["Allow"] = allowed_methods(request)
    return response


def allowed_methods(request: Request) -> str:
    """The ``Allow`` header of a 405: the methods ``/openapi.json`` documents for the request's path (the
    most literal of the templates that match it: ``POST /api/rollouts/claim``, not ``GET
    /api/rollouts/{rollout_id}``), else each method some route of the path takes. Starlette's own header
    names the methods of the first route that matched the path only, so a path with GET and POST routes
    lost one."""
    documented = _documented_methods(request.app.openapi().get("paths", {}), request.scope["path"])
    if documented is not None:
        return documented
    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def _documented_methods(paths: dict[str, Any], path: str) -> str | None:
    parts = path.split("/")
    best: tuple[int, str] | None = None
    for template, item in paths.items():
        segments = template.split("/")
        if len(segments) != len(parts) or not all(
                s == p or (s.startswith("{") and p) for s, p in zip(segments, parts, strict=True)):
            continue
        literal = sum(not s.startswith("{") for s in segments)
        if best is None or literal > best[0]:
            best = (literal, ", ".join(sorted(m.upper() for m in item if m.upper() in _METHODS)))
    return None if best is None else best[1]


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where the value was, not which one
        loc = loc[1:]
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs)
    return error_response(
        400, error_body(message or "invalid request", type="invalid_request_error", param=".".join(loc) or None)
    )


def internal_error(exc: BaseException, where: str) -> Response:
    """A 500 that names a request id and nothing else: the exception (which may hold SQL, bound
    parameters or a secret from the request) goes to the gateway's log under that id, never to the client."""
    request_id = uuid.uuid4().hex[:16]
    log.error("internal error in %s (request id %s)", where, request_id, exc_info=exc)
    return error_response(500, error_body(f"internal error (request id {request_id}); the gateway's log has "
                                          "the details", type="server_error", code="internal_error"))


STORE_UNAVAILABLE = "the trace store is unavailable (its database did not answer): retry shortly"


def store_outage_errors() -> tuple[type[Exception], ...]:
    """What SQLAlchemy raises while the store's database is out of reach: stopped or restarting (a
    refused or closed connection, "the database system is shutting down"), or out of connections (the
    pool's timeout)."""
    from sqlalchemy import exc

    return exc.OperationalError, exc.InterfaceError, exc.TimeoutError


def store_unavailable(exc: BaseException) -> OpenAIError | None:
    """The 503 for a request that failed because the store's database is out of reach (a client retries
    it), or None for any other error."""
    if not isinstance(exc, store_outage_errors()):
        return None
    log.warning("the trace store is unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return OpenAIError(503, STORE_UNAVAILABLE, type="server_error", code="store_unavailable")


async def _store_unavailable(_: Request, exc: Exception) -> Response:
    error = store_unavailable(exc)
    assert error is not None
    return error_response(error.status, error.body())


async def _unhandled(request: Request, exc: Exception) -> Response:
    return internal_error(exc, request.url.path)


async def _too_deep(_: Request, exc: Exception) -> Response:
    # JSON nested deep enough to exhaust the parser's recursion: the client's input, not our fault.
    return error_response(400, error_body("request JSON is nested too deeply", type="invalid_request_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RecursionError, _too_deep)
    for cls in store_outage_errors():  # a 503, not a 500: the client retries once the store is back
        app.add_exception_handler(cls, _store_unavailable)
    app.add_exception_handler(Exception, _unhandled)
