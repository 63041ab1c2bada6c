"""Shared helpers of the store tests: realistic CallRecords and a minimal app serving the store's routers
(the real ``create_app`` needs an upstream; these routers only need ``app.state.store``)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tests.procs import free_port
from tracegym.gateway.api import control, otlp
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.proxy.auth import Guard
from tracegym.gateway.traces.call_spans import attributes_to_row_fields, call_record_attributes, span_name
from tracegym.types import CallRecord, ChoiceRecord, WeightVersionSpan


def make_record(i: int = 0, *, rollout_id: str = "ro-1", n: int = 1, seed: int = 0, **kw) -> CallRecord:
    rng = random.Random(seed * 1000 + i)
    choices = [
        ChoiceRecord(
            index=j,
            output_ids=[rng.randrange(50_000) for _ in range(7 + j)],
            # float64 values that are not float32-exact, and engine-like float32 ones
            output_logprobs=[-rng.random() * 5 for _ in range(7 + j)] if j % 2 == 0
            else [float(-k / 8) for k in range(7 + j)],
            finish_reason="stop" if j == 0 else "length",
            message={"role": "assistant", "content": f"answer {i}.{j}", "tool_calls": None},
            weight_versions=[WeightVersionSpan("v1", 0, 3), WeightVersionSpan("v2", 3, 7 + j)],
        )
        for j in range(n)
    ]
    base = dict(
        call_id=f"chatcmpl-{seed}-{i}", rollout_id=rollout_id, operation="chat", model="tiny-random",
        upstream_kind="sglang",
        request={"model": "tiny-random", "messages": [{"role": "user", "content": f"q{i} ✓"}],
                 "temperature": 0.7, "top_p": 0.9, "max_tokens": 16, "n": n},
        choices=choices, prompt_ids=[rng.randrange(50_000) for _ in range(20)], task_id="task-1",
        agent_name="solver", weight_version="v2", drift="clean", prefix_len=5, input_tokens=20,
        output_tokens=7 * n, start_time_ns=1_700_000_000_000_000_000 + i * 1_000_000,
        end_time_ns=1_700_000_000_000_000_000 + i * 1_000_000 + 500_000,
        first_token_time_ns=1_700_000_000_000_000_000 + i * 1_000_000 + 100_000,
    )
    base.update(kw)
    return CallRecord(**base)


def span_row(rec: CallRecord, *, trace_id: str, span_id: str, resource: dict | None = None) -> dict:
    """The row dict of ``rec``'s span as a writer of span dicts (OTLP ingest) builds it: the span's
    attributes (``call_record_attributes``) split into the store's columns (``attributes_to_row_fields``).
    The gateway itself writes ``call_record_store_row`` tuples; ``test_ingest`` checks both store alike."""
    error = rec.status == "error"
    return {
        "trace_id": trace_id, "span_id": span_id, "parent_span_id": None, "source": "gateway",
        "name": span_name(rec), "kind": "client", "start_time_ns": rec.start_time_ns,
        "end_time_ns": rec.end_time_ns, "status": "error" if error else "ok",
        "status_message": rec.error if error else None, "resource": resource, "events": None,
        **attributes_to_row_fields(call_record_attributes(rec)),
    }


def make_app(store: object) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.state.guard = Guard(None)
    app.state.store = store
    app.state.max_body_bytes = 8 * 1024 * 1024
    app.state.metrics_registry = CollectorRegistry()
    app.include_router(control.router)
    app.include_router(otlp.router)
    return app


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on a free port (in a thread); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
