"""Alembic environment: always run online, on the connection handed in by ``tracegym.gateway.traces.store.migrate``
(``config.attributes["connection"]``), inside the caller's transaction."""

from __future__ import annotations

from alembic import context

from tracegym.gateway.traces.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `tracegym db upgrade --store URL` (tracegym.gateway.traces.store.migrate)")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
