"""Query-string helpers shared by the store's GET routes (``/api/rollouts``, ``/api/trajectories``, ...):
one reading of the parameters (an empty value counts as absent) and one error for unknown ones."""

from __future__ import annotations

from fastapi import Request

from tracegym.gateway.errors import bad_request

Query = dict[str, str]
JOINED = ("ids",)
"""Parameters that may repeat: their values are joined with commas."""


def query(request: Request) -> Query:
    """The query parameters; an empty value counts as absent, a repeated ``ids`` is joined, any other
    repeated parameter takes its last value."""
    q: Query = {}
    for key in request.query_params:
        values = [v for v in request.query_params.getlist(key) if v != ""]
        if values:
            q[key] = ",".join(values) if key in JOINED else values[-1]
    return q


def unknown_params(q: Query, allowed: tuple[str, ...]) -> None:
    """A 400 naming the first parameter of ``q`` not in ``allowed``."""
    unknown = sorted(set(q.keys()) - set(allowed))
    if unknown:
        raise bad_request(
            f"unknown query parameter(s) {', '.join(unknown)}; expected {', '.join(allowed)}",
            param=unknown[0],
        )
