"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for every failure of the
Messages routes: the shared call path raises ``OpenAIError``s (statuses already right), which the routes
answer in this shape instead."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from tracegym.gateway.openai_errors import OpenAIError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_message(e: OpenAIError) -> str:
    """The message, naming the parameter at fault when there is one (Anthropic's shape has no field)."""
    return f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message


def error_response(e: OpenAIError) -> Response:
    return Response(orjson.dumps(error_body(e.status, error_message(e))), status_code=e.status,
                    media_type="application/json")
