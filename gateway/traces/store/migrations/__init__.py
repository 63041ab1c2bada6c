"""Alembic migrations of the trace store."""
