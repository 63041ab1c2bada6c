"""Starting real processes on free ports for tests and benchmarks, and always stopping them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, base_url: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.base_url = base_url

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_process(
    args: list[str],
    *,
    port: int,
    log_path: Path,
    health_path: str = "/health",
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """Start ``python -m tracegym.cli ARGS`` (or any argv) and wait until ``health_path`` answers 200."""
    argv = args if args[0] != "tracegym" else [sys.executable, "-m", "tracegym.cli", *args[1:]]
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the process for its lifetime
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
    )
    mp = ManagedProcess(proc, log_path, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv} exited with {proc.returncode}:\n{mp.log()}")
        try:
            if httpx.get(mp.base_url + health_path, timeout=2).status_code == 200:
                return mp
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    mp.stop()
    raise TimeoutError(f"{argv} did not become healthy in {timeout}s:\n{mp.log()}")
