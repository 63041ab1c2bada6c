"""PostgreSQL: keep span rows (~3-4 KB) inline instead of TOASTing them.

By default PostgreSQL compresses or moves out of line every row above ~2 KB: for a span that means a pglz
attempt on incompressible token bytes and a second heap + index insert into the TOAST table, which more
than doubles the server's cost per ingested span (measured 79 -> 36 µs of backend CPU per span with
``benchmarks/store_ingest.py``'s rows). ``toast_tuple_target = 8160`` keeps rows up to a page inline;
larger ones (long prompts) are still TOASTed. No change on SQLite.

Revision ID: 0002_spans_inline_rows
Revises: 0001_initial
"""

from __future__ import annotations

from alembic import op

revision = "0002_spans_inline_rows"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE spans SET (toast_tuple_target = 8160)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE spans RESET (toast_tuple_target)")
