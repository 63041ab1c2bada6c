"""Commit-before-ack (``GatewaySettings.durability``), ``max_tokens_cap``, and non-stream calls aborted when
their client goes away; a real store-backed recorder in front of the SGLang fake."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import MemoryRecorder, ServerThread, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.store import Store

MODEL = "tiny-random"
Q = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("fake"), tokenizer=tiny_model_dir) as p:
        yield p


def _serve(fake: ManagedProcess, store_url: str, **kw: object) -> ServerThread:
    # schedule_delay of the recorder stays its default (0.1 s): in async mode a span read right after the
    # answer is normally not there yet, which is what the first test tells apart
    return ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=store_url,
                                                   **kw)))


def _stream_lines(url: str, body: dict, **kw: object) -> list[str]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30, **kw) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_call_is_answered_only_once_its_span_is_committed(fake: ManagedProcess, store_url: str) -> None:
    store = Store.open(store_url)
    try:
        with _serve(fake, store_url) as srv:
            for i in range(5):
                rid = f"ro-ack-{i}"
                r = httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", json={"model": MODEL, "messages": Q},
                               timeout=30)
                assert r.status_code == 200
                assert [s["call_id"] for s in list_spans(store, rid)] == [r.json()["id"]]  # read at once
                lines = _stream_lines(f"{srv.url}/rollouts/{rid}-s/v1/chat/completions",
                                      {"model": MODEL, "messages": Q})
                assert lines[-1] == "data: [DONE]"
                assert len(list_spans(store, f"{rid}-s")) == 1
                events = _stream_lines(f"{srv.url}/rollouts/{rid}-m/v1/messages",
                                       {"model": MODEL, "max_tokens": 16, "messages": Q})
                assert events[-1].startswith("data: ") and '"message_stop"' in events[-1]
                assert len(list_spans(store, f"{rid}-m")) == 1
                events = _stream_lines(f"{srv.url}/rollouts/{rid}-r/v1/responses", {"model": MODEL, "input": "hi"})
                assert '"response.completed"' in events[-1]
                assert len(list_spans(store, f"{rid}-r")) == 1
    finally:
        store.close()


def test_async_durability_answers_before_the_commit(fake: ManagedProcess, sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
    try:
        with _serve(fake, sqlite_url, durability="async") as srv:
            missing = 0
            for i in range(5):
                rid = f"ro-async-{i}"
                r = httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", json={"model": MODEL, "messages": Q},
                               timeout=30)
                assert r.status_code == 200
                missing += not list_spans(store, rid)
            assert missing > 0, "async mode wrote every span before answering: the test shows nothing"
    finally:
        store.close()


def test_a_span_the_store_cannot_take_is_a_503_not_a_200(fake: ManagedProcess, tmp_path: Path) -> None:
    db = tmp_path / "tg.db"
    with _serve(fake, f"sqlite:///{db}") as srv:
        url = f"{srv.url}/rollouts/ro-x/v1/chat/completions"
        assert httpx.post(url, json={"model": MODEL, "messages": Q}, timeout=30).status_code == 200
        with sqlite3.connect(db) as conn:  # the spans table goes away under the running gateway
            conn.execute("ALTER TABLE spans RENAME TO spans_gone")
        r = httpx.post(url, json={"model": MODEL, "messages": Q}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "span_not_stored", r.text
        lines = _stream_lines(url, {"model": MODEL, "messages": Q})
        assert '"span_not_stored"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert not any('"finish_reason":"stop"' in x and '"tracegym"' in x for x in lines[-2:])
        m = httpx.post(f"{srv.url}/rollouts/ro-x/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": Q},
                       timeout=30)
        assert m.status_code == 503 and m.json()["type"] == "error", m.text  # Anthropic's error shape


def test_max_tokens_cap(fake: ManagedProcess) -> None:
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None, max_tokens_cap=8)
    with ServerThread(create_app(settings, recorder=MemoryRecorder())) as srv:
        chat = f"{srv.url}/v1/chat/completions"
        r = httpx.post(chat, json={"model": MODEL, "messages": Q, "max_tokens": 9}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "at most 8" in r.json()["error"]["message"]
        r = httpx.post(chat, json={"model": MODEL, "messages": Q, "max_completion_tokens": 100}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        r = httpx.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 9},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
        r = httpx.post(f"{srv.url}/v1/messages", json={"model": MODEL, "messages": Q, "max_tokens": 9}, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error"
        for body in ({}, {"max_tokens": 8}):  # none asked: the cap; at the cap: allowed
            r = httpx.post(chat, json={"model": MODEL, "messages": Q, **body}, timeout=30)
            assert r.status_code == 200
            sent = httpx.get(fake.base_url + "/debug").json()["requests"][-1]
            assert sent["sampling_params"]["max_new_tokens"] == 8


def test_a_non_stream_call_whose_client_leaves_is_aborted_upstream(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, "--delay", "60", tokenizer=tiny_model_dir) as slow:
        rec = MemoryRecorder()
        settings = GatewaySettings(upstream_url=slow.base_url, model=MODEL, store_url=None)
        with ServerThread(create_app(settings, recorder=rec)) as srv:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": Q}, timeout=1.0)
            [call] = rec.wait_for(1, timeout=30)  # long before the upstream's 60 s answer
            assert call.status == "error" and call.error == "client disconnected"
            deadline = time.monotonic() + 30
            while call.call_id not in httpx.get(slow.base_url + "/debug").json()["aborted"]:
                assert time.monotonic() < deadline, "the gateway never sent /abort_request"
                time.sleep(0.1)
            metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
            assert 'route="/v1/chat/completions",status="499"} 1.0' in metrics, metrics


class _StoreLock:
    """Another client holding the store's write lock (SQLite ``BEGIN IMMEDIATE``) or the spans table's
    (PostgreSQL ``LOCK TABLE spans``) until ``release``: the gateway's commits wait behind it."""

    def __init__(self, store_url: str) -> None:
        self.url = store_url
        if store_url.startswith("sqlite"):
            self.conn = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")
        else:
            import psycopg

            self.conn = psycopg.connect(store_url.replace("postgresql+psycopg", "postgresql"))
            self.conn.execute("LOCK TABLE spans IN ACCESS EXCLUSIVE MODE")

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def test_a_stalled_store_makes_calls_wait_a_bounded_time_then_503(fake: ManagedProcess, store_url: str) -> None:
    store = Store.open(store_url)
    try:
        with _serve(fake, store_url, commit_timeout_s=1.0) as srv:
            url = f"{srv.url}/rollouts/ro-stall/v1/chat/completions"
            assert httpx.post(url, json={"model": MODEL, "messages": Q}, timeout=30).status_code == 200
            lock = _StoreLock(store_url)
            try:
                t = time.monotonic()
                r = httpx.post(url, json={"model": MODEL, "messages": Q}, timeout=30)
                waited = time.monotonic() - t
                assert r.status_code == 503 and r.json()["error"]["code"] == "span_not_stored", r.text
                assert "within 1 s" in r.json()["error"]["message"]
                assert 0.9 < waited < 10, waited
                lines = _stream_lines(url, {"model": MODEL, "messages": Q})
                assert '"span_not_stored"' in lines[-2] and lines[-1] == "data: [DONE]"
            finally:
                lock.release()
            # the store is back: the spans that waited are written (as failed answers), new calls succeed
            r = httpx.post(url, json={"model": MODEL, "messages": Q}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["id"] in {s["call_id"] for s in list_spans(store, "ro-stall")}
            assert len(list_spans(store, "ro-stall")) == 4
    finally:
        store.close()
