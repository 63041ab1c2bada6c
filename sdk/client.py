"""The SDK's HTTP client for the gateway's control API (docs/api.md): configuration, retries, errors.

Every call retries transport errors, timeouts and 408/429/5xx answers with exponential backoff, then
raises ``GatewayUnreachableError`` naming the URL and the last error. Other 4xx answers raise
``GatewayError`` at once with the gateway's message (``LeaseLostError`` for 409).

Requests the gateway does not deduplicate (``idempotent=False``: enqueue, claim, fail) are retried only
when they were never sent (the connection could not be opened): after a timeout or a 5xx answer the
gateway may have acted on them, and a second try would enqueue the tasks twice or use two attempts.
They raise at once instead (``GatewayUnreachableError`` for a transport error, ``GatewayError`` with the
status for an error answer).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# transport errors raised before any byte of the request was sent: safe to retry any request
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class GatewayError(RuntimeError):
    """The gateway answered with an error (or could not be reached: see the subclass)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GatewayUnreachableError(GatewayError):
    """The gateway did not answer successfully within the retry budget; ``last`` is the last try's error."""

    last: str = ""


def refused_field(e: GatewayError, name: str) -> bool:
    """The gateway refused a request for a body or query field ``name`` it does not know or accept (a 400
    naming it): how a client tells a gateway older than an optional field."""
    return e.status == 400 and name in str(e)


class LeaseLostError(GatewayError):
    """409 from the queue: the rollout's lease was lost or the rollout is already finished."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` tries in all; the waits between them double from ``backoff`` up to ``max_backoff``
    (each multiplied by a random factor in [0.75, 1.25] so many clients do not retry in lockstep)."""

    attempts: int = 6
    backoff: float = 0.5
    max_backoff: float = 8.0

    def delays(self) -> list[float]:
        """The nominal waits before tries 2..attempts (no jitter)."""
        return [min(self.max_backoff, self.backoff * 2**i) for i in range(max(0, self.attempts - 1))]


@dataclass(frozen=True, slots=True)
class SDKConfig:
    gateway_url: str = DEFAULT_GATEWAY
    api_key: str | None = None
    timeout: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class _ConfigHolder:
    """What ``tg.configure`` set, resolved against the environment at use time.

    This is the SDK's only process-wide state, and it is what ``configure`` is for. Code that runs
    agents (the runner) passes its own ``SDKConfig`` into each rollout scope and never reads this.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set: dict[str, Any] = {}

    def update(self, **values: Any) -> None:
        with self._lock:
            self._set.update({k: v for k, v in values.items() if v is not None})

    def reset(self) -> None:
        with self._lock:
            self._set.clear()

    def resolve(self) -> SDKConfig:
        with self._lock:
            s = dict(self._set)
        url = s.get("gateway_url") or os.environ.get("TRACEGYM_GATEWAY") or DEFAULT_GATEWAY
        key = s.get("api_key") or os.environ.get("TRACEGYM_API_KEY") or os.environ.get("TRACEGYM_ADMIN_KEY") or None
        base = SDKConfig(gateway_url=normalize_url(url), api_key=key)
        retry = replace(base.retry, **{k: s[k] for k in ("attempts", "backoff", "max_backoff") if k in s})
        return replace(base, timeout=s.get("timeout", base.timeout), retry=retry)


_CONFIG = _ConfigHolder()


def configure(
    gateway_url: str | None = None,
    api_key: str | None = None,
    *,
    timeout: float | None = None,
    retry_attempts: int | None = None,
    retry_backoff: float | None = None,
    retry_max_backoff: float | None = None,
) -> SDKConfig:
    """Set the gateway the SDK talks to (default ``$TRACEGYM_GATEWAY``, else ``http://127.0.0.1:8000``)
    and its API key (default ``$TRACEGYM_API_KEY``, else ``$TRACEGYM_ADMIN_KEY``). Returns the resulting configuration."""
    if gateway_url is not None:
        gateway_url = normalize_url(gateway_url)
    if retry_attempts is not None and retry_attempts < 1:
        raise ValueError(f"retry_attempts must be >= 1, got {retry_attempts}")
    _CONFIG.update(
        gateway_url=gateway_url,
        api_key=api_key,
        timeout=timeout,
        attempts=retry_attempts,
        backoff=retry_backoff,
        max_backoff=retry_max_backoff,
    )
    return _CONFIG.resolve()


def reset_configuration() -> None:
    """Forget everything ``configure`` set (tests use it)."""
    _CONFIG.reset()


def current_config() -> SDKConfig:
    return _CONFIG.resolve()


def config_for(gateway: str | None, base: SDKConfig | None = None) -> SDKConfig:
    """``base`` (default: the current configuration: ``tg.configure``, ``$TRACEGYM_GATEWAY``,
    ``$TRACEGYM_API_KEY``) with ``gateway`` as its URL when given (the ``--gateway`` options)."""
    config = base or current_config()
    return replace(config, gateway_url=normalize_url(gateway)) if gateway else config


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"gateway URL must start with http:// or https://, got {url!r}")
    return url


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One CA-loaded SSL context for all SDK clients: building it is most of a client's cost."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return json.dumps(body)[:500]


def _check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.is_success:
        return resp
    msg = f"{what}: gateway answered {resp.status_code}: {_error_text(resp)}"
    if resp.status_code == 409:
        raise LeaseLostError(msg, status=409)
    raise GatewayError(msg, status=resp.status_code)


def _jitter(delay: float) -> float:
    return delay * random.uniform(0.75, 1.25)


def _http_kwargs(config: SDKConfig) -> dict[str, Any]:
    """The arguments of the ``httpx.Client``/``httpx.AsyncClient`` behind a gateway client."""
    return {
        "base_url": config.gateway_url,
        "headers": config.headers(),
        "timeout": config.timeout,
        "verify": _ssl_context(),
    }


def _retry_reason(outcome: httpx.Response | httpx.TransportError, idempotent: bool) -> str | None:
    """Why this try should be repeated (the "last error" of the final message), or None when its outcome
    stands: a response is then checked (``_check``), a transport error raised.
    A request the gateway does not deduplicate is repeated only when it was never sent."""
    if isinstance(outcome, httpx.TransportError):
        if idempotent or isinstance(outcome, UNSENT_ERRORS):
            return f"{type(outcome).__name__}: {outcome}"
        return None
    if idempotent and outcome.status_code in RETRY_STATUSES:
        return f"HTTP {outcome.status_code}: {_error_text(outcome)}"
    return None


class _Tries:
    """The retry policy of one request, for the blocking and the asyncio client alike: ``waits`` gives the
    pause before each try (0 before the first), ``settle`` judges each try's outcome, and ``give_up`` is
    the error once the tries are spent. The clients only send and sleep, each in its own way::

        for wait in tries.waits():
            sleep(wait)
            if (resp := tries.settle(send())) is not None:
                return resp
        raise tries.give_up()
    """

    __slots__ = ("config", "idempotent", "last", "what")

    def __init__(self, config: SDKConfig, what: str, idempotent: bool) -> None:
        self.config, self.what, self.idempotent = config, what, idempotent
        self.last = "none"

    def waits(self) -> Iterator[float]:
        """Seconds to wait before each try: 0, then the policy's delays with jitter."""
        yield 0.0
        for delay in self.config.retry.delays():
            yield _jitter(delay)

    def settle(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response | None:
        """The checked response of a try that stands (``_check`` raises for an error answer), or None to
        try again. A transport error on a request that must not be repeated raises at once."""
        reason = _retry_reason(outcome, self.idempotent)
        if reason is not None:
            self.last = reason
            return None
        if isinstance(outcome, httpx.TransportError):
            raise GatewayUnreachableError(
                f"{self.what}: no answer from the tracegym gateway at {self.config.gateway_url} "
                f"({type(outcome).__name__}: {outcome}); not retried, since the gateway may have acted on the "
                "request and does not deduplicate it"
            ) from outcome
        return _check(outcome, self.what)

    def give_up(self) -> GatewayUnreachableError:
        return _give_up(self.config, self.what, self.last)


def _give_up(cfg: SDKConfig, what: str, last: str) -> GatewayUnreachableError:
    tries = cfg.retry.attempts
    spent = f" after {tries} attempts over ~{sum(cfg.retry.delays()):.1f}s" if tries > 1 else ""
    error = GatewayUnreachableError(
        f"{what}: the tracegym gateway at {cfg.gateway_url} did not answer{spent} (last error: {last}). Is "
        "`tracegym serve` running there? Set the URL with tg.configure(gateway_url=...) or $TRACEGYM_GATEWAY."
    )
    error.last = last
    return error


class GatewayClient:
    """Blocking client (rewards from sync code, enqueue, export). Thread-safe; close it when done."""

    def __init__(self, config: SDKConfig | None = None) -> None:
        self.config = config or current_config()
        self._http = httpx.Client(**_http_kwargs(self.config))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self, method: str, path: str, what: str, *, idempotent: bool = True, **kw: Any
    ) -> httpx.Response:
        tries = _Tries(self.config, what, idempotent)
        for wait in tries.waits():
            time.sleep(wait)
            if (resp := tries.settle(self._send(method, path, kw))) is not None:
                return resp
        raise tries.give_up()

    def _send(self, method: str, path: str, kw: dict[str, Any]) -> httpx.Response | httpx.TransportError:
        try:
            return self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            return e

    def post(self, path: str, body: dict[str, Any], what: str, *, idempotent: bool = True) -> Any:
        """POST ``body``; pass ``idempotent=False`` unless the gateway dedups a repeat (see the module doc)."""
        return self.request("POST", path, what, idempotent=idempotent, json=body).json()

    def get(self, path: str, what: str, params: dict[str, Any] | None = None) -> Any:
        return self.request("GET", path, what, params=_clean(params)).json()

    def iter_lines(self, path: str, what: str, params: dict[str, Any] | None = None, *, method: str = "GET",
                   body: dict[str, Any] | None = None) -> Iterator[str]:
        """The non-empty lines of a JSON-lines answer, streamed (one try: a half-read stream is not
        retried, so nothing is yielded twice); ``body`` is sent as JSON (with ``method="POST"``)."""
        try:
            with self._http.stream(method, path, params=_clean(params), json=body) as resp:
                if not resp.is_success:
                    resp.read()
                    _check(resp, what)
                for line in resp.iter_lines():
                    if line.strip():
                        yield line
        except httpx.TransportError as e:
            raise _give_up(replace(self.config, retry=RetryPolicy(attempts=1)), what, repr(e)) from e

    # -- typed helpers for the routes the SDK uses --------------------------------------------------
    def enqueue_tasks(
        self, tasks: list[dict[str, Any]], *, group_size: int = 1, max_attempts: int = 3
    ) -> list[dict[str, Any]]:
        body = {"tasks": tasks, "group_size": group_size, "max_attempts": max_attempts}
        # idempotent only when every task names its group (an existing group is returned, not enqueued again)
        idempotent = all(t.get("group_id") for t in tasks)
        return self.post("/api/tasks", body, "enqueue tasks", idempotent=idempotent)["tasks"]

    def add_event(self, rollout_id: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.post(f"/api/rollouts/{rollout_id}/{kind}", body, f"send {kind[:-1]} for {rollout_id}")

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self.get(f"/api/rollouts/{rollout_id}", f"get rollout {rollout_id}")

    def rollout_spans(self, rollout_id: str) -> list[dict[str, Any]]:
        return self.get(f"/api/rollouts/{rollout_id}/spans", f"get spans of {rollout_id}")["spans"]

    def iter_rollouts(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every rollout matching ``filters`` (status, task_id, group_id, since, until), page by page."""
        cursor = None
        while True:
            page = self.get("/api/rollouts", "list rollouts", {**filters, "cursor": cursor})
            yield from page["rollouts"]
            cursor = page.get("next_cursor")
            if not cursor:
                return


class AsyncGatewayClient:
    """The same on asyncio (the runner, ``tg.areward``). Use it as an async context manager."""

    def __init__(self, config: SDKConfig | None = None) -> None:
        self.config = config or current_config()
        self._http = httpx.AsyncClient(**_http_kwargs(self.config))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def post(self, path: str, body: dict[str, Any], what: str, *, idempotent: bool = True) -> Any:
        """POST ``body``; pass ``idempotent=False`` unless the gateway dedups a repeat (see the module doc)."""
        tries = _Tries(self.config, what, idempotent)
        for wait in tries.waits():
            await asyncio.sleep(wait)
            if (resp := tries.settle(await self._send(path, body))) is not None:
                return resp.json()
        raise tries.give_up()

    async def _send(self, path: str, body: dict[str, Any]) -> httpx.Response | httpx.TransportError:
        try:
            return await self._http.post(path, json=body)
        except httpx.TransportError as e:
            return e

    async def add_event(self, rollout_id: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        what = f"send {kind[:-1]} for {rollout_id}"
        return await self.post(f"/api/rollouts/{rollout_id}/{kind}", body, what)

    async def claim(self, worker_id: str, limit: int, lease_seconds: float,
                    wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Up to ``limit`` queued rollouts; with none queued, the gateway holds the answer up to ``wait_s``
        seconds for one to be."""
        body: dict[str, Any] = {"worker_id": worker_id, "limit": limit, "lease_seconds": lease_seconds}
        if wait_s:
            body["wait_s"] = wait_s
        # not idempotent: a repeat claims more rollouts (those of a lost answer wait for their lease to expire)
        return (await self.post("/api/rollouts/claim", body, "claim rollouts", idempotent=False))["rollouts"]

    async def heartbeat(self, rollout_id: str, worker_id: str, lease_seconds: float) -> dict[str, Any]:
        body = {"worker_id": worker_id, "lease_seconds": lease_seconds}
        return await self.post(f"/api/rollouts/{rollout_id}/heartbeat", body, f"heartbeat {rollout_id}")

    async def complete(self, rollout_id: str, worker_id: str, reward: float | None) -> dict[str, Any]:
        body: dict[str, Any] = {"worker_id": worker_id}
        if reward is not None:
            body["reward"] = reward
        # idempotent: completing a completed rollout returns it unchanged
        return await self.post(f"/api/rollouts/{rollout_id}/complete", body, f"complete {rollout_id}")

    async def fail(self, rollout_id: str, worker_id: str, error: str, tb: str | None) -> dict[str, Any]:
        body = {"worker_id": worker_id, "error": error, "traceback": tb}
        # not idempotent: a repeat after the requeue would use a second attempt
        return await self.post(
            f"/api/rollouts/{rollout_id}/fail", body, f"fail {rollout_id}", idempotent=False
        )

    async def release(self, rollout_id: str, worker_id: str) -> dict[str, Any]:
        # a repeat after a release that went through changes nothing (it answers 409)
        body = {"worker_id": worker_id}
        return await self.post(f"/api/rollouts/{rollout_id}/release", body, f"release {rollout_id}")


def _clean(params: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if params is None else {k: v for k, v in params.items() if v is not None}
