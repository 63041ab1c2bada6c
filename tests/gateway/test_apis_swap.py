"""A weight swap during a Responses stream and during a Messages call: the call is continued across it
exactly as a chat call is (one response, all tokens, ``weight_versions`` spans in the record), since all
three APIs run the same upstream call. SGLang fake with ``--token-delay`` so the pause lands mid-generation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.gateway.app_support import MemoryRecorder, ServerThread, recorded_gateway, slow_fake
from tests.procs import ManagedProcess
from tracegym.types import WeightVersionSpan

MODEL = "tiny-random"
MAX = 30


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with slow_fake(tmp_path_factory.mktemp("swapfake"), tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread,
                                                                                          MemoryRecorder]]:
    with recorded_gateway(fake.base_url, tmp_path_factory.mktemp("swapdb"), MODEL) as pair:
        yield pair


def _swap_during(srv: ServerThread, fake: ManagedProcess, call: Any, version: str, path: Path) -> Any:
    seen = len(httpx.get(fake.base_url + "/debug").json()["requests"])
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", call()))
    t.start()
    deadline = time.monotonic() + 10
    while len(httpx.get(fake.base_url + "/debug").json()["requests"]) <= seen:
        assert time.monotonic() < deadline, "the call never reached the fake"
        time.sleep(0.01)
    time.sleep(0.25)  # ~8 of 30 tokens generated
    swap = httpx.post(srv.url + "/api/weights/update", json={"model_path": str(path), "weight_version": version},
                      timeout=30)
    assert swap.status_code == 200 and swap.json()["success"] is True, swap.text
    t.join(timeout=30)
    return out["r"]


def _check_record(rec: MemoryRecorder, n0: int, before: str, version: str, api: str) -> None:
    call = rec.wait_for(n0 + 1)[n0]
    ch = call.choices[0]
    assert call.api == api and call.status == "ok" and len(ch.output_ids) == MAX
    spans = ch.weight_versions
    assert [s.version for s in spans] == [before, version] and spans[0].start == 0 and spans[-1].end == MAX
    assert spans == [WeightVersionSpan(before, 0, spans[0].end), WeightVersionSpan(version, spans[0].end, MAX)]


def test_responses_stream_is_continued_across_a_swap(gw, fake, tmp_path: Path) -> None:
    srv, rec = gw
    before, n0 = httpx.get(srv.url + "/api/weights").json()["weight_version"], len(rec.records)

    def call() -> list[dict]:
        body = {"model": MODEL, "input": "count", "max_output_tokens": MAX, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=30) as r:
            return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]

    events = _swap_during(srv, fake, call, "v-resp", tmp_path)
    assert events[-1]["type"] == "response.incomplete" and not any(e["type"] == "error" for e in events)
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] == MAX and final["tracegym"]["weight_version"] == "v-resp"
    _check_record(rec, n0, before, "v-resp", "responses")


def test_messages_call_is_continued_across_a_swap(gw, fake, tmp_path: Path) -> None:
    srv, rec = gw
    before, n0 = httpx.get(srv.url + "/api/weights").json()["weight_version"], len(rec.records)
    c = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    m = _swap_during(srv, fake, lambda: c.messages.create(model=MODEL, max_tokens=MAX, messages=[
        {"role": "user", "content": "count"}]), "v-msg", tmp_path)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == MAX
    assert m.model_extra["tracegym"]["weight_version"] == "v-msg"
    _check_record(rec, n0, before, "v-msg", "messages")
