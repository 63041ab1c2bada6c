"""Weight hot-swap through the gateway against the SGLang fake (a real process, ``--token-delay`` so a
pause lands mid-generation): the disk sequence pause → update → continue and the distributed one pause →
flush → begin → buckets → end → continue (the test stands in for the trainer's broadcast, see
``benchmarks/fake_sglang.py``), transparent continuation of swap-aborted calls (non-stream and stream),
weight_versions spans, failed swaps, one swap at a time (409), and the pure pieces."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.app_support import (
    SWAP_REPLY,
    MemoryRecorder,
    ServerThread,
    recorded_gateway,
    slow_fake,
    sse_payloads,
    start_fake,
)
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateRequest, SamplingParams
from tracegym.gateway.proxy.upstream.continuation import JoinedChoice, continuation_request, extend_spans
from tracegym.gateway.proxy.upstream.swap import Bucket, SwapGate, bucket_payload
from tracegym.gateway.settings import GatewaySettings
from tracegym.types import WeightVersionSpan

MODEL = "tiny-random"
REPLY = SWAP_REPLY
MAX = 30
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX,
        "temperature": 0.7, "seed": 3}


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with slow_fake(tmp_path_factory.mktemp("swapfake"), tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread,
                                                                                          MemoryRecorder]]:
    with recorded_gateway(fake.base_url, tmp_path_factory.mktemp("swapdb"), MODEL) as pair:
        yield pair


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
                  httpx.post(srv.url + "/api/weights/distributed/init", json=GROUP),
                  httpx.post(srv.url + "/api/weights/distributed/update", json=_update("1", [["a"]])),
                  httpx.get(srv.url + "/api/weights")):
            assert r.status_code == 400 and "sglang-kind upstream" in r.json()["error"]["message"], r.text


# --- the distributed (NCCL) sequence ---------------------------------------------------------------

GROUP = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 2}


def _update(version: str, buckets: list[list[str]]) -> dict[str, Any]:
    """An update body with one float32 vector of size 2 per name."""
    return {"weight_version": version, "buckets": [
        {"names": names, "dtypes": ["float32"] * len(names), "shapes": [[2]] * len(names)} for names in buckets]}


def _distributed(srv: ServerThread, fake: ManagedProcess, body: dict[str, Any],
                 on_event: Any = None) -> list[dict[str, Any]]:
    """Run a distributed swap as the trainer would: on each bucket event, broadcast that bucket (here: tell
    the fake it was sent); ``on_event(ev)`` runs first. Returns the events."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.url + "/api/weights/distributed/update", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-ndjson"
        for line in resp.iter_lines():
            ev = json.loads(line)
            events.append(ev)
            if on_event is not None:
                on_event(ev)
            if ev["event"] == "bucket":
                names = body["buckets"][ev["index"]]["names"]
                httpx.post(fake.base_url + "/debug/broadcast", json={"names": names}).raise_for_status()
    return events


def test_distributed_swap_sequence_and_an_in_flight_call_continued_across_it(gw, fake) -> None:
    srv, rec = gw
    before = httpx.get(srv.url + "/api/weights").json()["weight_version"]
    n0, c0 = len(rec.records), len(_debug(fake)["controls"])
    body = _update("v-dist", [["a", "b"], ["c"]])
    r, events, first = _during(fake, lambda: httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30),
                               lambda _: _distributed(srv, fake, body))
    assert [e["event"] for e in events] == ["bucket", "bucket", "done"]
    assert [e["index"] for e in events[:2]] == [0, 1]
    done = events[-1]
    assert done["success"] is True and done["weight_version"] == "v-dist" and done["swap_seconds"] > 0, done
    controls = _debug(fake)["controls"][c0:]
    assert [c["path"] for c in controls] == [
        "/pause_generation", "/flush_cache", "/begin_weight_update", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/end_weight_update", "/continue_generation"]
    assert controls[0]["body"] == {"mode": "abort"} and controls[2]["body"] == {"selector": "all"}
    assert controls[3]["body"] == {"names": ["a", "b"], "dtypes": ["float32", "float32"], "shapes": [[2], [2]],
                                   "group_name": "weight_update_group", "flush_cache": False}
    assert controls[4]["body"] == {"names": ["c"], "dtypes": ["float32"], "shapes": [[2]],
                                   "group_name": "weight_update_group", "flush_cache": False,
                                   "weight_version": "v-dist"}  # stamped once, with the last bucket
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX and r.json()["tracegym"]["weight_version"] == "v-dist"
    k = _check_continuation(fake, first, before, "v-dist")
    call = rec.wait_for(n0 + 1)[n0]
    assert call.status == "ok" and call.choices[0].weight_versions == [
        WeightVersionSpan(before, 0, k), WeightVersionSpan("v-dist", k, MAX)]
    status = httpx.get(srv.url + "/api/weights").json()
    assert status["weight_version"] == "v-dist" and not status["swapping"]
    assert status["last_swap"]["kind"] == "distributed" and status["last_swap"]["model_path"] is None
    listed = httpx.get(srv.url + "/api/weight_versions").json()["weight_versions"]
    assert [(v["path"], v["swap_seconds"] > 0) for v in listed if v["version"] == "v-dist"] == [(None, True)]


def test_distributed_failure_midway_is_reported_and_generation_continues(gw, fake) -> None:
    """Bucket 2 of 3 is refused: no third bucket, the session still ends, generation continues (a streamed
    call here), and the version is not stamped (it goes with the last bucket only)."""
    srv, rec = gw
    before = httpx.get(srv.url + "/api/weights").json()["weight_version"]
    n0, c0 = len(rec.records), len(_debug(fake)["controls"])

    def stream() -> list[Any]:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            return sse_payloads(list(resp.iter_lines()))

    body = _update("v-fail", [["a"], ["b.fail"], ["c"]])
    chunks, events, first = _during(fake, stream, lambda _: _distributed(srv, fake, body))
    assert [e["event"] for e in events] == ["bucket", "bucket", "done"]
    done = events[-1]
    assert done["success"] is False and "bucket 2 of 3" in done["message"] and "b.fail" in done["message"]
    # the engine loaded bucket 1 on receipt: it reloads its previous weights from disk when a directory
    # holds them (an earlier disk swap of this module), else it stays in the rotation for the next push
    reload = ["/update_weights_from_disk"] if "rolled back" in done["message"] else []
    assert [c["path"] for c in _debug(fake)["controls"][c0:]] == [
        "/pause_generation", "/flush_cache", "/begin_weight_update", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/end_weight_update", *reload, "/continue_generation"]
    assert chunks[-1] == "[DONE]" and not any("error" in c for c in chunks[:-1])
    assert chunks[-2]["usage"]["completion_tokens"] == MAX and chunks[-2]["tracegym"]["weight_version"] == before
    _check_continuation(fake, first, before, before)
    call = rec.wait_for(n0 + 1)[n0]
    assert call.status == "ok" and call.choices[0].weight_versions == [WeightVersionSpan(before, 0, MAX)]
    status = httpx.get(srv.url + "/api/weights").json()
    assert status["weight_version"] == before and status["last_swap"]["success"] is False
    listed = httpx.get(srv.url + "/api/weight_versions").json()["weight_versions"]
    assert "v-fail" not in [v["version"] for v in listed]
    assert "rolled back" in done["message"] or "push again" in done["message"], done
    assert [e["healthy"] for e in httpx.get(srv.url + "/api/upstreams").json()["engines"]] == [True]


def test_one_swap_at_a_time(gw, fake, tmp_path: Path) -> None:
    """While a distributed swap waits for its first broadcast, every other swap (and a group init) is a
    409; the running one then finishes normally."""
    srv, _ = gw
    refused: list[httpx.Response] = []

    def meanwhile(ev: dict[str, Any]) -> None:
        if ev["event"] != "bucket" or ev["index"] != 0:
            return
        assert httpx.get(srv.url + "/api/weights").json()["swapping"] is True
        refused.extend([
            httpx.post(srv.url + "/api/weights/update", json={"model_path": str(tmp_path), "weight_version": "x"}),
            httpx.post(srv.url + "/api/weights/distributed/update", json=_update("y", [["a"]])),
            httpx.post(srv.url + "/api/weights/distributed/init", json=GROUP)])

    events = _distributed(srv, fake, _update("v-one", [["a"], ["b"]]), on_event=meanwhile)
    assert events[-1]["success"] is True, events
    assert [r.status_code for r in refused] == [409, 409, 409]
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == "swap_in_progress" and "distributed swap" in err["message"], err
    ok = httpx.post(srv.url + "/api/weights/update", json={"model_path": str(tmp_path), "weight_version": "v-after"})
    assert ok.status_code == 200 and ok.json()["success"] is True  # the coordinator was released


def test_a_distributed_swap_whose_client_goes_away_still_completes(gw, fake) -> None:
    """The swap runs as its own task: the trainer's connection closing after the first cue cuts neither
    the sequence nor its end and continue."""
    srv, _ = gw
    c0 = len(_debug(fake)["controls"])
    body = _update("v-gone", [["a"], ["b"]])
    with httpx.stream("POST", srv.url + "/api/weights/distributed/update", json=body, timeout=30) as resp:
        first = json.loads(next(resp.iter_lines()))
    assert first == {"event": "bucket", "index": 0}
    for names in (["a"], ["b"]):  # the trainer's broadcasts, which went on without reading the answer
        httpx.post(fake.base_url + "/debug/broadcast", json={"names": names}).raise_for_status()
    deadline = time.monotonic() + 10
    while (status := httpx.get(srv.url + "/api/weights").json())["swapping"] or (
            status["last_swap"] or {}).get("weight_version") != "v-gone":
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["weight_version"] == "v-gone" and status["last_swap"]["success"] is True
    assert [c["path"] for c in _debug(fake)["controls"][c0:]][-2:] == ["/end_weight_update", "/continue_generation"]


def test_group_init_and_bad_distributed_bodies(gw, fake) -> None:
    srv, _ = gw
    c0 = len(_debug(fake)["controls"])
    r = httpx.post(srv.url + "/api/weights/distributed/init", json={**GROUP, "backend": "gloo"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _debug(fake)["controls"][c0:] == [{"path": "/init_weights_update_group", "body": {
        "master_address": "10.0.0.1", "master_port": 29500, "world_size": 2, "rank_offset": 1,
        "group_name": "weight_update_group", "backend": "gloo"}}]  # no pause: generation goes on
    for bad in ({**GROUP, "world_size": 1}, {**GROUP, "backend": "mpi"}, {**GROUP, "extra": 1}):
        r = httpx.post(srv.url + "/api/weights/distributed/init", json=bad)
        assert r.status_code == 400 and "error" in r.json(), r.text
    misaligned = _update("v", [["a", "b"]])
    misaligned["buckets"][0]["dtypes"] = ["float32"]
    for bad in (misaligned, _update("v", []), _update("", [["a"]]), {**_update("v", [["a"]]), "pause": False}):
        r = httpx.post(srv.url + "/api/weights/distributed/update", json=bad)
        assert r.status_code == 400 and "error" in r.json(), r.text
    assert len(_debug(fake)["controls"]) == c0 + 1  # nothing reached the upstream


def test_distributed_swap_on_a_server_without_weight_sessions(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang < 0.5.23 has no begin/end_weight_update (404): the sequence goes on without them."""
    with start_fake(tmp_path, "--no-weight-session", tokenizer=tiny_model_dir) as old, ServerThread(
            create_app(GatewaySettings(upstream_url=old.base_url, model=MODEL, store_url=None),
                       recorder=MemoryRecorder())) as srv:
        events = _distributed(srv, old, _update("v-old", [["a"], ["b"]]))
        assert events[-1]["success"] is True and "no begin/end_weight_update" in events[-1]["message"], events
        assert [c["path"] for c in _debug(old)["controls"]] == [  # the 404 on begin is no control call
            "/pause_generation", "/flush_cache", "/update_weights_from_distributed",
            "/update_weights_from_distributed", "/continue_generation"]
        assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == "v-old"


# --- pure pieces -------------------------------------------------------------------------------------

def test_bucket_payload_stamps_the_version_only_when_given() -> None:
    b = Bucket(["w"], ["bfloat16"], [[4, 2]])
    assert bucket_payload(b, "g", None) == {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[4, 2]],
                                            "group_name": "g", "flush_cache": False}
    assert bucket_payload(b, "g", "7")["weight_version"] == "7"


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
