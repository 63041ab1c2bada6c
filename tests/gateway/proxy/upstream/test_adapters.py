"""Upstream adapters against real servers: the SGLang adapter against the fake (n>1, stream deltas,
abort on early close), the OpenAI adapter against another gateway (token ids via return_token_ids) and
against a server that rejects that field, and the litellm adapter through litellm itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.gateway.app_support import REPLY, MemoryRecorder, ServerThread, sse_payloads, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.openai_errors import UpstreamRejected
from tracegym.gateway.proxy.upstream.base import GenerateRequest, SamplingParams
from tracegym.gateway.proxy.upstream.http import make_session
from tracegym.gateway.proxy.upstream.openai import OpenAIUpstream
from tracegym.gateway.proxy.upstream.sglang import SGLangUpstream
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
Q = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("fake"), "--stream-delay", "0.01", tokenizer=tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def inner(fake: ManagedProcess) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    """A gateway on the sglang fake, the upstream of the message-based adapters under test."""
    rec = MemoryRecorder()
    with ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None),
                                 recorder=rec)) as srv:
        yield srv, rec


def _req(rid: str, n: int = 1, max_tokens: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid=rid, operation="text_completion", input_ids=[1, 2, 3],
                           sampling=SamplingParams(n=n, max_tokens=max_tokens))


async def test_sglang_generate_n2_and_stream_deltas(fake: ManagedProcess) -> None:
    async with make_session(16) as session:
        up = SGLangUpstream(fake.base_url, session)
        res = await up.generate(_req("g-1", n=2))
        assert [c.index for c in res.choices] == [0, 1] and res.weight_version == "v0"
        assert res.prompt_tokens == 3 and res.choices[0].finish_reason == "stop"
        ids = res.choices[0].output_ids
        assert len(ids) == len(res.choices[0].logprobs) > 3
        streamed: dict[int, list[int]] = {0: [], 1: []}
        finishes = {}
        async for ev in up.stream(_req("s-1", n=2)):
            streamed[ev.choice.index] += ev.choice.output_ids
            if ev.choice.finish_reason:
                finishes[ev.choice.index] = ev.choice.finish_reason
        assert streamed == {0: ids, 1: ids} and finishes == {0: "stop", 1: "stop"}
        short = await up.generate(_req("g-2", max_tokens=2))
        assert short.choices[0].finish_reason == "length" and len(short.choices[0].output_ids) == 2
        info = await up.model_info()
        assert info.served_model_name == "fake-model" and info.weight_version == "v0"
        await up.close()


async def test_sglang_stream_closed_early_aborts_upstream(fake: ManagedProcess) -> None:
    async with make_session(16) as session:
        up = SGLangUpstream(fake.base_url, session)
        events = up.stream(_req("abort-me"))
        async for _ in events:
            break
        await events.aclose()
        deadline = time.monotonic() + 5
        while True:
            async with session.get(fake.base_url + "/debug") as r:
                if "abort-me" in (await r.json())["aborted"]:
                    break
            assert time.monotonic() < deadline, "the fake never saw the abort"
            await asyncio.sleep(0.05)
        await up.close()


def test_openai_upstream_is_token_exact_through_another_gateway(inner) -> None:
    srv, inner_rec = inner
    rec = MemoryRecorder()
    settings = GatewaySettings(upstream_kind="openai", upstream_url=srv.url, model=MODEL, store_url=None)
    with ServerThread(create_app(settings, recorder=rec)) as outer:
        body = httpx.post(outer.url + "/v1/chat/completions", json={"model": MODEL, "messages": Q},
                          timeout=30).json()
        assert body["choices"][0]["message"]["content"] == REPLY
        (mine,) = rec.wait_for(1)
        theirs = next(c for c in inner_rec.wait_for(1) if c.request["messages"] == Q)
        assert mine.upstream_kind == "openai" and mine.retokenized is False
        assert mine.prompt_ids == theirs.prompt_ids
        assert mine.choices[0].output_ids == theirs.choices[-1].output_ids
        with httpx.stream("POST", outer.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": Q, "stream": True}) as r:
            chunks = sse_payloads(list(r.iter_lines()))[:-1]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == REPLY
        streamed = rec.wait_for(2)[1]
        assert streamed.retokenized is False and streamed.prompt_ids == mine.prompt_ids
        assert streamed.choices[0].output_ids == mine.choices[0].output_ids
        assert streamed.choices[0].message["content"] == REPLY


async def test_openai_upstream_without_token_ids_is_marked_retokenized() -> None:
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if "return_token_ids" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument supplied: "
                                                 "return_token_ids"}}, status=400)
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "five"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        up = OpenAIUpstream(str(server.make_url("/")), session)
        req = GenerateRequest(rid="r", operation="chat", sampling=SamplingParams(),
                              body={"model": "m", "messages": Q})
        res = await up.generate(req)
        assert res.retokenized is True and res.choices[0].message["content"] == "five"
        assert res.completion_tokens == 1 and up.supports_token_ids is False
        await up.generate(req)
        assert ["return_token_ids" in b for b in seen] == [True, False, False]  # asked once, remembered


@pytest.mark.timeout(120)
def test_litellm_upstream(inner) -> None:
    srv, _ = inner
    rec = MemoryRecorder()
    settings = GatewaySettings(upstream_kind="litellm", upstream_url=srv.url + "/v1", upstream_api_key="x",
                               model="openai/tiny-random", store_url=None)
    with ServerThread(create_app(settings, recorder=rec)) as outer:
        chat = {"model": "openai/tiny-random", "messages": Q}
        body = httpx.post(outer.url + "/v1/chat/completions", json=chat, timeout=60).json()
        assert body["choices"][0]["message"]["content"] == REPLY
        with httpx.stream("POST", outer.url + "/v1/chat/completions", json={**chat, "stream": True},
                          timeout=60) as r:
            chunks = sse_payloads(list(r.iter_lines()))
        assert chunks[-1] == "[DONE]"
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]
                       if c["choices"]) == REPLY
        calls = rec.wait_for(2)
        assert [c.upstream_kind for c in calls] == ["litellm", "litellm"]
        assert all(c.retokenized and c.status == "ok" for c in calls)


@pytest.mark.parametrize(("upstream", "status", "kind"), [
    (429, 429, "rate_limit_error"), (408, 504, "upstream_timeout"), (404, 400, "invalid_request_error"),
    (503, 502, "upstream_error"),
])
def test_upstream_error_statuses_map_to_what_clients_handle(upstream: int, status: int, kind: str) -> None:
    """A rate limit stays a 429 (OpenAI SDKs back off and retry it); other rejections are the client's
    request (400) or the upstream's failure (502/504)."""
    e = UpstreamRejected(upstream, "nope")
    assert (e.status, e.body()["error"]["type"]) == (status, kind)
    assert f"HTTP {upstream}" in e.message


def _plain_openai_server() -> Any:
    """An OpenAI-compatible server without token ids (a hosted API): a two-chunk stream, then the
    ``include_usage`` chunk with no choices."""
    from fastapi import FastAPI
    from starlette.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        def chunk(**kw: Any) -> bytes:
            return b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", **kw}) + b"\n\n"

        async def body() -> Any:
            yield chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": "fi"}}])
            yield chunk(choices=[{"index": 0, "delta": {"content": "ve"}, "finish_reason": "stop"}])
            yield chunk(choices=[], usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_openai_upstream_stream_usage_comes_from_its_usage_chunk() -> None:
    """Without token ids the streamed call's usage is the upstream's own count, not zero."""
    with ServerThread(_plain_openai_server()) as upstream:
        rec = MemoryRecorder()
        settings = GatewaySettings(upstream_kind="openai", upstream_url=upstream.url, model=MODEL, store_url=None)
        with ServerThread(create_app(settings, recorder=rec)) as gw:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30,
                              json={"model": MODEL, "messages": Q, "stream": True,
                                    "stream_options": {"include_usage": True}}) as r:
                chunks = sse_payloads(list(r.iter_lines()))[:-1]
            (call,) = rec.wait_for(1)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "five"
    assert chunks[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    assert (call.input_tokens, call.output_tokens, call.retokenized) == (9, 2, True)


def test_prompt_logprobs_through_an_openai_upstream_are_refused_not_dropped() -> None:
    """The gateway answers prompt logprobs from a token-native upstream's input logprobs; through an
    OpenAI-compatible one it has none to answer, so the request is a 400 before anything is sent."""
    with ServerThread(_plain_openai_server()) as upstream:
        rec = MemoryRecorder()
        settings = GatewaySettings(upstream_kind="openai", upstream_url=upstream.url, model=MODEL, store_url=None)
        with ServerThread(create_app(settings, recorder=rec)) as gw:
            res = httpx.post(gw.url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": "2 + 3 =", "max_tokens": 2, "prompt_logprobs": 1})
    assert res.status_code == 400, res.text
    assert "token-native upstream" in res.json()["error"]["message"]
    assert res.json()["error"]["param"] == "prompt_logprobs"
    assert not rec.records
