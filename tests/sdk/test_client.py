"""The HTTP client: which requests are retried (only the ones a repeat cannot duplicate), the shared
configuration helper, and the CLI's hint when an extra is not installed."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

import tracegym as tg
from tests.sdk.fake_gateway import FakeGateway
from tracegym import cli
from tracegym.client import (
    GatewayClient,
    RetryPolicy,
    SDKConfig,
    _retry_reason,
    _Tries,
    config_for,
    current_config,
)
from tracegym.errors import UserError


def test_retry_reason() -> None:
    request = httpx.Request("POST", "http://gw/api/tasks")
    connect, read = httpx.ConnectError("refused"), httpx.ReadTimeout("slow")
    busy, bad = httpx.Response(503, request=request), httpx.Response(400, request=request)
    # idempotent: transport errors and 408/429/5xx are retried, other answers stand
    assert _retry_reason(connect, True) == "ConnectError: refused"
    assert _retry_reason(read, True) == "ReadTimeout: slow"
    assert _retry_reason(busy, True) is not None and "HTTP 503" in _retry_reason(busy, True)
    assert _retry_reason(bad, True) is None
    # not idempotent: only a request that was never sent is retried
    assert _retry_reason(connect, False) == "ConnectError: refused"
    assert _retry_reason(httpx.ConnectTimeout("t"), False) is not None
    assert _retry_reason(read, False) is None
    assert _retry_reason(busy, False) is None


def test_enqueue_is_not_repeated_after_a_lost_answer(gw: FakeGateway) -> None:
    gw.state.fail_next, gw.state.store_then_fail = 1, True  # enqueued, then the answer is lost
    with GatewayClient() as client, pytest.raises(tg.GatewayError) as err:
        client.enqueue_tasks([{"input": 1}], group_size=2)
    assert err.value.status == 503 and "enqueue tasks" in str(err.value)
    assert len(gw.state.queue) == 2  # one group, not a second one from a retry


def test_enqueue_is_retried_while_the_gateway_is_not_up(late_gw: FakeGateway) -> None:
    with GatewayClient() as client:
        out = client.enqueue_tasks([{"input": 1}])
    assert len(out) == 1 and len(late_gw.state.queue) == 1


def test_idempotent_posts_are_still_retried(gw: FakeGateway) -> None:
    gw.state.fail_next = 2
    with GatewayClient() as client:
        client.post("/api/rollouts/r/events", {"name": "x", "idempotency_key": "k"}, "send event")
    assert gw.state.attempts == ["r"] * 3


def test_one_retry_policy_drives_both_clients() -> None:
    """``_Tries`` is the retry loop of the blocking and the asyncio client alike."""
    config = SDKConfig(gateway_url="http://gw", retry=RetryPolicy(attempts=3, backoff=1.0, max_backoff=8.0))
    request = httpx.Request("POST", "http://gw/api/tasks")
    tries = _Tries(config, "enqueue tasks", idempotent=True)
    waits = list(tries.waits())
    assert len(waits) == 3 and waits[0] == 0.0 and 0.75 <= waits[1] <= 1.25 and 1.5 <= waits[2] <= 2.5
    assert tries.settle(httpx.Response(503, request=request)) is None and tries.last.startswith("HTTP 503")
    ok = httpx.Response(200, request=request, json={})
    assert tries.settle(ok) is ok
    assert "after 3 attempts" in str(tries.give_up()) and "HTTP 503" in str(tries.give_up())
    once = _Tries(config, "claim rollouts", idempotent=False)
    with pytest.raises(tg.GatewayUnreachableError, match="not retried"):
        once.settle(httpx.ReadTimeout("slow"))


def test_config_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEGYM_API_KEY", "sk-env")
    tg.configure(gateway_url="http://127.0.0.1:9", retry_attempts=2, timeout=7.0)
    assert config_for(None) == current_config()
    other = config_for(" http://gw.example:8000/ ")
    assert other.gateway_url == "http://gw.example:8000"
    assert (other.api_key, other.timeout, other.retry.attempts) == ("sk-env", 7.0, 2)
    with pytest.raises(ValueError, match="http://"):
        config_for("gw.example")

    from tracegym.trainer.run.gateway_client import ControlClient

    ctl = ControlClient("http://gw.example:8000/", timeout=60.0)
    try:
        cfg = ctl.client.config
        assert (cfg.gateway_url, cfg.api_key, cfg.timeout, cfg.retry.attempts) == (
            "http://gw.example:8000",
            "sk-env",
            60.0,
            2,
        )
    finally:
        ctl.close()


def _missing(name: str) -> Callable[[str], None]:
    def import_module(module: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    return import_module


def test_cli_names_the_missing_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli.importlib, "import_module", _missing("fastapi"))
    assert cli.main(["serve"]) == 2  # a usage error: its message, no traceback
    err = capsys.readouterr().err
    assert "'fastapi' package is not installed" in err and "pip install 'tracegym[gateway]'" in err
    assert "Traceback" not in err
    monkeypatch.setattr(cli.importlib, "import_module", _missing("torch"))
    with pytest.raises(UserError, match=r"tracegym\[trainer\]"):
        cli._load("models")
    with pytest.raises(UserError, match=r"tracegym\[gateway,trainer\]"):
        cli._load("train")


def test_cli_reraises_other_missing_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.importlib, "import_module", _missing("tracegym.gateway.serve"))
    with pytest.raises(ModuleNotFoundError):  # our own module missing: a broken install, not an extra
        cli._load("serve")
    monkeypatch.setattr(cli.importlib, "import_module", _missing("yaml"))
    with pytest.raises(ModuleNotFoundError):  # the bare SDK's commands need no extra
        cli._load("export")
