"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` for every failure, and the
exception handlers that produce it (validation failures are 400, never 422)."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("tracegym.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
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


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status, exc.body())


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = 400 if exc.status_code == 422 else exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else orjson.dumps(exc.detail).decode()
    return error_response(status, error_body(detail, type=_TYPES.get(status, "invalid_request_error")))


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs)
    return error_response(
        400, error_body(message or "invalid request", type="invalid_request_error", param=".".join(loc) or None)
    )


async def _unhandled(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unhandled)
