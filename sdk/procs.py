"""Child processes on free ports: start in their own process group, wait for health, always stop.

Used by ``tracegym serve --engine embedded`` and ``tracegym train`` (``start_engines``: the embedded
engines; the trainer also starts its gateway and runner here) and the tests, whose ``python -m`` children
are forked from a preloaded interpreter while ``$TRACEGYM_FORKSERVER`` names one (``forkserver``). httpx +
stdlib only.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tracegym import forkserver

_PORT_FLOOR = 20000
"""Ports that ``free_port`` picks start here: above the usual fixed ports of local services and above Ray's
default worker ports (10002-19999), which ``ray start`` refuses to see any of its other ports among."""


def _ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections take their local
    port); 32768 where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing is bound to now, for a process started next to bind.

    It is drawn at random below the kernel's ephemeral range where there is room: a port the kernel hands
    out itself could be given to another process's outgoing connection between this check and the bind,
    and a random draw keeps processes that look for ports at the same time apart."""
    floor = _ephemeral_floor()
    if floor > _PORT_FLOOR + 1000:
        for _ in range(100):
            port = _PORT_FLOOR + secrets.randbelow(floor - _PORT_FLOOR)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, taken: Sequence[int] = ()) -> list[int]:
    """``count`` distinct free ports, none of ``taken``, drawn before any child is started: a port drawn
    after one child started could be the port that child has not bound yet."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports and port not in taken:
            ports.append(port)
    return ports


class ManagedProcess:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, proc: subprocess.Popen | forkserver.ForkedChild, log_path: Path | None, base_url: str,
                 name: str = "") -> None:
        self.proc = proc
        self.log_path = log_path
        self.base_url = base_url
        self.name = name or str(proc.args)

    def log(self, tail: int = 6000) -> str:
        if self.log_path is None:
            return "(its output went to this process's stdout)"
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the whole group, then SIGKILL after ``timeout`` seconds."""
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


def tracegym_argv(args: list[str]) -> list[str]:
    """``["tracegym", "serve", ...]`` → the same command run by this interpreter."""
    return [sys.executable, "-m", "tracegym.cli", *args[1:]] if args and args[0] == "tracegym" else list(args)


def start_process(
    args: list[str],
    *,
    port: int | None,
    log_path: Path | None,
    health_path: str = "/health",
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    name: str = "",
) -> ManagedProcess:
    """Start ``args`` (``tracegym ...`` runs this interpreter's CLI) and wait until ``health_path`` on
    ``port`` answers 200 (no wait when ``port`` is None). The child's output goes to ``log_path`` (or to
    our stdout when None); it runs in its own process group and gets SIGTERM if we die. Raises with the
    child's log on failure."""
    mp = spawn_process(args, port=port, log_path=log_path, env=env, cwd=cwd, name=name)
    if port is not None:
        wait_ready(mp, health_path, timeout)
    return mp


def spawn_process(
    args: list[str],
    *,
    port: int | None,
    log_path: Path | None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    name: str = "",
) -> ManagedProcess:
    """``start_process`` without the wait: the child is started, ``wait_ready`` waits for it. Starting
    several children before waiting for any lets them start at once."""
    argv = tracegym_argv(args)
    popen = {
        "stdin": subprocess.DEVNULL,
        "start_new_session": True,
        "env": {**os.environ, **(env or {})},
        "cwd": cwd,
        "preexec_fn": forkserver.die_with_parent if sys.platform == "linux" else None,
    }
    base_url = f"http://127.0.0.1:{port}" if port else ""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    if (server := os.environ.get(forkserver.FORKSERVER_ENV)) and forkserver.module_argv(argv):
        try:
            child = forkserver.spawn(server, argv, env=popen["env"], cwd=cwd, log_path=log_path)
            return ManagedProcess(child, log_path, base_url, name)
        except OSError:  # the server is gone: start it as usual
            pass
    if log_path is None:
        proc = subprocess.Popen(argv, **popen)
    else:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **popen)
    return ManagedProcess(proc, log_path, base_url, name)


def wait_ready(mp: ManagedProcess, health_path: str = "/health", timeout: float = 300.0) -> None:
    """Wait until ``health_path`` of ``mp`` (started with a port) answers 200. Raises with the child's log
    if it exits first (``RuntimeError``) or is not ready within ``timeout`` seconds (``TimeoutError``,
    after stopping it)."""
    deadline = time.monotonic() + timeout
    what = mp.name or mp.proc.args
    with httpx.Client(timeout=2) as http:  # one client for the whole wait: each client builds an SSL context
        while time.monotonic() < deadline:
            if mp.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {mp.proc.returncode}; its log:\n{mp.log()}")
            try:
                if http.get(mp.base_url + health_path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    mp.stop()
    raise TimeoutError(f"{what} did not answer {health_path} within {timeout:.0f}s; its log:\n{mp.log()}")


ENGINE_KEY_ENV = "TRACEGYM_ENGINE_API_KEY"
"""The environment variable that gives an embedded engine the key of its weight and pause routes."""


@dataclass
class Engines:
    """Embedded engines started by ``start_engines``, and the key of their weight and pause routes."""

    procs: list[ManagedProcess]
    key: str

    @property
    def urls(self) -> list[str]:
        return [p.base_url for p in self.procs]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until every engine answers ``/health`` (``wait_ready``); if one fails, all are stopped and
        the error raised."""
        try:
            for p in self.procs:
                wait_ready(p, "/health", timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def start_engines(
    count: int,
    model: str,
    *,
    args: Sequence[str] = (),
    ports: Sequence[int] = (),
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
    wait: bool = True,
) -> Engines:
    """``count`` embedded engines (``tracegym engine --model MODEL --port P ARGS``), each in its own process
    group, sharing one fresh random key for their weight and pause routes, which only the caller (who hands
    it to its gateway) knows: it travels in their environment, never on a command line. ``ports`` picks the
    first ones (free ports otherwise); logs go to ``log_dir/engine[-N].log``, or to our output without a
    ``log_dir``. They start at once; with ``wait`` this returns once all are ready (else the caller calls
    ``Engines.wait_ready``). If one fails to start, all are stopped and the error raised."""
    started = Engines([], secrets.token_urlsafe(32))
    child_env = {**(env or {}), ENGINE_KEY_ENV: started.key}
    chosen = [*ports[:count], *free_ports(count - len(ports[:count]), taken=ports)]
    try:
        for i, port in enumerate(chosen):  # all started, then each waited for: they load their models at once
            suffix = "" if count == 1 else f"-{i + 1}"
            started.procs.append(spawn_process(
                ["tracegym", "engine", "--model", model, "--port", str(port), *args],
                port=port, log_path=None if log_dir is None else log_dir / f"engine{suffix}.log",
                name="embedded engine" if count == 1 else f"embedded engine {i + 1}", env=child_env,
            ))
        if wait:
            started.wait_ready(timeout)
    except BaseException:
        started.stop()
        raise
    return started
