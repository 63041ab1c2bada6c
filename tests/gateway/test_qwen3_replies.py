"""A Qwen3 reasoning model behind the gateway (``qwen3-tiny``'s tokenizer and chat template, the SGLang fake
answering fixed replies by prompt key) over real HTTP with a SQLite store: reasoning comes back as
``reasoning_content`` (chat), a reasoning item (Responses) and a thinking block (Messages); multi-turn
chats whose history Qwen3's template rewrites stay one trained sequence; malformed tool calls are
successful text replies whose span says why they did not parse (``tracegym.tool_parse``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import (
    TOKENS_APART,
    ServerThread,
    check_one_merged_sequence,
    spans_of,
    start_fake,
)
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings

MODEL = "qwen3-tiny"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
THINK_CALL = f"<think>\nI should add.\n</think>\n\n{CALL}"  # Qwen3's own form: re-renders exactly
ANSWER = "<think>\nThe tool said 5.\n</think>\n\nIt is 5."
MALFORMED = {  # prompt key → reply → what the span's tracegym.tool_parse starts with
    "case-half": ('<think>\nAdd.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2',
                  "failed: invalid JSON"),
    "case-unknown": ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2}}\n</tool_call>',
                     "failed: unknown tool 'multiply'"),
    "case-empty": ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', "failed: empty tool name"),
    "case-args": ('<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>',
                  "failed: arguments are not an object (list)"),
}
REPLIES = {"case-answer": ANSWER, "case-plain": "Just text.", **{k: v for k, (v, _) in MALFORMED.items()}}


@pytest.fixture(scope="module")
def fake(qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    keyed = [a for key, text in REPLIES.items() for a in ("--reply-when", f"{key}={text}")]
    with start_fake(tmp_path_factory.mktemp("fake"), *keyed, *TOKENS_APART, tokenizer=qwen3_model_dir,
                    reply=THINK_CALL) as p:
        yield p


@pytest.fixture(scope="module")
def srv(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("store") / "t.db"
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{db}")
    with ServerThread(create_app(settings)) as s:
        yield s


def _chat(srv: ServerThread, rollout: str, messages: list, **kw: object) -> dict:
    r = httpx.post(f"{srv.url}/rollouts/{rollout}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": messages, "tools": [ADD], **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(srv: ServerThread, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def _user(key: str) -> dict:
    return {"role": "user", "content": f"{key}: what is 2+3?"}


def test_chat_reasoning_content_and_a_tool_loop_then_a_new_turn_is_one_sequence(srv: ServerThread) -> None:
    msgs: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    one = _chat(srv, "q-chat", msgs)
    reply = one["choices"][0]["message"]
    assert reply["reasoning_content"] == "I should add." and reply["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["tool_calls"]] == [
        ("add", {"a": 2, "b": 3})]
    assert one["choices"][0]["finish_reason"] == "tool_calls"
    msgs += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}]
    two = _chat(srv, "q-chat", msgs)  # a tool loop: Qwen3 keeps this turn's reasoning, as sampled
    msgs += [two["choices"][0]["message"], _user("case-answer")]
    three = _chat(srv, "q-chat", msgs)  # a new user turn: Qwen3 drops every earlier <think>
    assert three["choices"][0]["message"] == {"role": "assistant", "content": "It is 5.",
                                              "reasoning_content": "The tool said 5."}
    assert [x["tracegym"]["drift"] for x in (one, two, three)] == ["none", "clean", "realigned"]
    spans = check_one_merged_sequence(srv.url, "q-chat", [one["id"], two["id"], three["id"]])
    assert [s["attributes"]["tracegym.tool_parse"] for s in spans] == ["ok", "ok", "none"]


def test_chat_stream_sends_reasoning_deltas_and_records_the_same_message(srv: ServerThread) -> None:
    chunks = _sse(srv, "/rollouts/q-stream/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": "2+3?"}], "tools": [ADD]})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I should add."
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 1  # token by token
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["add"] and not any(d.get("content") for d in deltas)
    (span,) = spans_of(srv.url, "q-stream", 1)
    recorded = span["choices"][0]["message"]
    assert recorded["reasoning_content"] == "I should add." and recorded["tool_calls"][0]["id"] == calls[0]["id"]
    assert span["attributes"]["tracegym.tool_parse"] == "ok"


def test_separate_reasoning_false_keeps_the_think_block_in_the_content(srv: ServerThread) -> None:
    body = _chat(srv, "q-raw", [_user("case-answer")], separate_reasoning=False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    streamed = _sse(srv, "/rollouts/q-raw/v1/chat/completions", {
        "model": MODEL, "messages": [_user("case-answer")], "separate_reasoning": False})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == ANSWER


@pytest.mark.parametrize("key", sorted(MALFORMED))
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_calls_are_text_and_the_span_says_why(srv: ServerThread, key: str, stream: bool) -> None:
    reply, status = MALFORMED[key]
    text_after_think = reply.split("</think>\n\n")[-1]
    rid = f"q-bad-{key}-{stream}"
    chat = {"model": MODEL, "messages": [_user(key)], "tools": [ADD]}
    resp = {"model": MODEL, "input": f"{key}: what is 2+3?", "tools": [{"type": "function", **ADD["function"]}]}
    msg = {"model": MODEL, "max_tokens": 64, "messages": [_user(key)],
           "tools": [{"name": "add", "input_schema": ADD["function"]["parameters"]}]}
    base = f"/rollouts/{rid}/v1"
    if stream:
        chunks = _sse(srv, f"{base}/chat/completions", chat)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) \
            == text_after_think
        events = _sse(srv, f"{base}/responses", resp)
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        events = _sse(srv, f"{base}/messages", msg)
        content = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        assert content == text_after_think and events[-1]["type"] == "message_stop"
    else:
        body = _chat(srv, rid, chat["messages"])
        assert body["choices"][0]["message"]["content"] == text_after_think
        assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["finish_reason"] == "stop"
        final = httpx.post(srv.url + f"{base}/responses", json=resp, timeout=30).json()
        m = httpx.post(srv.url + f"{base}/messages", json=msg, timeout=30).json()
        assert [b["type"] for b in m["content"] if b["type"] != "thinking"] == ["text"]
        assert m["content"][-1]["text"] == text_after_think and m["stop_reason"] == "end_turn"
    assert [o["type"] for o in final["output"] if o["type"] != "reasoning"] == ["message"]
    assert final["output"][-1]["content"][0]["text"] == text_after_think
    spans = spans_of(srv.url, rid, 3)
    assert [s["attributes"]["tracegym.api"] for s in spans] == ["chat", "responses", "messages"]
    for s in spans:
        assert s["status"] == "ok" and s["attributes"]["tracegym.tool_parse"].startswith(status), s["attributes"]


def test_no_tools_no_parse_attribute(srv: ServerThread) -> None:
    r = httpx.post(f"{srv.url}/rollouts/q-notools/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [_user("case-plain")]})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Just text."}
    _chat(srv, "q-notools", [_user("case-plain")], tool_choice="none")
    spans = spans_of(srv.url, "q-notools", 2)
    assert ["tracegym.tool_parse" in s["attributes"] for s in spans] == [False, False]
    assert spans_of(srv.url, "q-notools", 2)[0]["attributes"]["tracegym.api"] == "chat"
