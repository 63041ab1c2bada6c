"""Header injection: httpx sync/async and the OpenAI client, inside and outside a scope, other hosts."""

from __future__ import annotations

import httpx
import openai
import pytest

import tracegym as tg
from tests.sdk.fake_gateway import FakeGateway
from tracegym.instrument import targets_gateway

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
