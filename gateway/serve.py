"""``tracegym serve``: the gateway under uvicorn (uvloop + httptools, one worker), in front of an
upstream URL, or of the embedded engine started as a child process (``--engine embedded``).

The engine child runs ``tracegym engine --model NAME --port P`` in its own process group (it also gets
SIGTERM if this process dies, via PR_SET_PDEATHSIG on Linux) and is stopped when the gateway exits.
``--store none`` turns recording off (no store, no control API)."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tracegym.gateway.settings import GatewaySettings

log = logging.getLogger("tracegym.gateway")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the gateway process dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return


class EngineProcess:
    """The embedded engine as a child process on ``port``."""

    def __init__(self, model: str, port: int, log_level: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "tracegym.cli", "engine", "--model", model, "--port", str(port),
                "--log-level", log_level]
        self.proc = subprocess.Popen(argv, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the embedded engine exited with code {self.proc.returncode} before it "
                                   "became healthy (see its output above)")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the embedded engine at {self.url} was not healthy after {timeout:g}s")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            return


def settings_from_args(args: argparse.Namespace, upstream_url: str | None, kind: str) -> GatewaySettings:
    store = None if args.store in ("", "none") else args.store
    return GatewaySettings(
        upstream_url=upstream_url, upstream_kind=kind, model=args.model, store_url=store,
        max_body_bytes=args.max_body_bytes, upstream_timeout=args.upstream_timeout,
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
            engine = EngineProcess(args.model, args.engine_port or _free_port(), args.log_level)
            engine.wait_healthy(timeout=float(os.environ.get("TRACEGYM_ENGINE_START_TIMEOUT", "900")))
            upstream, kind = engine.url, "sglang"
        app = create_app(settings_from_args(args, upstream, kind))
        uvicorn.run(HotFront(app, HOT_ROUTES), host=args.host, port=args.port, loop="uvloop", http="httptools",
                    log_level=args.log_level.lower(), access_log=False, lifespan="on", timeout_graceful_shutdown=10,
                    proxy_headers=False)
    finally:
        if engine is not None:
            engine.stop()
    return 0
