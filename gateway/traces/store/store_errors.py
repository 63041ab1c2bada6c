"""Store errors, mapped by the routes: NotFound -> 404, Conflict -> 409 (bad input is ValueError -> 400)."""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's domain errors."""


class NotFound(StoreError):
    """An unknown id."""


class Conflict(StoreError):
    """The request contradicts the current state (a lost lease, a finished rollout)."""


class StoreBusy(StoreError):
    """The store cannot take a write without waiting now (``Database.span_write``); nothing was written."""
