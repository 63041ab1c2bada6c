"""LoRA adapter swaps end to end: a real gateway with the embedded engine on tiny-random loads adapters
through ``POST /api/weights/lora`` (pause, load under versioned names, stamp the version, route, unload,
continue), routes each agent's calls to its own adapter, records the adapter on every span, and refuses
an adapter trained on another base model while the old one keeps serving."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.e2e.conftest import serve_tiny, swap_while_generating
from tests.engine.test_lora import make_adapter
from tests.procs import ManagedProcess
from tracegym.modelfiles.formats import BASE_KEY

MODEL = "tiny-random"
Q = [{"role": "user", "content": "Plan the next step."}]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    # the weights root: the session's temporary folder, which holds the adapters written below
    with serve_tiny(tmp_path_factory.mktemp("e2e-lora"), "--weights-dir", str(tmp_path_factory.getbasetemp())) as p:
        yield p


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"planner": make_adapter(tiny_model_dir, root / "p", seed=1, targets=["q_proj", "v_proj"]),
            "executor": make_adapter(tiny_model_dir, root / "e", seed=2, targets=["up_proj", "down_proj"])}


def call(gw: ManagedProcess, rollout: str, agent: str | None) -> list[float]:
    headers = {"X-Agent-Name": agent} if agent else {}
    r = httpx.post(f"{gw.base_url}/rollouts/{rollout}/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "messages": Q, "max_tokens": 6, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    return [e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]]


def span(gw: ManagedProcess, rollout: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{gw.base_url}/api/rollouts/{rollout}/spans")
        spans = r.json()["spans"] if r.status_code == 200 else []
        if spans or time.monotonic() > deadline:
            assert len(spans) == 1, spans
            return spans[0]
        time.sleep(0.1)


def swap(gw: ManagedProcess, version: str, adapters: dict[str, Path], per_agent: bool) -> httpx.Response:
    body = {"weight_version": version, "per_agent": per_agent, "adapters": {k: str(v) for k, v in adapters.items()}}
    return httpx.post(gw.base_url + "/api/weights/lora", json=body, timeout=120)


def test_adapter_swaps_route_each_agent_to_its_adapter(
    gateway: ManagedProcess, adapters: dict[str, Path], tmp_path: Path
) -> None:
    base = call(gateway, "lora-base", "planner")
    assert "tracegym.lora_adapter" not in span(gateway, "lora-base")["attributes"]

    # one adapter for every call
    r = swap(gateway, "1", {"default": adapters["planner"]}, per_agent=False)
    assert r.status_code == 200 and r.json()["success"], r.text
    state = httpx.get(gateway.base_url + "/api/weights").json()
    assert state["weight_version"] == "1" and state["lora"] == {"per_agent": False, "served": {"default": "default-v1"}}
    one = call(gateway, "lora-one", "anyone")
    assert one != base
    attrs = span(gateway, "lora-one")["attributes"]
    assert attrs["tracegym.lora_adapter"] == "default" and attrs["tracegym.weight_version"] == "1"

    # one adapter per agent role
    r = swap(gateway, "2", adapters, per_agent=True)
    assert r.status_code == 200 and r.json()["success"], r.text
    planner, executor, critic = (call(gateway, f"lora-{a}", a) for a in ("planner", "executor", "critic"))
    assert planner == one  # the planner adapter is the one served as default before
    assert executor not in (planner, base) and critic == base  # an agent without an adapter: the base
    for agent, want in (("planner", "planner"), ("executor", "executor"), ("critic", None)):
        attrs = span(gateway, f"lora-{agent}")["attributes"]
        assert attrs.get("tracegym.lora_adapter") == want and attrs["tracegym.weight_version"] == "2"

    # an adapter trained on another base model is refused; the old ones keep serving
    bad = tmp_path / "bad"
    shutil.copytree(adapters["executor"], bad)
    t = load_file(str(bad / "adapter_model.safetensors"))
    save_file(t, str(bad / "adapter_model.safetensors"), metadata={BASE_KEY: "0000000000000000"})
    r = swap(gateway, "3", {"planner": adapters["planner"], "executor": bad}, per_agent=True)
    assert r.status_code == 400 and not r.json()["success"] and "another base model" in r.json()["message"]
    state = httpx.get(gateway.base_url + "/api/weights").json()
    assert state["weight_version"] == "2"
    assert state["lora"]["served"] == {"default": "default-v1", "planner": "planner-v2", "executor": "executor-v2"}
    assert call(gateway, "lora-after-refusal", "executor") == executor
    versions = [v["version"] for v in httpx.get(gateway.base_url + "/api/weight_versions").json()["weight_versions"]]
    assert "2" in versions and "3" not in versions


def test_a_lora_call_cut_by_an_adapter_swap_is_continued_on_the_new_adapter(
    gateway: ManagedProcess, adapters: dict[str, Path]
) -> None:
    r = swap(gateway, "10", {"default": adapters["planner"]}, per_agent=False)
    assert r.status_code == 200, r.text
    url = gateway.base_url + "/rollouts/lora-long/v1/chat/completions"
    body = {"model": MODEL, "messages": Q, "max_tokens": 200, "temperature": 1.0}
    httpx.post(gateway.base_url + "/rollouts/lora-warm/v1/chat/completions", timeout=120,
               json={**body, "max_tokens": 16})  # warm-up: the adapter's first call
    t = time.perf_counter()
    timed = httpx.post(gateway.base_url + "/rollouts/lora-timed/v1/chat/completions", timeout=120, json=body)
    per_token = (time.perf_counter() - t) / max(1, timed.json()["usage"]["completion_tokens"])
    body["max_tokens"] = max(1000, min(6000, int(1.5 / per_token)))
    reply, r = swap_while_generating(gateway, lambda: httpx.post(url, json=body, timeout=180),
                                     lambda: swap(gateway, "11", {"default": adapters["executor"]}, per_agent=False))
    assert r.status_code == 200 and r.json()["success"], r.text
    assert reply.status_code == 200, reply.text
    n = reply.json()["usage"]["completion_tokens"]
    s = span(gateway, "lora-long")
    assert s["attributes"]["tracegym.lora_adapter"] == "default"
    spans = [tuple(x) if isinstance(x, list) else (x["version"], x["start"], x["end"])
             for x in s["choices"][0]["weight_versions"]]
    assert [v for v, _, _ in spans] == ["10", "11"] and spans[0][2] == spans[1][1] and spans[1][2] == n
    assert httpx.get(gateway.base_url + "/api/weights").json()["lora"]["served"]["default"] == "default-v11"
