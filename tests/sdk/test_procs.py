"""``tracegym.procs``: children started without waiting (``spawn_process``), then waited for (``wait_ready``),
and ports drawn before any child starts (``free_ports``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tracegym.procs import free_ports, spawn_process, wait_ready

SERVE_LATE = """
import http.server, sys, time
time.sleep(0.5)  # not listening yet when spawn_process returns
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_free_ports_are_distinct_bindable_and_not_taken() -> None:
    taken = free_ports(2)
    ports = free_ports(6, taken=taken)
    assert len(set(ports)) == 6 and not set(ports) & set(taken)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_spawned_child_is_waited_for_until_its_health_answers(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    child = spawn_process([sys.executable, "-c", SERVE_LATE, str(port)], port=port, log_path=tmp_path / "c.log",
                          cwd=tmp_path, name="late server")
    try:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass  # spawned, not waited for: nothing listens yet
        wait_ready(child, "/", timeout=60)
        assert child.alive() and child.base_url == f"http://127.0.0.1:{port}"
    finally:
        child.stop()


def test_a_child_that_exits_before_it_is_ready_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    child = spawn_process([sys.executable, "-c", "import sys; print('cannot start'); sys.exit(3)"], port=port,
                          log_path=tmp_path / "c.log", name="failing child")
    with pytest.raises(RuntimeError, match=r"failing child exited with code 3; its log:\ncannot start"):
        wait_ready(child, timeout=60)


def test_a_child_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    child = spawn_process([sys.executable, "-c", "import time; time.sleep(120)"], port=port,
                          log_path=tmp_path / "c.log", name="silent child")
    with pytest.raises(TimeoutError, match="silent child did not answer /health within 1s"):
        wait_ready(child, timeout=1)
    assert not child.alive()
