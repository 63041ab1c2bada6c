"""Helpers for the gateway app/upstream tests (no tests here): the SGLang fake as a real process, the
gateway app served by a real uvicorn in a thread (so a test can read its in-memory recorder), and a
recorder that keeps CallRecords in a list."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

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


def start_fake(tmp_path: Path, *extra: str, tokenizer: Path | None = None, reply: str = REPLY) -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--reply", reply, "--record",
            *extra]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    return start_process(argv, port=port, log_path=tmp_path / f"fake-{port}.log", timeout=30,
                         env={"PYTHONPATH": str(REPO)})


class MemoryRecorder:
    """The ``record``/``shutdown`` interface of tracing.TraceRecorder, keeping records in memory."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []
        self.shut = False

    def record(self, rec: CallRecord) -> None:
        self.records.append(rec)

    def shutdown(self) -> None:
        self.shut = True

    def wait_for(self, n: int, timeout: float = 5.0) -> list[CallRecord]:
        deadline = time.monotonic() + timeout
        while len(self.records) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.records


class ServerThread:
    """A FastAPI app under a real uvicorn server on a free port, in a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="asyncio", log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

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
