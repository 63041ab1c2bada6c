"""Who may call what (docs/security.md): the admin key, per-rollout tokens, the Host allow-list and the
JSON content-type rule, checked once per request by the ASGI front (``front.py``) before any route runs.

- With an admin key set, every route needs a key except ``/healthz``, the inspector's page and static
  files (``/ui...``: its JSON reads under ``/api/`` need the key) and the API docs (``/docs``,
  ``/openapi.json``: no data). The key comes as ``Authorization: Bearer K`` (OpenAI clients, the SDK,
  the inspector), ``x-api-key: K`` (Anthropic clients) or ``X-Tracegym-Key: K`` (what the SDK's
  instrumentation adds to an agent's requests to the gateway, whatever API key the agent's own client
  was given).
- Agent routes (``/v1/...`` but OTLP's ``/v1/traces``, ``/rollouts/{id}/v1/...``, and a rollout's own
  ``GET /api/rollouts/{id}[/spans]`` and ``POST /api/rollouts/{id}/rewards|events``) also take a rollout token:
  ``tgr.<hex HMAC-SHA256(admin key, rollout id)>.<rollout id>``, handed out with each claimed rollout.
  It is valid for that rollout only (403 for another); a ``/v1/...`` call it makes without naming a
  rollout (no path prefix, no ``X-Rollout-Id``) is attributed to the token's rollout. Tokens are derived,
  not stored: every gateway on one store agrees on them, there is nothing in the database to leak, and
  changing the admin key revokes them all.
- Host allow-list (when set: ``tracegym serve`` on a loopback address): any other ``Host`` is a 421, so
  a web page whose DNS name was rebound to 127.0.0.1 cannot read the gateway.
- A request with a body to any route but OTLP ingest must say ``Content-Type: application/json`` (or a
  ``+json`` type), else 415: a browser sends a cross-site ``text/plain`` POST without asking first, a
  JSON one only after a CORS preflight the gateway never grants.

Keys are compared in constant time (``hmac.compare_digest``) and never logged."""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass

from starlette.responses import Response

from tracegym.gateway.openai_errors import OpenAIError, error_response
from tracegym.gateway.proxy.admission import FailureLimiter
from tracegym.gateway.proxy.anthropic.anthropic_errors import error_body as anthropic_error_body
from tracegym.gateway.proxy.ids import id_problem
from tracegym.http_rules import BODY_METHODS as _BODY_METHODS
from tracegym.http_rules import host_name, is_json

TOKEN_PREFIX = "tgr."
_SIG_HEX = 64
_DOMAIN = b"tracegym rollout token\x00"

OPEN, AGENT, ADMIN = 0, 1, 2
_OPEN_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/ui"})
NO_JSON_RULE = frozenset({"/v1/traces"})  # OTLP: protobuf or JSON, checked by the route


def rollout_token(admin_key: str, rollout_id: str) -> str:
    """The token that lets an agent call, reward and emit for ``rollout_id`` only."""
    sig = hmac.digest(admin_key.encode(), _DOMAIN + rollout_id.encode(), "sha256").hex()
    return f"{TOKEN_PREFIX}{sig}.{rollout_id}"


def token_rollout(admin_key: bytes, token: bytes) -> str | None:
    """The rollout a token is valid for, or None when it is not one this admin key made."""
    head = len(TOKEN_PREFIX)
    if not token.startswith(b"tgr.") or len(token) <= head + _SIG_HEX + 1 or token[head + _SIG_HEX] != 0x2E:
        return None
    rid = token[head + _SIG_HEX + 1:]
    sig = hmac.digest(admin_key, _DOMAIN + rid, "sha256").hex().encode()
    if not hmac.compare_digest(sig, token[head:head + _SIG_HEX]):
        return None
    try:
        return rid.decode()
    except UnicodeDecodeError:
        return None


def classify(method: str, path: str) -> tuple[int, str | None]:
    """``(OPEN | AGENT | ADMIN, the rollout the path names)`` for a request."""
    if path in _OPEN_PATHS or (path.startswith("/ui/") and method in ("GET", "HEAD")):
        return OPEN, None
    if path.startswith("/v1/"):
        return (ADMIN, None) if path == "/v1/traces" else (AGENT, None)
    if path.startswith("/rollouts/"):
        rid, _, tail = path[len("/rollouts/"):].partition("/")
        return (AGENT, rid) if rid and tail.startswith("v1/") else (ADMIN, None)
    if path.startswith("/api/rollouts/"):
        rid, _, tail = path[len("/api/rollouts/"):].partition("/")
        if rid and ((tail in ("", "spans") and method == "GET") or (tail in ("rewards", "events") and method == "POST")):
            return AGENT, rid
    return ADMIN, None


@dataclass(frozen=True, slots=True)
class Denial:
    status: int
    message: str
    code: str
    retry_after: int | None = None
    """Seconds, sent as ``Retry-After`` (a 429)."""
    param: str | None = None

    def response(self, path: str) -> Response:
        """In the route's API's error shape (Anthropic's for the Messages routes, else OpenAI's)."""
        headers = {"WWW-Authenticate": 'Bearer realm="tracegym"'} if self.status == 401 else None
        if self.retry_after is not None:
            headers = {"Retry-After": str(self.retry_after)}
        if path.endswith(("/v1/messages", "/v1/messages/count_tokens")):
            r = error_response(self.status, anthropic_error_body(self.status, self.message))
        else:
            r = error_response(self.status, OpenAIError(self.status, self.message, param=self.param,
                                                        code=self.code).body())
        if headers:
            r.headers.update(headers)
        return r


_NO_KEY = Denial(401, "missing API key: send the admin key (or a rollout's token) as 'Authorization: Bearer "
                 "KEY' or 'x-api-key: KEY'", "missing_api_key")
_BAD_KEY = Denial(401, "invalid API key", "invalid_api_key")
_ADMIN_ONLY = Denial(403, "a rollout token cannot call this route; it needs the admin key", "admin_key_required")
_OTHER_ROLLOUT = Denial(403, "this rollout token is valid only for its own rollout's calls, rewards and events",
                        "wrong_rollout")
_BAD_HOST = Denial(421, "Host not allowed: this gateway answers only the host names it was told "
                   "(tracegym serve --allowed-host)", "host_not_allowed")
_NOT_JSON = Denial(415, "Content-Type must be application/json", "unsupported_media_type")


def _too_many_failures(wait: float) -> Denial:
    return Denial(429, "too many requests with a missing or wrong key from this address: wait and retry",
                  "too_many_auth_failures", retry_after=max(1, math.ceil(wait)))


_HEADERS = ("X-Tracegym-Key", "Authorization", "x-api-key", "Host", "Content-Type", "Content-Length",
            "Transfer-Encoding", "X-Rollout-Id", "X-Task-Id", "X-Agent-Name")
"""The headers read here, each at most once per request: one that comes twice is a 400 (whichever copy a
later reader took, a repeated ``X-Rollout-Id`` or key could name one rollout to this check and another to
the call path, and two ``Host`` headers could pass the allow-list with the one not read)."""
_WANTED = {name.lower().encode(): i for i, name in enumerate(_HEADERS)}
_HOST, _CTYPE, _LENGTH, _CHUNKED, _ROLLOUT, _TASK = 3, 4, 5, 6, 7, 8
_REPEATED = tuple(Denial(400, f"the {name} header is repeated: send it once", "repeated_header")
                  for name in _HEADERS)
TOKEN_ROLLOUT = "tracegym.token_rollout"
"""The scope key under which ``Guard.check`` leaves the rollout of the token a request was let in with."""


def _presented_key(seen: list[bytes | None]) -> bytes | None:
    """``X-Tracegym-Key`` (the SDK's, over the agent client's own key), else a Bearer token, else
    ``x-api-key``."""
    if seen[0]:
        return seen[0].strip()
    auth = seen[1]
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return seen[2].strip() if seen[2] else None


def _bad_ids(path: str, rollout_header: bytes | None, task_header: bytes | None) -> Denial | None:
    """``ids.id_problem`` for the rollout a ``/rollouts/{id}/...`` path names and the ``X-Rollout-Id`` and
    ``X-Task-Id`` headers (an empty header counts as absent)."""
    for param, value in (("rollout_id", path[10:].partition("/")[0] if path.startswith("/rollouts/") else None),
                         ("X-Rollout-Id", rollout_header.decode("latin-1") if rollout_header else None),
                         ("X-Task-Id", task_header.decode("latin-1") if task_header else None)):
        problem = None if value is None else id_problem(param, value)
        if problem is not None:
            return Denial(400, problem, "invalid_value", param=param)
    return None


class Guard:
    """The checks of this module for one app, built from its settings once; its only state is the count of
    failed keys per client address (``admission.FailureLimiter``)."""

    __slots__ = ("_admin", "_failures", "_hosts")

    def __init__(self, admin_key: str | None, allowed_hosts: list[str] | None = None,
                 auth_failures_per_minute: int = 60) -> None:
        self._admin = admin_key.encode() if admin_key else None
        self._hosts = None if allowed_hosts is None else frozenset(h.lower().encode() for h in allowed_hosts)
        self._failures = FailureLimiter(auth_failures_per_minute)

    @property
    def keyed(self) -> bool:
        return self._admin is not None

    @property
    def checks_host(self) -> bool:
        return self._hosts is not None

    def token_for(self, rollout_id: str) -> str | None:
        """The rollout's token (None on a gateway without an admin key, where none is needed)."""
        return None if self._admin is None else rollout_token(self._admin.decode(), rollout_id)

    def check(self, scope: dict) -> Denial | None:
        """None to let the request through, else why not. May add ``x-rollout-id`` to ``scope``'s headers
        (a rollout token's call that names no rollout is attributed to the token's rollout) and sets
        ``scope[TOKEN_ROLLOUT]`` for a request let in with a rollout token."""
        seen: list[bytes | None] = [None] * len(_HEADERS)
        for k, v in scope["headers"]:  # one dict probe per header
            i = _WANTED.get(k)
            if i is not None:
                if seen[i] is not None:
                    return _REPEATED[i]
                seen[i] = v
        host, ctype, length, chunked, rollout_header = (seen[_HOST], seen[_CTYPE], seen[_LENGTH], seen[_CHUNKED],
                                                        seen[_ROLLOUT])
        if self._hosts is not None and (host is None or host_name(host) not in self._hosts):
            return _BAD_HOST
        method, path = scope["method"], scope["path"]
        denial = _bad_ids(path, rollout_header, seen[_TASK])
        if denial is not None:
            return denial
        if self._admin is not None:
            denial = self._authorize(scope, method, path, _presented_key(seen), rollout_header)
            if denial is not None:
                return denial
        has_body = chunked is not None or (length is not None and length.strip() != b"0")
        if has_body and method in _BODY_METHODS and path not in NO_JSON_RULE and not is_json(ctype or b""):
            return _NOT_JSON
        return None

    def _authorize(self, scope: dict, method: str, path: str, key: bytes | None,
                   rollout_header: bytes | None) -> Denial | None:
        kind, path_rollout = classify(method, path)
        if kind == OPEN:
            return None
        client = scope.get("client")
        address = client[0] if client else ""
        wait = self._failures.wait(address)
        if wait is not None:
            return _too_many_failures(wait)
        denial = self._key_denial(scope, kind, path_rollout, key, rollout_header)
        if denial is not None and denial.status == 401:
            self._failures.failed(address)
        return denial

    def _key_denial(self, scope: dict, kind: int, path_rollout: str | None, key: bytes | None,
                    rollout_header: bytes | None) -> Denial | None:
        if not key:
            return _NO_KEY
        assert self._admin is not None
        if hmac.compare_digest(key, self._admin):
            return None
        token_rid = token_rollout(self._admin, key)
        if token_rid is None:
            return _BAD_KEY
        if kind == ADMIN:
            return _ADMIN_ONLY
        target = path_rollout if path_rollout is not None else (rollout_header.decode("latin-1")
                                                                if rollout_header else None)
        if target is None:
            kept = [(k, v) for k, v in scope["headers"] if k != b"x-rollout-id"]  # an empty one included
            scope["headers"] = [*kept, (b"x-rollout-id", token_rid.encode())]
        elif not hmac.compare_digest(target.encode(), token_rid.encode()):
            return _OTHER_ROLLOUT
        scope[TOKEN_ROLLOUT] = token_rid
        return None
