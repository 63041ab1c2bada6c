"""One ``tracegym tinker-serve --model tiny-random`` (the service, its gateway and embedded engine, a SQLite
store) for the service's tests, with an admin key; helpers that speak its HTTP API directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import ManagedProcess, free_port, start_process

ADMIN_KEY = "service-test-key"
SMOLLM2_KEY = "smollm2-service-key"
MODEL = "tiny-random"


@dataclass
class Service:
    proc: ManagedProcess
    state_dir: Path

    @property
    def url(self) -> str:
        return self.proc.base_url

    def client(self, key: str | None = ADMIN_KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": key} if key else {}, timeout=120)

    def gateway(self, model: str = MODEL) -> httpx.Client:
        """The gateway the service started for ``model`` (its URL is in the service's log)."""
        log = self.proc.log(tail=10**7)  # the whole log: the line is near its start
        url = next(line.split(": ")[1].split()[0] for line in log.splitlines()
                   if line.startswith("gateway (the store") and f" for {model} (" in line)
        key = (self.state_dir / "gateway_key").read_text().strip()
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@contextmanager
def tiny_service(state: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Service]:
    """``tracegym tinker-serve --model tiny-random`` (fp32) with its state under ``state``, and ``flags``
    and ``env`` besides."""
    port = free_port()
    argv = ["tracegym", "tinker-serve", "--model", MODEL, "--port", str(port), "--state-dir", str(state),
            "--micro-batch-tokens", "4096", "--dtype", "float32", "--log-level", "warning", *flags]
    env = {"TRACEGYM_ADMIN_KEY": ADMIN_KEY, "TINKER_TELEMETRY": "0", **(env or {})}
    with start_process(argv, port=port, log_path=state / "service.log", health_path="/healthz", timeout=300,
                       env=env) as proc:
        yield Service(proc, state)


@pytest.fixture(scope="session")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The service most tests share; its engine serves LoRA versions (the first publish decides)."""
    with tiny_service(tmp_path_factory.mktemp("tinker-service")) as svc:
        yield svc


@pytest.fixture(scope="session")
def trainer_imports() -> None:
    """transformers' model classes imported once per session (seconds), before a test that trains here."""
    from transformers import AutoModelForCausalLM  # noqa: F401

    from tracegym.trainer.workers.group import WorkerGroup  # noqa: F401


@pytest.fixture(scope="session")
def smollm2_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """``tracegym tinker-serve --model smollm2-135m`` (slow tests only), bf16 where this CPU runs it fast."""
    state = tmp_path_factory.mktemp("tinker-smollm2")
    port = free_port()
    argv = ["tracegym", "tinker-serve", "--model", "smollm2-135m", "--port", str(port), "--state-dir", str(state)]
    with start_process(argv, port=port, log_path=state / "service.log", health_path="/healthz", timeout=600,
                       env={"TRACEGYM_ADMIN_KEY": SMOLLM2_KEY, "TINKER_TELEMETRY": "0"}) as proc:
        yield proc


def result(c: httpx.Client, answer: httpx.Response, timeout: float = 120.0) -> dict[str, Any]:
    """Poll a future's ``request_id`` until it is done; its JSON result (or error)."""
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.post("/api/v1/retrieve_future", json={"request_id": rid})
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{rid} not done in {timeout} s")


def session(c: httpx.Client) -> str:
    r = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "test"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def create_run(c: httpx.Client, lora_rank: int | None = 4, model: str = MODEL) -> str:
    sid = session(c)
    lora = None if lora_rank is None else {"rank": lora_rank}
    out = result(c, c.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                         "base_model": model, "lora_config": lora}))
    assert "model_id" in out, out
    return out["model_id"]


def datum(tokens: list[int], targets: list[int], **inputs: list[float]) -> dict[str, Any]:
    return {"model_input": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
            "loss_fn_inputs": {"target_tokens": targets, **inputs}}


def fb_body(model_id: str, data: list[dict], loss: str = "cross_entropy", seq_id: int | None = None,
            **config: float | str) -> dict[str, Any]:
    body: dict[str, Any] = {"model_id": model_id, "forward_backward_input": {
        "data": data, "loss_fn": loss, "loss_fn_config": config}}
    if seq_id is not None:
        body["seq_id"] = seq_id
    return body
