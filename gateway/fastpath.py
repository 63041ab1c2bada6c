"""The app's outermost middleware: request metrics for every route, and a fast path for the hot
inference routes (``POST /v1/chat/completions``, ``POST /v1/completions`` and their
``/rollouts/{rollout_id}/v1/...`` forms).

The fast path calls the same handlers the FastAPI routes use, with the same OpenAI error shape, but
skips the framework's per-request layers (exception/telemetry middleware, async exit stack, routing,
dependency resolution) — measured at about a quarter of the gateway's CPU per call. Every other route
goes through FastAPI unchanged."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracegym.gateway.deps import Services
from tracegym.gateway.errors import OpenAIError, error_body, error_response

log = logging.getLogger("tracegym.gateway")

Handler = Callable[[Request, Services, str | None], Awaitable[Response]]
_ROLLOUTS = "/rollouts/"


def match_hot_route(method: str, path: str, routes: dict[str, Handler]) -> tuple[Handler, str | None, str] | None:
    """``(handler, rollout_id, route template)`` for a hot route, else None."""
    if method != "POST":
        return None
    handler = routes.get(path)
    if handler is not None:
        return handler, None, path
    if not path.startswith(_ROLLOUTS):
        return None
    rest = path[len(_ROLLOUTS):]
    rollout_id, sep, tail = rest.partition("/")
    handler = routes.get("/" + tail) if sep else None
    if handler is None or not rollout_id:
        return None
    return handler, rollout_id, "/rollouts/{rollout_id}/" + tail


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, routes: dict[str, Handler]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        services: Services | None = getattr(scope["app"].state, "services", None)
        hot = match_hot_route(scope["method"], scope["path"], self.routes) if services is not None else None
        await self._counted(hot, services, scope, receive, send)

    async def _counted(self, hot: tuple[Handler, str | None, str] | None, services: Services | None,
                       scope: Scope, receive: Receive, send: Send) -> None:
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if hot is None:
                await self.app(scope, receive, send_wrapper)
            else:
                await self._hot(hot, services, scope, receive, send_wrapper)  # type: ignore[arg-type]
        finally:
            if services is not None:
                path = hot[2] if hot is not None else getattr(scope.get("route"), "path", "unmatched")
                services.metrics.count_request(path, scope["method"], status)

    async def _hot(self, hot: tuple[Handler, str | None, str], services: Services, scope: Scope,
                   receive: Receive, send: Send) -> None:
        handler, rollout_id, _ = hot
        try:
            response = await handler(Request(scope, receive), services, rollout_id)
        except OpenAIError as e:
            response = error_response(e.status, e.body())
        except Exception as e:
            log.exception("unhandled error in %s", scope["path"])
            response = error_response(500, error_body(f"internal error: {type(e).__name__}: {e}",
                                                      type="server_error"))
        await response(scope, receive, send)


class HotFront(GatewayMiddleware):
    """The same fast path, wrapped around the whole FastAPI ``app`` from outside (``tracegym serve``
    does): hot routes then also skip Starlette's own middleware stack (error, telemetry and body-limit
    wrappers, measured at ~7% of the gateway's CPU per call); every other request goes to ``app``
    untouched, whose inner ``GatewayMiddleware`` counts it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = getattr(self.app.state, "services", None) if scope["type"] == "http" else None
        hot = match_hot_route(scope["method"], scope["path"], self.routes) if services is not None else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        await self._counted(hot, services, scope, receive, send)
