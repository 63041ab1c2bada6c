"""``tracegym serve``'s binding rules: loopback only without a key, ``--insecure`` to override (with a
warning), the Host allow-list on loopback binds, the weights root made absolute."""

from __future__ import annotations

import logging
import os

import pytest

from tests.procs import run_command
from tracegym.cli import build_parser
from tracegym.gateway.serve import check_binding, is_loopback, security_settings


def _args(*argv: str):
    return build_parser().parse_args(["serve", "--upstream", "http://127.0.0.1:1", *argv])


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEGYM_ADMIN_KEY", raising=False)
    monkeypatch.delenv("TRACEGYM_WEIGHTS_DIR", raising=False)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("127.0.0.5", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.2", False), ("gw.example", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_non_loopback_needs_a_key_or_insecure(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                              ) -> None:
    refusal = check_binding(_args("--host", "0.0.0.0"))
    assert refusal is not None and "--insecure" in refusal and "\n" not in refusal
    assert check_binding(_args()) is None  # loopback: fine without a key
    assert check_binding(_args("--host", "0.0.0.0", "--admin-key", "k")) is None
    with caplog.at_level(logging.WARNING, logger="tracegym.gateway"):
        assert check_binding(_args("--host", "0.0.0.0", "--insecure")) is None
    assert "no admin key" in caplog.text
    monkeypatch.setenv("TRACEGYM_ADMIN_KEY", "from-env")
    assert check_binding(_args("--host", "0.0.0.0")) is None


def test_security_settings(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = security_settings(_args("--allowed-host", "gw.internal"))
    assert s == {"allowed_hosts": ["localhost", "127.0.0.1", "[::1]", "gw.internal"]}
    assert "allowed_hosts" not in security_settings(_args("--host", "0.0.0.0", "--admin-key", "k"))
    assert security_settings(_args("--host", "0.0.0.0", "--admin-key", "k", "--allowed-host", "a"))[
        "allowed_hosts"] == ["a"]
    monkeypatch.chdir(tmp_path)
    assert security_settings(_args("--weights-dir", "w"))["weights_dir"] == str(tmp_path / "w")
    monkeypatch.setenv("TRACEGYM_WEIGHTS_DIR", "from-env")  # what `tracegym train` sets for its gateway
    assert security_settings(_args())["weights_dir"] == str(tmp_path / "from-env")
    assert security_settings(_args("--weights-dir", "w"))["weights_dir"] == str(tmp_path / "w")
    monkeypatch.setenv("TRACEGYM_ADMIN_KEY", "from-env")
    assert security_settings(_args())["admin_key"] == "from-env"
    assert security_settings(_args("--admin-key", "flag"))["admin_key"] == "flag"


def test_serve_refuses_a_public_bind_without_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRACEGYM_ADMIN_KEY"}
    res = run_command(["tracegym", "serve", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:1"], env=env,
                      timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().startswith("tracegym serve: refusing to bind 0.0.0.0 without an admin key")
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_store_url_comes_from_the_environment_or_a_password_file(monkeypatch, tmp_path, caplog) -> None:
    from tracegym.gateway.serve import DEFAULT_STORE, store_url, warn_visible_password

    monkeypatch.delenv("TRACEGYM_STORE_URL", raising=False)
    assert store_url(_args()) == DEFAULT_STORE
    assert store_url(_args("--store", "none")) is None
    monkeypatch.setenv("TRACEGYM_STORE_URL", "postgresql+psycopg://u:envpw@db/tg")
    assert store_url(_args()) == "postgresql+psycopg://u:envpw@db/tg"
    secret = tmp_path / "pw"
    secret.write_text("s3cr@t\n")
    url = store_url(_args("--store", "postgresql+psycopg://u@db/tg", "--store-password-file", str(secret)))
    from sqlalchemy.engine import make_url

    assert make_url(url).password == "s3cr@t" and make_url(url).host == "db"
    with caplog.at_level(logging.WARNING, logger="tracegym.gateway"):
        warn_visible_password(_args("--store", "postgresql+psycopg://u@db/tg"))
        assert not caplog.records
        warn_visible_password(_args("--store", "postgresql+psycopg://u:pw@db/tg"))
    assert "process list" in caplog.text and "pw@" not in caplog.text
