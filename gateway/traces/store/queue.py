"""The task queue: enqueue tasks as groups of rollouts, claim with a lease, heartbeat, complete, fail,
release, and requeue expired leases.

Claims are one ``WITH picked AS MATERIALIZED (SELECT ... LIMIT n [FOR UPDATE SKIP LOCKED]) UPDATE ... FROM
picked ... RETURNING``:
on PostgreSQL concurrent claimers skip each other's locked rows; on SQLite the write transaction starts
with ``BEGIN IMMEDIATE`` so claims are serialised. ``attempt`` is 1-based: a rollout runs at most
``max_attempts`` times.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from tracegym.gateway.traces.store.db import Database, now
from tracegym.gateway.traces.store.keys import ordered_hex
from tracegym.gateway.traces.store.rollouts import read_rollout, rollout_dict
from tracegym.gateway.traces.store.schema import check_id_length, check_text, max_length
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.schema import tasks as T
from tracegym.gateway.traces.store.store_errors import Conflict, NotFound


def _new_id(prefix: str) -> str:
    return f"{prefix}-{ordered_hex()}"  # time-ordered: see store.keys


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _held_by_other(rollout: dict, worker_id: str | None) -> bool:
    held = rollout["worker_id"]
    return worker_id is not None and held is not None and held != worker_id


def _update(conn: sa.Connection, rollout_id: str, **values: Any) -> dict:
    row = conn.execute(sa.update(R).where(R.c.rollout_id == rollout_id).values(**values).returning(R)).one()
    return rollout_dict(row)


class QueueMixin:
    db: Database

    def enqueue_tasks(
        self, tasks: list[dict[str, Any]], *, group_size: int = 1, max_attempts: int = 3
    ) -> list[dict]:
        """Upsert tasks (``{"task_id"?, "input", "split"?, "metadata"?, "group_id"?}``) and queue
        ``group_size`` rollouts per task sharing one group id: ``group_id`` if given, else a new one. A
        ``group_id`` that exists already is not enqueued again: its existing rollouts are returned (so a
        retried or resumed enqueue never runs a group twice). Returns ``[{"task_id", "group_id",
        "rollout_ids"}]``."""
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        t = now()
        planned = []  # (task row, rollout rows, answer)
        for i, task in enumerate(tasks):
            if not isinstance(task, dict) or "input" not in task:
                raise ValueError(f"tasks[{i}] must be an object with an 'input' field")
            task_id = task.get("task_id") or _new_id("task")
            check_id_length(f"tasks[{i}].task_id", str(task_id))
            check_text(f"tasks[{i}].split", task.get("split"), max_length(T.c.split))
            group_id = str(task.get("group_id") or _new_id("grp"))
            check_id_length(f"tasks[{i}].group_id", group_id)
            task_row = {"task_id": str(task_id), "input": task["input"], "split": task.get("split"),
                        "metadata": task.get("metadata"), "created_at": t}
            rids = sorted(_new_id("ro") for _ in range(group_size))  # the order a re-enqueue reads them in
            rows = [
                {"rollout_id": rid, "task_id": str(task_id), "group_id": group_id, "status": "queued",
                 "attempt": 1, "max_attempts": max_attempts, "input": task["input"], "reward_final": False,
                 "created_at": t}
                for rid in rids
            ]
            planned.append((task_row, rows, {"task_id": str(task_id), "group_id": group_id, "rollout_ids": rids}))
        if not planned:
            return []
        given = [str(task["group_id"]) for task in tasks if task.get("group_id")]
        if len(set(given)) < len(given):
            raise ValueError("the same group_id is given to more than one task")
        ins = self.db.insert(T)
        upsert = ins.on_conflict_do_update(
            index_elements=["task_id"],
            set_={"input": ins.excluded.input, "split": ins.excluded.split,
                  "metadata": ins.excluded.metadata},
        )
        with self.db.write() as conn:
            existing: dict[str, dict] = {}
            if given:
                found = conn.execute(sa.select(R.c.group_id, R.c.task_id, R.c.rollout_id)
                                     .where(R.c.group_id.in_(given)).order_by(R.c.created_at, R.c.rollout_id))
                for gid, tid, rid in found:
                    existing.setdefault(gid, {"task_id": tid, "group_id": gid, "rollout_ids": []})
                    existing[gid]["rollout_ids"].append(rid)
            new = [p for p in planned if p[2]["group_id"] not in existing]
            if new:
                conn.execute(upsert, [task_row for task_row, _, _ in new])
                conn.execute(sa.insert(R), [row for _, rows, _ in new for row in rows])
        return [existing.get(answer["group_id"], answer) for _, _, answer in planned]

    def requeue_expired(self, now_s: float | None = None) -> int:
        """Requeue (attempt+1) running rollouts whose lease expired, or mark them failed once they used
        ``max_attempts``; returns how many changed."""
        t = now() if now_s is None else now_s
        expired = sa.and_(R.c.status == "running", R.c.lease_expires_at < t)
        sub = sa.select(R.c.rollout_id).where(expired)
        if self.db.dialect == "postgresql":
            sub = sub.with_for_update(skip_locked=True)
        ids = sub.scalar_subquery()
        with self.db.write() as conn:
            failed = conn.execute(
                sa.update(R).where(R.c.rollout_id.in_(ids), expired, R.c.attempt >= R.c.max_attempts)
                .values(status="failed", finished_at=t, lease_expires_at=None,
                        error="lease expired on the last attempt")
            ).rowcount
            requeued = conn.execute(
                sa.update(R).where(R.c.rollout_id.in_(ids), expired, R.c.attempt < R.c.max_attempts)
                .values(status="queued", attempt=R.c.attempt + 1, lease_expires_at=None,
                        error="lease expired")
            ).rowcount
        return failed + requeued

    def claim(self, worker_id: str, *, limit: int = 1, lease_seconds: float = 60.0) -> list[dict]:
        """Requeue expired leases, then atomically claim up to ``limit`` queued rollouts (oldest first):
        they become ``running`` under ``worker_id``. Two claimers never get the same rollout."""
        if not worker_id:
            raise ValueError("worker_id must be a non-empty string")
        check_id_length("worker_id", worker_id)
        if not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValueError(f"limit must be an integer between 1 and 1000, got {limit!r}")
        _check_positive("lease_seconds", lease_seconds)
        self.requeue_expired()
        t = now()
        sub = (sa.select(R.c.rollout_id).where(R.c.status == "queued")
               .order_by(R.c.created_at, R.c.rollout_id).limit(limit))
        if self.db.dialect == "postgresql":
            sub = sub.with_for_update(skip_locked=True)
        # A materialised CTE, not ``IN (subquery)``: PostgreSQL may re-run an IN subquery and then
        # update more than ``limit`` rows.
        picked = sub.cte("picked").prefix_with("MATERIALIZED", dialect="postgresql")
        stmt = (
            sa.update(R)
            .where(R.c.rollout_id == picked.c.rollout_id, R.c.status == "queued")
            .values(status="running", worker_id=worker_id, lease_seconds=lease_seconds,
                    lease_expires_at=t + lease_seconds, started_at=t)
            .returning(R)
        )
        with self.db.write() as conn:
            rows = conn.execute(stmt).all()
        claimed = [rollout_dict(r) for r in rows]
        claimed.sort(key=lambda r: (r["created_at"], r["rollout_id"]))
        return claimed

    def heartbeat(self, rollout_id: str, worker_id: str, *, lease_seconds: float | None = None) -> float:
        """Extend the lease; returns the new ``lease_expires_at`` (epoch s). Conflict if the lease was
        lost."""
        if lease_seconds is not None:
            _check_positive("lease_seconds", lease_seconds)
        t = now()
        new_lease = sa.func.coalesce(sa.literal(lease_seconds, sa.Double), R.c.lease_seconds, 60.0)
        stmt = (
            sa.update(R)
            .where(R.c.rollout_id == rollout_id, R.c.status == "running", R.c.worker_id == worker_id)
            .values(lease_expires_at=t + new_lease, lease_seconds=new_lease)
            .returning(R.c.lease_expires_at)
        )
        with self.db.write() as conn:
            expires = conn.execute(stmt).scalar()
            if expires is not None:
                return float(expires)
            row = read_rollout(self.db, conn, rollout_id)
        if row is None:
            raise NotFound(f"unknown rollout {rollout_id!r}")
        raise Conflict(f"lease lost: rollout {rollout_id} is {row['status']} (worker {row['worker_id']!r})")

    def complete(self, rollout_id: str, *, worker_id: str | None = None, reward: float | None = None) -> dict:
        """Mark completed. NotFound for a rollout the store never saw (as ``fail``, ``heartbeat`` and
        ``release`` answer; an ad-hoc rollout exists once a span or event of it was stored), Conflict if
        another worker now holds it or it already failed. Idempotent on a completed rollout."""
        check_id_length("rollout_id", rollout_id)
        check_id_length("worker_id", worker_id)
        t = now()
        with self.db.write() as conn:
            row = read_rollout(self.db, conn, rollout_id, lock=True)
            if row is None:
                raise NotFound(f"unknown rollout {rollout_id!r}")
            if row["status"] == "completed":
                return row
            if row["status"] == "failed":
                raise Conflict(f"rollout {rollout_id} already failed: {row['error']}")
            if _held_by_other(row, worker_id):
                raise Conflict(f"rollout {rollout_id} is held by worker {row['worker_id']!r}, "
                               f"not {worker_id!r}")
            values: dict[str, Any] = {"status": "completed", "finished_at": t, "lease_expires_at": None}
            if row["worker_id"] is None and worker_id is not None:
                values["worker_id"] = worker_id
            if reward is not None:
                values |= {"reward": float(reward), "reward_final": True}
            return _update(conn, rollout_id, **values)

    def fail(
        self, rollout_id: str, *, error: str, worker_id: str | None = None, traceback: str | None = None
    ) -> dict:
        """Requeue (attempt+1) while attempt < max_attempts, else mark failed. Returns the Rollout."""
        with self.db.write() as conn:
            row = read_rollout(self.db, conn, rollout_id, lock=True)
            if row is None:
                raise NotFound(f"unknown rollout {rollout_id!r}")
            if row["status"] in ("completed", "failed"):
                raise Conflict(f"rollout {rollout_id} is already {row['status']}")
            if _held_by_other(row, worker_id):
                raise Conflict(f"rollout {rollout_id} is held by worker {row['worker_id']!r}, "
                               f"not {worker_id!r}")
            values: dict[str, Any] = {"error": error, "traceback": traceback, "lease_expires_at": None}
            if row["status"] != "adhoc" and row["attempt"] < row["max_attempts"]:
                values |= {"status": "queued", "attempt": row["attempt"] + 1}
            else:
                values |= {"status": "failed", "finished_at": now()}
            return _update(conn, rollout_id, **values)

    def release(self, rollout_id: str, *, worker_id: str) -> dict:
        """Give a running rollout back to the queue without using an attempt."""
        with self.db.write() as conn:
            row = read_rollout(self.db, conn, rollout_id, lock=True)
            if row is None:
                raise NotFound(f"unknown rollout {rollout_id!r}")
            if row["status"] != "running" or row["worker_id"] != worker_id:
                raise Conflict(f"rollout {rollout_id} is {row['status']} (worker {row['worker_id']!r}); "
                               f"{worker_id!r} cannot release it")
            return _update(conn, rollout_id, status="queued", lease_expires_at=None)
