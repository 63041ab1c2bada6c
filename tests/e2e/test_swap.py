"""Weight hot-swap end to end: ``tracegym serve --engine embedded --model tiny-random`` (real gateway and
engine processes, SQLite store) swapping to a perturbed checkpoint while a long generation runs. The
client gets one normal response (or one uninterrupted stream), the span says which tokens came from
which version, later calls carry the new version; a corrupt checkpoint is refused and generation goes on
with the old weights."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import serve_tiny, swap_while_generating
from tests.gateway.app_support import sse_payloads
from tests.procs import ManagedProcess

MODEL = "tiny-random"
GENERATION_S = 1.5  # how long the generation a swap lands in should run (the swap starts once it decodes)
Q = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """Its own gateway: these tests swap the engine's weights."""
    # the weights root: pytest's base temporary directory, where every test writes its weights
    with serve_tiny(tmp_path_factory.mktemp("e2e-swap"), "--weights-dir", str(tmp_path_factory.getbasetemp())) as p:
        yield p


@pytest.fixture(scope="module")
def max_tokens(gateway: ManagedProcess) -> int:
    """Tokens that take ~GENERATION_S to generate on this machine (timed here; a fixed count ran out before
    the swap on a fast machine). tiny-random rarely samples EOS that early."""
    url = gateway.base_url + "/v1/chat/completions"
    httpx.post(url, json={"model": MODEL, "messages": Q, "max_tokens": 16}, timeout=120)  # warm-up
    t = time.perf_counter()
    r = httpx.post(url, json={"model": MODEL, "messages": Q, "max_tokens": 200}, timeout=120)
    per_token = (time.perf_counter() - t) / max(1, r.json()["usage"]["completion_tokens"])
    return max(1000, min(6000, int(GENERATION_S / per_token)))


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-random with every weight perturbed, saved as safetensors."""
    import torch

    from tracegym.modelfiles.load import load_model

    model = load_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    out = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(out)
    return out


def _swap_during(gw: ManagedProcess, call: Any, body: dict) -> tuple[Any, httpx.Response]:
    return swap_while_generating(
        gw, call, lambda: httpx.post(gw.base_url + "/api/weights/update", json=body, timeout=120), timeout=120)


def _span_choice(gw: ManagedProcess, rollout_id: str) -> tuple[dict, dict]:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{gw.base_url}/api/rollouts/{rollout_id}/spans")
        spans = r.json()["spans"] if r.status_code == 200 else []  # 404 until the span is flushed
        if spans or time.monotonic() > deadline:
            assert len(spans) == 1, spans
            return spans[0], spans[0]["choices"][0]
        time.sleep(0.1)


def _current(gw: ManagedProcess) -> str:
    return httpx.get(gw.base_url + "/api/weights").json()["weight_version"]


def _check_spans(choice: dict, before: str, after: str, n: int) -> None:
    spans = [tuple(s) if isinstance(s, list) else (s["version"], s["start"], s["end"])
             for s in choice["weight_versions"]]
    assert len(spans) == 2, spans
    (v0, s0, e0), (v1, s1, e1) = spans
    assert (v0, v1) == (before, after) and s0 == 0 and e0 == s1 and 0 < e0 < n and e1 == n
    assert len(choice["output_ids"]) == len(choice["output_logprobs"]) == n


def test_non_stream_call_spans_a_swap(gateway: ManagedProcess, checkpoint: Path, max_tokens: int) -> None:
    before = _current(gateway)
    url = gateway.base_url + "/rollouts/swap-ns/v1/chat/completions"
    r, swap = _swap_during(gateway, lambda: httpx.post(url, json={"model": MODEL, "messages": Q, "max_tokens": max_tokens},
                                                       timeout=120),
                           {"model_path": str(checkpoint), "weight_version": "e2e-1"})
    assert swap.status_code == 200 and swap.json()["success"] is True, swap.text
    assert r.status_code == 200, r.text
    body = r.json()
    finish, n = body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
    assert finish in ("stop", "length")
    if finish == "length":
        assert n == max_tokens
    assert body["tracegym"]["weight_version"] == "e2e-1"
    _, choice = _span_choice(gateway, "swap-ns")
    _check_spans(choice, before, "e2e-1", n)
    assert choice["finish_reason"] == finish
    # later calls carry the new version, in the response and in the span
    r2 = httpx.post(gateway.base_url + "/rollouts/swap-after/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": Q, "max_tokens": 4})
    assert r2.json()["tracegym"]["weight_version"] == "e2e-1"
    span2, choice2 = _span_choice(gateway, "swap-after")
    assert span2["attributes"]["tracegym.weight_version"] == "e2e-1"
    assert [tuple(s) if isinstance(s, list) else s["version"] for s in choice2["weight_versions"]] in (
        [("e2e-1", 0, r2.json()["usage"]["completion_tokens"])], ["e2e-1"])
    listed = httpx.get(gateway.base_url + "/api/weight_versions").json()["weight_versions"]
    entry = next(v for v in listed if v["version"] == "e2e-1")
    assert entry["path"] == str(checkpoint) and entry["swap_seconds"] > 0


def test_stream_spans_a_swap(gateway: ManagedProcess, checkpoint: Path, max_tokens: int) -> None:
    before = _current(gateway)
    url = gateway.base_url + "/rollouts/swap-st/v1/chat/completions"

    def call() -> list[Any]:
        with httpx.stream("POST", url, timeout=120, json={"model": MODEL, "messages": Q, "max_tokens": max_tokens,
                                                          "stream": True,
                                                          "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            return sse_payloads(list(resp.iter_lines()))

    events, swap = _swap_during(gateway, call, {"model_path": str(checkpoint), "weight_version": "e2e-2"})
    assert swap.status_code == 200 and swap.json()["success"] is True, swap.text
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    assert len([f for f in finishes if f]) == 1 and finishes[-1] in ("stop", "length")
    n = events[-2]["usage"]["completion_tokens"]
    if finishes[-1] == "length":
        assert n == max_tokens
    assert events[-2]["tracegym"]["weight_version"] == "e2e-2"
    _, choice = _span_choice(gateway, "swap-st")
    _check_spans(choice, before, "e2e-2", n)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1] if c["choices"])
    assert choice["message"]["content"] == text


def test_failed_swap_keeps_the_old_weights(gateway: ManagedProcess, tmp_path: Path, max_tokens: int) -> None:
    before = _current(gateway)
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    url = gateway.base_url + "/rollouts/swap-bad/v1/chat/completions"
    r, swap = _swap_during(gateway, lambda: httpx.post(url, json={"model": MODEL, "messages": Q, "max_tokens": max_tokens},
                                                       timeout=120),
                           {"model_path": str(bad), "weight_version": "e2e-bad"})
    assert swap.status_code == 400
    assert swap.json()["success"] is False and swap.json()["weight_version"] == "e2e-bad"
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert r.json()["tracegym"]["weight_version"] == before
    _, choice = _span_choice(gateway, "swap-bad")
    n = r.json()["usage"]["completion_tokens"]
    assert [tuple(s) if isinstance(s, list) else (s["version"], s["start"], s["end"])
            for s in choice["weight_versions"]] == [(before, 0, n)]
    assert _current(gateway) == before
    assert "e2e-bad" not in [v["version"] for v in
                             httpx.get(gateway.base_url + "/api/weight_versions").json()["weight_versions"]]
