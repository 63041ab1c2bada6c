"""The Tinker API's routes tracegym does not offer: every ``/api/v1/...`` path no other route answers is a 404
that names what is not offered (for the paths the ``tinker`` SDK calls) or the path itself, whatever its
method. Registered after every other route."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tracegym.trainer.service.access import Access, fail
from tracegym.trainer.service.state import ServiceState

NOT_OFFERED: tuple[tuple[str, str], ...] = (
    ("create_custom_loss", "server-side custom losses (custom losses run on the client: forward_backward_custom)"),
    ("copy_weights", "copying weights between accounts"),
    ("save_weights_external", "exporting weights to external storage"),
    (r"training_runs/[^/]+/checkpoints/.+/external_weights_urls",
     "external weights checkpoints (save_weights_external)"),
    ("retrieve_futures", "session-wide future polling (the SDK polls each future)"),
    ("cancel_future", "cancelling a request (its work runs to the end; its result is kept for an hour)"),
    ("auth/token", "JWT exchange (use an API key)"),
    ("audit", "an audit log"),
    (r"billing/.*", "billing or storage usage (list_checkpoints gives each checkpoint's size on disk)"),
    (r"sessions(/.*)?", "session listings, search, projects or trace exports (the gateway's trace inspector "
                        "shows every sample)"),
)
"""``(path pattern under /api/v1/, what is not offered)`` for the paths the SDK calls that have no route."""
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def not_offered_message(path: str) -> str:
    """The 404's message for ``/api/v1/{path}``."""
    what = next((w for pattern, w in NOT_OFFERED if re.fullmatch(pattern, path.strip("/"))), None)
    if what is not None:
        return f"tracegym does not offer {what} (/api/v1/{path})"
    return f"tracegym does not offer /api/v1/{path} ({path.split('/')[0]}); docs/tinker.md lists what it offers"


def add_not_offered_routes(app: FastAPI, svc: Callable[[Request], ServiceState]) -> None:
    @app.api_route("/api/v1/{rest:path}", methods=METHODS)
    async def not_offered(rest: str, request: Request) -> JSONResponse:
        Access(svc(request), request)
        return fail(404, not_offered_message(rest))
