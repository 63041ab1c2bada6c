"""Test-side helpers around ``tracegym.procs`` (real child processes, always stopped)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tracegym.procs import ManagedProcess, free_port, start_process

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = ["PG_ADMIN_URL", "ManagedProcess", "empty_pg_database", "free_port", "fresh_pg_database", "pg_available",
           "start_process"]


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
