"""Helpers for the gateway app/upstream tests (no tests here): the SGLang fake as a real process, the
gateway app served by a real uvicorn in a thread (so a test can read its in-memory recorder), and a
recorder that keeps CallRecords in a list."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.procs import ManagedProcess, free_port, start_process
from tracegym.types import CallRecord

REPO = Path(__file__).resolve().parents[2]
REPLY = "Hello! 2 + 3 = 5."
TOOL_REPLY = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


TOKENS_APART = ("--stream-delay", "0.05")
"""``start_fake`` arguments that stream a reply's tokens 50 ms apart, as an engine generates them: tokens that
arrive together the gateway forwards as one delta, so a test of token-by-token deltas needs them apart (20 ms
apart merged some under three pytest workers on two cores)."""


def start_fake(tmp_path: Path, *extra: str, tokenizer: Path | None = None, reply: str = REPLY,
               port: int | None = None, cwd: Path | None = None) -> ManagedProcess:
    port = port or free_port()
    argv = [sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--reply", reply, "--record",
            *extra]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    return start_process(argv, port=port, log_path=tmp_path / f"fake-{port}.log", timeout=30,
                         env={"PYTHONPATH": str(REPO)}, cwd=cwd)


class MemoryRecorder:
    """The ``record``/``shutdown`` interface of tracing.TraceRecorder, keeping records in memory."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []
        self.shut = False

    def record(self, rec: CallRecord) -> None:
        self.records.append(rec)

    def record_durably(self, rec: CallRecord) -> asyncio.Future[bool]:
        """Kept in memory at once: the future is already True."""
        self.records.append(rec)
        ack = asyncio.get_running_loop().create_future()
        ack.set_result(True)
        return ack

    def shutdown(self) -> None:
        self.shut = True

    def wait_for(self, n: int, timeout: float = 5.0) -> list[CallRecord]:
        deadline = time.monotonic() + timeout
        while len(self.records) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.records


class ServerThread:
    """A FastAPI app under a real uvicorn server in a background thread, on a port this object binds
    itself (so no other process can take it before the server listens)."""

    def __init__(self, app: Any) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="asyncio", log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway app failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway app did not start in 60 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    @property
    def services(self) -> Any:
        return self.app.state.services


def sse_payloads(lines: list[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    import json

    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


THINK_TOOL_REPLY = "<think>\nI add.\n</think>\n\n" + TOOL_REPLY
"""A reasoning model's reply: reasoning, text, one tool call."""


def spans_of(base_url: str, rollout_id: str, n: int, timeout: float = 10.0) -> list[dict]:
    """The rollout's spans once ``n`` are stored (recording is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{base_url}/api/rollouts/{rollout_id}/spans", timeout=30)
        spans = r.json()["spans"] if r.status_code == 200 else []
        if len(spans) >= n or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return spans


def check_one_merged_sequence(base_url: str, rollout_id: str, call_ids: list[str]) -> list[dict]:
    """The rollout's trajectory is one sequence whose mask-1 tokens and logprobs are exactly the calls'
    sampled ids and engine logprobs, in order (compared with the stored spans); returns the spans."""
    spans = spans_of(base_url, rollout_id, len(call_ids))
    assert [s["call_id"] for s in spans] == call_ids
    traj = httpx.get(f"{base_url}/api/rollouts/{rollout_id}/trajectory", timeout=30).json()
    assert traj["excluded"] == [] and len(traj["sequences"]) == 1, traj
    seq = traj["sequences"][0]
    mask = seq["loss_mask"]
    outputs = [s["choices"][0] for s in spans]
    assert [t for t, m in zip(seq["token_ids"], mask, strict=True) if m] == [t for c in outputs for t in c["output_ids"]]
    assert ([lp for lp, m in zip(seq["logprobs"], mask, strict=True) if m]
            == [lp for c in outputs for lp in c["output_logprobs"]])
    assert seq["token_ids"] == spans[-1]["prompt_ids"] + outputs[-1]["output_ids"]
    assert seq["call_ids"] == call_ids and sum(mask) == sum(len(c["output_ids"]) for c in outputs)
    return spans


SWAP_REPLY = " ".join(f"word{i}" for i in range(60))


@contextmanager
def slow_fake(tmp: Path, tokenizer: Path) -> Iterator[ManagedProcess]:
    """The SGLang fake answering ``SWAP_REPLY`` one token per 30 ms, so a swap lands mid-generation."""
    with start_fake(tmp, "--token-delay", "0.03", tokenizer=tokenizer, reply=SWAP_REPLY) as p:
        yield p


@contextmanager
def recorded_gateway(upstream_url: str, tmp: Path, model: str) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    """A gateway app (SQLite store in ``tmp``, calls recorded in memory) in front of ``upstream_url``."""
    from tracegym.gateway.app import create_app
    from tracegym.gateway.settings import GatewaySettings

    rec = MemoryRecorder()
    # the weights root: pytest's base temporary directory, which holds every test's tmp_path
    settings = GatewaySettings(upstream_url=upstream_url, model=model, store_url=f"sqlite:///{tmp / 'tg.db'}",
                               weights_dir=str(tmp.parent))
    with ServerThread(create_app(settings, recorder=rec)) as srv:
        yield srv, rec
