"""What is wrong when a store URL cannot be opened, said as a problem and its fix (``tracegym serve`` and
``tracegym db`` print them as two lines instead of a driver traceback)."""

from __future__ import annotations

import os
import re

import sqlalchemy as sa

from tracegym.gateway.traces.store.db import make_engine

URL_FORMS = "sqlite:///path/to/tracegym.db or postgresql+psycopg://USER:PASSWORD@HOST:5432/DBNAME"


def store_problem(url: str) -> tuple[str, str] | None:
    """None when ``url`` can be connected to; else ``(problem, fix)``. Connects once and disconnects (no
    schema change: the schema is upgraded by ``Store.open`` or ``tracegym db upgrade``)."""
    try:
        engine = make_engine(url)
    except (ValueError, sa.exc.ArgumentError) as e:
        return f"bad store URL {url!r}: {e}", f"use {URL_FORMS}"
    except ModuleNotFoundError as e:
        return f"the database driver {e.name!r} is not installed", "pip install 'tracegym[gateway]'"
    shown = engine.url.render_as_string(hide_password=True)
    try:
        with engine.connect():
            return None
    except sa.exc.OperationalError as e:
        return _explain(engine.url, shown, str(e.orig))
    finally:
        engine.dispose()


def _explain(url: sa.URL, shown: str, error: str) -> tuple[str, str]:
    first = error.strip().splitlines()[0] if error.strip() else error
    if url.get_backend_name() == "sqlite":
        folder = os.path.dirname(os.path.abspath(url.database or ""))
        return (f"cannot open the SQLite store {shown}: {first}",
                f"the folder {folder} must exist and be writable (or pass another --store)")
    where = f"{url.host or 'localhost'}:{url.port or 5432}"
    db = url.database or ""
    if re.search(r'database "[^"]*" does not exist', error):
        return (f'the PostgreSQL database "{db}" does not exist on {where}',
                f"create it (createdb -h {url.host or 'localhost'} -U {url.username or 'postgres'} {db}, or "
                f'CREATE DATABASE "{db}" in psql), then run: tracegym db upgrade --store {shown}')
    if "Connection refused" in error or "could not translate host name" in error or "timeout" in error:
        return (f"cannot reach PostgreSQL at {where} ({_reason(first)})",
                f"start PostgreSQL, or fix the host and port in --store ({URL_FORMS})")
    if "password authentication failed" in error or re.search(r'role "[^"]*" does not exist', error):
        return (f"PostgreSQL at {where} refused the login ({_reason(first)})",
                f"fix the user and password in --store ({URL_FORMS})")
    return f"cannot connect to the store {shown}: {_reason(first)}", f"check --store ({URL_FORMS})"


def _reason(line: str) -> str:
    """The driver's message without its ``connection failed: connection to server at ...`` preamble."""
    return re.sub(r"^connection failed: connection to server at [^,]*, port \d+ failed: ", "", line).strip()
