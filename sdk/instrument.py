"""Zero-code attribution: requests sent with httpx to the gateway carry the current rollout's headers.

``install()`` wraps ``httpx.Client.send`` and ``httpx.AsyncClient.send`` once per process (every
request of every client goes through ``send``: the OpenAI SDK, LangChain, AutoGen, litellm). The
wrapper adds ``X-Rollout-Id``/``X-Task-Id``/``X-Agent-Name`` when a rollout scope is open and the
request goes to that scope's gateway (same scheme, host and port, path under the gateway's path);
headers the caller set itself are left alone. ``tg.rollout`` calls ``install()`` on entry.
"""

from __future__ import annotations

import functools
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx

from tracegym.context import current_rollout

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MARK = "__tracegym_instrumented__"


_INSTALL_LOCK = threading.Lock()  # serialises the one-time patch (two threads' first scopes at once)


def _origin(scheme: str, host: str, port: int | None) -> tuple[str, str, int]:
    host = host.lower()
    if host in _LOOPBACK:
        host = "loopback"
    return scheme, host, port or _DEFAULT_PORTS.get(scheme, 0)


def targets_gateway(gateway_url: str, url: httpx.URL) -> bool:
    """True when ``url`` is on the gateway at ``gateway_url`` (loopback names are treated as one host)."""
    g = urlsplit(gateway_url)
    if _origin(g.scheme, g.hostname or "", g.port) != _origin(url.scheme, url.host, url.port):
        return False
    prefix = g.path.rstrip("/")
    return not prefix or url.path == prefix or url.path.startswith(prefix + "/")


def stamp(request: httpx.Request) -> None:
    """Add the current rollout's headers to ``request`` if it goes to the scope's gateway."""
    scope = current_rollout()
    if scope is None or not targets_gateway(scope.config.gateway_url, request.url):
        return
    for name, value in scope.headers().items():
        if name not in request.headers:
            request.headers[name] = value


def install() -> None:
    """Patch httpx's ``send`` methods (idempotent, thread-safe)."""
    with _INSTALL_LOCK:
        if getattr(httpx.Client.send, _MARK, False):
            return
        sync_send = httpx.Client.send
        async_send = httpx.AsyncClient.send

        @functools.wraps(sync_send)
        def send(self: httpx.Client, request: httpx.Request, **kw: Any) -> httpx.Response:
            stamp(request)
            return sync_send(self, request, **kw)

        @functools.wraps(async_send)
        async def asend(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> httpx.Response:
            stamp(request)
            return await async_send(self, request, **kw)

        setattr(send, _MARK, True)
        setattr(asend, _MARK, True)
        httpx.Client.send = send  # type: ignore[method-assign]
        httpx.AsyncClient.send = asend  # type: ignore[method-assign]
