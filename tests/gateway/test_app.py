"""The gateway app end to end over real HTTP: a real uvicorn server in a thread (so the in-memory
recorder can be inspected) in front of the SGLang fake as a real process."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from tests.gateway.app_support import (
    ADD_TOOL,
    REPLY,
    TOOL_REPLY,
    MemoryRecorder,
    ServerThread,
    sse_payloads,
    start_fake,
)
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.front import GatewayFront
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.serve import settings_from_args
from tracegym.gateway.settings import SERVE_SWITCH_INTERVAL_S, GatewaySettings

MODEL = "tiny-random"
Q = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("fake"), tokenizer=tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def tool_fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("toolfake"), tokenizer=tiny_model_dir, reply=TOOL_REPLY) as p:
        yield p


def _gateway(upstream: str, **kw: object) -> tuple[ServerThread, MemoryRecorder]:
    rec = MemoryRecorder()
    settings = GatewaySettings(upstream_url=upstream, model=MODEL, store_url=None, **kw)
    return ServerThread(create_app(settings, recorder=rec)), rec


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    srv, rec = _gateway(fake.base_url, max_body_bytes=20_000)
    with srv:
        yield srv, rec


@pytest.fixture(scope="module")
def tool_gw(tool_fake: ManagedProcess) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    srv, rec = _gateway(tool_fake.base_url)
    with srv:
        yield srv, rec


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_model_dir)


def _post(url: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30, **kw)


def _last_upstream_request(fake: ManagedProcess) -> dict:
    return httpx.get(fake.base_url + "/debug").json()["requests"][-1]


def test_chat_non_stream_is_token_exact_and_recorded(gw, fake, tok) -> None:
    srv, rec = gw
    r = _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q, "max_tokens": 64, "seed": 7,
                                                 "temperature": 0.5, "top_p": 0.9, "stop": ["###"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = tok.apply(Q)
    out = [*tok.encode(REPLY), tok.eos_token_ids[0]]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                             "total_tokens": len(prompt) + len(out)}
    tg = body["tracegym"]
    assert tg["call_id"] == body["id"] and tg["rollout_id"].startswith("adhoc-") and tg["weight_version"] == "v0"
    sent = _last_upstream_request(fake)
    assert sent["input_ids"] == prompt and sent["return_logprob"] is True and sent["rid"] == body["id"]
    assert sent["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.5, "top_p": 0.9, "stop": ["###"],
                                       "stop_token_ids": tok.eos_token_ids, "sampling_seed": 7}
    call = next(c for c in rec.wait_for(1) if c.call_id == body["id"])
    assert call.prompt_ids == prompt and call.choices[0].output_ids == out
    assert call.choices[0].output_logprobs == pytest.approx([-0.5 - 0.01 * k for k in range(len(out))])
    assert call.weight_version == "v0" and call.status == "ok" and call.retokenized is False
    assert call.upstream_kind == "sglang" and call.operation == "chat" and call.request["messages"] == Q


def test_turn_two_reuses_turn_one_ids(gw, tok) -> None:
    srv, rec = gw
    base = srv.url + "/rollouts/r-multi/v1/chat/completions"
    one = _post(base, {"model": MODEL, "messages": Q}).json()
    msgs2 = [*Q, one["choices"][0]["message"], {"role": "user", "content": "And 3+4?"}]
    two = _post(base, {"model": MODEL, "messages": msgs2}).json()
    assert one["tracegym"]["rollout_id"] == two["tracegym"]["rollout_id"] == "r-multi"
    by_id = {c.call_id: c for c in rec.wait_for(2)}
    c1, c2 = by_id[one["id"]], by_id[two["id"]]
    head = c1.prompt_ids + c1.choices[0].output_ids
    assert c2.prompt_ids[: len(head)] == head and len(c2.prompt_ids) > len(head)
    assert c2.drift == "clean" and two["tracegym"]["drift"] == "clean" and c2.prefix_len == len(head)
    assert c2.prompt_ids == tok.apply(msgs2)  # clean: equal to the whole re-render


def test_attribution_headers(gw) -> None:
    srv, rec = gw
    h = {"X-Rollout-Id": "r-head", "X-Task-Id": "t-1", "X-Agent-Name": "solver"}
    body = _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q}, headers=h).json()
    call = next(c for c in rec.wait_for(1) if c.call_id == body["id"])
    assert (call.rollout_id, call.task_id, call.agent_name) == ("r-head", "t-1", "solver")


def test_stream_chat_chunks_and_usage(gw) -> None:
    srv, rec = gw
    body = {"model": MODEL, "messages": Q, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == REPLY
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    lps = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
           for e in c["choices"][0]["logprobs"]["content"]]
    assert len(lps) == usage["usage"]["completion_tokens"]
    assert set(lps[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    call = next(c for c in rec.wait_for(1) if c.call_id == chunks[0]["id"])
    assert call.status == "ok" and call.choices[0].message["content"] == REPLY
    assert len(call.choices[0].output_ids) == usage["usage"]["completion_tokens"]
    assert call.first_token_time_ns is not None


def test_completions_string_and_token_prompt(gw, fake, tok) -> None:
    srv, rec = gw
    r1 = _post(srv.url + "/v1/completions", {"model": MODEL, "prompt": "2+3=", "logprobs": 0}).json()
    assert r1["object"] == "text_completion" and r1["choices"][0]["text"] == REPLY
    assert _last_upstream_request(fake)["input_ids"] == tok.encode("2+3=")
    lp = r1["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == r1["usage"]["completion_tokens"]
    r2 = _post(srv.url + "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}).json()
    assert _last_upstream_request(fake)["input_ids"] == [5, 6, 7]
    assert r2["choices"][0]["finish_reason"] == "length" and r2["usage"]["completion_tokens"] == 3
    call = next(c for c in rec.wait_for(2) if c.call_id == r2["id"])
    assert call.operation == "text_completion" and call.prompt_ids == [5, 6, 7]
    assert call.choices[0].message == {"text": r2["choices"][0]["text"]}


def test_stream_completion(gw) -> None:
    srv, _ = gw
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": [1, 2], "stream": True}) as r:
        events = sse_payloads(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_n_choices(gw) -> None:
    srv, rec = gw
    body = _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    call = next(c for c in rec.wait_for(1) if c.call_id == body["id"])
    assert len(call.choices) == 2 and call.choices[1].output_ids == call.choices[0].output_ids


def test_models_and_rollout_models(gw) -> None:
    srv, _ = gw
    for path in ("/v1/models", "/rollouts/x/v1/models"):
        data = httpx.get(srv.url + path).json()
        assert [m["id"] for m in data["data"]] == [MODEL]


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "tiny-random", "messages": "hi"}', 400, "messages"),
    (b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', 400,
     "max_tokens"),
    (b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "temperature": true}', 400,
     "temperature"),
    (b'{"model": "tiny-random", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 5}', 400,
     "chat_template_kwargs"),
    (b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
     b'{"tools": []}}', 400, "chat_template_kwargs"),
])
def test_bad_requests_get_openai_errors(gw, body, status, param) -> None:
    srv, _ = gw
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_template_kwargs_reach_the_template_on_both_paths(gw) -> None:
    """Any non-reserved key is a template variable, also one named like a parameter of ours."""
    srv, _ = gw
    body = {"model": MODEL, "messages": Q, "max_tokens": 4, "chat_template_kwargs": {"rollout_id": "x"}}
    for url in ("/v1/chat/completions", "/rollouts/tk-1/v1/chat/completions"):
        r = _post(srv.url + url, body)
        assert r.status_code == 200, r.text
    r = _post(srv.url + "/rollouts/tk-1/v1/chat/completions", {**body, "chat_template_kwargs": "ab"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_overlong_rollout_and_task_ids_are_400(gw) -> None:
    """Ids longer than the store's columns are refused up front (PostgreSQL would reject the span)."""
    srv, _ = gw
    body = {"model": MODEL, "messages": Q, "max_tokens": 4}
    r = _post(srv.url + "/rollouts/" + "r" * 201 + "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rollout_id", r.text
    r = _post(srv.url + "/v1/chat/completions", body, headers={"X-Task-Id": "t" * 201})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Task-Id", r.text
    assert _post(srv.url + "/v1/chat/completions", body, headers={"X-Rollout-Id": "r" * 200}).status_code == 200


def test_tool_arguments_too_deep_to_parse_are_rendered_as_sent(gw) -> None:
    """A client's arguments string that nests deeper than JSON parsing allows is kept as a string."""
    srv, _ = gw
    deep = "[" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": deep}}
    msgs = [*Q, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    for url in ("/v1/chat/completions", "/rollouts/deep-1/v1/chat/completions"):
        r = _post(srv.url + url, {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_body_too_large_is_413(gw) -> None:
    srv, _ = gw
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 30_000}]}
    r = _post(srv.url + "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_without_content_length(gw) -> None:
    """A body sent chunked (no Content-Length) is read whole, and refused once it passes the limit."""
    srv, _ = gw
    ok = orjson.dumps({"model": MODEL, "messages": Q})

    def chunks(data: bytes):
        for i in range(0, len(data), 7):
            yield data[i : i + 7]

    r = httpx.post(srv.url + "/v1/chat/completions", content=chunks(ok), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY
    big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 30_000}]})
    r = httpx.post(srv.url + "/v1/chat/completions", content=chunks(big), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_tool_calls_non_stream(tool_gw) -> None:
    srv, rec = tool_gw
    body = _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q, "tools": [ADD_TOOL]}).json()
    ch = body["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["content"] == "Let me add."
    (call,) = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and call["id"].startswith("call_")
    assert call["function"]["arguments"] == '{"a": 2, "b": 3}'
    recd = next(c for c in rec.wait_for(1) if c.call_id == body["id"])
    assert recd.choices[0].message == ch["message"] and recd.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("extra", [{}, {"tools": [ADD_TOOL], "tool_choice": "none"}])
def test_tool_calls_without_tools_stay_text(tool_gw, extra) -> None:
    srv, _ = tool_gw
    body = _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q, **extra}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TOOL_REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_stream(tool_gw) -> None:
    srv, rec = tool_gw
    req = {"model": MODEL, "messages": Q, "tools": [ADD_TOOL], "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=req, timeout=30) as r:
        chunks = sse_payloads(list(r.iter_lines()))[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me add.", deltas
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    recd = next(c for c in rec.wait_for(1) if c.call_id == chunks[0]["id"])
    assert recd.choices[0].message["tool_calls"][0]["id"] == calls[0]["id"]  # the id the client saw


def test_tool_round_trip_reuses_ids(tool_gw) -> None:
    """Turn 2 after a tool call: assistant tool_calls + tool result extend turn 1 token-exactly."""
    srv, rec = tool_gw
    url = srv.url + "/rollouts/r-tool/v1/chat/completions"
    one = _post(url, {"model": MODEL, "messages": Q, "tools": [ADD_TOOL]}).json()
    msg = one["choices"][0]["message"]
    msgs = [*Q, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "5"}]
    two = _post(url, {"model": MODEL, "messages": msgs, "tools": [ADD_TOOL]}).json()
    by_id = {c.call_id: c for c in rec.wait_for(2)}
    c1, c2 = by_id[one["id"]], by_id[two["id"]]
    head = c1.prompt_ids + c1.choices[0].output_ids
    assert c2.prompt_ids[: len(head)] == head
    assert c2.drift in ("clean", "realigned")


def test_healthz_and_metrics(gw) -> None:
    srv, _ = gw
    h = httpx.get(srv.url + "/healthz").json()
    assert h["status"] == "ok" and h["upstream"]["reachable"] is True and h["model"] == MODEL
    _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q})
    text = httpx.get(srv.url + "/metrics").text
    assert 'tracegym_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "tracegym_gateway_upstream_latency_seconds_bucket" in text


def test_stop_string_is_trimmed_non_stream_and_stream(gw) -> None:
    srv, rec = gw
    req = {"model": MODEL, "messages": Q, "stop": ["3 ="]}
    body = _post(srv.url + "/v1/chat/completions", req).json()
    expected = REPLY[: REPLY.index("3 =")]
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**req, "stream": True}, timeout=30) as r:
        chunks = sse_payloads(list(r.iter_lines()))[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    calls = {c.call_id: c for c in rec.wait_for(2)}
    streamed = calls[chunks[0]["id"]]
    assert streamed.choices[0].message["content"] == expected
    assert streamed.choices[0].output_ids == calls[body["id"]].choices[0].output_ids  # the stop's tokens kept


def test_the_front_serves_inference_routes_and_passes_the_rest(fake: ManagedProcess) -> None:
    """The front sits outside FastAPI's middleware stack: inference routes (and their errors) are served by
    it and counted once, another method on them is a 405; every other route (lifespan, /healthz, /metrics,
    404s) is FastAPI's."""
    rec = MemoryRecorder()
    app = create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None), recorder=rec)
    assert isinstance(app.build_middleware_stack(), GatewayFront)
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/healthz").json()["status"] == "ok"
        body = _post(srv.url + "/rollouts/r-front/v1/chat/completions", {"model": MODEL, "messages": Q}).json()
        assert body["choices"][0]["message"]["content"] == REPLY
        assert body["tracegym"]["rollout_id"] == "r-front"
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": "other", "messages": Q}, timeout=30)
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
        wrong = httpx.get(srv.url + "/rollouts/r-front/v1/messages")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert httpx.get(srv.url + "/nope").status_code == 404
        text = httpx.get(srv.url + "/metrics").text
        route = 'route="/rollouts/{rollout_id}/v1/chat/completions",status="200"} 1.0'
        assert route in text and 'route="/v1/chat/completions",status="404"} 1.0' in text
        assert [c.rollout_id for c in rec.wait_for(1)] == ["r-front"]  # the 404 is not a call


def test_inference_routes_before_the_lifespan_are_503() -> None:
    app = create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", model=MODEL, store_url=None))
    client = TestClient(app)  # no lifespan: no services yet
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": Q})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the gateway is not serving yet"


def test_switch_interval_is_set_while_serving_and_restored(fake) -> None:
    before = sys.getswitchinterval()
    srv, _ = _gateway(fake.base_url, switch_interval_s=0.0007)
    with srv:
        assert sys.getswitchinterval() == pytest.approx(0.0007)
        assert _post(srv.url + "/v1/chat/completions", {"model": MODEL, "messages": Q, "max_tokens": 2}).status_code == 200
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError):
        GatewaySettings(upstream_url=fake.base_url, switch_interval_s=0)


def test_serve_sets_the_switch_interval_and_freezes_gc() -> None:
    args = argparse.Namespace(model=MODEL, store="none", max_body_bytes=1000, upstream_timeout=5.0)
    settings = settings_from_args(args, "http://127.0.0.1:1", "sglang")
    assert settings.switch_interval_s == SERVE_SWITCH_INTERVAL_S and settings.freeze_gc
    assert GatewaySettings(upstream_url="http://127.0.0.1:1").switch_interval_s is None  # embedded apps: untouched
