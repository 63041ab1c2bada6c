"""Rollout rows: creation of ad-hoc rollouts, lookup and paginated listing."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tracegym.gateway.store.db import Database, decode_cursor, encode_cursor, iso, now, to_epoch
from tracegym.gateway.store.schema import check_id_length
from tracegym.gateway.store.schema import rollouts as R

PAGE_IDS = 500
"""Ids per ``IN (...)`` query (well under SQLite's bound-parameter limit)."""

STATUSES = ("queued", "running", "completed", "failed", "adhoc")
TimeLike = float | str | datetime | None


def rollout_dict(row: Any) -> dict[str, Any]:
    """The Rollout JSON of docs/api.md from a ``rollouts`` row."""
    m = row._mapping
    return {
        "rollout_id": m["rollout_id"],
        "task_id": m["task_id"],
        "group_id": m["group_id"],
        "status": m["status"],
        "attempt": m["attempt"],
        "max_attempts": m["max_attempts"],
        "input": m["input"],
        "reward": m["reward"],
        "worker_id": m["worker_id"],
        "lease_expires_at": iso(m["lease_expires_at"]),
        "weight_version": m["weight_version"],
        "error": m["error"],
        "created_at": iso(m["created_at"]),
        "started_at": iso(m["started_at"]),
        "finished_at": iso(m["finished_at"]),
    }


def check_status(status: str | None) -> None:
    if status is not None and status not in STATUSES:
        raise ValueError(f"unknown rollout status {status!r}; expected one of {', '.join(STATUSES)}")


def ensure_rollouts(db: Database, conn: sa.Connection, items: Iterable[tuple[str, str | None]],
                    status: str = "adhoc") -> None:
    """Insert missing rollouts ``(rollout_id, task_id)`` with ``status``; existing ones are untouched."""
    check_status(status)
    items = dict(items)
    for rid, tid in items.items():
        check_id_length("rollout_id", rid)
        check_id_length("task_id", tid)
    t = now()
    rows = [
        {"rollout_id": rid, "task_id": tid, "group_id": None, "status": status, "attempt": 1,
         "max_attempts": 1, "reward_final": False, "created_at": t}
        for rid, tid in items.items()
    ]
    if rows:
        conn.execute(db.insert(R).on_conflict_do_nothing(index_elements=["rollout_id"]), rows)


class RolloutsMixin:
    db: Database

    def ensure_rollout(self, rollout_id: str, *, task_id: str | None = None, status: str = "adhoc") -> None:
        """Create the rollout if it does not exist (no-op otherwise)."""
        if not rollout_id:
            raise ValueError("rollout_id must be a non-empty string")
        with self.db.write() as conn:
            ensure_rollouts(self.db, conn, [(rollout_id, task_id)], status)

    def get_rollout(self, rollout_id: str) -> dict | None:
        """The Rollout JSON of docs/api.md, or None."""
        with self.db.read() as conn:
            row = conn.execute(sa.select(R).where(R.c.rollout_id == rollout_id)).first()
        return None if row is None else rollout_dict(row)

    def get_rollouts(self, rollout_ids: Iterable[str]) -> dict[str, dict]:
        """``{rollout_id: Rollout}`` of the given ids that exist (unknown ids are absent), read in one
        transaction with one query per ``PAGE_IDS`` ids."""
        ids = list(dict.fromkeys(rollout_ids))
        out: dict[str, dict] = {}
        with self.db.read() as conn:
            for start in range(0, len(ids), PAGE_IDS):
                q = sa.select(R).where(R.c.rollout_id.in_(ids[start : start + PAGE_IDS]))
                for row in conn.execute(q):
                    out[row.rollout_id] = rollout_dict(row)
        return out

    def list_rollouts(
        self,
        *,
        status: str | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        since: TimeLike = None,
        until: TimeLike = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[dict], str | None]:
        """Newest first (by created_at); returns (rollouts, next_cursor or None). ``since``/``until`` bound
        created_at (epoch seconds, ISO-8601 string or datetime). A bad argument raises ValueError."""
        check_status(status)
        if not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be between 1 and 10000, got {limit}")
        q = sa.select(R)
        for col, value in ((R.c.status, status), (R.c.task_id, task_id), (R.c.group_id, group_id)):
            if value is not None:
                q = q.where(col == value)
        if (lo := to_epoch(since)) is not None:
            q = q.where(R.c.created_at >= lo)
        if (hi := to_epoch(until)) is not None:
            q = q.where(R.c.created_at < hi)
        if cursor:
            c_time, c_id = decode_cursor(cursor)
            q = q.where(sa.or_(R.c.created_at < c_time,
                               sa.and_(R.c.created_at == c_time, R.c.rollout_id < c_id)))
        q = q.order_by(R.c.created_at.desc(), R.c.rollout_id.desc()).limit(limit + 1)
        with self.db.read() as conn:
            rows = conn.execute(q).all()
        page = rows[:limit]
        next_cursor = None
        if len(rows) > limit:
            last = page[-1]._mapping
            next_cursor = encode_cursor(last["created_at"], last["rollout_id"])
        return [rollout_dict(r) for r in page], next_cursor
