"""Who a request's key is (the admin, the holder of one run's key, or nobody) and the HTTP errors the
service's routes answer with."""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.runs import Run
from tracegym.trainer.service.state import CHECKPOINTS, ServiceState, parse_path


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
        self.run_keys = {r.model_id for r in state.keyed_runs() if given is not None and _is(given, r.key)}
        """The runs this key is the key of (at most one)."""
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

    def may_read(self, owner: str | None) -> bool:
        """Whether this key may read what ``owner`` (a run's ``model_id``; None: the admin) owns."""
        return self.admin or owner in self.run_keys

    def need_checkpoint(self, path: str) -> None:
        """403 unless this key may load the saved state at ``path``: the admin key any, a run's key only its
        own run's (decided from the path alone, so nothing is said about whether another run's exists)."""
        try:
            owner, _ = parse_path(path, CHECKPOINTS)
        except UserFault as e:
            raise HttpError(400, str(e)) from None
        if not self.may_read(owner):
            raise HttpError(403, f"{path} is another run's checkpoint: a run's key loads only its own run's "
                                 "saved states (the admin key loads any)")


def get_run(state: ServiceState, model_id: Any) -> Run:
    try:
        return state.run(str(model_id))
    except LookupError as e:
        raise HttpError(404, str(e)) from None
