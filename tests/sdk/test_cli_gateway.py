"""Commands that talk to a gateway (enqueue, export, import) with none there: they fail within seconds, say so in
the command line's terms (--gateway, $TRACEGYM_GATEWAY; not the SDK's tg.configure) and leave no stray
file; a gateway lost half-way through an export is said the same way."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import free_port, run_command
from tracegym.cli_gateway import url_source
from tracegym.client import GatewayClient, GatewayUnreachableError, RetryPolicy, SDKConfig, _give_up

ROOT = Path(__file__).resolve().parents[2]


def tracegym(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    base = {k: v for k, v in os.environ.items() if k != "TRACEGYM_GATEWAY"}
    t0 = time.monotonic()
    res = run_command(["tracegym", *args], cwd=cwd, env={**base, **(env or {})}, timeout=60)
    return res, time.monotonic() - t0


def assert_cli_terms(res: subprocess.CompletedProcess[str], url: str) -> None:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    problem, fix = res.stderr.strip().splitlines()
    assert f"no tracegym gateway answers at {url}" in problem
    assert "--gateway" in fix and "$TRACEGYM_GATEWAY" in fix and "tg.configure" not in res.stderr


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    p = tmp_path / "tasks.jsonl"
    p.write_text('{"input": {"q": "1+1?"}}\n')
    return p


def test_enqueue_with_no_gateway_fails_fast(task_file: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    res, took = tracegym("enqueue", str(task_file), "--gateway", url, cwd=tmp_path)
    assert_cli_terms(res, url)
    assert "(--gateway;" in res.stderr
    assert took < 5, took


def test_export_with_no_gateway_leaves_no_file(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    res, took = tracegym("export", "--out", "sft.jsonl", "--format", "chat", cwd=tmp_path,
                         env={"TRACEGYM_GATEWAY": url})
    assert_cli_terms(res, url)
    assert "($TRACEGYM_GATEWAY;" in res.stderr and "attempts" not in res.stderr
    assert took < 5, took
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_import_with_no_gateway_fails_fast(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    res, took = tracegym("import", "chat.jsonl", "--name", "demo", "--gateway", url, cwd=tmp_path)
    assert_cli_terms(res, url)
    assert took < 5, took


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_enqueue_to_a_silent_gateway_gives_up_after_the_check(task_file: Path, tmp_path: Path,
                                                               silent_server: str) -> None:
    res, _ = tracegym("enqueue", str(task_file), "--gateway", silent_server, cwd=tmp_path)
    assert_cli_terms(res, silent_server)
    assert "ReadTimeout" in res.stderr


@pytest.fixture
def dropping_gateway() -> Iterator[str]:
    """Answers ``/healthz`` and closes every other connection without a reply (a gateway that died)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                request = conn.recv(65536)
                if request.startswith(b"GET /healthz"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(5)
    srv.close()


def test_export_losing_its_gateway(dropping_gateway: str, tmp_path: Path) -> None:
    res, took = tracegym("export", "--gateway", dropping_gateway, "--out", "out.jsonl", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    problem, fix = res.stderr.strip().splitlines()
    assert problem.startswith(f"tracegym export: the gateway at {dropping_gateway} (--gateway) stopped answering "
                              "during the export (")
    assert "attempts" not in problem and "tg.configure" not in res.stderr and "--gateway" in fix
    assert list(tmp_path.iterdir()) == []  # no empty .part file
    assert took < 5, took  # the stream of trajectories is one try


def test_one_try_is_not_counted_as_attempts() -> None:
    one = _give_up(SDKConfig(gateway_url="http://gw", retry=RetryPolicy(attempts=1)), "export", "ConnectError")
    assert "did not answer (last error: ConnectError)" in str(one) and "attempts" not in str(one)
    assert one.last == "ConnectError"
    six = _give_up(SDKConfig(gateway_url="http://gw"), "enqueue", "x")
    assert "did not answer after 6 attempts over ~" in str(six)


def test_iter_lines_loss_is_one_try() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with GatewayClient(SDKConfig(gateway_url=url)) as client, pytest.raises(GatewayUnreachableError) as err:
        list(client.iter_lines("/api/trajectories", "export trajectories"))
    assert "attempts" not in str(err.value) and "ConnectError" in err.value.last


def test_url_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEGYM_GATEWAY", raising=False)
    assert url_source("http://x") == "--gateway"
    assert url_source(None).startswith("the default")
    monkeypatch.setenv("TRACEGYM_GATEWAY", "http://y")
    assert url_source(None) == "$TRACEGYM_GATEWAY"
