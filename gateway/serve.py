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

from tracegym.errors import UserError
from tracegym.gateway.serve_checks import StartupFailure, preflight, start_embedded, wait_embedded
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
    chat_format = getattr(args, "chat_format", None)
    return GatewaySettings(
        upstream_url=urls[0] if urls else None, upstream_urls=urls[1:], upstream_kind=kind, model=args.model,
        store_url=store, **({"chat_format": chat_format} if chat_format else {}),
        max_body_bytes=args.max_body_bytes, upstream_timeout=args.upstream_timeout, freeze_gc=True,
        switch_interval_s=SERVE_SWITCH_INTERVAL_S, durability=getattr(args, "durability", "commit"),
        commit_timeout_s=getattr(args, "commit_timeout", 10.0),
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


def check_chat_format(args: argparse.Namespace) -> None:
    """SystemExit naming the known families when ``--chat-format`` (else ``$TRACEGYM_CHAT_FORMAT``) names none:
    before any engine starts."""
    from tracegym.gateway.proxy.prompt.families import UnknownChatFormat, family

    given = getattr(args, "chat_format", None)
    name = given or os.environ.get("TRACEGYM_CHAT_FORMAT")
    if not name:
        return
    try:
        family(name)
    except UnknownChatFormat as e:
        source = "--chat-format" if given else "$TRACEGYM_CHAT_FORMAT"
        raise SystemExit(f"tracegym serve: {source}: {e}") from None


def _check_args(args: argparse.Namespace) -> None:
    check_chat_format(args)
    if args.engine == "embedded":
        if args.upstream:
            raise SystemExit("tracegym serve: --engine embedded and --upstream are mutually exclusive")
        if not args.model:
            raise SystemExit("tracegym serve: --engine embedded needs --model NAME")
        if getattr(args, "engines", 1) < 1:
            raise SystemExit("tracegym serve: --engines must be at least 1")
    elif not args.upstream and args.upstream_kind != "litellm" and not browsing(args):
        raise SystemExit("tracegym serve: pass --upstream URL (or --engine embedded --model NAME), or --store URL "
                         "alone to browse a store in the trace inspector")


def browsing(args: argparse.Namespace) -> bool:
    """``serve --store URL`` with no upstream: the trace inspector over that store, read-only (``browse``)."""
    return (args.engine is None and not args.upstream and args.upstream_kind != "litellm"
            and getattr(args, "store", None) not in (None, "", "none"))


def serve_browse(args: argparse.Namespace, store: str, tokenizer_dir: Any) -> int:
    """Serve ``browse.create_browse_app`` over ``store`` on ``args.host``:``args.port``, with ``serve``'s
    checks (binding without a key, the port, the store)."""
    import uvicorn

    from tracegym.gateway.browse import browse_settings, create_browse_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refusal = check_binding(args)
    if refusal is not None:
        print(refusal.replace("tracegym serve", f"tracegym {args.command}"), file=sys.stderr)
        return 2
    preflight(args.host, args.port, None, store)
    app = create_browse_app(browse_settings(store, args.model, security_settings(args)), tokenizer_dir)
    print(f"trace inspector: http://{args.host}:{args.port}/ui (read-only; Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                lifespan="on", proxy_headers=False)
    return 0


def inspect_main(args: argparse.Namespace) -> int:
    """``tracegym inspect RUN_DIR``: the trace inspector over a finished run's store, no upstream needed."""
    from pathlib import Path

    from tracegym.gateway.browse import run_store, run_tokenizer
    from tracegym.models import check_model_name, find_local_model_dir

    store, run_dir = run_store(Path(args.run_dir))
    tokenizer_dir = None
    if args.model:
        check_model_name(args.model)
        tokenizer_dir = find_local_model_dir(args.model)
        if tokenizer_dir is None:
            raise UserError(f"model {args.model!r} is not prepared", f"tracegym models prepare {args.model}")
    else:
        tokenizer_dir = run_tokenizer(run_dir)
    return serve_browse(args, store, tokenizer_dir)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # alembic's import: "setup plugin"
    _check_args(args)
    if browsing(args):
        from tracegym.models import find_local_model_dir

        store = store_url(args)
        assert store is not None, "browsing() needs a store"
        return serve_browse(args, store, find_local_model_dir(args.model) if args.model else None)
    refusal = check_binding(args)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    warn_visible_password(args)
    preflight(args.host, args.port, args.model if args.engine == "embedded" else None, store_url(args) or "none")
    engines = None
    upstream, kind = args.upstream, args.upstream_kind
    try:
        if args.engine == "embedded":  # the engines load their model while this process builds its app
            engines = start_embedded(args)
            upstream, kind = engines.urls, "sglang"
        import uvicorn

        from tracegym.gateway.app import create_app
        from tracegym.gateway.proxy.connections import limited_protocol

        settings = settings_from_args(args, upstream, kind)
        if engines is not None:  # the engines' weight and pause routes: only this gateway has their key
            settings = settings.model_copy(update={"upstream_api_key": engines.key})
        app = create_app(settings)
        if engines is not None:
            wait_embedded(engines)
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
