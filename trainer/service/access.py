"""Who a request's key is (the admin, the holder of one run's key, or nobody) and the HTTP errors the
service's routes answer with."""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from tracegym.trainer.service.runs import Run
from tracegym.trainer.service.state import ServiceState


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def fail(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message, "error": {"message": message}}, status_code=status)


async def read_json(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise HttpError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _key(request: Request) -> str | None:
    if key := request.headers.get("x-api-key"):
        return key
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else None


def _is(given: str, key: str) -> bool:
    return hmac.compare_digest(given, key) or hmac.compare_digest(given, "tml-" + key)


class Access:
    """Who the request's key is: the admin, the holder of one run's key, or nobody."""

    def __init__(self, state: ServiceState, request: Request) -> None:
        self.state, admin = state, state.cfg.admin_key
        given = _key(request)
        self.admin = admin is None or (given is not None and _is(given, admin))
        self.run_keys = {r.model_id for r in state.runs.values() if given is not None and _is(given, r.key)}
        if not self.admin and not self.run_keys:
            raise HttpError(
                401,
                "missing or wrong API key: send the service's admin key (or a run's key) as "
                "X-API-Key or Authorization: Bearer (the tinker SDK: api_key='tml-' + key)",
            )

    def need_admin(self) -> None:
        if not self.admin:
            raise HttpError(403, "this route needs the admin key; a run's key works for that run only")

    def need_run(self, run: Run | None) -> None:
        if not self.admin and (run is None or run.model_id not in self.run_keys):
            raise HttpError(403, "this key belongs to another run")


def get_run(state: ServiceState, model_id: Any) -> Run:
    try:
        return state.run(str(model_id))
    except LookupError as e:
        raise HttpError(404, str(e)) from None
