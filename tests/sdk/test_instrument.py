"""Header injection through each HTTP client library (httpx, httpx2, requests, aiohttp) and the OpenAI
client, inside and outside a scope, other hosts, headers the caller set; what the scope's tally counts;
libraries imported only inside a scope. (The Anthropic SDK and both SDKs' previous major versions are
tested against a real gateway in test_instrument_gateway.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import httpx2
import openai
import pytest
import requests

import tracegym as tg
from tests.sdk.fake_gateway import FakeGateway
from tracegym.instrument import instrumented, targets_gateway

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = ["httpx", "httpx2", "requests", "aiohttp"]

ROLLOUT_HEADERS = ("x-rollout-id", "x-task-id", "x-agent-name")


def _attribution(headers: dict[str, str]) -> dict[str, str]:
    return {k: headers[k] for k in ROLLOUT_HEADERS if k in headers}


def test_httpx_sync_inside_and_outside(gw: FakeGateway) -> None:
    with httpx.Client() as client:  # created before any scope: still instrumented
        assert _attribution(client.get(gw.url + "/echo").json()) == {}
        with tg.rollout(task_id="t1", rollout_id="r1", agent_name="solver"):
            got = _attribution(client.get(gw.url + "/echo").json())
        assert got == {"x-rollout-id": "r1", "x-task-id": "t1", "x-agent-name": "solver"}
        assert _attribution(client.get(gw.url + "/echo").json()) == {}


async def test_httpx_async_per_task(gw: FakeGateway) -> None:
    import asyncio

    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def call(i: int) -> str:
            async with tg.rollout(rollout_id=f"r{i}"):
                await asyncio.sleep(0.01 * (i % 2))
                return (await client.get("/echo")).json()["x-rollout-id"]

        assert await asyncio.gather(*(call(i) for i in range(6))) == [f"r{i}" for i in range(6)]
        assert "x-rollout-id" not in (await client.get("/echo")).json()


def test_caller_headers_win(gw: FakeGateway) -> None:
    with tg.rollout(rollout_id="scope"):
        got = httpx.get(gw.url + "/echo", headers={"X-Rollout-Id": "mine"}).json()
    assert got["x-rollout-id"] == "mine"


def test_not_injected_to_other_hosts(gw: FakeGateway) -> None:
    with FakeGateway() as other, tg.rollout(rollout_id="r"):
        assert "x-rollout-id" not in httpx.get(other.url + "/echo").json()
        # localhost and 127.0.0.1 are the same gateway
        assert httpx.get(gw.url.replace("127.0.0.1", "localhost") + "/echo").json()["x-rollout-id"] == "r"


def test_targets_gateway_rules() -> None:
    u = httpx.URL
    assert targets_gateway("http://127.0.0.1:8000", "http://[::1]:8000/v1")  # plain strings too
    assert targets_gateway("http://127.0.0.1:8000", httpx2.URL("http://localhost:8000/v1"))
    assert targets_gateway("http://127.0.0.1:8000", u("http://localhost:8000/v1/chat/completions"))
    assert not targets_gateway("http://127.0.0.1:8000", u("http://127.0.0.1:8001/v1"))
    assert not targets_gateway("http://127.0.0.1:8000", u("https://127.0.0.1:8000/v1"))
    assert targets_gateway("https://gw.example", u("https://gw.example:443/v1"))
    assert not targets_gateway("https://gw.example", u("https://api.openai.com/v1"))
    assert targets_gateway("http://h/tg", u("http://h/tg/v1/models"))
    assert not targets_gateway("http://h/tg", u("http://h/tgx/v1"))
    assert not targets_gateway("http://h/tg", u("http://h/v1"))


def test_openai_client(gw: FakeGateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with tg.rollout(task_id="task-o", rollout_id="rollout-o"):
        resp = client.chat.completions.create(model="fake", messages=msgs)
    assert resp.choices[0].message.content == "rollout-o"
    assert _attribution(gw.state.seen_headers[-1]) == {"x-rollout-id": "rollout-o", "x-task-id": "task-o"}
    outside = client.chat.completions.create(model="fake", messages=msgs)
    assert outside.choices[0].message.content == "none"


async def test_async_openai_client(gw: FakeGateway) -> None:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)

    @tg.rollout(agent_name="async-agent")
    async def agent() -> tuple[str, str]:
        resp = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        s = tg.current_rollout()
        assert s is not None
        return s.rollout_id, resp.choices[0].message.content or ""

    rid, content = await agent()
    assert content == rid
    assert gw.state.seen_headers[-1]["x-agent-name"] == "async-agent"
    await client.close()


@pytest.mark.parametrize("gateway_path", ["", "/prefix"])
def test_scope_uses_its_own_gateway(gw: FakeGateway, gateway_path: str) -> None:
    tg.configure(gateway_url=gw.url + gateway_path)
    with tg.rollout(rollout_id="p"):
        got = httpx.get(gw.url + "/echo").json()
    assert ("x-rollout-id" in got) == (gateway_path == "")


# -- every client library ------------------------------------------------------------------------------
async def _aiohttp(method: str, url: str, headers: dict[str, str] | None, body: Any) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers, json=body) as r,
    ):
        return await r.json()


def send(lib: str, url: str, headers: dict[str, str] | None = None, body: Any = None) -> dict[str, Any]:
    """GET ``url`` (POST ``body`` as JSON when given) with ``lib``; the answer's JSON."""
    method = "GET" if body is None else "POST"
    if lib == "httpx":
        return httpx.request(method, url, headers=headers, json=body).json()
    if lib == "httpx2":
        return httpx2.request(method, url, headers=headers, json=body).json()
    if lib == "requests":
        return requests.request(method, url, headers=headers, json=body, timeout=30).json()
    return asyncio.run(_aiohttp(method, url, headers, body))  # asyncio.run's task inherits the scope


@pytest.mark.parametrize("lib", LIBRARIES)
def test_each_library_is_stamped_only_in_scope(gw: FakeGateway, lib: str) -> None:
    echo = gw.url + "/echo"
    assert _attribution(send(lib, echo)) == {}
    with tg.rollout(task_id="t", rollout_id=f"r-{lib}", agent_name=lib):
        got = _attribution(send(lib, echo))
        mine = send(lib, echo, headers={"x-rollout-id": "mine"})["x-rollout-id"]
        with FakeGateway() as other:
            elsewhere = _attribution(send(lib, other.url + "/echo"))
    assert got == {"x-rollout-id": f"r-{lib}", "x-task-id": "t", "x-agent-name": lib}
    assert mine == "mine" and elsewhere == {}
    assert _attribution(send(lib, echo)) == {}
    assert lib in instrumented()


@pytest.mark.parametrize("lib", LIBRARIES)
def test_each_library_counts_calls_on_the_tally(gw: FakeGateway, lib: str) -> None:
    call = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    with tg.rollout(rollout_id="counted") as scope:
        send(lib, gw.url + "/echo")  # reaches the gateway, but is no LLM call
        assert (scope.tally.calls, scope.tally.touched) == (0, True)
        reply = send(lib, gw.url + "/v1/chat/completions", body=call)
        send(lib, gw.url + "/v1/chat/completions", headers={"X-Rollout-Id": "another"}, body=call)
        with FakeGateway() as other:
            send(lib, other.url + "/v1/chat/completions", body=call)
        assert scope.tally.calls == 1  # the call attributed to another rollout is not this one's
        assert scope.tally.elsewhere == {other.url}
    assert reply["choices"][0]["message"]["content"] == "counted"


async def test_httpx2_async_per_task(gw: FakeGateway) -> None:
    async with httpx2.AsyncClient(base_url=gw.url) as client:

        async def call(i: int) -> str:
            async with tg.rollout(rollout_id=f"r{i}"):
                await asyncio.sleep(0.01 * (i % 2))
                return (await client.get("/echo")).json()["x-rollout-id"]

        assert await asyncio.gather(*(call(i) for i in range(6))) == [f"r{i}" for i in range(6)]
        assert "x-rollout-id" not in (await client.get("/echo")).json()


async def test_aiohttp_session_base_url_and_default_headers(gw: FakeGateway) -> None:
    session = aiohttp.ClientSession(base_url=gw.url, headers={"X-Task-Id": "session-default"})
    async with session, tg.rollout(task_id="scope-task", rollout_id="aio"), session.get("/echo") as r:
        got = _attribution(await r.json())
    # the relative URL is on the gateway through the session's base_url; the session's default wins
    assert got == {"x-rollout-id": "aio", "x-task-id": "session-default"}


def test_requests_session_default_headers_win(gw: FakeGateway) -> None:
    with requests.Session() as s, tg.rollout(task_id="scope-task", rollout_id="rq"):
        s.headers["X-Task-Id"] = "session-default"
        got = _attribution(s.get(gw.url + "/echo", timeout=30).json())
    assert got == {"x-rollout-id": "rq", "x-task-id": "session-default"}


_LATE_IMPORTS = """
import json, sys
import tracegym as tg
tg.configure(gateway_url=sys.argv[1])
late = ("httpx2", "requests", "aiohttp")
loaded_first = [m for m in late if m in sys.modules]
with tg.rollout(rollout_id="late"):
    import asyncio, aiohttp, httpx2, requests

    async def aio():
        async with aiohttp.ClientSession() as s, s.get(sys.argv[1] + "/echo") as r:
            return (await r.json()).get("x-rollout-id")

    got = {
        "httpx2": httpx2.get(sys.argv[1] + "/echo").json().get("x-rollout-id"),
        "requests": requests.get(sys.argv[1] + "/echo", timeout=30).json().get("x-rollout-id"),
        "aiohttp": asyncio.run(aio()),
    }
print(json.dumps({"loaded_first": loaded_first, "got": got}))
"""


def test_libraries_imported_inside_a_scope_are_patched_before_their_first_request(gw: FakeGateway) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _LATE_IMPORTS, gw.url], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded_first"] == []  # import tracegym imports none of them
    assert result["got"] == {"httpx2": "late", "requests": "late", "aiohttp": "late"}
