"""The app's outermost middleware: request metrics for every route, and a fast path for the hot
inference routes (``routes.HOT_ROUTES``: ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``/v1/messages``, ``/v1/messages/count_tokens`` and their
``/rollouts/{rollout_id}/v1/...`` forms).

Every request first passes the app's ``auth.Guard`` (keys, Host allow-list, JSON content type).

The hot routes are not FastAPI routes: this front calls their handlers directly, with the OpenAI error
shape (the Messages handlers answer theirs in Anthropic's), and so skips the framework's per-request
layers (exception/telemetry middleware, async exit stack, routing, dependency resolution), a large share
of the gateway's CPU per call. Every other route goes through FastAPI unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracegym.gateway.deps import Services
from tracegym.gateway.errors import OpenAIError, error_response, internal_error
from tracegym.gateway.proxy.auth import Guard

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
        await self._counted(hot, services, scope["app"].state.guard, scope, receive, send)

    async def _counted(self, hot: tuple[Handler, str | None, str] | None, services: Services | None,
                       guard: Guard, scope: Scope, receive: Receive, send: Send) -> None:
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            denial = guard.check(scope)
            if denial is not None:
                await denial.response(scope["path"])(scope, receive, send_wrapper)
            elif hot is None:
                limit = services.settings.max_body_bytes if services is not None else None
                await self._framework(scope, receive, send_wrapper, limit)
            else:
                await self._hot(hot, services, scope, receive, send_wrapper)  # type: ignore[arg-type]
        except ClientDisconnect:  # nobody to answer (the call was recorded as such); counted as nginx's 499
            status = 499
        finally:
            if services is not None:
                path = hot[2] if hot is not None else getattr(scope.get("route"), "path", "unmatched")
                services.metrics.count_request(path, scope["method"], status)

    async def _framework(self, scope: Scope, receive: Receive, send: Send, limit: int | None) -> None:
        """Any other route, through FastAPI, with the same body limit as the hot routes (413 up front
        for a declared length over it, else as soon as the bytes read pass it)."""
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large(limit)(scope, receive, send)
            return
        # Past the limit, ``receive`` raises; the framework turns whatever it makes of that into an
        # error response, which is replaced here by the 413.
        seen, over = 0, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise OpenAIError(413, "request body too large", code="request_too_large")
            return message

        async def answer(message: Message) -> None:
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await too_large(limit)(scope, receive, send)

        await self.app(scope, counted, answer)

    async def _hot(self, hot: tuple[Handler, str | None, str], services: Services, scope: Scope,
                   receive: Receive, send: Send) -> None:
        handler, rollout_id, _ = hot
        try:
            response = await handler(Request(scope, receive), services, rollout_id)
        except ClientDisconnect:
            raise
        except OpenAIError as e:
            response = error_response(e.status, e.body())
        except Exception as e:
            response = internal_error(e, scope["path"])
        await response(scope, receive, send)


class HotFront(GatewayMiddleware):
    """The same fast path, wrapped around the whole FastAPI ``app`` from outside (``tracegym serve``
    does): hot routes then also skip Starlette's own middleware stack (error, telemetry and body-limit
    wrappers); every other request goes to ``app``
    untouched, whose inner ``GatewayMiddleware`` counts it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = getattr(self.app.state, "services", None) if scope["type"] == "http" else None
        hot = match_hot_route(scope["method"], scope["path"], self.routes) if services is not None else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        await self._counted(hot, services, self.app.state.guard, scope, receive, send)


def too_large(limit: int) -> Response:
    return error_response(413, OpenAIError(413, f"request body exceeds the limit of {limit} bytes",
                                           code="request_too_large").body())

