"""Rollout rows: creation of ad-hoc rollouts and their weight versions (multi-row statements, see
``span_insert``); every read (one, many, a filtered page, the queue's locked read) goes through one
plain-SQL ``_select``."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa

from tracegym.gateway.traces.store.db import (
    PAGE_IDS,
    Database,
    decode_cursor,
    encode_cursor,
    iso,
    now,
    to_epoch,
)
from tracegym.gateway.traces.store.schema import check_id_length
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.span_insert import execute_values, rows_per_statement

STATUSES = ("queued", "running", "completed", "failed", "adhoc")
MAX_GROUP_IDS = 500
"""The most groups one ``list_rollouts`` names (SQLite binds at most 32,766 parameters per statement)."""
TimeLike = float | str | datetime | None


def rollout_dict(row: Any, *, input_text: bool = False) -> dict[str, Any]:
    """The Rollout JSON of docs/api.md from a whole ``rollouts`` row, its columns in table order (unpacked
    by position; a row of another shape raises ValueError): a ``_select`` row, whose ``input`` is the
    column's JSON text (``input_text``), or a ``returning(R)`` row of the queue's updates."""
    (rollout_id, task_id, group_id, status, attempt, max_attempts, input_, reward, _reward_final, worker_id,
     _lease_seconds, lease_expires_at, weight_version, error, _traceback, created_at, started_at,
     finished_at) = row
    if input_text and input_ is not None:
        input_ = orjson.loads(input_)
    return {
        "rollout_id": rollout_id,
        "task_id": task_id,
        "group_id": group_id,
        "status": status,
        "attempt": attempt,
        "max_attempts": max_attempts,
        "input": input_,
        "reward": reward,
        "worker_id": worker_id,
        "lease_expires_at": iso(lease_expires_at),
        "weight_version": weight_version,
        "error": error,
        "created_at": iso(created_at),
        "started_at": iso(started_at),
        "finished_at": iso(finished_at),
    }


_ROW_ORDER = ("rollout_id", "task_id", "group_id", "status", "attempt", "max_attempts", "input", "reward",
              "reward_final", "worker_id", "lease_seconds", "lease_expires_at", "weight_version", "error",
              "traceback", "created_at", "started_at", "finished_at")
if tuple(R.columns.keys()) != _ROW_ORDER:
    raise RuntimeError("rollout_dict unpacks the rollouts columns in table order: update it with the schema")
_TEXT_ROW = ", ".join("CAST(input AS TEXT)" if c == "input" else c for c in _ROW_ORDER)
"""A whole row for plain SQL, ``input`` as its JSON text on both dialects (PostgreSQL's driver would
parse a JSON column itself; SQLite may hand a bare JSON number back as a number)."""
_CREATED = _ROW_ORDER.index("created_at")


def _select(conn: sa.Connection, where: str, params: Sequence[Any], tail: str = "") -> list[tuple]:
    """Whole ``rollouts`` rows (``_TEXT_ROW``: ``rollout_dict(row, input_text=True)`` reads them) of
    ``SELECT ... FROM rollouts{where}{tail}``, as plain SQL on the transaction's DBAPI connection: every
    rollout read goes this way, because building, compiling and post-processing a SQLAlchemy statement
    costs more than the query (the bulk trajectory route lists a page per 100 rollouts)."""
    cur = conn.connection.dbapi_connection.cursor()
    try:
        cur.execute(f"SELECT {_TEXT_ROW} FROM rollouts{where}{tail}", params)
        return cur.fetchall()
    finally:
        cur.close()


def read_rollout(db: Database, conn: sa.Connection, rollout_id: str, *, lock: bool = False) -> dict | None:
    """The Rollout JSON of ``rollout_id`` inside the caller's transaction, or None. ``lock``: take the row's
    lock on PostgreSQL (``FOR UPDATE``; a SQLite write transaction holds the whole database already)."""
    tail = " FOR UPDATE" if lock and db.dialect == "postgresql" else ""
    rows = _select(conn, f" WHERE rollout_id = {_MARK[db.dialect]}", [rollout_id], tail)
    return rollout_dict(rows[0], input_text=True) if rows else None


def check_status(status: str | None) -> None:
    if status is not None and status not in STATUSES:
        raise ValueError(f"unknown rollout status {status!r}; expected one of {', '.join(STATUSES)}")


_ROLLOUT_INSERT_HEAD = ("INSERT INTO rollouts (rollout_id, task_id, group_id, status, attempt, max_attempts, "
                        "reward_final, created_at) VALUES ")
_ROLLOUT_INSERT_TAIL = " ON CONFLICT (rollout_id) DO NOTHING"
_VERSIONS_HEAD = "WITH v (rid, wv) AS (VALUES "
_VERSIONS_TAIL = {
    "sqlite": (") UPDATE rollouts SET weight_version = v.wv FROM v "
               "WHERE rollouts.rollout_id = v.rid AND rollouts.weight_version IS NOT v.wv"),
    "postgresql": (") UPDATE rollouts SET weight_version = v.wv FROM v "
                   "WHERE rollouts.rollout_id = v.rid AND rollouts.weight_version IS DISTINCT FROM v.wv"),
}
_MARK = {"sqlite": "?", "postgresql": "%s"}
_SQLITE_UPDATE_FROM = (3, 33, 0)


def _checked_ids(items: Iterable[tuple[str, str | None]]) -> dict[str, str | None]:
    """``{rollout_id: task_id}``; ValueError for an id longer than its column."""
    out = dict(items)
    for rid, tid in out.items():
        check_id_length("rollout_id", rid)
        check_id_length("task_id", tid)
    return out


def _execute_values(dialect: str, raw: Any, head: str, tail: str, rows: list[tuple]) -> None:
    """``span_insert.execute_values`` of ``rows`` on the transaction's DBAPI connection ``raw``, as many rows
    per statement as the dialect's parameter limit allows; nothing for no rows."""
    if not rows:
        return
    cur = raw.cursor()
    try:
        execute_values(cur, head, tail, rows, rows_per_statement(raw, dialect, len(rows[0])), _MARK[dialect])
    finally:
        cur.close()


def _new_rollout_rows(items: Iterable[tuple[str, str | None]], status: str) -> list[tuple]:
    """The ``_ROLLOUT_INSERT_HEAD`` rows of rollouts ``(rollout_id, task_id)`` with ``status``."""
    check_status(status)
    t = now()
    return [(rid, tid, None, status, 1, 1, False, t) for rid, tid in _checked_ids(items).items()]


def ensure_rollouts(db: Database, conn: sa.Connection, items: Iterable[tuple[str, str | None]],
                    status: str = "adhoc") -> None:
    """Insert missing rollouts ``(rollout_id, task_id)`` with ``status``; existing ones are untouched.

    One multi-row ``INSERT ... ON CONFLICT (rollout_id) DO NOTHING`` on the transaction's DBAPI connection
    (``span_insert.execute_values``; one per ``rows_per_statement`` rollouts): a span batch names hundreds
    of rollouts, and a row-by-row insert would wait for the GIL once per row on SQLite (see
    ``span_insert``). The values are those SQLAlchemy would bind (``reward_final`` False is 0 on SQLite, a
    boolean on PostgreSQL)."""
    _execute_values(db.dialect, conn.connection.dbapi_connection, _ROLLOUT_INSERT_HEAD, _ROLLOUT_INSERT_TAIL,
                    _new_rollout_rows(items, status))


def update_weight_versions(db: Database, conn: sa.Connection, versions: dict[str, str]) -> None:
    """Set ``weight_version`` of the given rollouts (``{rollout_id: version}``) where it differs, in one
    ``WITH v (rid, wv) AS (VALUES ...) UPDATE rollouts ... FROM v`` (one per ``rows_per_statement``
    rollouts; see ``ensure_rollouts`` for why not row by row). SQLite before 3.33 has no ``UPDATE ...
    FROM``: there the rows are updated one by one."""
    raw = conn.connection.dbapi_connection
    if db.dialect == "sqlite" and sqlite3.sqlite_version_info < _SQLITE_UPDATE_FROM:
        raw.executemany(
            "UPDATE rollouts SET weight_version = ? WHERE rollout_id = ? AND weight_version IS NOT ?",
            [(wv, rid, wv) for rid, wv in versions.items()])
        return
    _execute_values(db.dialect, raw, _VERSIONS_HEAD, _VERSIONS_TAIL[db.dialect], list(versions.items()))


_SPAN_ROLLOUTS_HEAD = ("INSERT INTO rollouts (rollout_id, task_id, group_id, status, attempt, max_attempts, "
                       "reward_final, created_at, weight_version) VALUES ")
_SPAN_ROLLOUTS_TAIL = (" ON CONFLICT (rollout_id) DO UPDATE SET "
                       "weight_version = coalesce(excluded.weight_version, rollouts.weight_version), "
                       "task_id = coalesce(rollouts.task_id, excluded.task_id) "
                       "WHERE (excluded.weight_version IS NOT NULL "
                       "AND rollouts.weight_version IS NOT excluded.weight_version) "
                       "OR (rollouts.task_id IS NULL AND excluded.task_id IS NOT NULL)")
_PG_ROLLOUTS_INPUT = (
    "WITH v (rid, tid, wv) AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[])), "
    "ins AS (INSERT INTO rollouts (rollout_id, task_id, group_id, status, attempt, max_attempts, "
    "reward_final, created_at, weight_version) SELECT rid, tid, NULL, 'adhoc', 1, 1, false, %s, wv "
    "FROM v ON CONFLICT (rollout_id) DO NOTHING)")
_PG_ROLLOUTS_UPDATE = (
    "UPDATE rollouts SET weight_version = coalesce(v.wv, rollouts.weight_version), "
    "task_id = coalesce(rollouts.task_id, v.tid) FROM v WHERE rollouts.rollout_id = v.rid "
    "AND ((v.wv IS NOT NULL AND rollouts.weight_version IS DISTINCT FROM v.wv) "
    "OR (rollouts.task_id IS NULL AND v.tid IS NOT NULL))")
PG_SPAN_ROLLOUTS = f"{_PG_ROLLOUTS_INPUT} {_PG_ROLLOUTS_UPDATE}"
"""The rollouts side of a span batch on PostgreSQL, one statement (``write_span_rollouts``); its parameters
are ``pg_span_rollouts_params``."""
PG_SPAN_ROLLOUTS_WITH = f"{_PG_ROLLOUTS_INPUT}, upd AS ({_PG_ROLLOUTS_UPDATE}) "
"""The same as the ``WITH`` clause of a statement that goes on to write the spans (same parameters, first):
PostgreSQL runs every data-modifying ``WITH`` part once, to completion, whether the statement reads it or not."""


def pg_span_rollouts_params(tasks: dict[str, str | None], versions: dict[str, str]
                            ) -> tuple[list[str], list[str | None], list[str | None], float]:
    """The parameters of ``PG_SPAN_ROLLOUTS``: the rollouts as three arrays in id order (two span writers commit
    side by side and take the rows' locks in one order), and the creation time of the new ones."""
    ids = sorted(_checked_ids(tasks.items()))
    return ids, [tasks[rid] for rid in ids], [versions.get(rid) for rid in ids], now()


def write_span_rollouts(dialect: str, raw: Any, tasks: dict[str, str | None], versions: dict[str, str]) -> None:
    """The rollouts side of a span batch, on the transaction's DBAPI connection ``raw``: create the missing
    rollouts ``{rollout_id: task_id}`` (status ``adhoc``), set ``weight_version`` to
    ``versions[rollout_id]`` where it differs, and fill a missing ``task_id`` from the spans (a rollout
    created by a reward or an event before its first call has none).

    SQLite: in one statement, a multi-row upsert (a new rollout is inserted with its version, an existing
    one updated where the version differs or its task is missing), since each statement costs the write
    thread a GIL re-acquisition (see ``span_insert``).

    PostgreSQL: an insert of the missing rollouts, then an ``UPDATE ... FROM`` of the rollouts that were
    there before, in one statement (the insert a data-modifying ``WITH`` of the update, which does not see
    the rows it inserts: a new rollout is written once, with its version), because an upsert's ``DO
    UPDATE`` would lock every conflicting rollout row until commit (queue claims skip locked rows), while
    the ``UPDATE`` locks only the rows it changes. A rollout another transaction inserts while this
    statement runs gets its version from its next span. The rollouts go as three arrays, in id order (two
    span writers commit side by side and take the rows' locks in one order): the statement's text is the
    same for any batch, so psycopg parses it once and the server prepares it once (a ``VALUES`` list with
    a placeholder per value, a new text for each size, cost a small batch's writer half its time). The
    update finds each rollout through the primary key: the span writer's connection does not let the
    planner scan the table (``db.Database.span_write``), which it would while the table's statistics lag
    its growth."""
    if dialect != "sqlite":
        params = pg_span_rollouts_params(tasks, versions)
        if params[0]:
            with raw.cursor() as cur:
                cur.execute(PG_SPAN_ROLLOUTS, params)
        return
    t = now()
    get = versions.get
    rows = [(rid, tid, None, "adhoc", 1, 1, False, t, get(rid))
            for rid, tid in _checked_ids(tasks.items()).items()]
    _execute_values(dialect, raw, _SPAN_ROLLOUTS_HEAD, _SPAN_ROLLOUTS_TAIL, rows)


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
            return read_rollout(self.db, conn, rollout_id)

    def get_rollouts(self, rollout_ids: Iterable[str]) -> dict[str, dict]:
        """``{rollout_id: Rollout}`` of the given ids that exist (unknown ids are absent), read in one
        transaction with one query per ``PAGE_IDS`` ids."""
        ids = list(dict.fromkeys(rollout_ids))
        out: dict[str, dict] = {}
        with self.db.read() as conn:
            for start in range(0, len(ids), PAGE_IDS):
                page = ids[start : start + PAGE_IDS]
                if self.db.dialect == "postgresql":
                    rows = _select(conn, " WHERE rollout_id = ANY(%s)", [page])
                else:
                    rows = _select(conn, f" WHERE rollout_id IN ({','.join('?' * len(page))})", page)
                for row in rows:
                    out[row[0]] = rollout_dict(row, input_text=True)
        return out

    def list_rollouts(
        self,
        *,
        status: str | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        group_ids: list[str] | None = None,
        since: TimeLike = None,
        until: TimeLike = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[dict], str | None]:
        """Newest first (by created_at); returns (rollouts, next_cursor or None). ``since``/``until`` bound
        created_at (epoch seconds, ISO-8601 string or datetime); ``group_ids``: the rollouts of any of these
        groups (at most ``MAX_GROUP_IDS``; a trainer follows its step's groups with one query). A bad
        argument raises ValueError."""
        check_status(status)
        if not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be between 1 and 10000, got {limit}")
        if group_ids is not None and not 1 <= len(group_ids) <= MAX_GROUP_IDS:
            raise ValueError(f"group_ids must name 1 to {MAX_GROUP_IDS} groups, got {len(group_ids)}")
        mark = _MARK[self.db.dialect]
        conds: list[str] = []
        params: list[Any] = []
        for col, value in (("status", status), ("task_id", task_id), ("group_id", group_id)):
            if value is not None:
                conds.append(f"{col} = {mark}")
                params.append(value)
        if group_ids:
            conds.append(f"group_id IN ({', '.join([mark] * len(group_ids))})")
            params += group_ids
        if (lo := to_epoch(since)) is not None:
            conds.append(f"created_at >= {mark}")
            params.append(lo)
        if (hi := to_epoch(until)) is not None:
            conds.append(f"created_at < {mark}")
            params.append(hi)
        if cursor:
            c_time, c_id = decode_cursor(cursor)
            conds.append(f"(created_at < {mark} OR (created_at = {mark} AND rollout_id < {mark}))")
            params += [c_time, c_time, c_id]
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        with self.db.read() as conn:
            rows = _select(conn, where, params,
                           f" ORDER BY created_at DESC, rollout_id DESC LIMIT {int(limit) + 1}")
        page = rows[:limit]
        next_cursor = None
        if len(rows) > limit:
            last = page[-1]
            next_cursor = encode_cursor(last[_CREATED], last[0])
        return [rollout_dict(r, input_text=True) for r in page], next_cursor
