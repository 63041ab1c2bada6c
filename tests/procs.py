"""Test-side helpers around ``tracegym.procs`` (real child processes, always stopped)."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tracegym import forkserver
from tracegym.forkserver import FORKSERVER_ENV
from tracegym.procs import ManagedProcess, free_port, start_process, tracegym_argv

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = ["PG_ADMIN_URL", "ForkServer", "ManagedProcess", "empty_pg_database", "fork_server", "forkserver_named",
           "free_port", "fresh_pg_database", "pg_available", "run_command", "start_process", "wait_for_socket"]

ROOT = Path(__file__).resolve().parents[1]
TEST_PRELOAD = ("benchmarks.fake_sglang", "transformers.models.qwen3.modeling_qwen3")
"""What the tests' fork server imports beyond ``tracegym.forkserver.PRELOAD``: the fake upstream most tests
start, and the model class of ``qwen3-tiny``."""


class ForkServer:
    """A ``tracegym.forkserver`` started in the background: ``wait`` for its socket, ``close`` to stop it."""

    def __init__(self, log_path: Path | None = None) -> None:
        self.folder = tempfile.mkdtemp(prefix="tg-fork-")  # short: a Unix socket's path is at most 107 bytes
        self.path = os.path.join(self.folder, "socket")
        self.log_path = log_path or Path(self.folder, "forkserver.log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tracegym.forkserver", self.path, *TEST_PRELOAD],
                                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 120.0) -> str:
        """Its socket's path, once it serves."""
        if not wait_for_socket(self.path, timeout, alive=lambda: self.proc.poll() is None):
            self.close()
            raise RuntimeError(f"the fork server did not start; its log:\n{self.log_path.read_text(errors='replace')}")
        return self.path

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def fork_server(log_path: Path, timeout: float = 120.0) -> Iterator[str]:
    """A ``tracegym.forkserver`` for this process's children, named in ``$TRACEGYM_FORKSERVER`` while it runs
    (and so to their children): each ``tracegym`` command and fake upstream a test starts is forked from it
    instead of importing torch, transformers and the gateway again. Yields its socket's path."""
    server = ForkServer(log_path)
    try:
        with forkserver_named(server.wait(timeout)):
            yield server.path
    finally:
        server.close()


@contextmanager
def forkserver_named(path: str) -> Iterator[str]:
    """``$TRACEGYM_FORKSERVER`` set to ``path`` while the block runs."""
    before = os.environ.get(FORKSERVER_ENV)
    os.environ[FORKSERVER_ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(FORKSERVER_ENV, None)
        else:
            os.environ[FORKSERVER_ENV] = before


def wait_for_socket(path: str, timeout: float = 120.0, alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether a fork server's socket appears at ``path`` within ``timeout`` seconds (and while ``alive``)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_command(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` for a command a test runs to
    its end (``env``, where given, is the child's whole environment, as with ``subprocess.run``). A ``python
    -m`` command (``tracegym ...`` included) is forked from this worker's fork server while one runs
    (``fork_server``): a fresh interpreter spends most of a short command importing the CLI and what it
    runs. Its stdin is ``/dev/null``."""
    full = tracegym_argv(argv)
    server = os.environ.get(FORKSERVER_ENV)
    child = None
    if server and forkserver.module_argv(full) is not None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            child = forkserver.spawn(server, full, env=dict(os.environ if env is None else env), cwd=cwd,
                                     log_path=None, fds=(out_w, err_w))
        except OSError:  # the server is gone: run it as usual
            os.close(out_r)
            os.close(err_r)
        finally:
            os.close(out_w)
            os.close(err_w)
    if child is None:
        return subprocess.run(full, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if data := os.read(key.fd, 1 << 16):
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
        timed_out = bool(sel.get_map())
        for key in list(sel.get_map().values()):
            os.close(key.fd)
    out, err = (b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
                for fd in (out_r, err_r))  # as text=True reads them: universal newlines
    try:
        if timed_out:
            raise subprocess.TimeoutExpired(full, timeout, out, err)
        code = child.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its own session and group, with whatever it started
        child.wait(timeout=30)
        raise subprocess.TimeoutExpired(full, timeout, out, err) from None
    return subprocess.CompletedProcess(full, code, out, err)


def pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def fresh_pg_database(prefix: str = "tg") -> Iterator[str]:
    """A new PostgreSQL database on 127.0.0.1:5432 (its SQLAlchemy URL), dropped afterwards."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def empty_pg_database(url: str) -> None:
    """Make the database at SQLAlchemy ``url`` (one of ``fresh_pg_database``'s) as empty as a new one, for a
    fraction of the server's work of creating and dropping one: its other connections are ended, and its
    ``public`` schema (where the store keeps everything) is dropped with all it holds and created again
    with the owner and privileges it had."""
    from psycopg import sql

    with psycopg_connect(url) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        owner, grants = conn.execute(
            "SELECT pg_get_userbyid(n.nspowner), array(SELECT (CASE WHEN a.grantee = 0 THEN NULL "
            "ELSE pg_get_userbyid(a.grantee) END, a.privilege_type) FROM aclexplode(n.nspacl) a) "
            "FROM pg_namespace n WHERE n.nspname = 'public'").fetchone() or (None, [])
        with conn.transaction():
            conn.execute("DROP SCHEMA IF EXISTS public CASCADE")
            conn.execute(sql.SQL("CREATE SCHEMA public AUTHORIZATION {}").format(
                sql.SQL("CURRENT_USER") if owner is None else sql.Identifier(owner)))
            for grantee, privilege in grants:
                conn.execute(sql.SQL("GRANT {} ON SCHEMA public TO {}").format(
                    sql.SQL({"USAGE": "USAGE", "CREATE": "CREATE"}[privilege]),
                    sql.SQL("PUBLIC") if grantee is None else sql.Identifier(grantee)))

def psycopg_connect(url: str) -> Any:
    """An autocommit psycopg connection to SQLAlchemy ``url`` (``postgresql+psycopg://...``)."""
    import psycopg

    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True)
