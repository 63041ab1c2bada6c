"""What the training loop asks of the gateway, over HTTP only (docs/api.md): enqueue groups, wait for
them, fetch their trajectories, record weight versions and per-step metrics."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tracegym.types import Trajectory

TERMINAL = {"completed", "failed"}


@dataclass
class Group:
    group_id: str
    task_id: str
    rollout_ids: list[str]
    split: str = "train"
    statuses: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.statuses) == len(self.rollout_ids) and all(
            s in TERMINAL for s in self.statuses.values()
        )


class ControlClient:
    def __init__(self, gateway_url: str, *, timeout: float = 60.0) -> None:
        self.base = gateway_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            raise RuntimeError(
                f"gateway {r.request.method} {r.request.url.path} -> {r.status_code}: {r.text[:500]}"
            )
        return r.json() if r.content else None

    def enqueue(self, tasks: list[dict[str, Any]], *, group_size: int, split: str) -> list[Group]:
        body = {"tasks": [{**t, "split": split} for t in tasks], "group_size": group_size}
        out = self._check(self.http.post("/api/tasks", json=body))
        return [Group(g["group_id"], g["task_id"], list(g["rollout_ids"]), split) for g in out["tasks"]]

    def refresh(self, groups: list[Group]) -> None:
        for g in groups:
            if g.done:
                continue
            rows, cursor = [], None
            while True:
                params: dict[str, Any] = {"group_id": g.group_id, "limit": 500}
                if cursor:
                    params["cursor"] = cursor
                page = self._check(self.http.get("/api/rollouts", params=params))
                rows += page["rollouts"]
                cursor = page.get("next_cursor")
                if not cursor:
                    break
            g.statuses = {r["rollout_id"]: r["status"] for r in rows}

    def wait(self, groups: list[Group], *, timeout: float, poll: float = 0.25, on_poll=None) -> bool:
        """Wait until every group is done or ``timeout`` passes; True if all finished."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh(groups)
            if on_poll:
                on_poll(groups)
            if all(g.done for g in groups):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll)

    def trajectories(self, rollout_ids: list[str]) -> list[Trajectory]:
        out: list[Trajectory] = []
        for i in range(0, len(rollout_ids), 200):
            chunk = rollout_ids[i : i + 200]
            r = self.http.get("/api/trajectories", params={"ids": ",".join(chunk), "status": "completed"})
            if r.status_code >= 400:
                self._check(r)
            out += [Trajectory.from_dict(json.loads(line)) for line in r.text.splitlines() if line.strip()]
        return out

    def rollout_rewards(self, groups: list[Group]) -> dict[str, float | None]:
        """Rewards of completed rollouts (None where no reward was given)."""
        out: dict[str, float | None] = {}
        for g in groups:
            page = self._check(self.http.get("/api/rollouts", params={"group_id": g.group_id, "limit": 500}))
            for r in page["rollouts"]:
                if r["status"] == "completed":
                    out[r["rollout_id"]] = r.get("reward")
        return out

    def add_weight_version(self, version: str, **info: Any) -> None:
        self._check(self.http.post("/api/weight_versions", json={"version": version, **info}))

    def add_metrics(self, run: str, step: int, metrics: dict[str, float]) -> None:
        self._check(self.http.post(f"/api/runs/{run}/metrics", json={"step": step, "metrics": metrics}))
