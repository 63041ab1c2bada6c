"""The SDK's side of the gateway's keys: a rollout scope's key travels as ``X-Tracegym-Key`` on the
agent's requests to the gateway (whatever API key its client holds), and the admin key is read from
``TRACEGYM_ADMIN_KEY`` when ``TRACEGYM_API_KEY`` is not set."""

from __future__ import annotations

import httpx
import pytest

from tracegym.client import SDKConfig, current_config
from tracegym.context import RolloutScope, enter_scope


def test_scope_headers_carry_its_key() -> None:
    keyed = RolloutScope("r-1", config=SDKConfig("http://127.0.0.1:9", api_key="tgr.x.r-1"))
    assert keyed.headers()["X-Tracegym-Key"] == "tgr.x.r-1"
    assert "X-Tracegym-Key" not in RolloutScope("r-1", config=SDKConfig("http://127.0.0.1:9")).headers()


def test_an_agents_request_to_the_gateway_is_stamped_with_the_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})

    scope = RolloutScope("r-1", config=SDKConfig("http://127.0.0.1:9", api_key="tgr.sig.r-1"))
    with enter_scope(scope), httpx.Client(transport=httpx.MockTransport(handler)) as client:
        client.post("http://127.0.0.1:9/v1/chat/completions", json={}, headers={"Authorization": "Bearer unused"})
        client.post("http://elsewhere.example/v1/chat/completions", json={})
    to_gateway, elsewhere = seen
    assert to_gateway.headers["x-tracegym-key"] == "tgr.sig.r-1"
    assert to_gateway.headers["authorization"] == "Bearer unused"  # the client's own header is left alone
    assert "x-tracegym-key" not in elsewhere.headers  # never sent to another host


def test_admin_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEGYM_API_KEY", raising=False)
    monkeypatch.setenv("TRACEGYM_ADMIN_KEY", "adm")
    assert current_config().api_key == "adm"
    monkeypatch.setenv("TRACEGYM_API_KEY", "api")
    assert current_config().api_key == "api"
