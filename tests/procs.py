"""Test-side helpers around ``tracegym.procs`` (real child processes, always stopped)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tracegym.procs import ManagedProcess, free_port, start_process

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = ["PG_ADMIN_URL", "ManagedProcess", "free_port", "fresh_pg_database", "pg_available", "start_process"]


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
