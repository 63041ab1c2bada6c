"""What the training loop asks of the gateway, over HTTP only (docs/api.md): enqueue groups, follow
them until they finish, fetch their trajectories, record per-step metrics. Built on the SDK's
``GatewayClient`` (retries with backoff, OpenAI-shaped errors surfaced)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from tracegym.client import GatewayClient, GatewayError, config_for, refused_field
from tracegym.types import Trajectory

TERMINAL = {"completed", "failed"}


@dataclass
class Group:
    group_id: str
    task_id: str
    rollout_ids: list[str]
    split: str = "train"
    statuses: dict[str, str] = field(default_factory=dict)
    rewards: dict[str, float | None] = field(default_factory=dict)
    """Rewards of the completed rollouts, as of the last ``refresh``."""

    @property
    def done(self) -> bool:
        return len(self.statuses) == len(self.rollout_ids) and all(s in TERMINAL for s in self.statuses.values())


MAX_GROUP_IDS = 500
"""Groups per ``GET /api/rollouts?group_ids=`` (the gateway's limit)."""


class ControlClient:
    def __init__(self, gateway_url: str, *, timeout: float = 60.0, api_key: str | None = None) -> None:
        # the current configuration ($TRACEGYM_API_KEY, tg.configure's retries) with this gateway
        base = config_for(gateway_url)
        self.client = GatewayClient(replace(base, timeout=timeout, api_key=api_key or base.api_key))

    def close(self) -> None:
        self.client.close()

    def enqueue(self, tasks: list[dict[str, Any]], *, group_size: int, split: str,
                group_ids: list[str] | None = None) -> list[Group]:
        """Queue a group per task. With ``group_ids``, a group that already exists is not queued again: its
        rollouts are followed (a resumed run picks up the groups it had queued, completed rollouts and all)."""
        sent = [{**t, "split": split} for t in tasks]
        if group_ids is not None:
            sent = [{**t, "group_id": g} for t, g in zip(sent, group_ids, strict=True)]
        out = self.client.enqueue_tasks(sent, group_size=group_size)
        return [Group(g["group_id"], g["task_id"], list(g["rollout_ids"]), split) for g in out]

    def _rollouts_by_group(self, group_ids: list[str], **filters: Any) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """``(group_id, its rollouts)`` for each of ``group_ids``, in one request per 500 groups (a group id
        with a comma in it is asked for alone: the list parameter is comma-separated)."""
        ids = [gid for gid in group_ids if "," not in gid]
        pages = [ids[i : i + MAX_GROUP_IDS] for i in range(0, len(ids), MAX_GROUP_IDS)]
        for page in [*pages, *([gid] for gid in group_ids if "," in gid)]:
            rows: dict[str, list[dict[str, Any]]] = {gid: [] for gid in page}
            query = {"group_ids": ",".join(page)} if len(page) > 1 else {"group_id": page[0]}
            for r in self.client.iter_rollouts(**query, **filters, limit=10_000):
                rows[r["group_id"]].append(r)
            yield from rows.items()

    def refresh(self, groups: list[Group], *, wait_s: float = 0.0) -> None:
        """The statuses and rewards of the groups not done yet, in one request per 500 groups: the trainer
        follows them while its engine generates, and each request costs the gateway and this process CPU that
        the engine's threads would otherwise have. With ``wait_s``, the gateway holds each answer up to that
        long until none of its rollouts is queued or running."""
        pending = {g.group_id: g for g in groups if not g.done}
        held = {"wait_s": wait_s} if wait_s else {}
        for gid, rs in self._rollouts_by_group(list(pending), with_tool_parse=False, **held):
            g = pending[gid]
            g.statuses = {r["rollout_id"]: r["status"] for r in rs}
            g.rewards = {r["rollout_id"]: r.get("reward") for r in rs if r["status"] == "completed"}

    def wait(
        self, groups: list[Group], *, timeout: float, poll: float = 0.25, hold_s: float = 1.0,
        on_poll: Callable[[list[Group]], None] | None = None,
    ) -> bool:  # fmt: skip
        """Wait until every group is done or ``timeout`` passes; True if all finished. Each look is held at
        the gateway up to ``hold_s`` until the groups' rollouts have ended, so the wait ends when they do
        (``on_poll`` runs after each look); looks that come back sooner are ``poll`` apart."""
        deadline = time.monotonic() + timeout
        while True:
            t0 = time.monotonic()
            try:
                self.refresh(groups, wait_s=min(hold_s, max(0.0, deadline - t0)))
            except GatewayError as e:
                if not (hold_s and refused_field(e, "wait_s")):
                    raise
                hold_s = 0.0  # a gateway older than held answers: poll
                continue
            if on_poll:
                on_poll(groups)
            if all(g.done for g in groups):
                return True
            now = time.monotonic()
            if now > deadline:
                return False
            time.sleep(max(0.0, poll - (now - t0)))

    def completed_rollouts(self, groups: list[Group]) -> list[dict[str, Any]]:
        """The completed rollouts of ``groups`` as ``GET /api/rollouts/{id}`` shows them (with their rewards
        and events), in one request per 500 groups."""
        done = {r for g in groups for r in g.rollout_ids if g.statuses.get(r) == "completed"}  # as of refresh
        pages = self._rollouts_by_group([g.group_id for g in groups], status="completed", with_events=True)
        return [r for _, rs in pages for r in rs if r["rollout_id"] in done]

    def tool_parse(self, groups: list[Group]) -> list[dict[str, int]]:
        """How the tool calls of the completed rollouts of ``groups`` parsed: each rollout's ``tool_parse``
        counts (``{"ok", "failed", "none"}``, docs/api.md), in one request per 500 groups."""
        done = {r for g in groups for r in g.rollout_ids if g.statuses.get(r) == "completed"}  # as of refresh
        pages = self._rollouts_by_group([g.group_id for g in groups], status="completed")
        return [r["tool_parse"] for _, rs in pages for r in rs if r["rollout_id"] in done and "tool_parse" in r]

    def trajectories(self, rollout_ids: list[str]) -> list[Trajectory]:
        out: list[Trajectory] = []
        for i in range(0, len(rollout_ids), 200):
            params = {"ids": ",".join(rollout_ids[i : i + 200]), "status": "completed"}
            lines = self.client.iter_lines("/api/trajectories", "fetch trajectories", params)
            out += [Trajectory.from_dict(json.loads(line)) for line in lines]
        return out

    def add_metrics(self, run: str, step: int, metrics: dict[str, float]) -> None:
        self.client.post(f"/api/runs/{run}/metrics", {"step": step, "metrics": metrics}, "store step metrics")
