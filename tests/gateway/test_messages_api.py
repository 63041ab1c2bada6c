"""``/v1/messages`` over real HTTP with the ``anthropic`` client: the gateway app under uvicorn with a
SQLite trace store, in front of the SGLang fake answering as a reasoning model that calls a tool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.gateway.app_support import (
    ADD_TOOL,
    REPLY,
    THINK_TOOL_REPLY,
    TOKENS_APART,
    ServerThread,
    check_one_merged_sequence,
    spans_of,
    start_fake,
)
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
TOOL = {"name": "add", "description": "Add two integers", "input_schema": ADD_TOOL["function"]["parameters"]}
Q = [{"role": "user", "content": "What is 2+3?"}]


def _gateway(fake: ManagedProcess, db: Path) -> ServerThread:
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{db}",
                               max_body_bytes=50_000)
    return ServerThread(create_app(settings))


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("messages")
    with start_fake(tmp, *TOKENS_APART, tokenizer=tiny_model_dir, reply=THINK_TOOL_REPLY) as fake, _gateway(fake, tmp / "t.db") as s:
        yield s


def _client(srv: ServerThread, rollout: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{srv.url}/rollouts/{rollout}", api_key="unused", max_retries=0)


def _create(srv: ServerThread, rollout: str, messages: list, **kw: object) -> anthropic.types.Message:
    return _client(srv, rollout).messages.create(model=MODEL, max_tokens=200, system="Be brief.",
                                                 messages=messages, tools=[TOOL], **kw)


def _tool_turn(reply: anthropic.types.Message, result: str) -> list[dict]:
    use = next(b for b in reply.content if b.type == "tool_use")
    return [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]


def test_blocks_stop_reason_usage_and_span(srv: ServerThread, tiny_model_dir: Path) -> None:
    m = _create(srv, "m-one", Q)
    assert m.id.startswith("msg_") and m.role == "assistant" and m.stop_reason == "tool_use"
    thinking, text, use = m.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "I add.", m.id)
    assert (text.type, text.text) == ("text", "Let me add.")
    assert (use.type, use.name, use.input) == ("tool_use", "add", {"a": 2, "b": 3}) and use.id.startswith("toolu_")
    (span,) = spans_of(srv.url, "m-one", 1)
    attrs = span["attributes"]
    assert attrs["tracegym.api"] == "messages" and attrs["gen_ai.operation.name"] == "chat"
    assert span["call_id"] == m.id and m.usage.output_tokens == len(span["choices"][0]["output_ids"])
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    assert m.usage.input_tokens == len(span["prompt_ids"]) == len(tok.apply(
        [{"role": "system", "content": "Be brief."}, *Q], [ADD_TOOL]))
    assert span["choices"][0]["message"]["tool_calls"][0]["id"] == use.id
    assert attrs["tracegym.request"]["tracegym_source"]["api"] == "messages"


def test_stream_grammar_and_the_same_message(srv: ServerThread) -> None:
    body = {"model": MODEL, "max_tokens": 200, "messages": Q, "tools": [TOOL], "stream": True}
    with httpx.stream("POST", f"{srv.url}/rollouts/m-stream/v1/messages", json=body, timeout=30) as r:
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert names.count("content_block_stop") == 3
    deltas = [d["delta"]["type"] for d in data if d["type"] == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and deltas.count("text_delta") > 1  # token by token
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    assert data[-2]["delta"]["stop_reason"] == "tool_use" and data[-2]["usage"]["output_tokens"] > 0
    with _client(srv, "m-stream").messages.stream(model=MODEL, max_tokens=200, messages=Q, tools=[TOOL]) as s:
        final = s.get_final_message()
    whole = _create(srv, "m-stream", Q)
    assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert final.content[0].thinking == "I add." and final.content[1].text == "Let me add."
    assert final.content[2].input == {"a": 2, "b": 3} and final.stop_reason == "tool_use"


def test_tool_round_trips_merge_into_one_sequence(srv: ServerThread) -> None:
    one = _create(srv, "m-multi", Q)
    msgs = [*Q, *_tool_turn(one, "5")]
    with _client(srv, "m-multi").messages.stream(model=MODEL, max_tokens=200, system="Be brief.", messages=msgs,
                                                 tools=[TOOL]) as s:
        two = s.get_final_message()  # sent back as the client accumulated it from the stream
    three = _create(srv, "m-multi", [*msgs, *_tool_turn(two, "5")])
    spans = check_one_merged_sequence(srv.url, "m-multi", [one.id, two.id, three.id])
    assert [s["attributes"]["tracegym.drift"] for s in spans] == ["none", "clean", "clean"]


def test_count_tokens_is_the_rendered_prompt_and_not_recorded(srv: ServerThread, tiny_model_dir: Path) -> None:
    n = _client(srv, "m-count").messages.count_tokens(model=MODEL, messages=Q, system="Be brief.", tools=[TOOL])
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    assert n.input_tokens == len(tok.apply([{"role": "system", "content": "Be brief."}, *Q], [ADD_TOOL]))
    srv.services.recorder.force_flush()
    assert httpx.get(f"{srv.url}/api/rollouts/m-count/spans").status_code == 404


BAD = [
    ({"messages": Q}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "5"}]}]}, 400, "toolu_nope"),
    ({"max_tokens": 5, "messages": Q, "model": "claude-sonnet-4-5"}, 404, "claude-sonnet-4-5"),
    ({"max_tokens": "many", "messages": Q}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 60_000}]}, 413, "limit"),
]


@pytest.mark.parametrize(("body", "status", "mentions"), BAD)
def test_bad_requests_are_anthropic_errors_and_not_recorded(srv: ServerThread, body: dict, status: int,
                                                            mentions: str) -> None:
    r = httpx.post(f"{srv.url}/rollouts/m-bad/v1/messages", json={"model": MODEL, **body}, timeout=30,
                   headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert r.status_code == status, r.text
    err = r.json()
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}[status]
    assert err["type"] == "error" and err["error"]["type"] == kind and mentions in err["error"]["message"]
    srv.services.recorder.force_flush()
    assert httpx.get(f"{srv.url}/api/rollouts/m-bad/spans").status_code == 404


def test_the_client_raises_its_own_error_types(srv: ServerThread) -> None:
    c = _client(srv, "m-bad-client")
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(model="claude-x", max_tokens=5, messages=Q)
    assert nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "5"}]}])
    r = httpx.post(f"{srv.url}/v1/messages", content=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_stop_sequence(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, tokenizer=tiny_model_dir, reply=REPLY) as fake, _gateway(fake, tmp_path / "t.db") as s:
        m = _client(s, "m-stop").messages.create(model=MODEL, max_tokens=50, messages=Q, stop_sequences=["="])
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "=")
        assert m.content[0].text == REPLY[: REPLY.index("=")]
        cut = _client(s, "m-stop").messages.create(model=MODEL, max_tokens=2, messages=Q)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_upstream_stalling_mid_stream_is_an_error_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, "--stream-delay", "1.0", tokenizer=tiny_model_dir, reply=REPLY) as fake:
        settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{tmp_path}/t.db",
                                   upstream_timeout=0.3)
        with ServerThread(create_app(settings)) as s:
            with pytest.raises(anthropic.APIStatusError) as e, _client(s, "m-stall").messages.stream(
                    model=MODEL, max_tokens=50, messages=Q) as stream:
                for _ in stream:
                    pass
            assert e.value.body["error"]["type"] == "timeout_error"
            (span,) = spans_of(s.url, "m-stall", 1)
            assert span["status"] == "error" and span["attributes"]["tracegym.api"] == "messages"
