"""``proxy/auth.py`` on its own: route classes, rollout tokens, and the Guard's answer to raw ASGI scopes
(the routes behind it are exercised in tests/gateway/test_auth_routes.py)."""

from __future__ import annotations

import pytest

from tracegym.gateway.proxy.auth import ADMIN, AGENT, OPEN, Guard, classify, rollout_token, token_rollout

KEY = "admin-key-0123456789"


def _scope(method: str, path: str, headers: dict[str, str] | None = None) -> dict:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("GET", "/healthz", (OPEN, None)),
    ("GET", "/ui", (OPEN, None)),
    ("GET", "/ui/rollouts/r-1", (OPEN, None)),
    ("GET", "/ui/static/app.js", (OPEN, None)),
    ("POST", "/ui/x", (ADMIN, None)),
    ("POST", "/v1/chat/completions", (AGENT, None)),
    ("GET", "/v1/responses/resp_1", (AGENT, None)),
    ("POST", "/v1/traces", (ADMIN, None)),
    ("POST", "/rollouts/r-1/v1/messages", (AGENT, "r-1")),
    ("POST", "/rollouts/r-1/other", (ADMIN, None)),
    ("POST", "/api/rollouts/r-1/rewards", (AGENT, "r-1")),
    ("POST", "/api/rollouts/r-1/events", (AGENT, "r-1")),
    ("GET", "/api/rollouts/r-1", (AGENT, "r-1")),
    ("GET", "/api/rollouts/r-1/spans", (AGENT, "r-1")),
    ("GET", "/api/rollouts/r-1/trajectory", (ADMIN, None)),
    ("POST", "/api/rollouts/r-1/complete", (ADMIN, None)),
    ("POST", "/api/rollouts/claim", (ADMIN, None)),
    ("GET", "/api/rollouts", (ADMIN, None)),
    ("POST", "/api/weights/update", (ADMIN, None)),
    ("GET", "/metrics", (ADMIN, None)),
])
def test_classify(method: str, path: str, expected: tuple[int, str | None]) -> None:
    assert classify(method, path) == expected


def test_rollout_token_round_trip_and_forgery() -> None:
    token = rollout_token(KEY, "r-abc.def")
    assert token.startswith("tgr.") and token.endswith(".r-abc.def")
    assert token_rollout(KEY.encode(), token.encode()) == "r-abc.def"
    assert token_rollout(b"another-key", token.encode()) is None
    forged = token.removesuffix("r-abc.def") + "r-other"  # the signature of one rollout on another's id
    assert token_rollout(KEY.encode(), forged.encode()) is None
    for junk in (b"", b"tgr.", b"tgr." + b"0" * 64, b"Bearer x", token.encode()[:-1]):
        assert token_rollout(KEY.encode(), junk) is None


def test_keyed_guard_statuses() -> None:
    g = Guard(KEY)
    a, b = g.token_for("r-a"), g.token_for("r-b")
    assert a == rollout_token(KEY, "r-a")

    def status(method: str, path: str, **headers: str) -> int:
        d = g.check(_scope(method, path, {k.replace("_", "-"): v for k, v in headers.items()}))
        return 200 if d is None else d.status

    assert status("GET", "/healthz") == 200
    assert status("GET", "/metrics") == 401
    assert status("GET", "/metrics", authorization="Bearer wrong") == 401
    assert status("GET", "/metrics", authorization=f"Bearer {KEY}") == 200
    assert status("GET", "/metrics", authorization=f"bearer {KEY}") == 200
    assert status("GET", "/metrics", authorization=f"Bearer {a}") == 403
    assert status("POST", "/rollouts/r-a/v1/chat/completions", authorization=f"Bearer {a}") == 200
    assert status("POST", "/rollouts/r-a/v1/chat/completions", authorization=f"Bearer {b}") == 403
    assert status("POST", "/rollouts/r-a/v1/messages", x_api_key=a) == 200
    assert status("POST", "/rollouts/r-a/v1/messages", x_api_key=b) == 403
    assert status("POST", "/v1/chat/completions", authorization=f"Bearer {a}", x_rollout_id="r-b") == 403
    # the SDK's X-Tracegym-Key wins over the "unused" key the agent's client was built with
    assert status("POST", "/v1/chat/completions", authorization="Bearer unused", x_tracegym_key=a) == 200
    assert status("POST", "/v1/chat/completions", x_tracegym_key=a, authorization="Bearer unused") == 200
    assert status("POST", "/api/rollouts/r-a/rewards", authorization=f"Bearer {a}") == 200
    assert status("POST", "/api/rollouts/r-a/rewards", authorization=f"Bearer {b}") == 403
    assert status("POST", "/api/rollouts/r-a/complete", authorization=f"Bearer {a}") == 403


def test_a_token_call_naming_no_rollout_is_attributed_to_the_tokens_rollout() -> None:
    g = Guard(KEY)
    scope = _scope("POST", "/v1/chat/completions", {"authorization": f"Bearer {g.token_for('r-a')}"})
    assert g.check(scope) is None
    assert (b"x-rollout-id", b"r-a") in scope["headers"]
    empty = _scope("POST", "/v1/chat/completions", {"authorization": f"Bearer {g.token_for('r-a')}",
                                                    "x-rollout-id": ""})
    assert g.check(empty) is None and [v for k, v in empty["headers"] if k == b"x-rollout-id"] == [b"r-a"]
    admin = _scope("POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY}"})
    assert g.check(admin) is None and all(k != b"x-rollout-id" for k, _ in admin["headers"])


def test_denials_carry_their_apis_error_shape() -> None:
    g = Guard(KEY)
    denial = g.check(_scope("POST", "/v1/messages"))
    assert denial is not None
    r = denial.response("/v1/messages")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert b'"type":"error"' in r.body and b"authentication_error" in r.body
    r = denial.response("/v1/chat/completions")
    assert b'"code":"missing_api_key"' in r.body and b"authentication_error" in r.body


@pytest.mark.parametrize(("host", "ok"), [
    ("localhost", True), ("localhost:8000", True), ("127.0.0.1:1", True), ("[::1]:8000", True), ("[::1]", True),
    ("LOCALHOST:80", True), ("gw.internal:8000", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.2", False), ("localhost.evil.example", False),
])
def test_host_allow_list(host: str, ok: bool) -> None:
    g = Guard(None, ["localhost", "127.0.0.1", "[::1]", "gw.internal"])
    d = g.check(_scope("GET", "/healthz", {"host": host}))
    assert (d is None) == ok and (d is None or d.status == 421)
    assert g.check(_scope("GET", "/healthz")) is not None  # no Host at all
    assert Guard(None).check(_scope("GET", "/healthz", {"host": "evil.example"})) is None  # no list: any


@pytest.mark.parametrize(("ctype", "ok"), [
    ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON", True),
    ("application/vnd.api+json", True), ("text/plain", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), (None, False),
])
def test_json_content_type_rule(ctype: str | None, ok: bool) -> None:
    g = Guard(None)
    headers = {"content-length": "2"} | ({"content-type": ctype} if ctype else {})
    d = g.check(_scope("POST", "/v1/chat/completions", headers))
    assert (d is None) == ok and (d is None or d.status == 415)
    assert g.check(_scope("POST", "/api/rollouts/claim", {"content-length": "0"})) is None  # no body
    chunked = g.check(_scope("POST", "/api/tasks", {"transfer-encoding": "chunked", "content-type": "text/plain"}))
    assert chunked is not None and chunked.status == 415
    assert g.check(_scope("POST", "/v1/traces", {"content-length": "9",
                                                 "content-type": "application/x-protobuf"})) is None


def test_unauthenticated_is_refused_before_the_content_type_is_judged() -> None:
    d = Guard(KEY).check(_scope("POST", "/api/tasks", {"content-length": "2", "content-type": "text/plain"}))
    assert d is not None and d.status == 401
