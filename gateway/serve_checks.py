"""What ``tracegym serve`` checks before it starts, so that a user's mistake reads as two lines (the problem,
then the fix; ``UserError``, exit code 2) instead of a traceback: the port in use, an unknown model name for
the embedded engine, a store it cannot open. ``StartupFailure`` does the same for what fails inside the
app's startup (an unreachable upstream, no tokenizer for the model)."""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

from tracegym.errors import UserError
from tracegym.gateway.openai_errors import UpstreamUnavailable
from tracegym.models import MODEL_FIX, check_model_name
from tracegym.procs import Engines, free_port, start_engines

log = logging.getLogger("tracegym.gateway")


def preflight(host: str, port: int, engine_model: str | None, store: str | None) -> None:
    """Raise a ``UserError`` for the first problem found, cheapest check first."""
    problem = port_problem(host, port)
    if problem is not None:
        raise UserError(*problem)
    if engine_model is not None:
        check_model_name(engine_model)
    if store and store != "none":
        from tracegym.gateway.traces.store.connect import store_problem

        problem = store_problem(store)
        if problem is not None:
            raise UserError(*problem)
        if store.startswith("sqlite:///"):
            log.info("trace store: %s (--store to change)", os.path.abspath(store.removeprefix("sqlite:///")))


def port_problem(host: str, port: int) -> tuple[str, str] | None:
    """None if ``host:port`` can be listened on now (as uvicorn binds: with SO_REUSEADDR), else the problem
    and its fix."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return f"cannot resolve --host {host!r}: {e.strerror}", "pass an address such as 127.0.0.1 or 0.0.0.0"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use (another gateway?)",
                        f"stop what listens there, or pass another --port (e.g. --port {free_port()})")
            return f"cannot listen on {host}:{port}: {e.strerror or e}", "pass another --host or --port"
    return None


def start_embedded(args: Any) -> Engines:
    """``--engines`` embedded engines (``tracegym engine``) whose output goes to ours, started and not waited
    for (``wait_embedded`` waits); one that dies before it is ready has printed its own error, so this adds
    one line and no traceback."""
    n = getattr(args, "engines", 1)
    ports = [args.engine_port + i for i in range(n)] if args.engine_port else []
    with _engine_failure():
        return start_engines(n, args.model, args=["--log-level", args.log_level], ports=ports, wait=False)


def wait_embedded(engines: Engines) -> None:
    """Wait for ``start_embedded``'s engines (``$TRACEGYM_ENGINE_START_TIMEOUT`` seconds, 900 by default)."""
    with _engine_failure():
        engines.wait_ready(float(os.environ.get("TRACEGYM_ENGINE_START_TIMEOUT", "900")))


@contextmanager
def _engine_failure() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:
        raise UserError(f"the {str(e).splitlines()[0].removesuffix('; its log:')} before it was ready (its error "
                        "is above)") from e


class StartupFailure(logging.Filter):
    """Keeps the exception the app's startup raised, for ``reraise`` to turn into a ``UserError``, and
    (unless ``keep_traceback``) drops uvicorn's log of its traceback and of the "startup failed" line."""

    def __init__(self, app: Any, *, keep_traceback: bool) -> None:
        super().__init__()
        self.error: Exception | None = None
        app.router.lifespan_context = self._catching(app.router.lifespan_context)
        if not keep_traceback:
            logging.getLogger("uvicorn.error").addFilter(self)

    def _catching(
        self, inner: Callable[[Any], AbstractAsyncContextManager[Any]]
    ) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[Any]:
            started = False
            try:
                async with inner(app) as state:
                    started = True
                    yield state
            except Exception as e:
                if not started:
                    self.error = e
                raise

        return lifespan

    def filter(self, record: logging.LogRecord) -> bool:
        if self.error is None:
            return True
        return not record.getMessage().startswith(("Traceback", "Application startup failed"))

    def reraise(self) -> None:
        """Raise the ``UserError`` for the startup error, if there was one."""
        if self.error is not None:
            raise explain(self.error) from self.error


def explain(e: Exception) -> UserError:
    """A startup exception as the problem and its fix."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, UpstreamUnavailable):
        return UserError(f"the gateway cannot start: {first}",
                         "start the inference server first, or fix --upstream (or use --engine embedded --model NAME)")
    if isinstance(e, FileNotFoundError) and "tokenizer" in first:
        return UserError(f"the gateway cannot start: {first.partition('; ')[0]}", MODEL_FIX)
    if isinstance(e, ValueError):
        return UserError(f"the gateway cannot start: {first}", "see tracegym serve --help")
    return UserError(f"the gateway cannot start: {type(e).__name__}: {first}",
                     "run it again with --debug for the traceback")
