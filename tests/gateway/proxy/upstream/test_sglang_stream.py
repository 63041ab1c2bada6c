"""SGLang's stream through the gateway when its events arrive together (a gateway reading behind its
engine): each event holds the whole output so far, so of the events of one read only the last is turned
into a delta; the client gets the same text, token ids and logprobs in fewer chunks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import REPLY, MemoryRecorder, ServerThread, sse_payloads, start_fake
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.upstream.http import sse_events
from tracegym.gateway.proxy.upstream.sglang import _holds
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
Q = [{"role": "user", "content": "What is 2+3?"}]


def _event(n: int, *, version: str = "v1", finish: dict | None = None, index: int = 0) -> dict:
    return {"index": index, "output_ids": list(range(n)),
            "meta_info": {"weight_version": version, "finish_reason": finish}}


def test_events_are_marked_when_more_or_the_end_came_with_them() -> None:
    reads = [b'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: {"a"', b': 3}\n\n', b'data: {"a": 4}\n\ndata: [DONE]\n\n']

    async def events(reads: list[bytes]) -> list[tuple[int, bool]]:
        it = iter(reads)

        async def read() -> bytes:
            return next(it, b"")

        return [(e["a"], more) async for e, more in sse_events(read)]

    assert asyncio.run(events(reads)) == [(1, True), (2, False), (3, False), (4, True)]
    assert asyncio.run(events([b'data: {"a": 1}\n\n', b'data: {"a": 2}'])) == [(1, False), (2, True)]  # no [DONE]


def test_a_later_event_holds_an_earlier_one_of_the_same_choice_and_version() -> None:
    assert _holds(_event(3), _event(2))
    assert not _holds(_event(3, version="v2"), _event(2))  # the earlier tokens keep their own version
    assert not _holds(_event(3, index=1), _event(2))  # n > 1: another choice's
    assert not _holds(_event(3), _event(2, finish={"type": "stop"}))  # an ended choice ends there


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    with start_fake(tmp_path_factory.mktemp("one-write"), "--one-write", tokenizer=tiny_model_dir) as fake:
        rec = MemoryRecorder()
        with ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None),
                                     recorder=rec)) as srv:
            yield srv, rec


def test_events_received_together_are_one_delta_with_every_token(gw: tuple[ServerThread, MemoryRecorder]) -> None:
    srv, rec = gw
    whole = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": Q, "logprobs": True}).json()
    body = {"model": MODEL, "messages": Q, "stream": True, "logprobs": True, "return_token_ids": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        chunks = sse_payloads(list(r.iter_lines()))[:-1]
    deltas = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(deltas) == 1 and deltas[0]["delta"]["content"] == REPLY == whole["choices"][0]["message"]["content"]
    tokens = [e["token"] for e in deltas[0]["logprobs"]["content"]]
    assert tokens == [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    calls = {c.call_id: c for c in rec.wait_for(2)}
    streamed, plain = calls[chunks[0]["id"]].choices[0], calls[whole["id"]].choices[0]
    assert streamed.output_ids == plain.output_ids and streamed.output_logprobs == plain.output_logprobs
    assert deltas[0]["token_ids"] == streamed.output_ids


def test_tokens_that_arrive_apart_go_out_apart(tiny_model_dir: Path, tmp_path: Path) -> None:
    """0.2 s between tokens: each read holds one event, even on a loaded machine, so the deltas are several."""
    with start_fake(tmp_path, "--stream-delay", "0.2", tokenizer=tiny_model_dir) as fake, \
            ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None),
                                    recorder=MemoryRecorder())) as srv:
        body = {"model": MODEL, "messages": Q, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            chunks = sse_payloads(list(r.iter_lines()))[:-1]
    texts = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert "".join(texts) == REPLY and len(texts) >= 6  # 11 tokens, each its own read but for a stall
