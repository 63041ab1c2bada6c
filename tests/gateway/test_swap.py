"""Weight hot-swap through the gateway against the SGLang fake (a real process, ``--token-delay`` so a
pause lands mid-generation): the request sequence pause → update → continue, transparent continuation of
swap-aborted calls (non-stream and stream), weight_versions spans, failed swaps, and the pure pieces."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.test_app_support import MemoryRecorder, ServerThread, sse_payloads, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings
from tracegym.gateway.swap import JoinedChoice, SwapGate, continuation_request, extend_spans
from tracegym.gateway.upstream.base import GenChoice, GenerateRequest, SamplingParams
from tracegym.types import WeightVersionSpan

MODEL = "tiny-random"
REPLY = " ".join(f"word{i}" for i in range(60))
MAX = 30
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX,
        "temperature": 0.7, "seed": 3}


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("swapfake"), "--token-delay", "0.03", tokenizer=tiny_model_dir,
                    reply=REPLY) as p:
        yield p


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread,
                                                                                          MemoryRecorder]]:
    rec = MemoryRecorder()
    db = tmp_path_factory.mktemp("swapdb") / "tg.db"
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{db}")
    with ServerThread(create_app(settings, recorder=rec)) as srv:
        yield srv, rec


def _debug(fake: ManagedProcess) -> dict[str, Any]:
    return httpx.get(fake.base_url + "/debug").json()


def _during(fake: ManagedProcess, call: Any, action: Any) -> tuple[Any, Any, int]:
    """Run ``call()`` in a thread and ``action(first)`` while it generates (``first``: the index of the
    call's first upstream request in the fake's log); (call's result, action's result, first)."""
    first = len(_debug(fake)["requests"])
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("r", call()))
    t.start()
    deadline = time.monotonic() + 10
    while len(_debug(fake)["requests"]) <= first:
        assert time.monotonic() < deadline, "the call never reached the fake"
        time.sleep(0.01)
    time.sleep(0.25)  # ~8 of 30 tokens generated
    done = action(first)
    t.join(timeout=30)
    return out["r"], done, first


def _swap_during(srv: ServerThread, fake: ManagedProcess, call: Any, body: dict) -> tuple[Any, httpx.Response,
                                                                                             int]:
    """Swap while ``call()`` generates; (call's result, swap response, index of the call's first upstream
    request in the fake's log)."""
    return _during(fake, call, lambda _: httpx.post(srv.url + "/api/weights/update", json=body, timeout=30))


def _check_continuation(fake: ManagedProcess, first: int, version_before: str, version_after: str) -> int:
    """The fake saw the original request, then its continuation; returns the tokens of segment one."""
    reqs = _debug(fake)["requests"][first:]
    assert len(reqs) == 2, [r["rid"] for r in reqs]
    a, b = reqs
    k = len(b["input_ids"]) - len(a["input_ids"])
    assert 0 < k < MAX
    assert b["input_ids"][: len(a["input_ids"])] == a["input_ids"]
    assert b["rid"] == a["rid"] + "-c1"
    assert a["sampling_params"]["max_new_tokens"] == MAX and b["sampling_params"]["max_new_tokens"] == MAX - k
    same = {key: v for key, v in a["sampling_params"].items() if key != "max_new_tokens"}
    assert {key: v for key, v in b["sampling_params"].items() if key != "max_new_tokens"} == same
    assert same["sampling_seed"] == 3 and same["temperature"] == 0.7
    return k


def test_non_stream_call_is_continued_across_a_swap(gw, fake, tmp_path: Path) -> None:
    srv, rec = gw
    before = httpx.get(srv.url + "/api/weights").json()["weight_version"]
    n0 = len(rec.records)
    r, swap, first = _swap_during(
        srv, fake, lambda: httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30),
        {"model_path": str(tmp_path), "weight_version": "v-ns"})
    assert swap.status_code == 200, swap.text
    out = swap.json()
    assert out["success"] is True and out["weight_version"] == "v-ns" and out["swap_seconds"] > 0
    assert [c["path"] for c in _debug(fake)["controls"][-3:]] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert _debug(fake)["controls"][-2]["body"] == {"model_path": str(tmp_path), "weight_version": "v-ns"}
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX and body["tracegym"]["weight_version"] == "v-ns"
    k = _check_continuation(fake, first, before, "v-ns")
    call = rec.wait_for(n0 + 1)[n0]
    ch = call.choices[0]
    assert len(ch.output_ids) == MAX and len(ch.output_logprobs) == MAX and ch.finish_reason == "length"
    assert ch.weight_versions == [WeightVersionSpan(before, 0, k), WeightVersionSpan("v-ns", k, MAX)]
    assert call.weight_version == "v-ns" and call.status == "ok"
    # the second segment's ids are exactly what the fake sent for the continuation (its reply restarts)
    m = min(k, MAX - k)
    assert ch.output_ids[k:k + m] == ch.output_ids[:m]
    status = httpx.get(srv.url + "/api/weights").json()
    assert status["weight_version"] == "v-ns" and status["last_swap"]["success"] is True
    listed = httpx.get(srv.url + "/api/weight_versions").json()["weight_versions"]
    assert [v["version"] for v in listed if v["version"] == "v-ns"] == ["v-ns"]
    assert listed[-1]["path"] == str(tmp_path) and listed[-1]["swap_seconds"] > 0


def test_stream_is_one_uninterrupted_stream_across_a_swap(gw, fake, tmp_path: Path) -> None:
    srv, rec = gw
    before = httpx.get(srv.url + "/api/weights").json()["weight_version"]
    n0 = len(rec.records)

    def call() -> list[Any]:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            return sse_payloads(list(resp.iter_lines()))

    events, swap, first = _swap_during(srv, fake, call, {"model_path": str(tmp_path), "weight_version": "v-st"})
    assert swap.status_code == 200 and swap.json()["success"] is True, swap.text
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    chunks = events[:-1]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["length"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == MAX and chunks[-1]["tracegym"]["weight_version"] == "v-st"
    k = _check_continuation(fake, first, before, "v-st")
    call_rec = rec.wait_for(n0 + 1)[n0]
    ch = call_rec.choices[0]
    assert len(ch.output_ids) == MAX and ch.finish_reason == "length" and call_rec.status == "ok"
    assert ch.weight_versions == [WeightVersionSpan(before, 0, k), WeightVersionSpan("v-st", k, MAX)]
    assert ch.message["content"] == text


def _abort_during(fake: ManagedProcess, call: Any) -> Any:
    """Run ``call()`` and abort its upstream request by rid (``/abort_request``, no weight swap)."""
    def abort(first: int) -> None:
        httpx.post(fake.base_url + "/abort_request", json={"rid": _debug(fake)["requests"][first]["rid"]})

    return _during(fake, call, abort)[0]


def test_an_abort_that_is_no_swap_fails_the_call_and_is_recorded_as_an_error(gw, fake) -> None:
    """OpenAI has no 'abort' finish reason: a non-stream call gets a 502, a stream an error event; the
    span is an error (so assembly leaves it out), a streamed one with the tokens produced."""
    srv, rec = gw
    n0 = len(rec.records)
    r = _abort_during(fake, lambda: httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30))
    assert r.status_code == 502 and "aborted" in r.json()["error"]["message"], r.text
    call_rec = rec.wait_for(n0 + 1)[n0]
    assert call_rec.status == "error" and "aborted" in call_rec.error

    def stream() -> list[Any]:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "stream": True}) as resp:
            assert resp.status_code == 200
            return sse_payloads(list(resp.iter_lines()))

    events = _abort_during(fake, stream)
    assert events[-1] == "[DONE]" and "aborted" in events[-2]["error"]["message"]
    assert not any(c["choices"][0]["finish_reason"] for c in events[:-2] if c.get("choices"))
    call_rec = rec.wait_for(n0 + 2)[n0 + 1]
    assert call_rec.status == "error" and "aborted" in call_rec.error
    assert 0 < len(call_rec.choices[0].output_ids) < MAX


def test_failed_swap_is_400_and_generation_continues_on_the_old_weights(gw, fake, tmp_path: Path) -> None:
    srv, rec = gw
    before = httpx.get(srv.url + "/api/weights").json()["weight_version"]
    n0 = len(rec.records)
    r, swap, first = _swap_during(
        srv, fake, lambda: httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30),
        {"model_path": str(tmp_path / "missing"), "weight_version": "v-bad"})
    assert swap.status_code == 400
    out = swap.json()
    assert out["success"] is False and "missing" in out["message"] and out["weight_version"] == "v-bad"
    assert _debug(fake)["controls"][-1]["path"] == "/continue_generation"
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    _check_continuation(fake, first, before, before)
    ch = rec.wait_for(n0 + 1)[n0].choices[0]
    assert ch.weight_versions == [WeightVersionSpan(before, 0, MAX)]  # one version: the spans merge
    assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == before
    listed = httpx.get(srv.url + "/api/weight_versions").json()["weight_versions"]
    assert "v-bad" not in [v["version"] for v in listed]


def test_swap_without_pause_and_bad_bodies(gw, fake, tmp_path: Path) -> None:
    srv, _ = gw
    n = len(_debug(fake)["controls"])
    r = httpx.post(srv.url + "/api/weights/update", timeout=30,
                   json={"model_path": str(tmp_path), "weight_version": "v-np", "pause": False})
    assert r.status_code == 200 and r.json()["success"] is True
    assert [c["path"] for c in _debug(fake)["controls"][n:]] == ["/update_weights_from_disk"]
    for bad in ({"model_path": str(tmp_path)}, {"model_path": "", "weight_version": "x"},
                {"model_path": str(tmp_path), "weight_version": "x", "extra": 1}):
        r = httpx.post(srv.url + "/api/weights/update", json=bad, timeout=30)
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_swaps_need_an_sglang_upstream(fake) -> None:
    settings = GatewaySettings(upstream_url=fake.base_url + "/v1", upstream_kind="openai", model=MODEL,
                               store_url=None)
    with ServerThread(create_app(settings, recorder=MemoryRecorder())) as srv:
        for r in (httpx.post(srv.url + "/api/weights/update", json={"model_path": "/x", "weight_version": "1"}),
                  httpx.get(srv.url + "/api/weights")):
            assert r.status_code == 400 and "sglang-kind upstream" in r.json()["error"]["message"], r.text


# --- pure pieces -------------------------------------------------------------------------------------

def test_gate_tells_swap_aborts_from_other_aborts() -> None:
    gate = SwapGate()
    t = gate.ticket()
    assert not gate.is_pause_abort(t)  # no swap since the request started: a user abort
    gate.begin()
    assert gate.is_pause_abort(t) and gate.is_pause_abort(gate.ticket())  # swapping now
    gate.end()
    assert gate.is_pause_abort(t)  # the swap finished before the aborted response was read
    assert not gate.is_pause_abort(gate.ticket())


def test_spans_merge_and_continuation_requests() -> None:
    spans: list[WeightVersionSpan] = []
    extend_spans(spans, "0", 0, 5)
    extend_spans(spans, "0", 5, 7)
    extend_spans(spans, "1", 7, 7)  # empty segment: nothing
    extend_spans(spans, "1", 7, 9)
    assert spans == [WeightVersionSpan("0", 0, 7), WeightVersionSpan("1", 7, 9)]

    req = GenerateRequest(rid="r", operation="chat", input_ids=[1, 2],
                          sampling=SamplingParams(max_tokens=10, temperature=0.5, stop_token_ids=[9], n=2))
    j = JoinedChoice(1)
    j.add(GenChoice(1, output_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0]), "0")
    j.continuations = 1
    sub = continuation_request(req, j)
    assert sub is not None and sub.input_ids == [1, 2, 5, 6, 7] and sub.rid == "r-1-c1"
    assert sub.sampling.max_tokens == 7 and sub.sampling.n == 1 and sub.sampling.temperature == 0.5
    assert sub.sampling.stop_token_ids == [9] and req.sampling.max_tokens == 10 and req.input_ids == [1, 2]
    j.add(GenChoice(1, output_ids=list(range(7)), logprobs=[0.0] * 7), "1")
    assert continuation_request(req, j) is None  # budget spent
    final = j.final("length", None)
    assert len(final.output_ids) == 10 and final.weight_versions == [WeightVersionSpan("0", 0, 3),
                                                                      WeightVersionSpan("1", 3, 10)]
    unset = GenerateRequest(rid="r", operation="chat", input_ids=[1], sampling=SamplingParams())
    assert continuation_request(unset, j).sampling.max_tokens == 128 - 10  # SGLang's default budget
