"""``tracegym engine``: the embedded engine as an HTTP server. ``create_app`` wires the routes
(``routes.py``) to an ``Engine`` owned by the app's lifespan; ``main`` is the CLI."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tracegym.engine.endpoints import router
from tracegym.engine.runtime import Engine, EngineConfig, set_torch_threads
from tracegym.http_rules import LOOPBACK_HOSTS, host_allowed, json_body_refused
from tracegym.modelfiles.cpu_threads import in_own_thread

log = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(app: FastAPI, config: EngineConfig) -> AsyncIterator[None]:
    """Load the model (in a thread of its own: ``modelfiles.cpu_threads``) and start the model thread; stop
    it (failing whatever is left) on shutdown."""
    engine = await in_own_thread(Engine, config)
    engine.start()
    app.state.engine = engine
    log.info(
        "engine ready: %s on %s (weight_version=%s)", config.model_path, engine.device, config.weight_version
    )
    try:
        yield
    finally:
        engine.stop()


class HttpRules:
    """The gateway's Host and Content-Type rules (``tracegym.http_rules``; docs/security.md), in front of
    every route: with an allow-list, any other ``Host`` (or two of them) is a 421, so a web page whose DNS
    name was rebound to 127.0.0.1 cannot drive ``/generate``; a body that is not JSON is a 415."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str] | None = None) -> None:
        self.app = app
        self.hosts = None if allowed_hosts is None else frozenset(h.lower().encode() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            refusal = None
            if self.hosts is not None and not host_allowed(headers, self.hosts):
                refusal = (421, "Host not allowed: this engine answers only its allowed host names "
                                "(TRACEGYM_ENGINE_ALLOWED_HOSTS)")
            elif json_body_refused(scope["method"], headers):
                refusal = (415, "Content-Type must be application/json")
            if refusal is not None:
                status, message = refusal
                await JSONResponse({"error": {"message": message, "code": status}}, status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def allowed_hosts(bind_host: str) -> list[str] | None:
    """The engine's Host allow-list: on a loopback address the loopback names, plus any in
    ``$TRACEGYM_ENGINE_ALLOWED_HOSTS`` (comma-separated; also the whole list on another address, where
    without it any Host is answered, as behind a service name in a container network)."""
    extra = [h.strip() for h in os.environ.get("TRACEGYM_ENGINE_ALLOWED_HOSTS", "").split(",") if h.strip()]
    if bind_host.strip("[]") in ("127.0.0.1", "localhost", "::1"):
        return [*LOOPBACK_HOSTS, *extra]
    return extra or None


def create_app(config: EngineConfig, api_key: str | None = None, hosts: list[str] | None = None) -> FastAPI:
    """``api_key`` (default ``$TRACEGYM_ENGINE_API_KEY``): what the weight, pause and abort routes need;
    ``hosts``: the ``Host`` allow-list (None: any; ``main`` gives ``allowed_hosts(--host)``)."""
    app = FastAPI(title="tracegym engine", lifespan=lambda a: _lifespan(a, config))
    app.add_middleware(HttpRules, allowed_hosts=hosts)
    app.state.api_key = api_key or os.environ.get("TRACEGYM_ENGINE_API_KEY") or None
    app.state.weights_root = os.environ.get("TRACEGYM_ENGINE_WEIGHTS_DIR") or None
    """Where the engine loads weights and adapters from (None: anywhere); the gateway's ``--weights-dir``
    is the jail users see, this one keeps an engine to the volume it was given."""
    app.include_router(router)
    return app


def main(args: argparse.Namespace) -> int:
    """``tracegym engine --model NAME --port 30000``."""
    import uvicorn

    from tracegym.modelfiles.prepare import prepare_model

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = set_torch_threads()
    path = prepare_model(args.model)
    log.info("serving %s from %s with %d torch threads", args.model, path, threads)
    config = EngineConfig(
        model_path=path,
        served_model_name=args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
    )
    app = create_app(config, hosts=allowed_hosts(args.host))
    if app.state.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("engine bound to %s with no TRACEGYM_ENGINE_API_KEY: anyone who reaches the port can load "
                    "weights and pause it", args.host)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
