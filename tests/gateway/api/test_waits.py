"""Held answers (``gateway/api/waits.py``): a claim that finds nothing queued and a list of rollouts still
running wait for the queue to change, are woken at once by this gateway's own changes, look at the store
again on their own (changes made through another gateway), and give up at ``wait_s``.

The bounds below are seconds apart from what they separate (a hold of 10-20 s against an answer expected
well under a second), so a loaded machine does not turn them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.gateway.helpers import make_app, serve
from tracegym.gateway.api.waits import QueueChanges
from tracegym.gateway.traces.store import Store


@pytest.fixture
def gateway(tmp_path: Path):
    store = Store.open(f"sqlite:///{tmp_path / 'tg.db'}")
    with serve(make_app(store)) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield store, http
    store.close()


def _enqueue(http: httpx.Client, n: int = 1, **kw: int) -> list[str]:
    out = http.post("/api/tasks", json={"tasks": [{"input": i} for i in range(n)], **kw})
    assert out.status_code == 201, out.text
    return [rid for t in out.json()["tasks"] for rid in t["rollout_ids"]]


def test_a_held_claim_takes_a_rollout_the_moment_it_is_enqueued(gateway) -> None:
    _, http = gateway
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.post, "/api/rollouts/claim", json={"worker_id": "w", "wait_s": 20})
        time.sleep(0.5)
        assert not held.done()  # nothing queued: the answer waits
        [rid] = _enqueue(http)
        enqueued = time.monotonic()
        answer = held.result(timeout=30)
    assert answer.status_code == 200, answer.text
    assert [r["rollout_id"] for r in answer.json()["rollouts"]] == [rid]
    assert time.monotonic() - enqueued < 10  # woken by the enqueue, not at the end of the hold


def test_a_held_claim_sees_a_rollout_another_gateway_enqueued(gateway) -> None:
    store, http = gateway
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.post, "/api/rollouts/claim", json={"worker_id": "w", "wait_s": 20})
        time.sleep(0.3)
        [t] = store.enqueue_tasks([{"input": 1}], group_size=1)  # the store's own: no route woke the hold
        enqueued = time.monotonic()
        answer = held.result(timeout=30)
    assert [r["rollout_id"] for r in answer.json()["rollouts"]] == t["rollout_ids"]
    assert time.monotonic() - enqueued < 10  # seen at a look RECHECK_S apart, well before the hold ended


def test_a_held_claim_with_nothing_queued_answers_empty_after_its_wait(gateway) -> None:
    _, http = gateway
    t0 = time.monotonic()
    answer = http.post("/api/rollouts/claim", json={"worker_id": "w", "wait_s": 1.0})
    assert answer.json() == {"rollouts": []}
    assert time.monotonic() - t0 >= 1.0
    assert http.post("/api/rollouts/claim", json={"worker_id": "w"}).json() == {"rollouts": []}


def test_a_held_list_answers_when_the_last_rollout_of_the_page_ends(gateway) -> None:
    _, http = gateway
    rids = _enqueue(http, 2, max_attempts=1)
    group_ids = ",".join(sorted({r["group_id"] for r in http.get("/api/rollouts").json()["rollouts"]}))
    claimed = http.post("/api/rollouts/claim", json={"worker_id": "w", "limit": 2}).json()["rollouts"]
    assert sorted(r["rollout_id"] for r in claimed) == sorted(rids)
    params = {"group_ids": group_ids, "wait_s": 20}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.get, "/api/rollouts", params=params)
        assert http.post(f"/api/rollouts/{rids[0]}/complete", json={"reward": 1.0}).status_code == 200
        time.sleep(0.5)
        assert not held.done()  # one of the two still runs
        assert http.post(f"/api/rollouts/{rids[1]}/fail", json={"error": "x"}).status_code == 200
        ended = time.monotonic()
        answer = held.result(timeout=30)
    assert time.monotonic() - ended < 10
    statuses = {r["rollout_id"]: r["status"] for r in answer.json()["rollouts"]}
    assert statuses[rids[0]] == "completed"
    assert statuses[rids[1]] == "failed"


@pytest.mark.parametrize("wait_s", [31, -1, False, "1", float("nan")])
def test_a_hold_out_of_bounds_or_not_a_number_is_refused(gateway, wait_s: object) -> None:
    _, http = gateway
    body = '{"worker_id": "w", "wait_s": %s}' % ("NaN" if wait_s != wait_s else json.dumps(wait_s))
    answer = http.post("/api/rollouts/claim", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "wait_s" in answer.text
    assert http.get("/api/rollouts", params={"wait_s": 31}).status_code == 400


def test_a_bump_from_another_thread_wakes_a_wait_and_an_unchanged_version_times_out() -> None:
    async def main() -> None:
        changes = QueueChanges(asyncio.get_running_loop())
        seen = changes.version
        t0 = time.monotonic()
        await changes.wait(seen, 0.2)  # nothing changed: the whole timeout
        assert time.monotonic() - t0 >= 0.2
        threading.Timer(0.1, changes.bump).start()
        t0 = time.monotonic()
        await changes.wait(seen, 20)
        assert time.monotonic() - t0 < 10 and changes.version == seen + 1
        t0 = time.monotonic()
        await changes.wait(seen, 20)  # already past: at once
        assert time.monotonic() - t0 < 10

    asyncio.run(main())
