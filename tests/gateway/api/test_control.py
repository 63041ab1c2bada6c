"""The control API (docs/api.md) over HTTP on SQLite and PostgreSQL: queue routes, rewards and events,
queries, weight versions, run metrics, and OpenAI-shaped errors for bad input."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.gateway.helpers import make_app, make_record
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.store import Store


@pytest.fixture
def client(store_url: str):
    store = Store.open(store_url)
    with TestClient(make_app(store)) as c:
        c.store = store  # type: ignore[attr-defined]
        yield c
    store.close()


def _err(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_queue_routes(client):
    r = client.post("/api/tasks", json={"tasks": [{"task_id": "t1", "input": {"q": 1}}, {"input": "free"}],
                                        "group_size": 2, "max_attempts": 2})
    assert r.status_code == 201
    tasks = r.json()["tasks"]
    assert tasks[0]["task_id"] == "t1" and len(tasks[0]["rollout_ids"]) == 2 and tasks[1]["task_id"]
    claimed = client.post("/api/rollouts/claim", json={"worker_id": "w1", "limit": 3}).json()["rollouts"]
    assert len(claimed) == 3 and all(c["status"] == "running" for c in claimed)
    rid = claimed[0]["rollout_id"]
    hb = client.post(f"/api/rollouts/{rid}/heartbeat", json={"worker_id": "w1", "lease_seconds": 90})
    assert hb.status_code == 200 and hb.json()["lease_expires_at"].endswith("+00:00")
    _err(client.post(f"/api/rollouts/{rid}/heartbeat", json={"worker_id": "w2"}), 409)
    _err(client.post("/api/rollouts/nope/heartbeat", json={"worker_id": "w1"}), 404)
    done = client.post(f"/api/rollouts/{rid}/complete", json={"worker_id": "w1", "reward": 0.5}).json()
    assert done["status"] == "completed" and done["reward"] == 0.5
    failed = client.post(f"/api/rollouts/{claimed[1]['rollout_id']}/fail",
                         json={"worker_id": "w1", "error": "boom", "traceback": "tb"}).json()
    assert failed["status"] == "queued" and failed["attempt"] == 2
    rel = client.post(f"/api/rollouts/{claimed[2]['rollout_id']}/release", json={"worker_id": "w1"}).json()
    assert rel["status"] == "queued" and rel["attempt"] == 1
    _err(client.post(f"/api/rollouts/{rid}/release", json={"worker_id": "w1"}), 409)
    _err(client.post("/api/rollouts/nope/fail", json={"error": "x"}), 404)
    assert _err(client.post("/api/rollouts/nope/complete", json={"reward": 1.0}), 404)["code"] == "not_found"
    _err(client.get("/api/rollouts/nope"), 404)  # refusing the completion did not create it


def test_rewards_events_and_rollout_detail(client):
    r = client.post("/api/rollouts/r1/rewards", json={"value": 1.0, "idempotency_key": "a"})
    assert r.status_code == 201 and r.json()["duplicate"] is False
    again = client.post("/api/rollouts/r1/rewards", json={"value": 1.0, "idempotency_key": "a"}).json()
    assert again == {"event_id": r.json()["event_id"], "duplicate": True}
    e = client.post("/api/rollouts/r1/events", json={"name": "tool_call", "value": {"ok": 1},
                                                     "attributes": {"tool": "calc"}, "idempotency_key": "b"})
    assert e.status_code == 201
    insert_call_records(client.store, [make_record(0, rollout_id="r1")])
    detail = client.get("/api/rollouts/r1").json()
    assert detail["status"] == "adhoc" and detail["reward"] == 1.0
    assert [x["value"] for x in detail["rewards"]] == [1.0] and detail["events"][0]["name"] == "tool_call"
    spans = client.get("/api/rollouts/r1/spans").json()["spans"]
    assert spans[0]["prompt_ids"] == make_record(0).prompt_ids
    assert spans[0]["choices"][0]["output_logprobs"] == make_record(0).choices[0].output_logprobs
    _err(client.get("/api/rollouts/nope"), 404)
    _err(client.get("/api/rollouts/nope/spans"), 404)


def test_list_rollouts_route(client):
    client.post("/api/tasks", json={"tasks": [{"input": i} for i in range(3)], "group_size": 2})
    page = client.get("/api/rollouts", params={"limit": 4}).json()
    assert len(page["rollouts"]) == 4 and page["next_cursor"]
    rest = client.get("/api/rollouts", params={"limit": 4, "cursor": page["next_cursor"]}).json()
    assert len(rest["rollouts"]) == 2 and rest["next_cursor"] is None
    assert client.get("/api/rollouts", params={"status": "queued", "since": "2000-01-01T00:00:00Z"}
                      ).json()["rollouts"]
    assert _err(client.get("/api/rollouts", params={"status": "bogus"}), 400)["message"].startswith("unknown")
    _err(client.get("/api/rollouts", params={"limit": "ten"}), 400)
    _err(client.get("/api/rollouts", params={"cursor": "garbage"}), 400)
    _err(client.get("/api/rollouts", params={"since": "yesterday"}), 400)
    assert _err(client.get("/api/rollouts", params={"colour": "red"}), 400)["param"] == "colour"


def test_list_rollouts_of_several_groups(client):
    """``group_ids``: the rollouts of any of the named groups in one query (the trainer's poll), paginated
    like the rest; an empty list is absent, and more than 500 groups is a 400."""
    made = client.post("/api/tasks", json={"tasks": [{"input": i, "group_id": f"g{i}"} for i in range(4)],
                                           "group_size": 3}).json()["tasks"]
    want = {r for t in made if t["group_id"] in ("g0", "g2") for r in t["rollout_ids"]}
    got = client.get("/api/rollouts", params={"group_ids": "g0,g2,nope", "limit": 100}).json()
    assert {r["rollout_id"] for r in got["rollouts"]} == want and got["next_cursor"] is None
    repeated = client.get("/api/rollouts?group_ids=g0&group_ids=g2&limit=100").json()["rollouts"]
    assert {r["rollout_id"] for r in repeated} == want
    first = client.get("/api/rollouts", params={"group_ids": "g0,g2", "limit": 4}).json()
    rest = client.get("/api/rollouts", params={"group_ids": "g0,g2", "cursor": first["next_cursor"]}).json()
    assert {r["rollout_id"] for r in first["rollouts"] + rest["rollouts"]} == want
    both = client.get("/api/rollouts", params={"group_ids": "g0,g1", "group_id": "g1"}).json()["rollouts"]
    assert {r["group_id"] for r in both} == {"g1"}
    assert len(client.get("/api/rollouts", params={"group_ids": ""}).json()["rollouts"]) == 12
    err = _err(client.get("/api/rollouts", params={"group_ids": ",".join(f"x{i}" for i in range(501))}), 400)
    assert "1 to 500 groups" in err["message"]


def test_list_rollouts_with_their_events(client):
    """``with_events=true``: each listed rollout carries its ``rewards`` and ``events`` exactly as its own
    ``GET /api/rollouts/{id}`` shows them; without it the rows have neither."""
    made = client.post("/api/tasks", json={"tasks": [{"input": i, "group_id": f"e{i}"} for i in range(2)],
                                           "group_size": 2}).json()["tasks"]
    rids = [r for t in made for r in t["rollout_ids"]]
    for rid, route, body in [(rids[0], "events", {"name": "tool_calls", "value": 2}),
                             (rids[0], "rewards", {"value": 0.5}), (rids[3], "events", {"name": "done", "value": True})]:
        r = client.post(f"/api/rollouts/{rid}/{route}", json={**body, "idempotency_key": f"{rid}-{route}"})
        assert r.status_code == 201, r.text
    listed = client.get("/api/rollouts", params={"group_ids": "e0,e1", "with_events": "true"}).json()["rollouts"]
    assert len(listed) == 4
    for row in listed:
        one = client.get(f"/api/rollouts/{row['rollout_id']}").json()
        assert (row["rewards"], row["events"]) == (one["rewards"], one["events"])
    by_id = {r["rollout_id"]: r for r in listed}
    assert [e["name"] for e in by_id[rids[0]]["events"]] == ["tool_calls"] and len(by_id[rids[0]]["rewards"]) == 1
    assert by_id[rids[1]]["events"] == [] and by_id[rids[1]]["rewards"] == []
    plain = client.get("/api/rollouts", params={"group_ids": "e0,e1"}).json()["rollouts"]
    assert all("events" not in r and "rewards" not in r for r in plain)
    _err(client.get("/api/rollouts", params={"with_events": "maybe"}), 400)


def test_rollouts_show_how_their_tool_calls_parsed(client):
    """Each listed rollout (and ``GET /api/rollouts/{id}``) counts its calls by tool-call parse status: ``ok``,
    ``failed`` (every ``failed: <reason>``) and ``none``; calls never parsed (no tools) and OTLP spans are
    not counted; ``with_tool_parse=false`` leaves the counts out."""
    made = client.post("/api/tasks", json={"tasks": [{"input": 0, "group_id": "tp"}], "group_size": 3}).json()
    a, b, c = made["tasks"][0]["rollout_ids"]
    statuses = {a: ["ok", "failed: invalid JSON (Expecting value)", "none", None, "failed: unknown tool 'x'"],
                b: [None]}
    insert_call_records(client.store, [make_record(i, rollout_id=rid, seed=k, tool_parse=status)
                                       for k, (rid, ss) in enumerate(statuses.items()) for i, status in enumerate(ss)])
    client.store.insert_spans([{"trace_id": "f" * 32, "span_id": "e" * 16, "rollout_id": a, "source": "otlp",
                                "name": "tool", "kind": "internal", "start_time_ns": 1, "end_time_ns": 2,
                                "status": "ok", "attributes": {"tracegym.tool_parse": "failed: x"}}])
    listed = {r["rollout_id"]: r["tool_parse"] for r in client.get("/api/rollouts", params={"group_id": "tp"}
                                                                   ).json()["rollouts"]}
    assert listed == {a: {"ok": 1, "failed": 2, "none": 1}, b: {"ok": 0, "failed": 0, "none": 0},
                      c: {"ok": 0, "failed": 0, "none": 0}}
    assert client.get(f"/api/rollouts/{a}").json()["tool_parse"] == listed[a]
    off = client.get("/api/rollouts", params={"group_id": "tp", "with_tool_parse": "false"}).json()["rollouts"]
    assert len(off) == 3 and all("tool_parse" not in r for r in off)


def test_weight_versions_and_run_metrics(client):
    assert client.post("/api/weight_versions", json={"version": "v1", "step": 1, "path": "/w"}).status_code == 201
    assert [v["version"] for v in client.get("/api/weight_versions").json()["weight_versions"]] == ["v1"]
    for step in (1, 2):
        r = client.post("/api/runs/exp1/metrics", json={"step": step, "metrics": {"loss": 1.0 / step}})
        assert r.status_code == 201
    got = client.get("/api/runs/exp1/metrics").json()["metrics"]
    assert [(m["step"], m["metrics"]["loss"]) for m in got] == [(1, 1.0), (2, 0.5)]
    assert client.get("/api/runs/other/metrics").json()["metrics"] == []


@pytest.mark.parametrize("path,body", [
    ("/api/tasks", {"tasks": []}),
    ("/api/tasks", {"tasks": [{"input": 1}], "group_size": 0}),
    ("/api/tasks", {"tasks": [{"nope": 1}]}),
    ("/api/rollouts/claim", {"limit": 1}),
    ("/api/rollouts/claim", {"worker_id": "w", "lease_seconds": -1}),
    ("/api/rollouts/x/rewards", {"value": "high", "idempotency_key": "k"}),
    ("/api/rollouts/x/rewards", {"value": 1.0}),
    ("/api/rollouts/x/events", {"idempotency_key": "k"}),
    ("/api/runs/r/metrics", {"step": "one", "metrics": {}}),
    ("/api/weight_versions", {"path": "/x"}),
    # integers are JSON integers: pydantic alone took false for 0 and "5" for 5 (the fuzzer's finding)
    ("/api/tasks", {"tasks": [{"input": 1}], "group_size": True}),
    ("/api/rollouts/claim", {"worker_id": "w", "limit": "2"}),
    ("/api/rollouts/x/rewards", {"value": 1.0, "idempotency_key": "k", "call_index": False}),
    ("/api/runs/r/metrics", {"step": False, "metrics": {}}),
    ("/api/weight_versions", {"version": "v", "step": "5"}),
])
def test_bad_bodies_are_400_in_openai_shape(client, path, body):
    assert _err(client.post(path, json=body), 400)["type"] == "invalid_request_error"


def test_a_finished_rollout_already_has_all_its_spans(store_url: str) -> None:
    """The recorder writes spans ~0.1 s late; completing (or failing) a rollout flushes first, so a reader
    that sees it finished — the trainer fetching its trajectory — sees every call."""
    from tracegym.gateway.traces.recorder import TraceRecorder

    store = Store.open(store_url)
    recorder = TraceRecorder(store, schedule_delay_s=30.0)  # nothing is written unless flushed
    app = make_app(store)
    app.state.recorder = recorder
    try:
        with TestClient(app) as c:
            for rid, route, body in (("ro-done", "complete", {"reward": 1.0}), ("ro-bad", "fail", {"error": "x"})):
                recorder.record(make_record(0, rollout_id=rid))
                assert c.post(f"/api/rollouts/{rid}/{route}", json=body).status_code == 200
                assert len(list_spans(store, rid)) == 1
    finally:
        recorder.shutdown()
        store.close()


@pytest.mark.parametrize("path,body", [
    ("/api/tasks", {"tasks": [{"task_id": "t" * 201, "input": 1}]}),
    ("/api/tasks", {"tasks": [{"input": 1, "split": "s" * 101}]}),
    ("/api/rollouts/claim", {"worker_id": "w" * 201}),
    ("/api/rollouts/r1/heartbeat", {"worker_id": "w" * 201}),
    ("/api/rollouts/r1/complete", {"worker_id": "w" * 201}),
    ("/api/rollouts/r1/fail", {"worker_id": "w" * 201, "error": "x"}),
    ("/api/rollouts/r1/release", {"worker_id": "w" * 201}),
    ("/api/rollouts/r1/rewards", {"value": 1.0, "idempotency_key": "k", "name": "n" * 201}),
    ("/api/rollouts/r1/rewards", {"value": 1.0, "idempotency_key": "k", "call_index": 2**31}),
    ("/api/rollouts/r1/events", {"name": "n" * 201, "idempotency_key": "k"}),
    ("/api/rollouts/r1/events", {"name": "e\u0000", "idempotency_key": "k"}),
    (f"/api/rollouts/{'r' * 201}/complete", {}),
    (f"/api/rollouts/{'r' * 201}/rewards", {"value": 1.0, "idempotency_key": "k"}),
    ("/api/weight_versions", {"version": "v" * 201}),
    ("/api/weight_versions", {"version": "v", "step": 2**31}),
    ("/api/runs/r/metrics", {"step": 2**40, "metrics": {}}),
    (f"/api/runs/{'r' * 201}/metrics", {"step": 1, "metrics": {}}),
])
def test_values_the_store_cannot_keep_are_400(client, path, body):
    """PostgreSQL refuses strings longer than their VARCHAR column (and NULs, and INTEGER overflow) with a
    DataError (a 500 before); the routes check the column limits first, on both backends."""
    assert _err(client.post(path, json=body), 400)["type"] == "invalid_request_error"
    assert client.store.list_rollouts()[0] == []


def test_rollout_queries_take_epoch_seconds_and_ignore_empty_values(client):
    client.post("/api/tasks", json={"tasks": [{"input": 1}], "group_size": 2})
    page = client.get("/api/rollouts", params={"since": "1700000000", "status": "", "cursor": ""})
    assert page.status_code == 200, page.text
    assert len(page.json()["rollouts"]) == 2
    assert client.get("/api/rollouts", params={"until": "1700000000"}).json()["rollouts"] == []
    _err(client.get("/api/rollouts", params={"since": "nan"}), 400)
    _err(client.get("/api/rollouts", params={"limit": "0"}), 400)
