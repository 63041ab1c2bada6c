"""Helpers for the fleet tests (no tests here): a gateway app in front of several SGLang fakes (real
processes), its records kept in memory."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.app_support import MemoryRecorder, ServerThread
from tests.procs import ManagedProcess

MODEL = "tiny-random"


@contextmanager
def fleet_gateway(urls: list[str], tmp: Path, **settings: Any) -> Iterator[tuple[ServerThread, MemoryRecorder]]:
    """A gateway app (SQLite store in ``tmp``, calls recorded in memory) in front of the engines ``urls``,
    checking their health every 0.2 s, loading weights from under ``tmp`` (``settings`` override)."""
    from tracegym.gateway.app import create_app
    from tracegym.gateway.settings import GatewaySettings

    rec = MemoryRecorder()
    conf = GatewaySettings(**{"upstream_url": urls[0], "upstream_urls": urls[1:], "model": MODEL,
                              "store_url": f"sqlite:///{tmp / 'tg.db'}", "upstream_health_interval_s": 0.2,
                              "health_timeout": 1.0, "weights_dir": str(tmp), **settings})
    with ServerThread(create_app(conf, recorder=rec)) as srv:
        yield srv, rec


def chat(srv: ServerThread, rollout: str | None, text: str = "hi", **extra: Any) -> httpx.Response:
    base = f"{srv.url}/rollouts/{rollout}/v1" if rollout else f"{srv.url}/v1"
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}
    return httpx.post(base + "/chat/completions", json=body, timeout=30)


def upstreams(srv: ServerThread) -> dict[str, Any]:
    r = httpx.get(srv.url + "/api/upstreams", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def engine(srv: ServerThread, url: str) -> dict[str, Any]:
    return next(e for e in upstreams(srv)["engines"] if e["url"] == url)


def wait_until(cond: Any, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout:g}s"
        time.sleep(0.05)


def debug(fake: ManagedProcess) -> dict[str, Any]:
    return httpx.get(fake.base_url + "/debug", timeout=10).json()


def kill(fake: ManagedProcess) -> None:
    """SIGKILL: the engine dies with its connections open, as a crashed server does."""
    fake.proc.kill()
    fake.proc.wait(timeout=10)
