"""Test-side helpers around ``tracegym.procs`` (real child processes, always stopped)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tracegym.forkserver import FORKSERVER_ENV
from tracegym.procs import ManagedProcess, free_port, start_process

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = ["PG_ADMIN_URL", "ManagedProcess", "empty_pg_database", "fork_server", "free_port", "fresh_pg_database",
           "pg_available", "start_process"]

ROOT = Path(__file__).resolve().parents[1]
TEST_PRELOAD = ("benchmarks.fake_sglang", "transformers.models.qwen3.modeling_qwen3")
"""What the tests' fork server imports beyond ``tracegym.forkserver.PRELOAD``: the fake upstream most tests
start, and the model class of ``qwen3-tiny``."""


@contextmanager
def fork_server(log_path: Path, timeout: float = 120.0) -> Iterator[str]:
    """A ``tracegym.forkserver`` for this process's children, named in ``$TRACEGYM_FORKSERVER`` while it runs
    (and so to their children): each ``tracegym`` command and fake upstream a test starts is forked from it
    instead of importing torch, transformers and the gateway again. Yields its socket's path."""
    folder = tempfile.mkdtemp(prefix="tg-fork-")  # short: a Unix socket's path is at most 107 bytes
    path = os.path.join(folder, "socket")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tracegym.forkserver", path, *TEST_PRELOAD], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start; its log:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        before = os.environ.get(FORKSERVER_ENV)
        os.environ[FORKSERVER_ENV] = path
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop(FORKSERVER_ENV, None)
            else:
                os.environ[FORKSERVER_ENV] = before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


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
