"""The official ``openai`` client against ``tracegym serve --engine embedded --model tiny-random`` (real
processes: gateway, engine child, SQLite store), plus the error statuses it surfaces."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import ManagedProcess, free_port, start_process

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"
Q = [{"role": "user", "content": "What is 2+3?"}]


def _serve(tmp: Path, *args: str, timeout: float = 240) -> ManagedProcess:
    port = free_port()
    return start_process(["tracegym", "serve", "--port", str(port), *args], port=port,
                         log_path=tmp / f"serve-{port}.log", health_path="/healthz", timeout=timeout)


@pytest.fixture(scope="module")
def client(gateway: ManagedProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _spans(gateway: ManagedProcess, rollout_id: str, n: int) -> list[dict]:
    """The rollout's spans once ``n`` are stored (recording is asynchronous: until its first span is written
    the rollout is unknown, 404)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{gateway.base_url}/api/rollouts/{rollout_id}/spans")
        spans = r.json()["spans"] if r.status_code == 200 else []
        if len(spans) >= n or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return spans
        time.sleep(0.1)


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=8, seed=1, logprobs=True)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and isinstance(ch.message.content, str)
    assert r.usage.completion_tokens == len(ch.logprobs.content) > 0
    assert r.model_extra["tracegym"]["call_id"] == r.id
    assert r.model_extra["tracegym"]["rollout_id"].startswith("adhoc-")


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=Q, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_completions_string_and_tokens(client: openai.OpenAI) -> None:
    a = client.completions.create(model=MODEL, prompt="2+3=", max_tokens=4)
    b = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    for r in (a, b):
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
    assert b.usage.prompt_tokens == 3


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_serve_freezes_its_startup_heap(gateway: ManagedProcess) -> None:
    """`tracegym serve` moves its startup objects out of the collector's generations (p99 latency)."""
    metrics = httpx.get(gateway.base_url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("tracegym_gateway_gc_frozen_objects "))
    assert float(line.split()[1]) > 10_000


def test_turn_two_extends_turn_one_in_the_store(gateway: ManagedProcess) -> None:
    c = openai.OpenAI(base_url=f"{gateway.base_url}/rollouts/e2e-r1/v1", api_key="unused", max_retries=0)
    one = c.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, seed=3)
    msgs = [*Q, {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "And 3+4?"}]
    two = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, seed=3)
    assert two.model_extra["tracegym"]["rollout_id"] == "e2e-r1"
    s1, s2 = _spans(gateway, "e2e-r1", 2)
    assert s1["call_id"] == one.id and s2["call_id"] == two.id
    head = s1["prompt_ids"] + s1["choices"][0]["output_ids"]
    assert s2["prompt_ids"][: len(head)] == head and len(s2["prompt_ids"]) > len(head)


def test_error_statuses(client: openai.OpenAI, gateway: ManagedProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=Q)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=Q, max_tokens="many")  # type: ignore[arg-type]
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 300_000}])
    assert e.value.status_code == 413
    r = httpx.post(gateway.base_url + "/v1/chat/completions", content=b"{oops",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_upstream_down_and_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    with _serve(tmp_path, "--upstream", f"http://127.0.0.1:{free_port()}", "--model", MODEL,
                "--store", "none", timeout=60) as gw:
        c = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=Q)
        assert e.value.status_code == 502
    fake_port = free_port()
    fake_argv = [sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(fake_port), "--delay", "2",
                 "--tokenizer", str(tiny_model_dir)]
    with start_process(fake_argv, port=fake_port, log_path=tmp_path / "fake.log", timeout=30,
                       env={"PYTHONPATH": str(REPO)}) as fake, \
            _serve(tmp_path, "--upstream", fake.base_url, "--model", MODEL, "--store", "none",
                   "--upstream-timeout", "0.5", timeout=60) as gw:
        c = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=Q)
        assert e.value.status_code == 504


@pytest.mark.slow
def test_smollm2_answers_two_plus_three(tmp_path: Path) -> None:
    """The real model answers through each API the gateway speaks: Chat Completions, Responses (also
    streamed) and Anthropic Messages, with one greedy answer (the three render the same chat prompt)."""
    import anthropic

    from tracegym.modelfiles.prepare import prepare_model

    prepare_model("smollm2-135m")
    with _serve(tmp_path, "--engine", "embedded", "--model", "smollm2-135m", "--store", "none",
                timeout=600) as gw:
        c = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="smollm2-135m", messages=Q, max_tokens=48, temperature=0)
        chat = r.choices[0].message.content
        assert "5" in chat, chat
        resp = c.responses.create(model="smollm2-135m", input=Q[0]["content"], max_output_tokens=48,
                                  temperature=0)
        assert resp.output_text == chat, (resp.output_text, chat)
        with c.responses.stream(model="smollm2-135m", input=Q[0]["content"], max_output_tokens=48,
                                temperature=0) as stream:
            streamed = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        assert streamed == chat, (streamed, chat)
        a = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=300)
        msg = a.messages.create(model="smollm2-135m", max_tokens=48, messages=Q,
                                 extra_body={"temperature": 0})  # anthropic 2.x dropped the argument
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat, (msg.content, chat)
