"""The gateway's one app factory. ``create_app(settings)`` returns a FastAPI app whose lifespan builds
and owns everything a request needs (upstream client, tokenizer, prefix cache, store, recorder,
metrics registry) and tears it down on shutdown. Nothing here imports torch."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from tracegym.gateway.deps import GatewayMetrics, Recorder, Services, ServicesDep
from tracegym.gateway.errors import install_error_handlers
from tracegym.gateway.fastpath import GatewayMiddleware
from tracegym.gateway.routes import openai as openai_routes
from tracegym.gateway.routes import weights as weights_routes
from tracegym.gateway.settings import GatewaySettings
from tracegym.gateway.upstream.base import ModelInfo, Upstream
from tracegym.gateway.upstream.http import make_session

log = logging.getLogger("tracegym.gateway")

def build_upstream(settings: GatewaySettings, session: aiohttp.ClientSession) -> Upstream:
    kind = settings.upstream_kind
    if kind in ("sglang", "openai") and not settings.upstream_url:
        raise ValueError(f"the {kind} upstream needs an upstream URL (--upstream / TRACEGYM_UPSTREAM_URL)")
    common = {"timeout": settings.upstream_timeout, "connect_timeout": settings.upstream_connect_timeout,
              "health_timeout": settings.health_timeout}
    if kind == "sglang":
        from tracegym.gateway.upstream.sglang import SGLangUpstream

        return SGLangUpstream(settings.upstream_url, session, **common)  # type: ignore[arg-type]
    if kind == "openai":
        from tracegym.gateway.upstream.openai import OpenAIUpstream

        return OpenAIUpstream(settings.upstream_url, session, api_key=settings.upstream_api_key,  # type: ignore[arg-type]
                              **common)
    if kind == "litellm":
        from tracegym.gateway.upstream.litellm import LiteLLMUpstream

        if not settings.model:
            raise ValueError("the litellm upstream needs --model (the litellm model name, e.g. openai/gpt-4o)")
        return LiteLLMUpstream(settings.model, api_base=settings.upstream_url, api_key=settings.upstream_api_key,
                               timeout=settings.upstream_timeout)
    raise ValueError(f"unknown upstream kind {kind!r}; expected sglang, openai or litellm")


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


def _open_store(settings: GatewaySettings, recorder: Recorder | None,
                registry: CollectorRegistry) -> tuple[Any, Recorder | None]:
    if not settings.store_url:
        return None, recorder
    from tracegym.gateway.store import Store

    store = Store.open(settings.store_url)
    if recorder is None:
        from tracegym.gateway.tracing import TraceRecorder

        recorder = TraceRecorder(store, registry=registry)
    return store, recorder


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: GatewaySettings, injected: Recorder | None) -> AsyncIterator[None]:
    registry = CollectorRegistry()
    app.state.metrics_registry = registry
    session = make_session(settings.upstream_max_connections)
    upstream = store = recorder = None
    switch_interval = sys.getswitchinterval()
    try:
        upstream = build_upstream(settings, session)
        await upstream.start()
        served, tdir = await _resolve_model(settings, upstream)
        tokenizer = prefix = None
        if tdir is not None:
            from tracegym.gateway.templating import ChatTokenizer

            tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, tdir)
        store, recorder = await asyncio.to_thread(_open_store, settings, injected, registry)
        if tokenizer is not None and upstream.token_native:
            from tracegym.gateway.prefix import PrefixCache

            prefix = PrefixCache(tokenizer, loader=store.list_call_records if store is not None else None)
        app.state.store, app.state.recorder = store, recorder
        app.state.swap = _swap_coordinator(upstream, store)
        app.state.services = Services(
            settings=settings, upstream=upstream, served_model=served, tokenizer=tokenizer, prefix=prefix,
            recorder=recorder, metrics=GatewayMetrics(registry), created=int(time.time()),
        )
        log.info("gateway serving %r via %s upstream %s (tokenizer %s, store %s)", served, upstream.kind,
                 settings.upstream_url, tdir, settings.store_url)
        if settings.switch_interval_s is not None:
            sys.setswitchinterval(settings.switch_interval_s)
        if settings.freeze_gc:
            gc.collect()
            gc.freeze()
        yield
    finally:
        if upstream is not None:
            await upstream.close()
        await session.close()
        if recorder is not None:
            await asyncio.to_thread(recorder.shutdown)
        if store is not None:
            await asyncio.to_thread(store.close)
        sys.setswitchinterval(switch_interval)


def _swap_coordinator(upstream: Upstream, store: Any) -> Any:
    """Weight hot-swap (``/api/weights/update``) for SGLang-protocol upstreams; None for the others."""
    from tracegym.gateway.upstream.sglang import SGLangUpstream

    if not isinstance(upstream, SGLangUpstream):
        return None
    from tracegym.gateway.swap import SwapCoordinator

    return SwapCoordinator(upstream, store)


def _include_store_routers(app: FastAPI) -> None:
    from tracegym.gateway.routes import control, otlp, trajectories

    for module in (control, otlp, trajectories):
        app.include_router(module.router)


def create_app(settings: GatewaySettings | None = None, *, recorder: Recorder | None = None) -> FastAPI:
    """The gateway app. ``recorder`` replaces the store-backed TraceRecorder (tests)."""
    settings = settings or GatewaySettings()
    app = FastAPI(title="tracegym gateway", lifespan=lambda a: _lifespan(a, settings, recorder),
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(GatewayMiddleware, routes=openai_routes.HOT_ROUTES)
    app.include_router(openai_routes.router)
    app.include_router(weights_routes.router)
    if settings.store_url:
        _include_store_routers(app)

    @app.get("/healthz")
    async def healthz(svc: ServicesDep) -> Response:
        upstream = await svc.upstream.health()
        body = {"status": "ok", "model": svc.served_model, "upstream_kind": svc.upstream.kind,
                "upstream": upstream, "recording": svc.recorder is not None}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/metrics")
    async def metrics(svc: ServicesDep) -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
