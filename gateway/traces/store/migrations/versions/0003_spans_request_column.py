"""Spans: an LLM call's request body (``tracegym.request``, the messages) in a ``request`` column of its own.

The body is most of a call span's attributes (the whole conversation so far) and the assembly read never
needs it: kept in ``attributes`` it was read with every span and cut out of the text before parsing. The
column is JSON text, last in the row; readers put it back into the attributes (``tracegym.request``). Rows
written before this revision keep the body inside ``attributes`` with ``request`` NULL, and are read as
before (no backfill: a rewrite of every span row would be the cost of an upgrade).

Revision ID: 0003_spans_request_column
Revises: 0002_spans_inline_rows
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_spans_request_column"
down_revision = "0002_spans_inline_rows"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("spans", sa.Column("request", sa.Text, nullable=True))


def downgrade() -> None:
    # The bodies go back into the attributes first (at the end of the object: such rows are then read with
    # a full parse of their attributes, not the request cut).
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE spans SET attributes = (attributes::jsonb || "
                   "jsonb_build_object('tracegym.request', request::jsonb))::json WHERE request IS NOT NULL")
    else:
        op.execute("UPDATE spans SET attributes = json_set(attributes, '$.\"tracegym.request\"', json(request)) "
                   "WHERE request IS NOT NULL")
    op.drop_column("spans", "request")
