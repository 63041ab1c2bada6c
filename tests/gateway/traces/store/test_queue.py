"""The rollout queue on SQLite and PostgreSQL: lifecycle, lease expiry and attempts, and many concurrent
claimers (threads and processes) never getting the same rollout."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.store import Conflict, NotFound, Store


def test_claim_complete_lifecycle(store: Store):
    [t] = store.enqueue_tasks([{"task_id": "t1", "input": {"q": "2+2"}}], group_size=2)
    first = store.claim("w1", limit=1, lease_seconds=30)
    assert len(first) == 1 and first[0]["status"] == "running" and first[0]["worker_id"] == "w1"
    assert first[0]["input"] == {"q": "2+2"} and first[0]["group_id"] == t["group_id"]
    assert first[0]["lease_expires_at"] is not None and first[0]["started_at"] is not None
    second = store.claim("w2", limit=5)
    assert [r["rollout_id"] for r in second] != [first[0]["rollout_id"]] and len(second) == 1
    assert store.claim("w3") == []
    rid = first[0]["rollout_id"]
    before = store.get_rollout(rid)["lease_expires_at"]
    store.heartbeat(rid, "w1", lease_seconds=120)
    assert store.get_rollout(rid)["lease_expires_at"] > before
    with pytest.raises(Conflict):
        store.heartbeat(rid, "w2")
    with pytest.raises(NotFound):
        store.heartbeat("nope", "w1")
    with pytest.raises(Conflict):
        store.complete(rid, worker_id="w2", reward=1.0)
    done = store.complete(rid, worker_id="w1", reward=1.0)
    assert done["status"] == "completed" and done["reward"] == 1.0 and done["finished_at"] is not None
    assert store.complete(rid, worker_id="w1", reward=1.0)["status"] == "completed"  # idempotent
    with pytest.raises(Conflict):
        store.fail(rid, error="late")
    with pytest.raises(Conflict):
        store.heartbeat(rid, "w1")


def test_fail_requeues_until_max_attempts(store: Store):
    store.enqueue_tasks([{"input": 1}], max_attempts=2)
    [r] = store.claim("w1")
    again = store.fail(r["rollout_id"], error="boom", worker_id="w1", traceback="Traceback ...")
    assert again["status"] == "queued" and again["attempt"] == 2 and again["error"] == "boom"
    [r2] = store.claim("w2")
    assert r2["rollout_id"] == r["rollout_id"] and r2["attempt"] == 2
    final = store.fail(r["rollout_id"], error="boom again", worker_id="w2")
    assert final["status"] == "failed" and final["attempt"] == 2 and final["finished_at"] is not None
    assert store.claim("w3") == []
    with pytest.raises(NotFound):
        store.fail("nope", error="x")


def test_release_keeps_the_attempt(store: Store):
    store.enqueue_tasks([{"input": 1}])
    [r] = store.claim("w1")
    with pytest.raises(Conflict):
        store.release(r["rollout_id"], worker_id="w2")
    back = store.release(r["rollout_id"], worker_id="w1")
    assert back["status"] == "queued" and back["attempt"] == 1 and back["lease_expires_at"] is None
    assert store.claim("w2")[0]["rollout_id"] == r["rollout_id"]


def test_expired_leases_are_requeued_then_failed(store: Store):
    store.enqueue_tasks([{"input": 1}], max_attempts=2)
    [r] = store.claim("w1", lease_seconds=0.05)
    time.sleep(0.1)
    [again] = store.claim("w2", lease_seconds=0.05)  # the claim requeues the expired lease first
    assert again["rollout_id"] == r["rollout_id"] and again["attempt"] == 2 and again["worker_id"] == "w2"
    with pytest.raises(Conflict):
        store.heartbeat(r["rollout_id"], "w1")  # w1 lost it
    time.sleep(0.1)
    assert store.claim("w3") == []
    final = store.get_rollout(r["rollout_id"])
    assert final["status"] == "failed" and "lease expired" in final["error"]


def test_complete_of_an_unknown_rollout_is_not_found_and_adhoc_ones_complete(store: Store):
    with pytest.raises(NotFound):
        store.complete("never-seen", reward=0.5)
    assert store.get_rollout("never-seen") is None  # refusing it did not create it
    store.add_event("sdk-adhoc-1", kind="event", name="start", idempotency_key="k")  # the SDK's ad-hoc rollout
    out = store.complete("sdk-adhoc-1", reward=0.5)
    assert out["status"] == "completed" and out["reward"] == 0.5
    adhoc = store.fail("adhoc-2", error="x") if store.get_rollout("adhoc-2") else None
    assert adhoc is None
    store.ensure_rollout("adhoc-3")
    assert store.fail("adhoc-3", error="agent crashed")["status"] == "failed"  # ad-hoc: one attempt


def test_bad_queue_input(store: Store):
    for kwargs in ({"group_size": 0}, {"max_attempts": 0}):
        with pytest.raises(ValueError):
            store.enqueue_tasks([{"input": 1}], **kwargs)
    with pytest.raises(ValueError, match="input"):
        store.enqueue_tasks([{"task_id": "x"}])
    with pytest.raises(ValueError):
        store.claim("", limit=1)
    with pytest.raises(ValueError):
        store.claim("w", lease_seconds=0)


def _claim_all(url: str, worker: str, out: list | None = None) -> list[str]:
    s = Store.open(url, upgrade=False)
    got: list[str] = []
    try:
        while batch := s.claim(worker, limit=3, lease_seconds=300):
            got += [r["rollout_id"] for r in batch]
    finally:
        s.close()
    if out is not None:
        out.append(got)
    return got


N_ROLLOUTS = 240


def test_concurrent_thread_claimers_never_share(store: Store, store_url: str):
    store.enqueue_tasks([{"input": i} for i in range(N_ROLLOUTS // 4)], group_size=4)
    results: list[list[str]] = []
    threads = [threading.Thread(target=_claim_all, args=(store_url, f"t{i}", results)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    claimed = [rid for got in results for rid in got]
    assert len(results) == 8
    assert len(claimed) == N_ROLLOUTS and len(set(claimed)) == N_ROLLOUTS
    assert sum(1 for got in results if got) >= 2  # the claimers really interleaved


def test_concurrent_process_claimers_never_share(store: Store, store_url: str):
    store.enqueue_tasks([{"input": i} for i in range(N_ROLLOUTS // 4)], group_size=4)
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_claim_all, [(store_url, f"p{i}") for i in range(4)])
    claimed = [rid for got in results for rid in got]
    assert len(claimed) == N_ROLLOUTS and len(set(claimed)) == N_ROLLOUTS
    running = store.list_rollouts(status="running", limit=1000)[0]
    assert len(running) == N_ROLLOUTS
    owner = {rid: f"p{i}" for i, got in enumerate(results) for rid in got}
    assert all(owner[r["rollout_id"]] == r["worker_id"] for r in running)


def test_claim_takes_exactly_limit_oldest_first(store: Store):
    first = store.enqueue_tasks([{"input": i} for i in range(4)], group_size=3)
    store.enqueue_tasks([{"input": "late"}], group_size=3)
    got = store.claim("w", limit=5)
    assert len(got) == 5
    early = {rid for t in first for rid in t["rollout_ids"]}
    assert {r["rollout_id"] for r in got} <= early
    assert len(store.list_rollouts(status="queued", limit=100)[0]) == 10


def test_concurrent_writers_of_one_new_rollout_do_not_conflict(store: Store):
    """add_event (a reward and an event) and insert_spans all create an unknown rollout; run together on
    the same new id (PostgreSQL: separate transactions) none of them may fail on the primary key."""
    from tests.gateway.helpers import make_record

    errors: list[BaseException] = []
    for n in range(8):
        rid = f"ro-race-{n}"
        barrier = threading.Barrier(3)

        def run(fn, rid=rid, barrier=barrier) -> None:
            try:
                barrier.wait(10)
                fn(rid)
            except BaseException as e:  # collected, asserted below
                errors.append(e)

        writers = [
            lambda rid: store.add_event(rid, kind="reward", value=1.0, idempotency_key="r"),
            lambda rid: store.add_event(rid, kind="event", name="e", idempotency_key="k"),
            lambda rid: insert_call_records(store, [make_record(0, rollout_id=rid)]),
        ]
        threads = [threading.Thread(target=run, args=(w,)) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.complete(rid, worker_id="w", reward=1.0)
        row = store.get_rollout(rid)
        assert row["status"] == "completed" and row["worker_id"] == "w" and row["reward"] == 1.0
    assert errors == []


def test_enqueue_with_a_group_id_is_idempotent(store: Store):
    first = store.enqueue_tasks([{"task_id": "t1", "input": 1, "group_id": "run-a-0"}, {"input": 2}], group_size=3)
    assert first[0]["group_id"] == "run-a-0" and len(first[0]["rollout_ids"]) == 3
    again = store.enqueue_tasks([{"input": 1, "group_id": "run-a-0"}, {"task_id": "t3", "input": 3,
                                                                      "group_id": "run-a-1"}], group_size=3)
    assert again[0] == first[0]  # the existing group, its task and rollouts: nothing enqueued twice
    assert again[1]["group_id"] == "run-a-1" and len(again[1]["rollout_ids"]) == 3
    assert len(store.list_rollouts(group_id="run-a-0", limit=100)[0]) == 3
    assert len(store.list_rollouts(status="queued", limit=100)[0]) == 9
    with pytest.raises(ValueError, match="more than one task"):
        store.enqueue_tasks([{"input": 1, "group_id": "g"}, {"input": 2, "group_id": "g"}])
