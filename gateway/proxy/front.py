"""The gateway's one way in: ``GatewayFront``, the outermost ASGI layer of the app (``app.GatewayApp``
puts it outside FastAPI's own middleware stack, so tests and ``tracegym serve`` run the same app).

Every request passes the app's ``auth.Guard`` (each security header once, keys, Host allow-list, ids, JSON
content type) and is counted in the request metrics; a rollout token's writes into its ended rollout are
409s, and inference calls past ``admission.Admission``'s bounds are 429s. The inference routes (``INFERENCE_ROUTES``: ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/v1/messages``, ``/v1/messages/count_tokens`` and their
``/rollouts/{rollout_id}/v1/...`` forms) are served here and only here: the front calls their handlers
directly, with the OpenAI error shape (the Messages handlers answer theirs in Anthropic's), and so skips
the framework's per-request layers (error, telemetry and body-limit middleware, exception middleware,
async exit stack, routing, dependency resolution), a large share of the gateway's CPU per call. They are
no FastAPI routes: ``/openapi.json`` declares them from ``inference_openapi.py``, and a method other than
POST is answered here with 405. Every other route goes through FastAPI, with the same body limit."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracegym.gateway.deps import Services
from tracegym.gateway.openai_errors import (
    OpenAIError,
    error_body,
    error_response,
    internal_error,
    store_unavailable,
)
from tracegym.gateway.proxy.admission import Admission
from tracegym.gateway.proxy.anthropic.messages_routes import count_tokens, create_message
from tracegym.gateway.proxy.auth import TOKEN_ROLLOUT, Denial
from tracegym.gateway.proxy.call_path import InferenceHandler
from tracegym.gateway.proxy.completions_routes import create_chat_completion, create_completion
from tracegym.gateway.proxy.responses.responses_routes import create_response

INFERENCE_ROUTES: dict[str, InferenceHandler] = {
    "/v1/chat/completions": create_chat_completion, "/v1/completions": create_completion,
    "/v1/responses": create_response, "/v1/messages": create_message, "/v1/messages/count_tokens": count_tokens,
}
"""The routes ``GatewayFront`` serves (POST only), by path; each also under ``/rollouts/{rollout_id}``."""
_ROLLOUTS = "/rollouts/"
InferenceRoute = tuple[InferenceHandler, str | None, str]
"""``(handler, rollout_id, route template)``."""


def match_inference_route(path: str, routes: dict[str, InferenceHandler]) -> InferenceRoute | None:
    """The inference route of ``path`` (whatever the method), else None."""
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


class GatewayFront:
    """Guard, metrics and body limit for every request; the inference routes served directly (see the
    module docstring). ``app``: FastAPI's middleware stack, for every other request."""

    def __init__(self, app: ASGIApp, routes: dict[str, InferenceHandler]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        services: Services | None = getattr(state, "services", None)
        route = match_inference_route(scope["path"], self.routes)
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            denial = state.guard.check(scope)
            admission: Admission | None = getattr(state, "admission", None)
            token_rollout = scope.get(TOKEN_ROLLOUT)
            if denial is None and token_rollout is not None and admission is not None and services is not None:
                denial = await _ended(admission, services, scope, token_rollout)
            if denial is not None:
                await denial.response(scope["path"])(scope, receive, send_wrapper)
            elif route is None:
                limit = services.settings.max_body_bytes if services is not None else None
                await self._framework(scope, receive, send_wrapper, limit)
            elif admission is None:
                await self._inference(route, services, scope, receive, send_wrapper)
            else:
                refused = admission.enter(token_rollout)
                if refused is not None:
                    busy = Denial(429, refused, "too_many_requests", retry_after=admission.retry_after)
                    await busy.response(scope["path"])(scope, receive, send_wrapper)
                    return
                try:
                    await self._inference(route, services, scope, receive, send_wrapper)
                finally:
                    admission.leave(token_rollout)
        except ClientDisconnect:  # nobody to answer (the call was recorded as such); counted as nginx's 499
            status = 499
        finally:
            if services is not None:
                path = route[2] if route is not None else getattr(scope.get("route"), "path", "unmatched")
                services.metrics.count_request(path, scope["method"], status)

    async def _framework(self, scope: Scope, receive: Receive, send: Send, limit: int | None) -> None:
        """Any other route, through FastAPI, with the same body limit as the inference routes (413 up front
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

    async def _inference(self, route: InferenceRoute, services: Services | None, scope: Scope,
                         receive: Receive, send: Send) -> None:
        handler, rollout_id, _ = route
        try:
            if scope["method"] != "POST":
                response = not_allowed()
            elif services is None:  # the lifespan has not built the services (yet)
                response = error_response(503, OpenAIError(503, "the gateway is not serving yet").body())
            else:
                response = await handler(Request(scope, receive), services, rollout_id)
        except ClientDisconnect:
            raise
        except OpenAIError as e:
            response = error_response(e.status, e.body())
        except Exception as e:
            down = store_unavailable(e)
            response = internal_error(e, scope["path"]) if down is None else error_response(503, down.body())
        await response(scope, receive, send)


async def _ended(admission: Admission, services: Services, scope: Scope, rollout_id: str) -> Denial | None:
    """The 409 for a rollout token's write (a POST but a token count) into its ended rollout (a 503 while
    the store is out of reach)."""
    if scope["method"] != "POST" or scope["path"].endswith("/count_tokens"):
        return None
    try:
        status = await admission.rollouts.ended_status(services.store, rollout_id)
    except Exception as e:
        down = store_unavailable(e)
        if down is None:
            raise
        return Denial(503, down.message, "store_unavailable")
    if status is None:
        return None
    return Denial(409, f"rollout {rollout_id!r} has ended ({status}): its token can no longer add calls, "
                  "rewards or events (it can still read the rollout)", "rollout_ended")


def not_allowed() -> Response:
    """405 for an inference route asked with another method than POST."""
    response = error_response(405, error_body("Method Not Allowed", type="invalid_request_error"))
    response.headers["Allow"] = "POST"
    return response


def too_large(limit: int) -> Response:
    return error_response(413, OpenAIError(413, f"request body exceeds the limit of {limit} bytes",
                                           code="request_too_large").body())
