"""The gateway's one app factory. ``create_app(settings)`` returns a ``GatewayApp`` (FastAPI with the
ASGI front outermost) whose lifespan builds and owns everything a request needs (upstream client,
tokenizer, prefix cache, store, recorder, metrics registry) and tears it down on shutdown. Nothing here
imports torch."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tracegym.gateway.api import openapi
from tracegym.gateway.api import upstreams as upstreams_routes
from tracegym.gateway.api import weights as weights_routes
from tracegym.gateway.deps import GatewayMetrics, Recorder, Services, ServicesDep
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.proxy import completions_routes
from tracegym.gateway.proxy.admission import Admission
from tracegym.gateway.proxy.auth import Guard
from tracegym.gateway.proxy.front import INFERENCE_ROUTES, GatewayFront
from tracegym.gateway.proxy.responses import responses_routes
from tracegym.gateway.proxy.upstream.base import ModelInfo, Upstream
from tracegym.gateway.proxy.upstream.http import make_session
from tracegym.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from tracegym.gateway.proxy.prefix_lookup import PrefixLookup
    from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache
    from tracegym.gateway.traces.store import Store

log = logging.getLogger("tracegym.gateway")


class GatewayApp(FastAPI):
    """FastAPI with ``front.GatewayFront`` outside its own middleware stack: the one way into the gateway,
    whose inference routes skip every layer FastAPI and Starlette would add (see ``proxy/front.py``).

    FastAPI asks on every request whether an OpenTelemetry provider is configured for its own telemetry
    (environment lookups, ~3 % of the gateway's CPU per call); here that is asked once, at the first
    request, and without one the request goes straight to the middleware stack."""

    _no_native_telemetry: bool | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.middleware_stack is not None and not self.root_path:
            if self._no_native_telemetry is None:
                native = getattr(self, "_native_telemetry", None)
                self._no_native_telemetry = native is None or not native.enabled()
            if self._no_native_telemetry:
                scope["app"] = self
                await self.middleware_stack(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        return GatewayFront(super().build_middleware_stack(), INFERENCE_ROUTES)


def build_upstream(settings: GatewaySettings, session: aiohttp.ClientSession) -> Upstream:
    kind = settings.upstream_kind
    if kind in ("sglang", "openai") and not settings.upstream_url:
        raise ValueError(f"the {kind} upstream needs an upstream URL (--upstream / TRACEGYM_UPSTREAM_URL)")
    common = {"timeout": settings.upstream_timeout, "connect_timeout": settings.upstream_connect_timeout,
              "health_timeout": settings.health_timeout}
    if kind == "sglang":
        from tracegym.gateway.proxy.upstream.sglang import SGLangUpstream

        return SGLangUpstream(settings.upstream_url, session, api_key=settings.upstream_api_key,  # type: ignore[arg-type]
                              **common)
    if kind == "openai":
        from tracegym.gateway.proxy.upstream.openai import OpenAIUpstream

        return OpenAIUpstream(settings.upstream_url, session, api_key=settings.upstream_api_key,  # type: ignore[arg-type]
                              **common)
    if kind == "litellm":
        from tracegym.gateway.proxy.upstream.litellm import LiteLLMUpstream

        if not settings.model:
            raise ValueError("the litellm upstream needs --model (the litellm model name, e.g. openai/gpt-4o)")
        return LiteLLMUpstream(settings.model, api_base=settings.upstream_url, api_key=settings.upstream_api_key,
                               timeout=settings.upstream_timeout)
    raise ValueError(f"unknown upstream kind {kind!r}; expected sglang, openai or litellm")


def build_fleet(settings: GatewaySettings, session: aiohttp.ClientSession) -> Upstream:
    """One adapter per upstream URL (``upstream_url`` then ``upstream_urls``) behind one
    ``fleet.UpstreamFleet``; a litellm upstream (a provider, not engines) stays as it is."""
    from tracegym.gateway.proxy.upstream.fleet import UpstreamFleet

    urls = [u for u in (settings.upstream_url, *settings.upstream_urls) if u]
    if settings.upstream_kind == "litellm" or len(urls) <= 1:
        adapters = [(urls[0] if urls else settings.upstream_kind, build_upstream(settings, session))]
    else:
        adapters = [(u, build_upstream(settings.model_copy(update={"upstream_url": u, "upstream_urls": []}),
                                       session)) for u in urls]
    if settings.upstream_kind == "litellm":
        return adapters[0][1]
    return UpstreamFleet(adapters, health_interval_s=settings.upstream_health_interval_s,
                         health_timeout=settings.health_timeout)


def tokenizer_dir(settings: GatewaySettings, info: ModelInfo | None) -> Path | None:
    """Where the tokenizer and chat template live: explicit path, the model name, or the upstream's."""
    from tracegym.models import find_local_model_dir

    if settings.tokenizer_path:
        p = Path(settings.tokenizer_path).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"tokenizer_path {p} is not a directory")
        return p
    if settings.model:
        found = find_local_model_dir(settings.model)
        if found is not None:
            return found
    if info is not None and info.tokenizer_path:
        found = find_local_model_dir(info.tokenizer_path)
        if found is not None:
            return found
    return None


async def _resolve_model(settings: GatewaySettings, upstream: Upstream) -> tuple[str, Path | None]:
    info = None
    if upstream.kind != "litellm" and (settings.model is None or
                                       (settings.tokenizer_path is None and _needs_info(settings))):
        info = await upstream.model_info()
    served = settings.model or (info.served_model_name if info else None)
    if not served:
        raise ValueError("no model name: pass --model, or use an upstream whose /model_info reports one")
    tdir = tokenizer_dir(settings, info)
    if tdir is None and upstream.token_native:
        raise FileNotFoundError(
            f"no tokenizer found for model {served!r} (tried --model {settings.model!r} and the upstream's "
            f"tokenizer_path {info.tokenizer_path if info else None!r}); pass a local directory with "
            "tokenizer.json/tokenizer_config.json as --model or TRACEGYM_TOKENIZER_PATH"
        )
    return served, tdir


def _needs_info(settings: GatewaySettings) -> bool:
    from tracegym.models import find_local_model_dir

    return settings.model is not None and find_local_model_dir(settings.model) is None


def _open_store(settings: GatewaySettings, recorder: Recorder | None, registry: CollectorRegistry,
                in_flight: Callable[[], int]) -> tuple[Any, Recorder | None]:
    """The store and its recorder; ``in_flight``: the inference calls in the gateway now (commit groups)."""
    if not settings.store_url:
        return None, recorder
    from tracegym.gateway.traces.store import Store

    store = Store.open(settings.store_url)
    if recorder is None:
        from tracegym.gateway.traces.recorder import TraceRecorder

        recorder = TraceRecorder(store, registry=registry, commit_delay_s=settings.commit_delay_s,
                                 in_flight=in_flight)
    return store, recorder


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: GatewaySettings, injected: Recorder | None) -> AsyncIterator[None]:
    registry = CollectorRegistry()
    app.state.metrics_registry = registry
    session = make_session(settings.upstream_max_connections)
    upstream = store = recorder = None
    switch_interval = sys.getswitchinterval()
    try:
        upstream = build_fleet(settings, session)
        await upstream.start()
        served, tdir = await _resolve_model(settings, upstream)
        tokenizer = prefix = None
        if tdir is not None:
            from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

            tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, tdir, chat_format=settings.chat_format)
        admission = app.state.admission
        store, recorder = await asyncio.to_thread(_open_store, settings, injected, registry,
                                                  lambda: admission.active)
        if tokenizer is not None and upstream.token_native:
            from tracegym.gateway.proxy.prompt.prefix_reuse import PrefixCache

            prefix = PrefixCache(tokenizer)
        app.state.store, app.state.recorder = store, recorder
        app.state.swap = _swap_coordinator(upstream, store)
        metrics = GatewayMetrics(registry)
        prefix_lookup = app.state.prefix_lookup = _prefix_lookup(settings, store, prefix, metrics)
        app.state.services = Services(
            settings=settings, upstream=upstream, served_model=served, tokenizer=tokenizer, prefix=prefix,
            recorder=recorder, metrics=metrics, created=int(time.time()), store=store,
            prefix_lookup=prefix_lookup,
        )
        log.info("gateway serving %r via %s upstream %s (tokenizer %s, store %s, %s)", served, upstream.kind,
                 settings.upstream_url, tdir, _redacted(settings.store_url),
                 "admin key set" if settings.admin_key else "no admin key")
        if settings.switch_interval_s is not None:
            sys.setswitchinterval(settings.switch_interval_s)
        if settings.freeze_gc:
            gc.collect()
            gc.freeze()
        yield
    finally:
        if getattr(app.state, "swap", None) is not None:
            await app.state.swap.close()
        if getattr(app.state, "prefix_lookup", None) is not None:
            app.state.prefix_lookup.close()
        if upstream is not None:
            await upstream.close()
        await session.close()
        if recorder is not None:
            await asyncio.to_thread(recorder.shutdown)
        if store is not None:
            await asyncio.to_thread(store.close)
        sys.setswitchinterval(switch_interval)


def _prefix_lookup(settings: GatewaySettings, store: Store | None, prefix: PrefixCache | None,
                    metrics: GatewayMetrics) -> PrefixLookup | None:
    """The store lookup of prefix parents on a cache miss (``proxy/prefix_lookup.py``): on every store, SQLite
    included (it finds the calls of a rollout served before a restart); None without a prefix cache or a
    store, or with ``prefix_lookup_timeout_s`` 0."""
    if prefix is None or store is None or not settings.prefix_lookup_timeout_s:
        return None
    from tracegym.gateway.proxy.prefix_lookup import PrefixLookup

    return PrefixLookup(store, metrics, timeout_s=settings.prefix_lookup_timeout_s)


def _redacted(url: str | None) -> str | None:
    """A store URL without its password, for the log."""
    if not url or "@" not in url:
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _swap_coordinator(upstream: Upstream, store: Any) -> Any:
    """The one owner of weight swaps (``/api/weights/...``: disk and distributed) for SGLang-protocol
    upstreams; None for the others."""
    if not getattr(upstream, "swappable", False):  # a fleet of SGLang-protocol engines
        return None
    from tracegym.gateway.proxy.upstream.swap import SwapCoordinator

    return SwapCoordinator(upstream, store)


def _include_store_routers(app: FastAPI) -> None:
    from tracegym.gateway.api import control, imports, otlp, trajectories, ui

    for module in (control, imports, otlp, trajectories):
        app.include_router(module.router)
    ui.install(app)


def create_app(settings: GatewaySettings | None = None, *, recorder: Recorder | None = None) -> GatewayApp:
    """The gateway app. ``recorder`` replaces the store-backed TraceRecorder (tests)."""
    settings = settings or GatewaySettings()
    app = GatewayApp(title="tracegym gateway", lifespan=lambda a: _lifespan(a, settings, recorder),
                  docs_url="/docs", redoc_url=None)
    app.state.max_body_bytes = settings.max_body_bytes
    app.state.guard = Guard(settings.admin_key, settings.allowed_hosts, settings.auth_failures_per_minute)
    app.state.admission = Admission(settings)
    install_error_handlers(app)
    app.include_router(completions_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(weights_routes.router)
    app.include_router(upstreams_routes.router)
    if settings.store_url:
        _include_store_routers(app)

    @app.get("/healthz")
    async def healthz(svc: ServicesDep) -> Response:
        upstream = await svc.upstream.health()
        # open to anyone: where the engine listens (its URL, also in a connection error) is not theirs to know
        upstream = {k: v for k, v in upstream.items() if k in ("reachable", "status_code")}
        body = {"status": "ok", "model": svc.served_model, "upstream_kind": svc.upstream.kind,
                "upstream": upstream, "recording": svc.recorder is not None}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(svc: ServicesDep) -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    openapi.install(app)
    return app
