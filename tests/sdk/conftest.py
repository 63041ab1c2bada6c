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
    reset_configuration()
    yield
    reset_configuration()


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
