"""The trace store's one repository: ``Store``, assembled from one mixin per idea (spans, rollouts, the
task queue, events/weights/metrics), all sharing one ``Database`` (engine + transaction helpers).

Every method is synchronous and thread-safe (one SQLAlchemy engine with a connection pool); async routes
call them through ``starlette.concurrency.run_in_threadpool``. Errors: ``NotFound`` (-> 404),
``Conflict`` (-> 409) from ``tracegym.gateway.traces.store.store_errors``, ``ValueError`` for bad input (-> 400).
"""

from __future__ import annotations

from tracegym.gateway.traces.store.db import Database, make_engine
from tracegym.gateway.traces.store.events import EventsMixin
from tracegym.gateway.traces.store.imports import ImportsMixin
from tracegym.gateway.traces.store.migrate import upgrade as run_upgrade
from tracegym.gateway.traces.store.queue import QueueMixin
from tracegym.gateway.traces.store.rollouts import RolloutsMixin
from tracegym.gateway.traces.store.spans import SpansMixin


class Store(SpansMixin, RolloutsMixin, QueueMixin, EventsMixin, ImportsMixin):
    def __init__(self, db: Database, url: str) -> None:
        self.db = db
        self.url = url

    @classmethod
    def open(cls, url: str, *, upgrade: bool = True) -> Store:
        """Connect to ``url`` (``sqlite:///path.db`` in WAL mode, or ``postgresql+psycopg://...``) and, with
        ``upgrade``, run the alembic migrations to head first."""
        db = Database(make_engine(url))
        if upgrade:
            try:
                run_upgrade(db)
            except Exception:
                db.close()
                raise
        return cls(db, url)

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.db.dialect

    def close(self) -> None:
        """Dispose of the connection pool (SQLite: after a last WAL checkpoint)."""
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
