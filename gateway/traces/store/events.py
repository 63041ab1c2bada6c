"""Rewards and events (idempotent per rollout and key), weight versions, and training metrics."""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa

from tracegym.gateway.traces.store.db import PAGE_IDS, Database, iso, now
from tracegym.gateway.traces.store.rollouts import ensure_rollouts
from tracegym.gateway.traces.store.schema import check_id_length, check_text, max_length
from tracegym.gateway.traces.store.schema import events as E
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.schema import train_metrics as M
from tracegym.gateway.traces.store.schema import weight_versions as W

EVENT_KINDS = ("reward", "event")


def _event_dict(row: Any) -> dict[str, Any]:
    m = row._mapping
    return {
        "event_id": m["event_id"],
        "rollout_id": m["rollout_id"],
        "kind": m["kind"],
        "name": m["name"],
        "value": m["value"],
        "attributes": m["attributes"],
        "call_index": m["call_index"],
        "idempotency_key": m["idempotency_key"],
        "created_at": iso(m["created_at"]),
    }


def _reward_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"a reward value must be a finite number, got {value!r}")
    return float(value)


def _weight_dict(row: Any) -> dict[str, Any]:
    m = row._mapping
    return {"version": m["version"], "path": m["path"], "step": m["step"],
            "swap_seconds": m["swap_seconds"], "created_at": iso(m["created_at"])}


class EventsMixin:
    db: Database

    def add_event(
        self,
        rollout_id: str,
        *,
        kind: str,
        idempotency_key: str,
        name: str | None = None,
        value: Any = None,
        attributes: dict | None = None,
        call_index: int | None = None,
    ) -> tuple[int, bool]:
        """Store a ``reward`` or ``event`` once per (rollout, idempotency_key); returns (event_id,
        duplicate). Creates an unknown rollout as ``adhoc``. An unnamed reward sets the rollout's reward
        unless ``complete`` gave one."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {kind!r}")
        if not rollout_id or not idempotency_key:
            raise ValueError("rollout_id and idempotency_key must be non-empty strings")
        check_id_length("idempotency_key", idempotency_key)
        check_text("name", name, max_length(E.c.name))
        if kind == "reward":
            value = _reward_value(value)
        row = {"rollout_id": rollout_id, "kind": kind, "name": name, "value": value, "attributes": attributes,
               "call_index": call_index, "idempotency_key": idempotency_key, "created_at": now()}
        stmt = (self.db.insert(E).values(**row)
                .on_conflict_do_nothing(index_elements=["rollout_id", "idempotency_key"])
                .returning(E.c.event_id))
        with self.db.write() as conn:
            ensure_rollouts(self.db, conn, [(rollout_id, None)])
            event_id = conn.execute(stmt).scalar()
            if event_id is None:
                existing = conn.execute(sa.select(E.c.event_id).where(
                    E.c.rollout_id == rollout_id, E.c.idempotency_key == idempotency_key)).scalar_one()
                return int(existing), True
            if kind == "reward" and name is None:
                conn.execute(sa.update(R).where(R.c.rollout_id == rollout_id, R.c.reward_final.is_(False))
                             .values(reward=value))
        return int(event_id), False

    def add_reward(self, rollout_id: str, value: float, *, idempotency_key: str, name: str | None = None,
                   call_index: int | None = None) -> tuple[int, bool]:
        """``add_event(kind="reward", ...)``."""
        return self.add_event(rollout_id, kind="reward", idempotency_key=idempotency_key, name=name,
                              value=value, call_index=call_index)

    def list_events(self, rollout_id: str, kind: str | None = None) -> list[dict]:
        """``[{"event_id", "rollout_id", "kind", "name", "value", "attributes", "call_index",
        "idempotency_key", "created_at"}]`` in insertion order."""
        if kind is not None and kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {kind!r}")
        q = sa.select(E).where(E.c.rollout_id == rollout_id)
        if kind is not None:
            q = q.where(E.c.kind == kind)
        with self.db.read() as conn:
            return [_event_dict(r) for r in conn.execute(q.order_by(E.c.event_id))]

    def list_events_many(self, rollout_ids: list[str], kind: str | None = None) -> dict[str, list[dict]]:
        """``list_events`` of several rollouts in one query per ``PAGE_IDS`` of them: ``{rollout_id: [event,
        ...]}`` (insertion order; rollouts without events are absent)."""
        if kind is not None and kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {kind!r}")
        ids = list(rollout_ids)
        out: dict[str, list[dict]] = {}
        with self.db.read() as conn:
            for start in range(0, len(ids), PAGE_IDS):
                q = sa.select(E).where(E.c.rollout_id.in_(ids[start : start + PAGE_IDS]))
                if kind is not None:
                    q = q.where(E.c.kind == kind)
                for r in conn.execute(q.order_by(E.c.event_id)):
                    ev = _event_dict(r)
                    out.setdefault(ev["rollout_id"], []).append(ev)
        return out

    def add_weight_version(self, version: str, *, path: str | None = None, step: int | None = None,
                           swap_seconds: float | None = None) -> dict:
        """Record (upsert) a served weight version; returns ``{"version", "path", "step", "swap_seconds",
        "created_at"}``."""
        if not version:
            raise ValueError("version must be a non-empty string")
        check_id_length("version", version)
        ins = self.db.insert(W).values(version=version, path=path, step=step, swap_seconds=swap_seconds,
                                       created_at=now())
        stmt = ins.on_conflict_do_update(
            index_elements=["version"],
            set_={"path": sa.func.coalesce(ins.excluded.path, W.c.path),
                  "step": sa.func.coalesce(ins.excluded.step, W.c.step),
                  "swap_seconds": sa.func.coalesce(ins.excluded.swap_seconds, W.c.swap_seconds)},
        ).returning(W)
        with self.db.write() as conn:
            return _weight_dict(conn.execute(stmt).one())

    def list_weight_versions(self) -> list[dict]:
        """Oldest first."""
        with self.db.read() as conn:
            return [_weight_dict(r) for r in conn.execute(sa.select(W).order_by(W.c.created_at, W.c.version))]

    def add_metrics(self, run: str, step: int, metrics: dict[str, Any]) -> None:
        """Store one training step's metrics (a re-post of the same step replaces it)."""
        if not run:
            raise ValueError("run must be a non-empty string")
        check_id_length("run", run)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an integer, got {step!r}")
        if not isinstance(metrics, dict):
            raise ValueError("metrics must be a JSON object")
        ins = self.db.insert(M).values(run=run, step=step, metrics=metrics, created_at=now())
        stmt = ins.on_conflict_do_update(index_elements=["run", "step"],
                                         set_={"metrics": ins.excluded.metrics,
                                               "created_at": ins.excluded.created_at})
        with self.db.write() as conn:
            conn.execute(stmt)

    def list_metrics(self, run: str) -> list[dict]:
        """``[{"step", "metrics", "time"}]`` ordered by step."""
        with self.db.read() as conn:
            rows = conn.execute(sa.select(M).where(M.c.run == run).order_by(M.c.step)).all()
        return [{"step": r.step, "metrics": r.metrics, "time": iso(r.created_at)} for r in rows]
