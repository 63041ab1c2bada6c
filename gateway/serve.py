"""``tracegym serve``: the gateway under uvicorn (uvloop + httptools, one worker), in front of an
upstream URL, or of the embedded engine started as a child process (``--engine embedded``).

The engine child runs ``tracegym engine --model NAME --port P`` in its own process group (it also gets
SIGTERM if this process dies, via PR_SET_PDEATHSIG on Linux) and is stopped when the gateway exits.
``--store none`` turns recording off (no store, no control API)."""

from __future__ import annotations

import argparse
import logging
import os

from tracegym.gateway.settings import SERVE_SWITCH_INTERVAL_S, GatewaySettings
from tracegym.procs import free_port, start_process

log = logging.getLogger("tracegym.gateway")


def settings_from_args(args: argparse.Namespace, upstream_url: str | None, kind: str) -> GatewaySettings:
    store = None if args.store in ("", "none") else args.store
    return GatewaySettings(
        upstream_url=upstream_url, upstream_kind=kind, model=args.model, store_url=store,
        max_body_bytes=args.max_body_bytes, upstream_timeout=args.upstream_timeout, freeze_gc=True,
        switch_interval_s=SERVE_SWITCH_INTERVAL_S,
    )


def _check_args(args: argparse.Namespace) -> None:
    if args.engine == "embedded":
        if args.upstream:
            raise SystemExit("tracegym serve: --engine embedded and --upstream are mutually exclusive")
        if not args.model:
            raise SystemExit("tracegym serve: --engine embedded needs --model NAME")
    elif not args.upstream and args.upstream_kind != "litellm":
        raise SystemExit("tracegym serve: pass --upstream URL (or --engine embedded --model NAME)")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from tracegym.gateway.app import create_app
    from tracegym.gateway.fastpath import HotFront
    from tracegym.gateway.routes.openai import HOT_ROUTES

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_args(args)
    engine = None
    upstream, kind = args.upstream, args.upstream_kind
    try:
        if args.engine == "embedded":
            port = args.engine_port or free_port()
            engine = start_process(
                ["tracegym", "engine", "--model", args.model, "--port", str(port), "--log-level", args.log_level],
                port=port, log_path=None, health_path="/health", name="the embedded engine",
                timeout=float(os.environ.get("TRACEGYM_ENGINE_START_TIMEOUT", "900")),
            )
            upstream, kind = engine.base_url, "sglang"
        app = create_app(settings_from_args(args, upstream, kind))
        uvicorn.run(HotFront(app, HOT_ROUTES), host=args.host, port=args.port, loop="uvloop", http="httptools",
                    log_level=args.log_level.lower(), access_log=False, lifespan="on", timeout_graceful_shutdown=10,
                    proxy_headers=False)
    finally:
        if engine is not None:
            engine.stop()
    return 0
