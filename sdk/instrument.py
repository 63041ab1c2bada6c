"""Zero-code attribution: requests sent to the gateway carry the current rollout's headers, whichever
HTTP client library sends them (httpx, httpx2, requests, aiohttp: see ``tracegym.http_patches``).

``install()`` patches each of those libraries that is imported, once per process, and puts an import
hook in place that patches the others when they are first imported (so ``import tracegym`` imports
none of them, and a library the agent imports inside its first scope is patched before its first
request). ``tg.rollout`` calls ``install()`` on entry.

The patched clients call ``stamp``: when a rollout scope is open and the request goes to that scope's
gateway (same scheme, host and port, path under the gateway's path), it adds ``X-Rollout-Id``/
``X-Task-Id``/``X-Agent-Name`` and the scope's key as ``X-Tracegym-Key`` (under ``tracegym run``, the
rollout's token; never sent to another host; headers the caller set itself are left alone), and counts the request
on the scope's ``CallTally`` if it is an LLM call attributed to the scope's rollout. An LLM call that
goes to another host is noted too: that is the likely cause when a rollout ends with no call.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from urllib.parse import SplitResult, urlsplit

from tracegym.context import current_rollout
from tracegym.http_patches import PATCHERS, HeaderMap, ensure_import_hook, is_patched

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# the gateway's LLM call routes (docs/api.md), also under /rollouts/{id}; the path below its prefix
_GATEWAY_CALL = re.compile(
    r"^(?:/rollouts/(?P<rid>[^/]+))?/v1/(?:chat/completions|completions|responses|messages)/?$"
)
# the same routes as any OpenAI- or Anthropic-compatible server names them (api.openai.com, Azure, ...)
_LLM_CALL = re.compile(r"/(?:chat/completions|completions|responses|messages)/?$")


_INSTALL_LOCK = threading.Lock()  # serialises patching (two threads' first scopes, an import meanwhile)
# set while a patched client sends a request: a client it sends through (an SDK's aiohttp transport
# under httpx2) sees the same request again, and must not count it twice
_SENDING: ContextVar[bool] = ContextVar("tracegym_sending", default=False)


def _origin(scheme: str, host: str, port: int | None) -> tuple[str, str, int]:
    host = host.lower()
    if host in _LOOPBACK:
        host = "loopback"
    return scheme, host, port or _DEFAULT_PORTS.get(scheme, 0)


@functools.lru_cache(maxsize=64)  # a process talks to a gateway or two; parsed on every request
def _gateway_origin(gateway_url: str) -> tuple[tuple[str, str, int], str]:
    g = urlsplit(gateway_url)
    return _origin(g.scheme, g.hostname or "", g.port), g.path.rstrip("/")


def _gateway_path(gateway_url: str, url: SplitResult) -> str | None:
    """The path of ``url`` below the gateway at ``gateway_url``, or None if ``url`` is not on it."""
    origin, prefix = _gateway_origin(gateway_url)
    if origin != _origin(url.scheme, url.hostname or "", url.port):
        return None
    if not prefix:
        return url.path
    if url.path == prefix or url.path.startswith(prefix + "/"):
        return url.path[len(prefix) :]
    return None


def targets_gateway(gateway_url: str, url: object) -> bool:
    """True when ``url`` (a string or any client's URL object) is on the gateway at ``gateway_url``
    (loopback names are treated as one host)."""
    return _gateway_path(gateway_url, urlsplit(str(url))) is not None


@contextmanager
def stamp(headers: HeaderMap, url: object) -> Iterator[None]:
    """``with stamp(request.headers, request.url): send it``: adds the current rollout's headers if the
    request goes to the scope's gateway and counts it on the scope's tally (see the module docstring),
    unless an outer patched client is already sending it."""
    if _SENDING.get():
        yield
        return
    _stamp(headers, url)
    token = _SENDING.set(True)
    try:
        yield
    finally:
        _SENDING.reset(token)


def _stamp(headers: HeaderMap, url: object) -> None:
    scope = current_rollout()
    if scope is None:
        return
    parts = urlsplit(str(url))
    path = _gateway_path(scope.config.gateway_url, parts)
    if path is None:
        if _LLM_CALL.search(parts.path):
            port = f":{parts.port}" if parts.port else ""
            scope.tally.call_elsewhere(f"{parts.scheme}://{parts.hostname}{port}")
        return
    for name, value in scope.headers().items():
        if name not in headers:
            headers[name] = value
    call = _GATEWAY_CALL.match(path)
    if call is None:
        scope.tally.touch()  # the control API (a reward), /v1/models, ...: the gateway is reachable
        return
    # the gateway attributes a call to the rollout in its path, else to the X-Rollout-Id header
    scope.tally.call(mine=(call["rid"] or headers.get("X-Rollout-Id")) == scope.rollout_id)


def _patch(name: str, module: ModuleType) -> None:
    if not getattr(getattr(module, "__spec__", None), "_initializing", False):
        PATCHERS[name](module, stamp)  # a module still being imported is patched by the hook when done


def _on_import(name: str, module: ModuleType) -> None:
    with _INSTALL_LOCK:
        PATCHERS[name](module, stamp)


def install() -> None:
    """Patch the supported HTTP clients already imported; patch the others when they are imported
    (idempotent, thread-safe, cheap: called at every scope entry)."""
    with _INSTALL_LOCK:
        ensure_import_hook(_on_import)
        for name in PATCHERS:
            module = sys.modules.get(name)
            if module is not None and not is_patched(name, module):
                _patch(name, module)


def instrumented() -> list[str]:
    """The supported HTTP client libraries imported and patched in this process."""
    return [n for n in PATCHERS if (m := sys.modules.get(n)) is not None and is_patched(n, m)]
