"""Admission control under load (docs/security.md, Limits): calls past the gateway's or a token's bound are
429s with ``Retry-After`` in their API's shape; wrong keys from one address meet a rate limit; clients that
trickle their headers or body are answered 408 and closed, and connections past the limit are closed; the
limiter and budget objects on their own."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.gateway.app_support import ServerThread, start_fake
from tests.procs import ManagedProcess, free_port
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.admission import Admission, ByteBudget, FailureLimiter, RolloutStates
from tracegym.gateway.proxy.connections import limited_protocol
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
KEY = "admission-admin-key-Vv3"
ADMIN = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
DELAY_S = 1.5


@pytest.fixture(scope="module")
def slow_fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("slowfake"), "--delay", str(DELAY_S), tokenizer=tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def gw(slow_fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("adm") / "tg.db"
    settings = GatewaySettings(upstream_url=slow_fake.base_url, model=MODEL, store_url=f"sqlite:///{db}",
                               admin_key=KEY, max_concurrent_calls=3, max_concurrent_calls_per_rollout=1,
                               retry_after_s=2)
    with ServerThread(create_app(settings)) as srv:
        yield srv


def _all_at_once(calls: list) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda f: f(), calls))


def test_calls_past_the_gateways_and_a_tokens_bound_are_429(gw) -> None:
    srv = gw
    httpx.post(srv.url + "/api/tasks", json={"tasks": [{"input": 1}]}, headers=ADMIN).raise_for_status()
    claimed = httpx.post(srv.url + "/api/rollouts/claim", json={"worker_id": "w"}, headers=ADMIN).json()
    token = claimed["rollouts"][0]["token"]

    def call(path: str, body: dict, key: str) -> httpx.Response:
        return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    # one token, two calls at once: one is served, one refused (in Anthropic's shape on /v1/messages)
    got = _all_at_once([lambda: call("/v1/chat/completions", CHAT, token), lambda: call("/v1/messages", MESSAGES, token)])
    assert sorted(r.status_code for r in got) == [200, 429], [r.text for r in got]
    refused = next(r for r in got if r.status_code == 429)
    assert refused.headers["retry-after"] == "2"
    body = refused.json()
    assert body["error"]["type"] in ("rate_limit_error",), body
    # the gateway's bound: 5 admin calls at once against 3 places
    got = _all_at_once([lambda: call("/v1/chat/completions", CHAT, KEY)] * 5)
    assert sorted(r.status_code for r in got) == [200, 200, 200, 429, 429], [r.text for r in got]
    assert all(r.json()["error"]["code"] == "too_many_requests" for r in got if r.status_code == 429)
    admission = srv.app.state.admission
    # every place given back: each just after its answer was written, so the client may read it first
    deadline = time.monotonic() + 5
    while (admission.active or admission.by_rollout) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admission.active == 0 and admission.by_rollout == {}
    assert call("/v1/chat/completions", CHAT, token).status_code == 200


def test_wrong_keys_from_one_address_meet_a_rate_limit(slow_fake) -> None:
    settings = GatewaySettings(upstream_url=slow_fake.base_url, model=MODEL, store_url=None, admin_key=KEY,
                               auth_failures_per_minute=5)
    with ServerThread(create_app(settings)) as srv, httpx.Client(base_url=srv.url) as client:
        codes = [client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code for _ in range(8)]
        assert codes == [401] * 5 + [429] * 3, codes
        blocked = client.get("/v1/models", headers=ADMIN)
        assert blocked.status_code == 429 and int(blocked.headers["retry-after"]) >= 1
        assert client.get("/healthz").status_code == 200  # open routes stay open


def _serve_limited(app, *, header_s: float, body_s: float, max_connections: int) -> tuple[uvicorn.Server, int]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=limited_protocol(header_s, body_s, max_connections))
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, port


async def _echo(scope, receive, send) -> None:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_clients_are_answered_408_and_connections_past_the_limit_closed() -> None:
    server, port = _serve_limited(_echo, header_s=0.5, body_s=0.5, max_connections=3)
    try:
        trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
        trickle.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        slow_body = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow_body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")  # 97 bytes short
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)  # sends nothing
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert _read_all(extra).startswith(b"HTTP/1.1 503")  # the 4th of 3 allowed
        started = time.monotonic()
        for sock in (trickle, slow_body, idle):
            assert _read_all(sock).startswith(b"HTTP/1.1 408"), sock
            sock.close()
        assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:  # a prompt client is served
            ok.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
            assert _read_all(ok).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True


def test_failure_limiter_refills_and_forgets() -> None:
    now = [0.0]
    limiter = FailureLimiter(6, clock=lambda: now[0])  # 6 per minute: one every 10 s
    for _ in range(6):
        assert limiter.wait("a") is None
        limiter.failed("a")
    assert limiter.wait("a") == pytest.approx(10.0)
    assert limiter.wait("b") is None
    now[0] = 10.0
    assert limiter.wait("a") is None
    now[0] = 1000.0
    assert limiter.wait("a") is None and not limiter._buckets


def test_rollout_states_look_up_the_store_once_per_ttl() -> None:
    class Store:
        reads = 0
        status = "running"

        def get_rollout(self, rid: str) -> dict:
            Store.reads += 1
            return {"rollout_id": rid, "status": Store.status}

    now = [0.0]
    states, store = RolloutStates(2.0, clock=lambda: now[0]), Store()
    assert asyncio.run(states.ended_status(store, "r")) is None
    assert asyncio.run(states.ended_status(store, "r")) is None and Store.reads == 1
    Store.status = "completed"  # ended on another gateway
    now[0] = 2.5
    assert asyncio.run(states.ended_status(store, "r")) == "completed" and Store.reads == 2
    assert asyncio.run(states.ended_status(store, "r")) == "completed" and Store.reads == 2
    states.ended("r2", "failed")
    assert asyncio.run(states.ended_status(store, "r2")) == "failed" and Store.reads == 2


def test_admission_and_byte_budget_give_back_what_they_took() -> None:
    adm = Admission(GatewaySettings(max_concurrent_calls=2, max_concurrent_calls_per_rollout=1))
    assert adm.enter("r") is None and adm.enter("r") is not None and adm.enter(None) is None
    assert adm.enter(None) is not None
    adm.leave("r")
    adm.leave(None)
    assert adm.active == 0 and adm.by_rollout == {}
    budget = ByteBudget(10)
    assert budget.take(25)  # alone, larger than the budget: served
    assert not budget.take(1)
    budget.give(25)
    assert budget.take(6) and not budget.take(6) and budget.take(4)
