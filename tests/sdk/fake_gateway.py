"""A small real HTTP server (FastAPI + uvicorn in a thread) implementing the few gateway routes the SDK
uses, with knobs for failure injection. The real gateway is tested in test_runner_gateway.py and e2e."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.procs import free_port
from tracegym.client import GatewayClient, config_for


@dataclass
class FakeState:
    fail_next: int = 0
    """Answer the next N control-API requests with 503 (after storing, for rewards: a lost answer)."""
    store_then_fail: bool = False
    """With ``fail_next``: store the event first, then answer 503 (the client must not double count)."""
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    events: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """rollout id -> idempotency key -> body."""
    attempts: list[str] = field(default_factory=list)
    queue: list[dict[str, Any]] = field(default_factory=list)
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    spans: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    heartbeats: list[str] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)
    hold_heartbeats: set[str] = field(default_factory=set)
    """Rollout ids whose heartbeats are answered only once the rollout has stopped running (within 10 s):
    a heartbeat that crosses the rollout's own complete/fail, and so reaches a finished rollout."""
    reject_complete: str | None = None
    """Answer every ``complete`` with 400 and this message (a result the gateway refuses)."""
    fail_on_enqueue: int = 0
    """Set ``fail_next`` to this when the next task is enqueued, atomically with queueing it (so a claim
    already in flight cannot take the task before the failures are armed)."""
    fail_finish: int = 0
    """Answer the next N ``complete``/``fail`` requests with 503, without acting on them."""
    finish_calls: list[tuple[str, str]] = field(default_factory=list)
    """(``complete``|``fail``, rollout id) of every such request, in order."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rewards(self, rollout_id: str) -> list[dict[str, Any]]:
        return [b for b in self.events.get(rollout_id, {}).values() if b["kind"] == "reward"]


def _err(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "x", "param": None, "code": None}}, status)


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def maybe_fail() -> JSONResponse | None:
        with state.lock:
            if state.fail_next > 0 and not state.store_then_fail:
                state.fail_next -= 1
                return _err(503, "injected failure")
        return None

    @app.post("/v1/chat/completions")
    @app.post("/rollouts/{rid}/v1/chat/completions")
    async def chat(request: Request, rid: str | None = None) -> dict[str, Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        state.seen_headers.append({**headers, "path": request.url.path})
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": headers.get("x-rollout-id", "none")},
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @app.get("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {k.lower(): v for k, v in request.headers.items()}

    async def add_event(rid: str, request: Request, kind: str) -> JSONResponse:
        body = await request.json()
        state.attempts.append(rid)
        if (resp := maybe_fail()) is not None:
            return resp
        key = body["idempotency_key"]
        with state.lock:
            store = state.events.setdefault(rid, {})
            duplicate = key in store
            store.setdefault(key, {**body, "kind": kind})
            if state.store_then_fail and state.fail_next > 0:
                state.fail_next -= 1
                return _err(503, "stored, but the answer is lost")
        return JSONResponse({"event_id": key, "duplicate": duplicate}, 201)

    @app.post("/api/rollouts/{rid}/rewards")
    async def rewards(rid: str, request: Request) -> JSONResponse:
        return await add_event(rid, request, "reward")

    @app.post("/api/rollouts/{rid}/events")
    async def events(rid: str, request: Request) -> JSONResponse:
        return await add_event(rid, request, "event")

    @app.post("/api/tasks")
    async def tasks(request: Request) -> JSONResponse:
        if (resp := maybe_fail()) is not None:
            return resp
        body = await request.json()
        out = []
        for t in body["tasks"]:
            tid = t.get("task_id") or uuid.uuid4().hex
            gid = uuid.uuid4().hex
            rids = []
            for _ in range(body.get("group_size", 1)):
                rid = uuid.uuid4().hex
                r = {
                    "rollout_id": rid,
                    "task_id": tid,
                    "group_id": gid,
                    "status": "queued",
                    "attempt": 0,
                    "max_attempts": body.get("max_attempts", 3),
                    "input": t["input"],
                    "reward": None,
                    "error": None,
                    "traceback": None,
                    "created_at": time.time(),
                }
                with state.lock:
                    state.rollouts[rid] = r
                    state.queue.append(r)
                    if state.fail_on_enqueue:
                        state.fail_next, state.fail_on_enqueue = state.fail_on_enqueue, 0
                rids.append(rid)
            out.append({"task_id": tid, "group_id": gid, "rollout_ids": rids})
        with state.lock:
            if state.store_then_fail and state.fail_next > 0:
                state.fail_next -= 1
                return _err(503, "enqueued, but the answer is lost")
        return JSONResponse({"tasks": out}, 201)

    @app.post("/api/rollouts/claim")
    async def claim(request: Request) -> Any:
        body = await request.json()
        with state.lock:  # the failure check and the take in one step (see fail_on_enqueue)
            if state.fail_next > 0 and not state.store_then_fail:
                state.fail_next -= 1
                return _err(503, "injected failure")
            got = state.queue[: body.get("limit", 1)]
            del state.queue[: len(got)]
            for r in got:
                r.update(status="running", worker_id=body["worker_id"])
        return {"rollouts": got}

    def finish(rid: str, body: dict[str, Any], **changes: Any) -> Any:
        r = state.rollouts.get(rid)
        if r is None:
            return _err(404, f"unknown rollout {rid}")
        if rid in state.lost or r["status"] != "running" or r.get("worker_id") != body.get("worker_id"):
            return _err(409, f"lease lost on {rid}")
        r.update(changes)
        return r

    @app.post("/api/rollouts/{rid}/heartbeat")
    async def heartbeat(rid: str, request: Request) -> Any:
        state.heartbeats.append(rid)
        body = await request.json()
        deadline = time.monotonic() + 10
        while rid in state.hold_heartbeats and state.rollouts[rid]["status"] == "running":
            if time.monotonic() > deadline:
                return _err(400, f"held heartbeat: {rid} still running after 10 s")
            await asyncio.sleep(0.01)
        resp = finish(rid, body)
        return resp if isinstance(resp, JSONResponse) else {"lease_expires_at": "later"}

    def finish_refused(kind: str, rid: str) -> JSONResponse | None:
        with state.lock:
            state.finish_calls.append((kind, rid))
            if state.fail_finish > 0:
                state.fail_finish -= 1
                return _err(503, "injected failure")
        if kind == "complete" and state.reject_complete is not None:
            return _err(400, state.reject_complete)
        return None

    @app.post("/api/rollouts/{rid}/complete")
    async def complete(rid: str, request: Request) -> Any:
        body = await request.json()
        if (resp := finish_refused("complete", rid)) is not None:
            return resp
        return finish(rid, body, status="completed", reward=body.get("reward"))

    @app.post("/api/rollouts/{rid}/fail")
    async def fail(rid: str, request: Request) -> Any:
        body = await request.json()
        if (resp := finish_refused("fail", rid)) is not None:
            return resp
        return finish(rid, body, status="failed", error=body["error"], traceback=body.get("traceback"))

    @app.post("/api/rollouts/{rid}/release")
    async def release(rid: str, request: Request) -> Any:
        resp = finish(rid, await request.json(), status="queued")
        if not isinstance(resp, JSONResponse):
            state.queue.append(resp)
        return resp

    @app.get("/api/rollouts")
    async def list_rollouts(status: str | None = None, limit: int = 100, cursor: str | None = None) -> Any:
        rows = sorted(
            (r for r in state.rollouts.values() if status in (None, r["status"])),
            key=lambda r: -r["created_at"],
        )
        start = int(cursor or 0)
        page = rows[start : start + limit]
        nxt = str(start + limit) if start + limit < len(rows) else None
        return {"rollouts": page, "next_cursor": nxt}

    @app.get("/api/rollouts/{rid}/spans")
    async def spans(rid: str) -> Any:
        return {"spans": state.spans.get(rid, [])}

    @app.get("/api/trajectories")
    async def trajectories(status: str = "completed", limit: int | None = None) -> PlainTextResponse:
        import json

        rows = [r for r in state.rollouts.values() if r["status"] == status][:limit]
        lines = [
            json.dumps(
                {
                    "rollout_id": r["rollout_id"],
                    "task_id": r["task_id"],
                    "reward": r["reward"],
                    "sequences": [],
                }
            )
            for r in rows
        ]
        return PlainTextResponse("".join(line + "\n" for line in lines), media_type="application/jsonl")

    return app


class FakeGateway:
    """``with FakeGateway() as gw:`` serves on ``gw.url`` until the block ends. ``start=False`` with
    ``port`` reserves the URL but starts later (``gw.start()``), to test a late gateway."""

    def __init__(self, port: int | None = None) -> None:
        self.state = FakeState()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeGateway:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def __enter__(self) -> FakeGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def enqueue(gw: FakeGateway, inputs: list[Any], group_size: int = 1) -> list[str]:
    """Enqueue one task per input on ``gw`` (the SDK configured for it); the new rollout ids."""
    with GatewayClient(config_for(gw.url)) as c:
        out = c.enqueue_tasks([{"input": i} for i in inputs], group_size=group_size)
    return [rid for t in out for rid in t["rollout_ids"]]


def status(gw: FakeGateway, rids: list[str]) -> list[tuple[str, Any]]:
    """(status, reward) of each rollout."""
    return [(gw.state.rollouts[r]["status"], gw.state.rollouts[r]["reward"]) for r in rids]
