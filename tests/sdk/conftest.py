"""SDK test fixtures: a fake gateway (real HTTP server in a thread) and a clean SDK configuration."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import tracegym as tg
from tests.sdk.fake_gateway import FakeGateway
from tracegym.client import reset_configuration


@pytest.fixture(autouse=True)
def _clean_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TRACEGYM_GATEWAY", raising=False)
    monkeypatch.delenv("TRACEGYM_API_KEY", raising=False)
    monkeypatch.delenv("TRACEGYM_ADMIN_KEY", raising=False)
    reset_configuration()
    yield
    reset_configuration()


@pytest.fixture(autouse=True)
def _no_attribution_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-calls check (``tracegym.attribution``) runs in a background thread and may post a
    ``tracegym.no_calls`` event about a second after a reward: tests of other things, whose rollouts make
    no LLM call and which assert exact events or request counts, run without it (so they cannot depend on
    whether that thread came before their asserts). Its own tests (and the instrumentation's) keep it."""
    module = request.module.__name__
    if "attribution" not in module and "instrument" not in module:
        monkeypatch.setattr("tracegym.context.check_calls_later", lambda *a, **k: None)


@pytest.fixture
def gw() -> Iterator[FakeGateway]:
    """A fake gateway the SDK is configured to use, with fast retries (5 tries, 20 ms first wait)."""
    with FakeGateway() as g:
        tg.configure(gateway_url=g.url, retry_attempts=5, retry_backoff=0.02, retry_max_backoff=0.1)
        yield g


@pytest.fixture
def late_gw() -> Iterator[FakeGateway]:
    """A fake gateway that starts listening only 0.4 s after the test begins (the SDK is configured to
    retry for longer than that), stopped afterwards."""
    late = FakeGateway()
    tg.configure(gateway_url=late.url, retry_attempts=8, retry_backoff=0.1, retry_max_backoff=0.4)
    timer = threading.Timer(0.4, late.start)
    timer.start()
    try:
        yield late
    finally:
        timer.join()
        late.stop()
