"""A gateway that only browses a store: the trace inspector (``/ui`` and the JSON routes it reads) over a
finished run's store, with no upstream and nothing that writes. ``tracegym inspect RUN_DIR`` serves it, and
so does ``tracegym serve --store URL`` without an upstream.

It is the gateway's front and guard (keys, Host allow-list, request metrics) around the inspector and the
control and trajectory API's reads (``GET``: rollouts, their spans and trajectories, weight versions, run
metrics; so ``tracegym export`` reads a finished run): no inference routes, no writes, no OTLP ingest, no
weight routes. The tokenizer that shows tokens as
text comes from ``--model`` or, for a run directory, from the last weights the run wrote."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.responses import Response
from starlette.types import ASGIApp

from tracegym.errors import UserError
from tracegym.gateway.api import control, trajectories, ui
from tracegym.gateway.app import _redacted
from tracegym.gateway.deps import GatewayMetrics, Services
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.proxy.auth import Guard
from tracegym.gateway.proxy.front import GatewayFront
from tracegym.gateway.proxy.upstream.base import Upstream
from tracegym.gateway.settings import GatewaySettings

log = logging.getLogger("tracegym.gateway")

NO_UPSTREAM = "none: this gateway browses a store (tracegym inspect); it serves no model"


class BrowseApp(FastAPI):
    """FastAPI behind the gateway's front (guard and request metrics), with no inference route."""

    def build_middleware_stack(self) -> ASGIApp:
        return GatewayFront(super().build_middleware_stack(), {})


class NoUpstream(Upstream):
    """The upstream of a gateway that browses a store: the system page reports it as absent."""

    kind = "none"
    token_native = False

    async def generate(self, req: Any) -> Any:
        raise RuntimeError("no upstream: this gateway only browses a store")

    def stream(self, req: Any) -> Any:
        raise RuntimeError("no upstream: this gateway only browses a store")

    async def model_info(self) -> Any:
        raise RuntimeError("no upstream: this gateway only browses a store")

    async def health(self) -> dict[str, Any]:
        return {"reachable": False, "status": NO_UPSTREAM}

    async def close(self) -> None:
        return None


def run_store(run_dir: Path) -> tuple[str, Path]:
    """The store URL of a run directory (``runs/NAME`` means its ``latest`` run) and the run directory
    itself; a ``UserError`` when it holds no store."""
    d = run_dir.expanduser()
    if (d / "latest").is_dir() and not (d / "tracegym.db").is_file():
        d = d / "latest"
    db = d / "tracegym.db"
    if not d.is_dir():
        raise UserError(f"no run directory at {d.resolve()}",
                        "pass a run directory (runs/NAME/TIME, or runs/NAME for its latest run), or a store "
                        "with tracegym serve --store URL")
    if not db.is_file():
        raise UserError(f"{d.resolve()} holds no tracegym.db (a run whose recipe sets `store` elsewhere?)",
                        "browse that store with tracegym serve --store URL")
    return f"sqlite:///{db.resolve()}", d.resolve()


def run_tokenizer(run_dir: Path) -> Path | None:
    """The newest ``weights/v<N>/`` (or adapters' base) of a run directory that holds a tokenizer, else its
    ``tokenizer/`` (what a run that keeps no weights leaves, recipe ``keep: none``)."""
    found = [p.parent for p in (run_dir / "weights").glob("**/tokenizer.json")]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    return run_dir / "tokenizer" if (run_dir / "tokenizer" / "tokenizer.json").is_file() else None


def browse_settings(store_url: str, model: str | None, security: dict[str, Any]) -> GatewaySettings:
    return GatewaySettings(store_url=store_url, model=model, upstream_kind="openai", **security)


def _reads(*routers: APIRouter) -> APIRouter:
    """The routes of ``routers`` that only read (``GET``), in one router."""
    reads = APIRouter()
    reads.routes.extend(r for router in routers for r in router.routes
                        if isinstance(r, APIRoute) and r.methods == {"GET"})
    return reads


def create_browse_app(settings: GatewaySettings, tokenizer_dir: Path | None) -> BrowseApp:
    """The read-only inspector over ``settings.store_url`` (see the module docstring)."""
    if not settings.store_url:
        raise ValueError("a browsing gateway needs a store")
    app = BrowseApp(title="tracegym inspector", lifespan=lambda a: _lifespan(a, settings, tokenizer_dir),
                    docs_url=None, redoc_url=None)
    app.state.max_body_bytes = settings.max_body_bytes
    app.state.guard = Guard(settings.admin_key, settings.allowed_hosts, settings.auth_failures_per_minute)
    install_error_handlers(app)
    ui.install(app)
    app.include_router(_reads(control.router, trajectories.router))

    @app.get("/healthz")
    async def healthz() -> Response:
        body = {"status": "ok", "model": None, "upstream_kind": "none", "recording": False, "browsing": True}
        return Response(orjson.dumps(body), media_type="application/json")

    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: GatewaySettings, tokenizer_dir: Path | None) -> AsyncIterator[None]:
    from tracegym.gateway.traces.store import Store

    store = await asyncio.to_thread(Store.open, settings.store_url)
    try:
        tokenizer = None
        if tokenizer_dir is not None:
            from tracegym.gateway.proxy.prompt.templating import ChatTokenizer

            tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, tokenizer_dir, chat_format=settings.chat_format)
        app.state.store = store
        app.state.services = Services(
            settings=settings, upstream=NoUpstream(), served_model=settings.model or "none", tokenizer=tokenizer,
            prefix=None, recorder=None, metrics=GatewayMetrics(CollectorRegistry()), created=int(time.time()),
            store=store,
        )
        log.info("browsing the store %s read-only (no upstream; tokens as text: %s)", _redacted(settings.store_url),
                 tokenizer_dir or "no tokenizer, ids only")
        yield
    finally:
        await asyncio.to_thread(store.close)
