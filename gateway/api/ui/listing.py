"""``GET /api/inspect/rollouts``: rollouts newest first, filtered, a page at a time.

Column filters (status, task, group, weight version, reward range, run) are SQL; ``has_errors`` and
``has_drift`` use the in-memory ``FlaggedRollouts`` (an id list for SQL when the flagged set is small,
else a set test on each row). ``q`` is an id search when it matches an id (rollout, task, group id: a
substring, case-insensitively; a call id: exactly), and otherwise searches the text of the rollouts'
calls (``ui_reads.rollouts_containing``).

Text search reads span bodies, so it works under a time budget: rollouts are read newest first in
chunks, and when ``SEARCH_BUDGET_S`` runs out before the page is full the answer says how far it got
(``partial``) and hands back a cursor to go on from there. Every other filter is exact and complete.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from pydantic import Field

from tracegym.gateway.api.params import QueryModel, Status
from tracegym.gateway.api.ui.flags import FlaggedRollouts
from tracegym.gateway.openai_errors import bad_request
from tracegym.gateway.traces.store import ui_reads
from tracegym.gateway.traces.store.db import decode_cursor, encode_cursor, iso
from tracegym.gateway.traces.store.rollouts import check_status

SEARCH_BUDGET_S = 0.1
"""Wall time a page may spend searching call text before it answers with what it found."""
FLAGGED_IN_SQL = 900
"""A flagged set at most this large becomes an ``IN (...)`` list in SQL (well under SQLite's limit)."""
CHUNK = 200


class InspectRolloutParams(QueryModel):
    run: str | None = None
    """A training run (``GET /api/runs``): rollouts created in its time window (``ui_reads.run_windows``)."""
    status: Status = None
    task_id: str | None = None
    group_id: str | None = None
    weight_version: str | None = None
    """The rollout's weight version (that of its latest call)."""
    reward_min: float | None = None
    reward_max: float | None = None
    has_errors: bool | None = None
    """True: a call ended in error or the rollout failed an attempt; False: neither."""
    has_drift: bool | None = None
    """True: a call's prompt was ``realigned`` or ``forked``; False: none was."""
    q: str | None = Field(None, max_length=200)
    """An id (rollout, task or group id substring; exact call id) or text in the calls."""
    limit: int = Field(50, ge=1, le=500)
    cursor: str | None = None


def _columns(store: Any, p: InspectRolloutParams, flags: FlaggedRollouts) -> tuple[ui_reads.RolloutColumns, Any]:
    """The SQL filters, and the row test for what SQL does not do (None: SQL does it all)."""
    try:
        check_status(p.status)
    except ValueError as e:
        raise bad_request(str(e), param="status") from None
    after = until = None
    if p.run is not None:
        windows = ui_reads.run_windows(store.db)
        if p.run not in windows:
            raise bad_request(f"unknown run {p.run!r}; runs: {', '.join(sorted(windows)) or 'none'}", param="run")
        after, until = windows[p.run]
    errors = drifted = None
    if p.has_errors is not None or p.has_drift is not None:
        flags.refresh(store)
        errors = flags.errors() if p.has_errors is not None else None
        drifted = flags.drifted() if p.has_drift is not None else None
    ids: frozenset[str] | None = None
    ids_or_error = False
    if p.has_drift and drifted is not None and len(drifted) <= FLAGGED_IN_SQL:
        ids = drifted
    elif p.has_errors and errors is not None and len(errors) <= FLAGGED_IN_SQL:
        ids, ids_or_error = errors, True
    cols = ui_reads.RolloutColumns(
        status=p.status, task_id=p.task_id, group_id=p.group_id, weight_version=p.weight_version,
        reward_min=p.reward_min, reward_max=p.reward_max, after=after, until=until, ids=ids,
        ids_or_error=ids_or_error,
    )

    def keep(row: dict) -> bool:
        rid = row["rollout_id"]
        if errors is not None and ((rid in errors or row["error"] is not None) != p.has_errors):
            return False
        return drifted is None or (rid in drifted) == p.has_drift

    return cols, (keep if errors is not None or drifted is not None else None)


def _id_match(row: dict, needle: str) -> bool:
    n = needle.lower()
    return any(v is not None and n in v.lower() for v in (row["rollout_id"], row["task_id"], row["group_id"]))


def list_page(store: Any, p: InspectRolloutParams, flags: FlaggedRollouts) -> dict[str, Any]:
    """``{"rollouts", "next_cursor", "scanned", "partial"}``: see the module docstring and docs/api.md."""
    cols, keep = _columns(store, p, flags)
    try:
        cursor = decode_cursor(p.cursor) if p.cursor else None
    except ValueError as e:
        raise bad_request(str(e), param="cursor") from None
    needle = p.q.strip() if p.q else ""
    by_id: set[str] = set()
    if needle:
        # An id search when some id matches (exact and complete: SQL's id list, or a test on each row when
        # the needle is in many ids); else a search of the calls' text.
        by_id = ui_reads.rollouts_with_id_like(store.db, needle, FLAGGED_IN_SQL + 1)
        if by_id and len(by_id) <= FLAGGED_IN_SQL and cols.ids is None:
            cols = replace(cols, ids=frozenset(by_id))
    deadline = time.monotonic() + SEARCH_BUDGET_S
    found: list[dict] = []
    scanned, partial, last = 0, False, None
    for chunk, more in ui_reads.rollout_chunks(store.db, cols, cursor, chunk=CHUNK):
        rows = [r for r in chunk if keep is None or keep(r)]
        if by_id:
            rows = [r for r in rows if r["rollout_id"] in by_id or _id_match(r, needle)]
        elif needle:
            hits = ui_reads.rollouts_containing(store.db, [r["rollout_id"] for r in rows], needle) if rows else set()
            rows = [r for r in rows if r["rollout_id"] in hits]
        kept = {r["rollout_id"] for r in rows}
        for r in chunk:
            scanned += 1
            last = r
            if r["rollout_id"] in kept:
                found.append(r)
                if len(found) == p.limit:
                    break
        if len(found) == p.limit:
            more = more or r is not chunk[-1]
            break
        if not more:
            break
        if needle and not by_id and time.monotonic() > deadline:
            partial = True
            break
    else:
        more = False
    if not more:
        last = None  # every matching rollout was read (with a row test or a search, rows that follow a
        # full page may still not match: the next page can then come out empty)
    next_cursor = encode_cursor(last["created_at"], last["rollout_id"]) if last is not None else None
    return {"rollouts": _with_summaries(store, found), "next_cursor": next_cursor, "scanned": scanned,
            "partial": partial}


def _with_summaries(store: Any, rows: list[dict]) -> list[dict[str, Any]]:
    """The listed rows as JSON, with their calls' counts, errors, drift and time span."""
    summaries = ui_reads.call_summaries(store.db, [r["rollout_id"] for r in rows])
    out = []
    for r in rows:
        s = summaries.get(r["rollout_id"])
        out.append({
            **{k: r[k] for k in ui_reads.LISTED if k not in ("created_at", "started_at", "finished_at")},
            "created_at": iso(r["created_at"]), "started_at": iso(r["started_at"]),
            "finished_at": iso(r["finished_at"]),
            "calls": s["calls"] if s else 0, "call_errors": s["errors"] if s else 0,
            "drifted_calls": s["drifted"] if s else 0,
            "calls_seconds": (s["end_ns"] - s["start_ns"]) / 1e9 if s else None,
        })
    return out
