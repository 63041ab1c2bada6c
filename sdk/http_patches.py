"""One patch per HTTP client library, so every request it sends passes through a ``stamp`` callback
first; and an import hook that patches a library the moment it is imported.

The libraries (``PATCHERS``, by module name) and where each is hooked:

- ``httpx`` and ``httpx2`` (its successor, which the OpenAI SDK 3.x and the Anthropic SDK send through):
  ``Client.send`` / ``AsyncClient.send``, which every request of every client goes through, whatever
  its transport (the SDKs' aiohttp-backed clients are ``httpx2.AsyncClient`` subclasses too).
- ``requests``: ``Session.send``, which ``requests.get``, sessions and redirects all go through.
- ``aiohttp``: ``ClientSession._request``, which ``request``/``get``/``post``/``aiohttp.request`` all
  go through. It is private but has kept its name and keyword-only signature since aiohttp 1.x; the
  hooks aiohttp offers publicly (tracing signals, middlewares) are set per session, too late for
  sessions the agent's framework creates itself.

Nothing here imports a client library: a patch receives the module once it is imported (``install``
in ``tracegym.instrument`` decides when). Each patch sends the request inside ``with stamp(headers,
url):``, which may add headers first; it is handed the request's case-insensitive header mapping (for
aiohttp, one that also sees the session's default headers, so a default the caller set is not
overridden). The ``with`` lets ``stamp`` see that a request is already being sent by an outer client:
an SDK's aiohttp transport under ``httpx2`` is one request, not two.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Protocol

MARK = "__tracegym_instrumented__"


class HeaderMap(Protocol):
    """What ``stamp`` needs of a request's headers (case-insensitive in every library)."""

    def __contains__(self, name: object) -> bool: ...
    def __setitem__(self, name: str, value: str) -> None: ...
    def get(self, name: str, default: Any = None) -> Any: ...


Stamp = Callable[[HeaderMap, object], AbstractContextManager[None]]


def _marked(fn: Any) -> bool:
    return bool(getattr(fn, MARK, False))


def _mark(fn: Any) -> Any:
    setattr(fn, MARK, True)
    return fn


def _patch_httpx_like(module: ModuleType, stamp: Stamp) -> bool:
    """``httpx`` or ``httpx2`` (same API): wrap ``Client.send`` and ``AsyncClient.send``."""
    client, aclient = getattr(module, "Client", None), getattr(module, "AsyncClient", None)
    if client is None or aclient is None:
        return False
    if _marked(client.send):
        return True
    sync_send, async_send = client.send, aclient.send

    @functools.wraps(sync_send)
    def send(self: Any, request: Any, **kw: Any) -> Any:
        with stamp(request.headers, request.url):
            return sync_send(self, request, **kw)

    @functools.wraps(async_send)
    async def asend(self: Any, request: Any, **kw: Any) -> Any:
        with stamp(request.headers, request.url):
            return await async_send(self, request, **kw)

    aclient.send = _mark(asend)
    client.send = _mark(send)  # last: its mark says the whole module is done
    return True


def _patch_requests(module: ModuleType, stamp: Stamp) -> bool:
    """``requests``: wrap ``Session.send`` (the prepared request has its final URL and headers)."""
    session = getattr(module, "Session", None)
    if session is None:
        return False
    if _marked(session.send):
        return True
    original = session.send

    @functools.wraps(original)
    def send(self: Any, request: Any, **kw: Any) -> Any:
        with stamp(request.headers, request.url):
            return original(self, request, **kw)

    session.send = _mark(send)
    return True


class _SessionHeaders:
    """An aiohttp request's own headers, looked up over the session's default headers (which aiohttp
    merges later): a name set in either counts as set by the caller; additions go to the request's."""

    def __init__(self, own: Any, defaults: Any) -> None:
        self.own, self.defaults = own, defaults

    def __contains__(self, name: object) -> bool:
        return name in self.own or name in self.defaults

    def __setitem__(self, name: str, value: str) -> None:
        self.own[name] = value

    def get(self, name: str, default: Any = None) -> Any:
        return self.own.get(name, self.defaults.get(name, default))


def _patch_aiohttp(module: ModuleType, stamp: Stamp) -> bool:
    """``aiohttp``: wrap ``ClientSession._request`` and pass it the stamped headers."""
    session = getattr(module, "ClientSession", None)
    if session is None or not hasattr(session, "_request"):
        return False
    if _marked(session._request):
        return True
    original = session._request

    @functools.wraps(original)
    async def _request(self: Any, method: str, str_or_url: Any, **kw: Any) -> Any:
        from multidict import CIMultiDict  # aiohttp's own dependency, loaded with it
        from yarl import URL

        build = getattr(self, "_build_url", None)  # joins the session's base_url (aiohttp >= 3.8)
        url = build(str_or_url) if build is not None else URL(str_or_url)
        own = CIMultiDict(kw.get("headers") or {})
        before = len(own)
        with stamp(_SessionHeaders(own, self.headers), url):
            if len(own) != before:  # leave the caller's argument untouched when nothing was added
                kw["headers"] = own
            return await original(self, method, str_or_url, **kw)

    session._request = _mark(_request)
    return True


PATCHERS: dict[str, Callable[[ModuleType, Stamp], bool]] = {
    "httpx": _patch_httpx_like,
    "httpx2": _patch_httpx_like,
    "requests": _patch_requests,
    "aiohttp": _patch_aiohttp,
}


# the (class, method) whose mark tells that a library is patched (for httpx-like ones, the last patched)
_PATCH_POINTS = {"requests": ("Session", "send"), "aiohttp": ("ClientSession", "_request")}


def is_patched(name: str, module: ModuleType) -> bool:
    """Whether ``module`` (one of ``PATCHERS``) carries our patch."""
    cls_name, method = _PATCH_POINTS.get(name, ("Client", "send"))
    cls = getattr(module, cls_name, None)
    return cls is not None and _marked(getattr(cls, method, None))


# -- patch on import ---------------------------------------------------------------------------------------
class _PatchingLoader:
    """Delegates to the real loader, then hands the executed module to ``on_import``."""

    def __init__(self, loader: Any, on_import: Callable[[str, ModuleType], None]) -> None:
        self._loader, self._on_import = loader, on_import

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._on_import(module.__name__, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code, ...
        return getattr(self._loader, name)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that lets the other finders find ``names`` and wraps their loader, so a
    library first imported inside a rollout scope (``from anthropic import Anthropic`` in the agent
    function) is patched before the scope's first request, not at the next scope."""

    def __init__(self, names: Sequence[str], on_import: Callable[[str, ModuleType], None]) -> None:
        self.names = frozenset(names)
        self.on_import = on_import

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self.on_import)
                return spec
        return None


def ensure_import_hook(on_import: Callable[[str, ModuleType], None]) -> None:
    """Put one ``PatchOnImport`` for ``PATCHERS`` first on ``sys.meta_path`` (no-op if there is one).
    Call it under the install lock."""
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(list(PATCHERS), on_import))
