"""Rollout scopes against a real gateway (`tracegym serve` in front of the SGLang fake, SQLite store):
two LLM calls inside ``tg.rollout`` through each HTTP client library and through the OpenAI, Anthropic
and LangChain clients of whatever versions are installed land in the scope's rollout with its task and
agent; a rollout rewarded with no call shows the ``tracegym.no_calls`` flag in ``GET /api/rollouts/{id}``.

What the SDKs send through (read in their ``_base_client.py``): openai 2.x through ``httpx`` (``httpx2``
on request), openai 3.x and anthropic 1.x and 2.x through ``httpx2``; their ``DefaultAioHttpClient`` is
a client of the same library on an aiohttp transport (openai 2.x's needs the ``httpx_aiohttp``
package). The environment's versions are the ones tested. The other majors (the project's venv has
openai 2.x and anthropic 2.x) run in a venv layered over it:

    python -m venv /tmp/majors
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /tmp/majors/lib/python3.11/site-packages/zz_base.pth
    /tmp/majors/bin/pip install --no-deps "openai>=3,<4" "anthropic>=1,<2"
    /tmp/majors/bin/python -m pytest tests/sdk/test_instrument_gateway.py tests/sdk/test_instrument.py \
        tests/sdk/test_attribution.py
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import httpx2
import openai
import pytest
import requests

import tracegym as tg
from tests.gateway.app_support import start_fake
from tests.procs import ManagedProcess, free_port, start_process
from tests.sdk.test_attribution import join_checks
from tracegym.attribution import NO_CALLS_EVENT

MODEL = "tiny-random"
MSGS = [{"role": "user", "content": "What is 2+3?"}]
CHAT = {"model": MODEL, "messages": MSGS, "max_tokens": 8}


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    tmp = tmp_path_factory.mktemp("gw")
    port = free_port()
    with start_fake(tmp, tokenizer=tiny_model_dir) as fake:
        args = ["tracegym", "serve", "--model", MODEL, "--port", str(port), "--upstream", fake.base_url]
        args += ["--store", f"sqlite:///{tmp / 'tracegym.db'}"]
        with start_process(args, port=port, log_path=tmp / "gateway.log", health_path="/healthz") as gw:
            yield gw


@pytest.fixture(autouse=True)
def _configured(gateway: ManagedProcess) -> None:
    tg.configure(gateway_url=gateway.base_url)


def spans(gateway: ManagedProcess, rollout_id: str, n: int) -> list[dict[str, Any]]:
    """The rollout's spans once ``n`` are stored (a call is acknowledged after its span is committed, but
    check for a while anyway)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{gateway.base_url}/api/rollouts/{rollout_id}/spans")
        got = r.json()["spans"] if r.status_code == 200 else []
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# -- one call per client -----------------------------------------------------------------------------------
def _openai(gw: str) -> None:
    openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0).chat.completions.create(**CHAT)


def _openai_async(gw: str) -> None:
    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0) as c:
            await c.chat.completions.create(**CHAT)

    asyncio.run(main())


def _aiohttp_backend(sdk: Any) -> Any:
    try:
        return sdk.DefaultAioHttpClient()
    except (AttributeError, RuntimeError) as e:  # older versions, or the aiohttp extra missing
        why = f"{sdk.__name__} {sdk.__version__} has no usable DefaultAioHttpClient: {e}"
        if os.environ.get("CI"):  # the dev extra installs httpx-aiohttp: in CI this transport is tested
            pytest.fail(why)
        pytest.skip(why)


def _openai_aiohttp(gw: str) -> None:
    async def main() -> None:
        http = _aiohttp_backend(openai)
        async with openai.AsyncOpenAI(base_url=gw + "/v1", api_key="unused", http_client=http) as c:
            await c.chat.completions.create(**CHAT)

    asyncio.run(main())


def _anthropic(gw: str) -> None:
    client = anthropic.Anthropic(base_url=gw, api_key="unused", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=8, messages=MSGS)  # type: ignore[arg-type]


def _anthropic_async(gw: str) -> None:
    async def main() -> None:
        async with anthropic.AsyncAnthropic(base_url=gw, api_key="unused", max_retries=0) as c:
            await c.messages.create(model=MODEL, max_tokens=8, messages=MSGS)  # type: ignore[arg-type]

    asyncio.run(main())


def _anthropic_aiohttp(gw: str) -> None:
    async def main() -> None:
        http = _aiohttp_backend(anthropic)
        async with anthropic.AsyncAnthropic(base_url=gw, api_key="unused", http_client=http) as c:
            await c.messages.create(model=MODEL, max_tokens=8, messages=MSGS)  # type: ignore[arg-type]

    asyncio.run(main())


def _langchain(gw: str) -> None:
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    chat_openai(base_url=gw + "/v1", api_key="unused", model=MODEL, max_tokens=8).invoke("What is 2+3?")


def _httpx(gw: str) -> None:
    httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=60).raise_for_status()


def _httpx2(gw: str) -> None:
    httpx2.post(gw + "/v1/chat/completions", json=CHAT, timeout=60).raise_for_status()


def _requests(gw: str) -> None:
    requests.post(gw + "/v1/chat/completions", json=CHAT, timeout=60).raise_for_status()


def _aiohttp(gw: str) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s, s.post(gw + "/v1/chat/completions", json=CHAT) as r:
            r.raise_for_status()

    asyncio.run(main())


CLIENTS: dict[str, Callable[[str], None]] = {
    "openai": _openai,
    "openai-async": _openai_async,
    "openai-aiohttp": _openai_aiohttp,
    "anthropic": _anthropic,
    "anthropic-async": _anthropic_async,
    "anthropic-aiohttp": _anthropic_aiohttp,
    "langchain-openai": _langchain,
    "httpx": _httpx,
    "httpx2": _httpx2,
    "requests": _requests,
    "aiohttp": _aiohttp,
}


@pytest.mark.parametrize("name", list(CLIENTS))
def test_call_lands_in_the_scopes_rollout(gateway: ManagedProcess, name: str) -> None:
    with tg.rollout(task_id=f"task-{name}", agent_name=name) as scope:
        CLIENTS[name](gateway.base_url)
        CLIENTS[name](gateway.base_url)
        tg.reward(1.0)
    assert scope.tally.calls == 2
    got = spans(gateway, scope.rollout_id, 2)
    assert len(got) == 2, f"{name}: {len(got)} of 2 calls in the scope's rollout"
    assert {(s["attributes"]["tracegym.task_id"], s["attributes"]["tracegym.agent_name"]) for s in got} == {
        (f"task-{name}", name)
    }
    join_checks()
    rollout = httpx.get(f"{gateway.base_url}/api/rollouts/{scope.rollout_id}").json()
    assert rollout["reward"] == 1.0 and rollout["events"] == []  # not flagged


def test_reward_without_calls_is_flagged_on_the_rollout(gateway: ManagedProcess) -> None:
    with tg.rollout(task_id="lost") as scope:
        other = f"http://127.0.0.1:{free_port()}"  # nothing listens: the call fails, the agent goes on
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=other + "/v1", api_key="unused", max_retries=0).chat.completions.create(
                **CHAT
            )
        tg.reward(0.0)
    join_checks()
    rollout = httpx.get(f"{gateway.base_url}/api/rollouts/{scope.rollout_id}").json()
    (flag,) = [e for e in rollout["events"] if e["name"] == NO_CALLS_EVENT]
    assert flag["attributes"]["calls_elsewhere"] == [other] and flag["attributes"]["when"] == "reward"
    assert rollout["reward"] == 0.0


def test_rollout_scoped_base_url_is_not_flagged(gateway: ManagedProcess) -> None:
    """Calls attributed by the path (here through urllib, which tracegym does not patch) are seen by the
    gateway: the check asks it before flagging."""
    import json
    import urllib.request

    with tg.rollout(task_id="by-path") as scope:
        url = f"{gateway.base_url}/rollouts/{scope.rollout_id}/v1/chat/completions"
        req = urllib.request.Request(url, json.dumps(CHAT).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        assert scope.tally.calls == 0
        tg.reward(1.0)
    join_checks()
    rollout = httpx.get(f"{gateway.base_url}/api/rollouts/{scope.rollout_id}").json()
    assert rollout["events"] == [] and len(spans(gateway, scope.rollout_id, 1)) == 1
