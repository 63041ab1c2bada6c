"""Imported examples (``POST /api/import``): tasks and rollouts written as already completed, in one
transaction, so a runner following the queue never claims them. A group that exists already is left as
it is (an import re-sent after an interruption adds nothing twice)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from tracegym.gateway.traces.store.db import Database, now
from tracegym.gateway.traces.store.schema import check_id_length
from tracegym.gateway.traces.store.schema import rollouts as R
from tracegym.gateway.traces.store.schema import tasks as T


class ImportsMixin:
    db: Database

    def import_rollouts(self, groups: list[dict[str, Any]]) -> list[str]:
        """``groups``: ``[{"group_id", "task_id", "input", "split", "rollouts": [{"rollout_id", "reward"}]}]``.
        Writes the groups that do not exist yet (their task upserted, their rollouts ``completed``);
        returns the group ids written."""
        for g in groups:
            for key in ("group_id", "task_id"):
                check_id_length(key, g[key])
            for r in g["rollouts"]:
                check_id_length("rollout_id", r["rollout_id"])
        t = now()
        ins = self.db.insert(T)
        upsert = ins.on_conflict_do_update(index_elements=["task_id"], set_={"input": ins.excluded.input})
        with self.db.write() as conn:
            ids = [g["group_id"] for g in groups]
            found = {gid for (gid,) in conn.execute(sa.select(R.c.group_id).where(R.c.group_id.in_(ids)).distinct())}
            new = [g for g in groups if g["group_id"] not in found]
            if not new:
                return []
            conn.execute(upsert, [{"task_id": g["task_id"], "input": g["input"], "split": g["split"],
                                   "metadata": None, "created_at": t} for g in new])
            conn.execute(sa.insert(R), [
                {"rollout_id": r["rollout_id"], "task_id": g["task_id"], "group_id": g["group_id"],
                 "status": "completed", "attempt": 1, "max_attempts": 1, "input": g["input"],
                 "reward": r.get("reward"), "reward_final": r.get("reward") is not None, "created_at": t,
                 "started_at": t, "finished_at": t}
                for g in new for r in g["rollouts"]])
        return [g["group_id"] for g in new]
