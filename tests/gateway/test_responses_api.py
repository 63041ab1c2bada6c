"""``/v1/responses`` over real HTTP: the gateway app under uvicorn with a SQLite trace store, in front of
the SGLang fake answering as a reasoning model that calls a tool (reasoning, text, one call)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import (
    ADD_TOOL,
    THINK_TOOL_REPLY,
    TOKENS_APART,
    ServerThread,
    check_one_merged_sequence,
    spans_of,
    start_fake,
)
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.front import INFERENCE_ROUTES
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
TOOL = {"type": "function", **ADD_TOOL["function"]}
ASK = {"model": MODEL, "input": "What is 2+3?", "tools": [TOOL], "instructions": "Be brief."}


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("fake"), *TOKENS_APART, tokenizer=tiny_model_dir,
                    reply=THINK_TOOL_REPLY) as p:
        yield p


@pytest.fixture(scope="module")
def srv(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("store") / "t.db"
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{db}",
                               max_body_bytes=50_000)
    with ServerThread(create_app(settings)) as s:
        yield s


def _post(srv: ServerThread, body: dict, rollout: str | None = None, **kw: object) -> httpx.Response:
    path = f"/rollouts/{rollout}/v1/responses" if rollout else "/v1/responses"
    return httpx.post(srv.url + path, json=body, timeout=30, **kw)


def _events(srv: ServerThread, body: dict, rollout: str) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{srv.url}/rollouts/{rollout}/v1/responses", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]
    return list(zip(names, data, strict=True))


def _call_output(resp: dict, text: str) -> dict:
    fc = next(o for o in resp["output"] if o["type"] == "function_call")
    return {"type": "function_call_output", "call_id": fc["call_id"], "output": text}


def test_responses_and_messages_are_inference_routes(srv: ServerThread) -> None:
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= INFERENCE_ROUTES.keys()
    paths = srv.app.openapi()["paths"]  # the POSTs declared by inference_openapi; the front serves them
    assert set(paths["/v1/responses"]) == {"post"} and set(paths["/v1/messages"]) == {"post"}
    assert set(paths["/v1/responses/{response_id}"]) == {"get"}


def test_reasoning_text_and_call_become_items_and_one_span(srv: ServerThread, tiny_model_dir: Path) -> None:
    r = _post(srv, ASK, "r-one")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    rs, msg, fc = body["output"]
    assert rs["type"] == "reasoning" and rs["content"] == [{"type": "reasoning_text", "text": "I add."}]
    assert msg["type"] == "message" and msg["content"][0]["text"] == "Let me add."
    assert (fc["type"], fc["name"], json.loads(fc["arguments"])) == ("function_call", "add", {"a": 2, "b": 3})
    assert body["instructions"] == "Be brief." and body["tools"] == [TOOL]
    (span,) = spans_of(srv.url, "r-one", 1)
    attrs = span["attributes"]
    assert attrs["tracegym.api"] == "responses" and attrs["gen_ai.operation.name"] == "chat"
    assert span["call_id"] == body["id"] == body["tracegym"]["call_id"]
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    out = span["choices"][0]["output_ids"]
    assert tok.decode(out, skip_special_tokens=True) == THINK_TOOL_REPLY
    assert span["prompt_ids"] == tok.apply(attrs["tracegym.request"]["messages"], [ADD_TOOL])
    usage = body["usage"]
    assert usage["input_tokens"] == len(span["prompt_ids"]) and usage["output_tokens"] == len(out)
    think = tok.encode("<think>\nI add.\n</think>")
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(think) and out[:len(think)] == think
    request = attrs["tracegym.request"]
    assert request["tracegym_source"] == {"api": "responses", "request": ASK}
    assert request["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2+3?"}]


def test_stream_grammar_and_same_response_as_get(srv: ServerThread) -> None:
    events = _events(srv, ASK, "r-stream")
    names = [n for n, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-1] == "response.completed"
    for kind in ("reasoning_text", "output_text"):  # streamed in pieces, one per token
        assert names.count(f"response.{kind}.delta") > 1 and names.count(f"response.{kind}.done") == 1
    assert names.count("response.function_call_arguments.done") == 1
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 3
    final = events[-1][1]["response"]
    texts = {}
    for n, d in events:
        if n.endswith(".delta"):
            texts[d["item_id"]] = texts.get(d["item_id"], "") + d["delta"]
    rs, msg, fc = final["output"]
    assert texts == {rs["id"]: "I add.", msg["id"]: "Let me add.", fc["id"]: fc["arguments"]}
    assert all(i["status"] == "completed" for i in final["output"])
    got = httpx.get(f"{srv.url}/v1/responses/{final['id']}").json()
    assert got["output"] == final["output"] and got["usage"] == final["usage"]
    whole = _post(srv, ASK, "r-stream-2").json()
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole["output"]]
    assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in final["output"]]


def test_previous_response_id_chain_merges_into_one_sequence(srv: ServerThread) -> None:
    one = _post(srv, ASK, "r-chain").json()
    two = _post(srv, {**ASK, "previous_response_id": one["id"], "input": [_call_output(one, "5")]}, "r-chain").json()
    three = _post(srv, {**ASK, "previous_response_id": two["id"],
                        "input": [_call_output(two, "5"), {"role": "user", "content": "Thanks"}]}, "r-chain").json()
    assert [x["tracegym"]["drift"] for x in (one, two, three)] == ["none", "clean", "clean"]
    assert three["previous_response_id"] == two["id"]
    spans = check_one_merged_sequence(srv.url, "r-chain", [one["id"], two["id"], three["id"]])
    roles = [m["role"] for m in spans[-1]["attributes"]["tracegym.request"]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "user"]


def test_history_sent_back_as_items_merges_the_same(srv: ServerThread) -> None:
    one = _post(srv, ASK, "r-items").json()
    items = [{"role": "user", "content": "What is 2+3?"}, *one["output"], _call_output(one, "5")]
    two = _post(srv, {**ASK, "input": items}, "r-items").json()
    assert two["tracegym"]["drift"] == "clean"
    check_one_merged_sequence(srv.url, "r-items", [one["id"], two["id"]])


def test_unattributed_chain_stays_in_the_first_calls_adhoc_rollout(srv: ServerThread) -> None:
    one = _post(srv, ASK).json()
    rollout = one["tracegym"]["rollout_id"]
    assert rollout.startswith("adhoc-")
    two = _post(srv, {**ASK, "previous_response_id": one["id"], "input": [_call_output(one, "5")]}).json()
    assert two["tracegym"]["rollout_id"] == rollout and two["tracegym"]["drift"] == "clean"
    check_one_merged_sequence(srv.url, rollout, [one["id"], two["id"]])


def test_get_by_rollout_and_store_false(srv: ServerThread) -> None:
    one = _post(srv, ASK, headers={"X-Rollout-Id": "r-get"}).json()
    assert one["tracegym"]["rollout_id"] == "r-get"
    assert httpx.get(f"{srv.url}/rollouts/r-get/v1/responses/{one['id']}").json()["id"] == one["id"]
    other = httpx.get(f"{srv.url}/rollouts/r-else/v1/responses/{one['id']}")
    assert other.status_code == 404 and other.json()["error"]["type"] == "invalid_request_error"
    hidden = _post(srv, {**ASK, "store": False}, "r-get").json()
    assert hidden["store"] is False and httpx.get(f"{srv.url}/v1/responses/{hidden['id']}").status_code == 404
    r = _post(srv, {**ASK, "previous_response_id": hidden["id"], "input": "more"}, "r-get")
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert len(spans_of(srv.url, "r-get", 2)) == 2  # a response kept out of GET is still trained on


BAD = [
    ({"input": [{"type": "computer_call", "id": "cu_1"}]}, 400, "input[0].type", None),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "5"}]}, 400, "input", None),
    ({"previous_response_id": "resp_doesnotexist", "input": "x"}, 400, "previous_response_id",
     "previous_response_not_found"),
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"max_output_tokens": "many"}, 400, "max_output_tokens", "invalid_value"),
]


@pytest.mark.parametrize(("change", "status", "param", "code"), BAD)
def test_bad_requests_are_openai_errors_and_not_recorded(srv: ServerThread, change: dict, status: int,
                                                         param: str, code: str | None) -> None:
    r = _post(srv, {**ASK, **change}, "r-bad")
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and (code is None or err["code"] == code)
    srv.services.recorder.force_flush()
    assert httpx.get(f"{srv.url}/api/rollouts/r-bad/spans").status_code == 404  # nothing recorded


def test_chain_refusals(srv: ServerThread) -> None:
    one = _post(srv, ASK, "r-owner").json()
    cross = _post(srv, {**ASK, "previous_response_id": one["id"], "input": [_call_output(one, "5")]}, "r-thief")
    assert cross.status_code == 400 and cross.json()["error"]["code"] == "previous_response_not_found"
    assert "r-owner" in cross.json()["error"]["message"]
    resent = [{"role": "user", "content": "What is 2+3?"}, *one["output"], _call_output(one, "5")]
    for items in (resent, [*one["output"], _call_output(one, "5")]):
        r = _post(srv, {**ASK, "previous_response_id": one["id"], "input": items}, "r-owner")
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert len(spans_of(srv.url, "r-owner", 1)) == 1
    assert httpx.get(f"{srv.url}/api/rollouts/r-thief/spans").status_code == 404


def test_chat_calls_are_marked_as_chat(srv: ServerThread) -> None:
    r = httpx.post(f"{srv.url}/rollouts/r-chat/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 200
    (span,) = spans_of(srv.url, "r-chat", 1)
    assert span["attributes"]["tracegym.api"] == "chat" and span["call_id"].startswith("chatcmpl-")


def test_upstream_stalling_mid_stream_fails_the_response(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = {"model": MODEL, "store_url": f"sqlite:///{tmp_path / 't.db'}", "upstream_timeout": 0.3}
    with start_fake(tmp_path, "--stream-delay", "1.0", tokenizer=tiny_model_dir, reply="Hello there.") as fake, \
            ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, **settings))) as s:
        events = _events(s, {"model": MODEL, "input": "hi"}, "r-stall")
        assert [n for n, _ in events][-2:] == ["error", "response.failed"]
        assert "response.output_text.delta" in [n for n, _ in events]  # the first token went out before
        failed = events[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "upstream_timeout"
        (span,) = spans_of(s.url, "r-stall", 1)
        assert span["status"] == "error" and span["attributes"]["tracegym.api"] == "responses"
