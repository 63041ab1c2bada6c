"""The trainer's control client against the control API (in process): following a step's groups."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from tests.gateway.helpers import make_app, make_record
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.store import Store
from tracegym.trainer.run import gateway_client
from tracegym.trainer.run.gateway_client import ControlClient


def test_refresh_follows_every_pending_group_in_one_request_per_page(tmp_path, monkeypatch) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'tg.db'}")
    with TestClient(make_app(store)) as http:
        seen: list[dict] = []
        ctl = ControlClient("http://testserver")
        ctl.client._http.close()  # its own client, replaced by the app's
        ctl.client._http = http
        get = ctl.client.get

        def counting_get(path, what, params=None):
            seen.append(dict(params or {}))
            return get(path, what, params)

        ctl.client.get = counting_get  # type: ignore[method-assign]
        monkeypatch.setattr(gateway_client, "MAX_GROUP_IDS", 2)  # 3 plain groups: 2 pages
        ids = ["run-train-0", "run-train-1", "run-train-2", "odd,name"]
        groups = ctl.enqueue([{"input": i} for i in range(4)], group_size=2, split="train", group_ids=ids)
        [claimed] = [store.claim("w", limit=1, lease_seconds=30)]
        rid = claimed[0]["rollout_id"]
        store.complete(rid, worker_id="w", reward=0.5)

        ctl.refresh(groups)
        # pages of 2 plain ids (a page of one asks by group_id), and the id with a comma on its own
        assert [p.get("group_ids") for p in seen] == ["run-train-0,run-train-1", None, None]
        assert [p.get("group_id") for p in seen] == [None, "run-train-2", "odd,name"]
        statuses = {r: s for g in groups for r, s in g.statuses.items()}
        assert statuses[rid] == "completed" and len(statuses) == 8
        assert [g.rewards for g in groups if rid in g.rollout_ids] == [{rid: 0.5}]

        for g in groups[1:]:  # done groups are not asked for again
            for r in g.rollout_ids:
                g.statuses[r] = "completed"
        seen.clear()
        ctl.refresh(groups)
        assert len(seen) == 1 and seen[0].get("group_id") == groups[0].group_id
    store.close()


def test_completed_rollouts_come_with_their_events_in_one_request(tmp_path) -> None:
    """An evaluation's completed rollouts, with the events the agent emitted, in one request per 500 groups
    (it had been one per rollout); rollouts not completed as of the last refresh are left out."""
    store = Store.open(f"sqlite:///{tmp_path / 'tg.db'}")
    with TestClient(make_app(store)) as http:
        ctl = ControlClient("http://testserver")
        ctl.client._http.close()
        ctl.client._http = http
        seen: list[tuple[str, dict]] = []
        get = ctl.client.get

        def counting_get(path, what, params=None):
            seen.append((path, dict(params or {})))
            return get(path, what, params)

        ctl.client.get = counting_get  # type: ignore[method-assign]
        groups = ctl.enqueue([{"input": i} for i in range(3)], group_size=2, split="eval",
                             group_ids=["ev-0", "ev-1", "ev-2"])
        claimed = store.claim("w", limit=6, lease_seconds=30)
        done = [c["rollout_id"] for c in claimed[:4]]
        for i, rid in enumerate(done):
            store.add_event(rid, kind="event", name="tool_calls", value=i, idempotency_key=f"k{i}")
            store.complete(rid, worker_id="w", reward=1.0)
        ctl.refresh(groups)
        seen.clear()
        got = ctl.completed_rollouts(groups)
        assert len(seen) == 1 and seen[0][0] == "/api/rollouts" and seen[0][1]["with_events"] is True
        assert sorted(r["rollout_id"] for r in got) == sorted(done)
        assert {r["rollout_id"]: [e["value"] for e in r["events"]] for r in got} == {
            rid: [i] for i, rid in enumerate(done)}
        # the reward given at completion is the rollout's own column, not a reward event
        assert all(r["reward"] == 1.0 and r["rewards"] == [] for r in got)
    store.close()


def test_tool_parse_counts_of_a_steps_completed_rollouts(tmp_path) -> None:
    """A step's completed rollouts with how their calls' tool calls parsed, in one request; the poll that
    follows the groups' statuses does not ask for them."""
    store = Store.open(f"sqlite:///{tmp_path / 'tg.db'}")
    with TestClient(make_app(store)) as http:
        ctl = ControlClient("http://testserver")
        ctl.client._http.close()
        ctl.client._http = http
        seen: list[dict] = []
        get = ctl.client.get

        def counting_get(path, what, params=None):
            seen.append(dict(params or {}))
            return get(path, what, params)

        ctl.client.get = counting_get  # type: ignore[method-assign]
        groups = ctl.enqueue([{"input": 0}], group_size=3, split="train", group_ids=["tp-0"])
        claimed = [c["rollout_id"] for c in store.claim("w", limit=3, lease_seconds=30)]
        insert_call_records(store, [make_record(i, rollout_id=claimed[i % 2], seed=i, tool_parse=s)
                                    for i, s in enumerate(["ok", "failed: invalid JSON", "none", "ok"])])
        for rid in claimed[:2]:
            store.complete(rid, worker_id="w", reward=1.0)
        ctl.refresh(groups)
        assert seen[-1]["with_tool_parse"] is False
        seen.clear()
        counts = ctl.tool_parse(groups)
        assert len(seen) == 1 and "with_tool_parse" not in seen[0]
        # calls 0 and 2 (ok, none) on the first rollout, 1 and 3 (failed, ok) on the second
        assert sorted(counts, key=lambda c: c["none"]) == [{"ok": 1, "failed": 1, "none": 0},
                                                           {"ok": 1, "failed": 0, "none": 1}]
    store.close()


def test_wait_ends_when_the_groups_end_not_at_the_next_poll(tmp_path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'tg.db'}")
    with TestClient(make_app(store)) as http:
        ctl = ControlClient("http://testserver")
        ctl.client._http.close()
        ctl.client._http = http
        groups = ctl.enqueue([{"input": 1}], group_size=2, split="train")
        claimed = store.claim("w", limit=2, lease_seconds=30)

        def finish() -> None:  # through the store, as another gateway would: seen at the held answer's next look
            for r in claimed:
                store.complete(r["rollout_id"], worker_id="w", reward=1.0)

        threading.Timer(0.5, finish).start()
        t0 = time.monotonic()
        # looks 30 s apart: only an answer held at the gateway sees the groups end within the bound below
        assert ctl.wait(groups, timeout=60, poll=30, hold_s=10) is True
        assert time.monotonic() - t0 < 8
        assert groups[0].rewards == {r["rollout_id"]: 1.0 for r in claimed}
    store.close()
