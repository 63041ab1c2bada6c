"""``tracegym engine``: the embedded engine as an HTTP server. ``create_app`` wires the routes
(``routes.py``) to an ``Engine`` owned by the app's lifespan; ``main`` is the CLI."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tracegym.engine.endpoints import router
from tracegym.engine.runtime import Engine, EngineConfig, set_torch_threads

log = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(app: FastAPI, config: EngineConfig) -> AsyncIterator[None]:
    """Load the model and start the model thread; stop it (failing whatever is left) on shutdown."""
    engine = Engine(config)
    engine.start()
    app.state.engine = engine
    log.info(
        "engine ready: %s on %s (weight_version=%s)", config.model_path, engine.device, config.weight_version
    )
    try:
        yield
    finally:
        engine.stop()


def create_app(config: EngineConfig, api_key: str | None = None) -> FastAPI:
    """``api_key`` (default ``$TRACEGYM_ENGINE_API_KEY``): what the weight, pause and abort routes need."""
    app = FastAPI(title="tracegym engine", lifespan=lambda a: _lifespan(a, config))
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
    app = create_app(config)
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
