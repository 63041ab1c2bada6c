"""tracegym trace store: ``Store`` (SQLAlchemy; SQLite in WAL mode or PostgreSQL) and its errors.

``Store`` is imported lazily so that light modules (``store_errors``, ``span_rows``) import without the repository.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracegym.gateway.traces.store.store_errors import Conflict, NotFound, StoreError

if TYPE_CHECKING:
    from tracegym.gateway.traces.store.repo import Store

__all__ = ["Conflict", "NotFound", "Store", "StoreError"]


def __getattr__(name: str) -> Any:
    if name == "Store":
        from tracegym.gateway.traces.store.repo import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
