"""A gpt-oss model behind the gateway (``gptoss-tiny``'s tokenizer and chat template, the SGLang fake answering
harmony replies ending in ``<|return|>`` or ``<|call|>``): with or without tools offered, the client gets
the final channel's text as the content and the analysis channel as the reasoning, streamed or not,
through chat, Responses and Messages, never the harmony markup; so sending the reply back continues the
conversation (the template refuses markup in an assistant's content)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import ServerThread, spans_of, start_fake
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings

MODEL = "gptoss-tiny"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ANSWER = "<|channel|>analysis<|message|>Easy sum.<|end|><|start|>assistant<|channel|>final<|message|>It is 5."
CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.add<|channel|>"
        'commentary json<|message|>{"a": 2, "b": 3}')


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tracegym.modelfiles.prepare import prepare_model

    return prepare_model(MODEL)


@pytest.fixture(scope="module")
def srv(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("oss")
    with start_fake(tmp, "--reply-when", f"case-call={CALL}", "--eos", "<|return|>", tokenizer=model_dir,
                    reply=ANSWER) as fake:
        settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{tmp / 't.db'}")
        with ServerThread(create_app(settings)) as s:
            yield s


def _sse(srv: ServerThread, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


@pytest.mark.parametrize("tools", [None, [ADD]])
def test_chat_content_is_the_final_channel_and_the_reply_goes_back(srv: ServerThread, tools: list | None) -> None:
    rid = f"oss-chat-{bool(tools)}"
    extra = {"tools": tools} if tools else {}
    msgs: list = [{"role": "user", "content": "2+3?"}]
    one = httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", timeout=30,
                     json={"model": MODEL, "messages": msgs, **extra}).json()
    reply = one["choices"][0]["message"]
    assert reply == {"role": "assistant", "content": "It is 5.", "reasoning_content": "Easy sum."}
    msgs += [reply, {"role": "user", "content": "and 3+4?"}]
    two = httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", timeout=30,
                     json={"model": MODEL, "messages": msgs, **extra})
    assert two.status_code == 200, two.text
    chunks = _sse(srv, f"/rollouts/{rid}-s/v1/chat/completions",
                  {"model": MODEL, "messages": msgs[:1], **extra})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "It is 5."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Easy sum."
    spans = spans_of(srv.url, rid, 2)
    assert [s["attributes"].get("tracegym.tool_parse") for s in spans] == (["none", "none"] if tools
                                                                           else [None, None])


def test_a_call_is_a_call_with_tools_and_text_without(srv: ServerThread) -> None:
    msgs = [{"role": "user", "content": "case-call: 2+3?"}]
    called = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                        json={"model": MODEL, "messages": msgs, "tools": [ADD]}).json()["choices"][0]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert called["message"]["tool_calls"][0]["function"]["name"] == "add"
    plain = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": msgs}).json()["choices"][0]["message"]
    assert plain["reasoning_content"] == "Use the tool." and "to=functions.add" in plain["content"]  # as written


@pytest.mark.parametrize("stream", [False, True])
def test_responses_and_messages_without_tools(srv: ServerThread, stream: bool) -> None:
    resp = {"model": MODEL, "input": "2+3?"}
    msg = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "2+3?"}]}
    if stream:
        events = _sse(srv, "/v1/responses", resp)
        done = events[-1]["response"]
        text = "".join(e["delta"].get("text", "") for e in _sse(srv, "/v1/messages", msg)
                       if e["type"] == "content_block_delta")
    else:
        done = httpx.post(srv.url + "/v1/responses", json=resp, timeout=30).json()
        m = httpx.post(srv.url + "/v1/messages", json=msg, timeout=30).json()
        text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
    outputs = [o for o in done["output"] if o["type"] == "message"]
    assert outputs[0]["content"][0]["text"] == "It is 5." and text == "It is 5."
