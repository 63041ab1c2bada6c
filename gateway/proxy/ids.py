"""The one rule for a rollout or task id named by a request, on every route: at most ``ID_MAX_LENGTH``
characters (the store's id columns), no control character and no U+FFFD (what a malformed %-escape of a
path decodes to), so every id a call is recorded under can be read back through ``/api/rollouts/{id}``.
``ID_CHARS`` is the same rule as a pattern, for FastAPI path parameters and the published schema."""

from __future__ import annotations

import re

from tracegym.gateway.traces.store.schema import ID_MAX_LENGTH

ID_CHARS = r"^[^\x00-\x1f\x7f\ufffd]+$"
_BAD_CHAR = re.compile(r"[\x00-\x1f\x7f\ufffd]")


def id_problem(name: str, value: str) -> str | None:
    """Why ``value`` is not a valid id (None: it is)."""
    if not value:
        return f"{name} must not be empty"
    if len(value) > ID_MAX_LENGTH:
        return f"{name} is {len(value)} characters long; the store keeps at most {ID_MAX_LENGTH}"
    if _BAD_CHAR.search(value) is not None:
        return f"{name} must not contain control characters"
    return None
