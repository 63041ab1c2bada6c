"""Test-side helpers around ``tracegym.procs`` (real child processes, always stopped)."""

from __future__ import annotations

import socket

from tracegym.procs import ManagedProcess, free_port, start_process

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = ["PG_ADMIN_URL", "ManagedProcess", "free_port", "pg_available", "start_process"]


def pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False
