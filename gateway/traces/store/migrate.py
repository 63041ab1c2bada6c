"""Schema migrations of the trace store (alembic), and ``tracegym db upgrade|current``.

Upgrades run inside one write transaction (``BEGIN IMMEDIATE`` on SQLite, plus a transaction-scoped
advisory lock on PostgreSQL) so that several processes opening the same store at once upgrade it once.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from tracegym.errors import UserError
from tracegym.gateway.traces.store.connect import store_problem
from tracegym.gateway.traces.store.db import Database, make_engine

_INI = Path(__file__).with_name("alembic.ini")
_PG_LOCK_KEY = 0x7472_6163  # "trac"


def alembic_config() -> Config:
    return Config(str(_INI))


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found next to {_INI}")
    return head


def current_revision(db: Database) -> str | None:
    with db.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()


class _AlembicNoise(logging.Filter):
    """Drops alembic's per-connection INFO lines ("Context impl SQLiteImpl.", "Will assume ... DDL."),
    which every gateway start printed; the "Running upgrade" lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Context impl", "Will assume"))


def _quiet_alembic() -> None:
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # seven "setup plugin" lines
    migration = logging.getLogger("alembic.runtime.migration")
    if not any(isinstance(f, _AlembicNoise) for f in migration.filters):
        migration.addFilter(_AlembicNoise())


def upgrade(db: Database, revision: str = "head") -> None:
    _quiet_alembic()
    cfg = alembic_config()
    with db.write() as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def main(args: argparse.Namespace) -> int:
    """``tracegym db upgrade|current --store URL``; a store it cannot open is a ``UserError``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    problem = store_problem(args.store)
    if problem is not None:
        raise UserError(*problem)
    _quiet_alembic()
    db = Database(make_engine(args.store))
    try:
        if args.action == "upgrade":
            upgrade(db)
        print(current_revision(db) or "(empty database)")
        return 0
    finally:
        db.close()
