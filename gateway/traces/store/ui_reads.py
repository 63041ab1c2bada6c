"""The trace inspector's reads (``/ui`` and ``/api/inspect/...``): training runs, rollouts newest first in
keyset-paged chunks with their column filters, per-rollout call summaries, the call spans flagged with an
error or drift, text search over the calls of some rollouts, and the queue's counts.

SQL only, plain functions over a ``Database`` (the ``Store`` mixins stay as they are); the filtering that
needs more than one query (flagged spans, text search under a time budget) is the caller's. Every query
here is bounded by an index or by the ids it is given, except the counts over the ``rollouts`` and
``tasks`` tables, which are small next to ``spans`` (one rollout row per ~8 spans).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.traces.store.db import Database, iso
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.schema import tasks as T
from tracegym.gateway.traces.store.schema import train_metrics as M

DRIFTED = ("realigned", "forked")
"""Drift statuses the inspector flags (``clean`` and ``none`` are the normal ones, see ``types.Drift``)."""
IDS_PER_QUERY = 500
ERROR_PREVIEW = 300
"""Characters of a rollout's error shown in listings (the rollout's own page shows all of it)."""
LISTED = ("rollout_id", "task_id", "group_id", "status", "attempt", "max_attempts", "reward", "worker_id",
          "weight_version", "error", "created_at", "started_at", "finished_at")
"""The columns of a listed rollout (no input, no traceback: either may be large)."""


def _attr(dialect: str, key: str) -> str:
    """SQL for the text of a top-level span attribute (keys contain dots, hence the quoting)."""
    if dialect == "postgresql":
        return f"(attributes ->> '{key}')"
    return f"json_extract(attributes, '$.\"{key}\"')"


def _ids_param(name: str) -> sa.BindParameter:
    return sa.bindparam(name, expanding=True)


# -- runs ------------------------------------------------------------------------------------------------
def list_runs(db: Database) -> list[dict[str, Any]]:
    """Every run with training metrics, most recently updated first: ``{"run", "steps", "first_step",
    "last_step", "started_at", "updated_at", "latest"}`` (``latest``: the metrics of its last step)."""
    agg = (sa.select(M.c.run, sa.func.count().label("n"), sa.func.min(M.c.step).label("lo"),
                     sa.func.max(M.c.step).label("hi"), sa.func.min(M.c.created_at).label("t0"),
                     sa.func.max(M.c.created_at).label("t1"))
           .group_by(M.c.run).subquery())
    q = (sa.select(agg, M.c.metrics)
         .join(M, sa.and_(M.c.run == agg.c.run, M.c.step == agg.c.hi))
         .order_by(agg.c.t1.desc()))
    with db.read() as conn:
        rows = conn.execute(q).all()
    return [{"run": r.run, "steps": r.n, "first_step": r.lo, "last_step": r.hi, "started_at": iso(r.t0),
             "updated_at": iso(r.t1), "latest": r.metrics} for r in rows]


def run_windows(db: Database) -> dict[str, tuple[float | None, float | None]]:
    """``{run: (after, until)}``: the creation times of the rollouts taken to belong to each run.

    Rollouts do not record their run; runs that share a store run one after another, so a run's rollouts
    are those created after the previous run's last metrics and up to its own last metrics (the newest
    run's window is open-ended, the oldest run's has no start)."""
    q = sa.select(M.c.run, sa.func.max(M.c.created_at).label("t1")).group_by(M.c.run).order_by("t1")
    with db.read() as conn:
        ends = [(r.run, r.t1) for r in conn.execute(q)]
    out: dict[str, tuple[float | None, float | None]] = {}
    for i, (run, end) in enumerate(ends):
        out[run] = (ends[i - 1][1] if i else None, end if i < len(ends) - 1 else None)
    return out


# -- rollouts ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RolloutColumns:
    """Filters on the ``rollouts`` table's own columns (None: no filter). ``after``/``until`` bound
    ``created_at`` (epoch seconds, ``after < created_at <= until``); ``ids``: only these rollouts, or
    only these or those with an error when ``ids_or_error`` is set."""

    status: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    weight_version: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    after: float | None = None
    until: float | None = None
    ids: frozenset[str] | None = None
    ids_or_error: bool = False

    def where(self) -> list[Any]:
        c = R.c
        conds: list[Any] = [col == v for col, v in ((c.status, self.status), (c.task_id, self.task_id),
                                                   (c.group_id, self.group_id),
                                                   (c.weight_version, self.weight_version)) if v is not None]
        if self.reward_min is not None:
            conds.append(c.reward >= self.reward_min)
        if self.reward_max is not None:
            conds.append(c.reward <= self.reward_max)
        if self.after is not None:
            conds.append(c.created_at > self.after)
        if self.until is not None:
            conds.append(c.created_at <= self.until)
        if self.ids is not None:
            among = c.rollout_id.in_(sorted(self.ids))
            conds.append(sa.or_(among, c.error.is_not(None)) if self.ids_or_error else among)
        return conds


def rollout_chunks(db: Database, cols: RolloutColumns, cursor: tuple[float, str] | None = None,
                   chunk: int = 200) -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """Rollouts matching ``cols``, newest first (``created_at``, then id, descending), as ``(rows, more)``
    with ``chunk`` rows at a time, starting after ``cursor`` (the ``(created_at, rollout_id)`` of the last
    row already seen); ``more`` tells whether rows follow. Each chunk is its own short read; the caller
    stops iterating when it has enough. Rows: ``LISTED`` with times as epoch seconds and the error cut to
    ``ERROR_PREVIEW`` characters."""
    columns = [R.c[name] for name in LISTED if name != "error"]
    columns.append(sa.func.substr(R.c.error, 1, ERROR_PREVIEW).label("error"))
    base = sa.select(*columns).where(*cols.where())
    while True:
        q = base
        if cursor is not None:
            t, rid = cursor
            q = q.where(sa.or_(R.c.created_at < t, sa.and_(R.c.created_at == t, R.c.rollout_id < rid)))
        q = q.order_by(R.c.created_at.desc(), R.c.rollout_id.desc()).limit(chunk + 1)  # one more: is there more?
        with db.read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(q)]
        more = len(rows) > chunk
        rows = rows[:chunk]
        if rows:
            yield rows, more
        if not more:
            return
        cursor = (rows[-1]["created_at"], rows[-1]["rollout_id"])


def group_rollouts(db: Database, group_id: str) -> list[dict[str, Any]]:
    """The rollouts of a GRPO group (``LISTED`` columns, epoch times) in creation order."""
    cols = [R.c[name] for name in LISTED]
    q = sa.select(*cols).where(R.c.group_id == group_id).order_by(R.c.created_at, R.c.rollout_id)
    with db.read() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


def rollout_traceback(db: Database, rollout_id: str) -> str | None:
    """The traceback stored with a rollout's last failure (``Store.get_rollout`` leaves it out)."""
    with db.read() as conn:
        return conn.execute(sa.select(R.c.traceback).where(R.c.rollout_id == rollout_id)).scalar()


def task_split(db: Database, task_id: str | None) -> str | None:
    if task_id is None:
        return None
    with db.read() as conn:
        return conn.execute(sa.select(T.c.split).where(T.c.task_id == task_id)).scalar()


# -- spans -------------------------------------------------------------------------------------------------
def call_summaries(db: Database, rollout_ids: list[str]) -> dict[str, dict[str, int]]:
    """Per rollout, over its LLM call spans: ``{"calls", "errors", "drifted", "start_ns", "end_ns"}``
    (rollouts without calls are absent). Reads the spans of these rollouts only (by index)."""
    drift = _attr(db.dialect, "tracegym.drift")
    sql = sa.text(
        "SELECT rollout_id, COUNT(*) AS calls, "
        "SUM(CASE WHEN status = 'error' THEN 1 ELSE 0 END) AS errors, "
        f"SUM(CASE WHEN {drift} IN ('realigned', 'forked') THEN 1 ELSE 0 END) AS drifted, "
        "MIN(start_time_ns) AS start_ns, MAX(end_time_ns) AS end_ns "
        "FROM spans WHERE rollout_id IN :ids AND call_id IS NOT NULL GROUP BY rollout_id"
    ).bindparams(_ids_param("ids"))
    out: dict[str, dict[str, int]] = {}
    with db.read() as conn:
        for start in range(0, len(rollout_ids), IDS_PER_QUERY):
            for r in conn.execute(sql, {"ids": rollout_ids[start : start + IDS_PER_QUERY]}):
                m = r._mapping
                out[m["rollout_id"]] = {k: int(m[k] or 0) for k in ("calls", "errors", "drifted", "start_ns",
                                                                    "end_ns")}
    return out


def max_span_id(db: Database) -> int:
    with db.read() as conn:
        return int(conn.execute(sa.text("SELECT MAX(id) FROM spans")).scalar() or 0)


def flagged_spans(db: Database, after_id: int, upto_id: int) -> list[tuple[str, bool, bool]]:
    """``(rollout_id, error, drifted)`` of the LLM call spans with ``after_id < id <= upto_id`` that ended
    in error or whose prompt drifted (``DRIFTED``): a range scan of the primary key."""
    drift = _attr(db.dialect, "tracegym.drift")
    sql = sa.text(
        f"SELECT rollout_id, status, {drift} AS drift FROM spans "
        "WHERE id > :lo AND id <= :hi AND call_id IS NOT NULL AND rollout_id IS NOT NULL "
        f"AND (status = 'error' OR {drift} IN ('realigned', 'forked'))"
    )
    with db.read() as conn:
        rows = conn.execute(sql, {"lo": after_id, "hi": upto_id}).all()
    return [(r.rollout_id, r.status == "error", r.drift in DRIFTED) for r in rows]


def rollouts_of_call(db: Database, call_id: str) -> set[str]:
    """The rollouts with a call of this id (the ``call_id`` index)."""
    sql = sa.text("SELECT DISTINCT rollout_id FROM spans WHERE call_id = :c AND rollout_id IS NOT NULL")
    with db.read() as conn:
        return {r[0] for r in conn.execute(sql, {"c": call_id})}


def rollouts_with_id_like(db: Database, needle: str, limit: int) -> set[str]:
    """Up to ``limit`` rollouts whose rollout, task or group id contains ``needle`` (case-insensitively),
    or that have a call whose id is ``needle``: a scan of the ``rollouts`` table (ids only)."""
    op = "ILIKE" if db.dialect == "postgresql" else "LIKE"
    sql = sa.text(
        f"SELECT rollout_id FROM rollouts WHERE rollout_id {op} :p ESCAPE '\\' OR task_id {op} :p ESCAPE '\\' "
        f"OR group_id {op} :p ESCAPE '\\' LIMIT :n"
    )
    with db.read() as conn:
        found = {r[0] for r in conn.execute(sql, {"p": _like_pattern(needle), "n": limit})}
    return found | rollouts_of_call(db, needle)


def _like_pattern(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def rollouts_containing(db: Database, rollout_ids: list[str], text: str) -> set[str]:
    """Those of ``rollout_ids`` with a span whose request body (the messages sent) or attributes (the
    replies, tool calls, errors) contain ``text``, case-insensitively (ASCII letters on SQLite). The JSON
    text is searched, so a quote or a line break in ``text`` must be written as JSON escapes it."""
    if db.dialect == "postgresql":
        cond = "(request ILIKE :p ESCAPE '\\' OR attributes::text ILIKE :p ESCAPE '\\')"
    else:
        cond = "(request LIKE :p ESCAPE '\\' OR CAST(attributes AS TEXT) LIKE :p ESCAPE '\\')"
    sql = sa.text(f"SELECT DISTINCT rollout_id FROM spans WHERE rollout_id IN :ids AND {cond}"
                  ).bindparams(_ids_param("ids"))
    pattern = _like_pattern(orjson.dumps(text).decode()[1:-1])  # as the stored JSON writes it
    out: set[str] = set()
    with db.read() as conn:
        for start in range(0, len(rollout_ids), IDS_PER_QUERY):
            page = rollout_ids[start : start + IDS_PER_QUERY]
            out.update(r[0] for r in conn.execute(sql, {"ids": page, "p": pattern}))
    return out


def group_replies(db: Database, rollout_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per rollout, its last LLM call's first reply message and the call's finish reason: ``{"message",
    "finish_reason"}`` (rollouts without calls are absent)."""
    sql = sa.text(
        "SELECT rollout_id, attributes FROM spans WHERE rollout_id IN :ids AND call_id IS NOT NULL "
        "ORDER BY rollout_id, start_time_ns, id"
    ).bindparams(_ids_param("ids"))
    last: dict[str, Any] = {}
    with db.read() as conn:
        for r in conn.execute(sql, {"ids": rollout_ids}):
            last[r.rollout_id] = r.attributes
    out = {}
    for rid, attrs in last.items():
        if isinstance(attrs, str | bytes):  # a text() query: SQLite hands the JSON column back as text
            attrs = orjson.loads(attrs)
        choices = (attrs or {}).get("tracegym.choices") or [{}]
        out[rid] = {"message": choices[0].get("message"), "finish_reason": choices[0].get("finish_reason")}
    return out


# -- the queue ---------------------------------------------------------------------------------------------
def queue_counts(db: Database) -> dict[str, Any]:
    """``{"rollouts": {status: n}, "active_by_split": [{"split", "status", "rollouts"}], "tasks": {split: n},
    "retried": n}``: all rollouts by status (an index-only count), the queued and running ones by their
    task's split (the status index finds them; finished ones are left out, as splitting those would join
    every rollout to its task), tasks by split, and ``retried``: rollouts not failed whose earlier attempt
    failed."""
    active = (sa.select(T.c.split, R.c.status, sa.func.count().label("n"))
              .select_from(R.outerjoin(T, T.c.task_id == R.c.task_id))
              .where(R.c.status.in_(("queued", "running"))).group_by(T.c.split, R.c.status))
    with db.read() as conn:
        statuses = dict(conn.execute(sa.select(R.c.status, sa.func.count()).group_by(R.c.status)).all())
        splits = [{"split": s, "status": st, "rollouts": n} for s, st, n in conn.execute(active)]
        tasks = {s or "": n for s, n in conn.execute(sa.select(T.c.split, sa.func.count()).group_by(T.c.split))}
        retried = conn.execute(sa.select(sa.func.count()).where(R.c.attempt > 1, R.c.status != "failed")
                               ).scalar()
    return {"rollouts": statuses, "active_by_split": splits, "tasks": tasks, "retried": int(retried or 0)}


def lease_holders(db: Database) -> list[dict[str, Any]]:
    """Workers holding running rollouts: ``{"worker_id", "running", "lease_expires_min",
    "lease_expires_max"}`` (epoch seconds), most rollouts first."""
    q = (sa.select(R.c.worker_id, sa.func.count().label("n"), sa.func.min(R.c.lease_expires_at).label("lo"),
                   sa.func.max(R.c.lease_expires_at).label("hi"))
         .where(R.c.status == "running").group_by(R.c.worker_id).order_by(sa.text("n DESC")))
    with db.read() as conn:
        return [{"worker_id": r.worker_id, "running": r.n, "lease_expires_min": r.lo, "lease_expires_max": r.hi}
                for r in conn.execute(q)]


def failed_rollouts(db: Database, limit: int = 50) -> list[dict[str, Any]]:
    """The most recently failed rollouts with their error and traceback (epoch times)."""
    q = (sa.select(R.c.rollout_id, R.c.task_id, R.c.group_id, R.c.attempt, R.c.max_attempts, R.c.worker_id,
                   R.c.error, R.c.traceback, R.c.finished_at)
         .where(R.c.status == "failed").order_by(R.c.finished_at.desc(), R.c.rollout_id).limit(limit))
    with db.read() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]
