"""``tracegym serve``: the gateway under uvicorn (uvloop + httptools, one worker), in front of an
upstream URL, or of the embedded engine started as a child process (``--engine embedded``).

The engine child runs ``tracegym engine --model NAME --port P`` in its own process group (it also gets
SIGTERM if this process dies, via PR_SET_PDEATHSIG on Linux) and is stopped when the gateway exits.
``--store none`` turns recording off (no store, no control API).

Security (docs/security.md): with no admin key (``--admin-key``, env ``TRACEGYM_ADMIN_KEY``) the gateway
binds loopback only; a non-loopback ``--host`` without a key is refused unless ``--insecure``. On a loopback
address the ``Host`` header must be a loopback name or an ``--allowed-host``. The embedded engine child gets
a fresh random key for its weight and pause routes, which only this gateway knows."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

from tracegym.gateway.serve_checks import StartupFailure, preflight, start_embedded
from tracegym.gateway.settings import SERVE_SWITCH_INTERVAL_S, GatewaySettings

log = logging.getLogger("tracegym.gateway")


DEFAULT_STORE = "sqlite:///./tracegym.db"


def store_url(args: argparse.Namespace) -> str | None:
    """``--store``, else ``$TRACEGYM_STORE_URL``, else a SQLite file in the current directory (None:
    ``none``, recording off); with ``--store-password-file``, the URL with that file's password."""
    url = getattr(args, "store", None) or os.environ.get("TRACEGYM_STORE_URL") or DEFAULT_STORE
    if url in ("", "none"):
        return None
    password_file = getattr(args, "store_password_file", None)
    if password_file:
        from sqlalchemy.engine import make_url

        with open(password_file, encoding="utf-8") as f:
            password = f.read().strip()
        url = make_url(url).set(password=password).render_as_string(hide_password=False)
    return url


def warn_visible_password(args: argparse.Namespace) -> None:
    """A warning when ``--store`` carries a password, which every user of the machine sees in ``ps``."""
    given = getattr(args, "store", None)
    if not given or "://" not in given:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        password = make_url(given).password
    except ArgumentError:
        return
    if password:
        log.warning("--store carries the store's password, which anyone on this machine can read in the "
                    "process list: set TRACEGYM_STORE_URL instead, or --store-password-file FILE")


def settings_from_args(args: argparse.Namespace, upstream_url: str | list[str] | None, kind: str) -> GatewaySettings:
    store = store_url(args)
    urls = [upstream_url] if isinstance(upstream_url, str) else list(upstream_url or [])
    return GatewaySettings(
        upstream_url=urls[0] if urls else None, upstream_urls=urls[1:], upstream_kind=kind, model=args.model,
        store_url=store,
        max_body_bytes=args.max_body_bytes, upstream_timeout=args.upstream_timeout, freeze_gc=True,
        switch_interval_s=SERVE_SWITCH_INTERVAL_S, durability=getattr(args, "durability", "commit"),
        max_tokens_cap=getattr(args, "max_tokens_cap", None), **security_settings(args),
    )


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "admin_key", None) or os.environ.get("TRACEGYM_ADMIN_KEY") or None


def security_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of docs/security.md that ``tracegym serve``'s flags (else the environment) fill."""
    from tracegym.http_rules import LOOPBACK_HOSTS

    extra = list(getattr(args, "allowed_host", None) or [])
    hosts = [*LOOPBACK_HOSTS, *extra] if is_loopback(getattr(args, "host", "127.0.0.1")) else (extra or None)
    weights = getattr(args, "weights_dir", None) or os.environ.get("TRACEGYM_WEIGHTS_DIR")
    out = {"admin_key": admin_key(args), "allowed_hosts": hosts,
           "weights_dir": os.path.abspath(weights) if weights else None,
           "max_concurrent_calls": getattr(args, "max_concurrent_calls", None)}
    return {k: v for k, v in out.items() if v is not None}  # unset: the environment's (TRACEGYM_...), if any


def check_binding(args: argparse.Namespace) -> str | None:
    """The one-line refusal of a non-loopback bind without a key (None: go ahead; warns under --insecure)."""
    if admin_key(args) or is_loopback(args.host):
        return None
    if not getattr(args, "insecure", False):
        return (f"tracegym serve: refusing to bind {args.host} without an admin key: anyone who reaches the port "
                "could read every prompt and load weights; set --admin-key / TRACEGYM_ADMIN_KEY, or pass "
                "--insecure to do it anyway")
    log.warning("binding %s with no admin key (--insecure): anyone who reaches this port controls the gateway",
                args.host)
    return None


def _check_args(args: argparse.Namespace) -> None:
    if args.engine == "embedded":
        if args.upstream:
            raise SystemExit("tracegym serve: --engine embedded and --upstream are mutually exclusive")
        if not args.model:
            raise SystemExit("tracegym serve: --engine embedded needs --model NAME")
        if getattr(args, "engines", 1) < 1:
            raise SystemExit("tracegym serve: --engines must be at least 1")
    elif not args.upstream and args.upstream_kind != "litellm":
        raise SystemExit("tracegym serve: pass --upstream URL (or --engine embedded --model NAME)")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from tracegym.gateway.app import create_app
    from tracegym.gateway.proxy.connections import limited_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_args(args)
    refusal = check_binding(args)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    warn_visible_password(args)
    preflight(args.host, args.port, args.model if args.engine == "embedded" else None, store_url(args) or "none")
    engines = None
    upstream, kind = args.upstream, args.upstream_kind
    try:
        if args.engine == "embedded":
            engines = start_embedded(args)
            upstream, kind = engines.urls, "sglang"
        settings = settings_from_args(args, upstream, kind)
        if engines is not None:  # the engines' weight and pause routes: only this gateway has their key
            settings = settings.model_copy(update={"upstream_api_key": engines.key})
        app = create_app(settings)
        failure = StartupFailure(app, keep_traceback=getattr(args, "debug", False))
        try:
            http = limited_protocol(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections)
            uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http=http,
                        log_level=args.log_level.lower(), access_log=False, lifespan="on",
                        timeout_graceful_shutdown=10, proxy_headers=False)
        except SystemExit:
            failure.reraise()
            raise
    finally:
        if engines is not None:
            engines.stop()
    return 0
