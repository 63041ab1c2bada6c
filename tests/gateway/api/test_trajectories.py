"""The trajectory routes over a real store (SQLite and PostgreSQL): one rollout, options, errors, and the
JSON-lines bulk export with filters, ids and pagination."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tracegym.gateway.api.trajectories import router
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.traces.assembly import check_invariants
from tracegym.gateway.traces.call_spans import insert_call_records
from tracegym.gateway.traces.reads import list_call_records
from tracegym.gateway.traces.store import Store
from tracegym.types import CallRecord, ChoiceRecord, Trajectory


def _call(rid: str, i: int, prompt: list[int], out: list[int], agent: str = "solver") -> CallRecord:
    return CallRecord(
        call_id=f"{rid}-c{i}",
        rollout_id=rid,
        operation="chat",
        model="m",
        upstream_kind="sglang",
        request={"messages": [{"role": "user", "content": "hi"}]},
        choices=[
            ChoiceRecord(0, out, [-0.125 * (k + 1) for k in range(len(out))], "stop", {"role": "assistant"})
        ],
        prompt_ids=prompt,
        agent_name=agent,
        weight_version="v1",
        start_time_ns=1_000_000 * (i + 1),
        end_time_ns=1_000_000 * (i + 1) + 500,
    )


def _multi_turn(rid: str, seed: int) -> list[CallRecord]:
    """Three turns: model → tool result → model → user → model; each prompt extends the last reply."""
    calls, prompt = [], [1, 2, seed]
    for i in range(3):
        out = [100 * seed + 10 * i + k for k in range(3)]
        calls.append(_call(rid, i, list(prompt), out))
        prompt = prompt + out + [7, 8 + i]  # tool/user tokens
    return calls


@pytest.fixture
def setup(store_url: str) -> Iterator[tuple[TestClient, Store, dict[str, Any]]]:
    store = Store.open(store_url)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    app.state.store = store
    groups = store.enqueue_tasks(
        [{"task_id": "t1", "input": {"q": 1}}, {"task_id": "t2", "input": {"q": 2}}], group_size=2
    )
    rids = [rid for g in groups for rid in g["rollout_ids"]]
    claimed = {r["rollout_id"] for r in store.claim("w", limit=4)}
    assert claimed == set(rids)
    for n, rid in enumerate(rids):
        insert_call_records(store, _multi_turn(rid, n + 1))
    for n, rid in enumerate(rids[:3]):
        store.complete(rid, worker_id="w", reward=float(n))
    store.add_reward(rids[0], 0.5, idempotency_key="k1", name="tool_ok", call_index=1)
    with TestClient(app) as client:
        yield client, store, {"groups": groups, "rids": rids}
    store.close()


def _lines(resp) -> list[Trajectory]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    return [Trajectory.from_dict(orjson.loads(line)) for line in resp.content.splitlines() if line]


def test_one_rollout_is_one_merged_sequence(setup):
    client, store, d = setup
    rid = d["rids"][0]
    resp = client.get(f"/api/rollouts/{rid}/trajectory")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {"rollout_id", "task_id", "reward", "sequences"} <= body.keys()
    assert (body["rollout_id"], body["task_id"], body["reward"]) == (rid, "t1", 0.0)
    traj = Trajectory.from_dict(body)
    calls = list_call_records(store, rid)
    check_invariants(calls, traj)
    (seq,) = traj.sequences
    assert [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m] == [
        t for c in calls for t in c.choices[0].output_ids
    ]
    assert [lp for lp in seq.logprobs if lp is not None] == [
        lp for c in calls for lp in c.choices[0].output_logprobs
    ]
    assert (
        seq.agent_name == "solver"
        and seq.weight_versions == ["v1"]
        and traj.group_id == d["groups"][0]["group_id"]
    )
    assert seq.step_rewards == [{"value": 0.5, "name": "tool_ok", "call_index": 1}]


def test_options_as_query_parameters(setup):
    client, _, d = setup
    rid = d["rids"][1]
    per_call = client.get(f"/api/rollouts/{rid}/trajectory", params={"mode": "per_call"}).json()
    assert [s["call_ids"] for s in per_call["sequences"]] == [[f"{rid}-c0"], [f"{rid}-c1"], [f"{rid}-c2"]]
    none = client.get(f"/api/rollouts/{rid}/trajectory", params={"agents": "planner,critic"}).json()
    assert none["sequences"] == [] and {e["reason"] for e in none["excluded"]} == {"agent"}
    regex = client.get(f"/api/rollouts/{rid}/trajectory", params={"agent_match": "^sol"}).json()
    assert len(regex["sequences"]) == 1


BAD_OPTIONS = [
    ({"gamma": "x"}, "gamma"),
    ({"gamma": "2"}, "gamma"),
    ({"mode": "tree"}, None),
    ({"include_errors": "maybe"}, "include_errors"),
    ({"agent_match": "(", "agents": "a"}, "agents"),
    ({"agent_match": "("}, None),
    ({"colour": "red"}, "colour"),
]


def test_bad_options_are_400_in_openai_shape(setup):
    client, _, d = setup
    for params, param in BAD_OPTIONS:
        resp = client.get(f"/api/rollouts/{d['rids'][0]}/trajectory", params=params)
        assert resp.status_code == 400, (params, resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param, params


def test_unknown_rollout_is_404(setup):
    client, _, _ = setup
    resp = client.get("/api/rollouts/nope/trajectory")
    assert resp.status_code == 404 and "nope" in resp.json()["error"]["message"]


def test_bulk_streams_completed_trajectories_page_by_page(setup):
    client, store, d = setup
    done = _lines(client.get("/api/trajectories", params={"status": "completed", "page_size": 2}))
    assert sorted(t.rollout_id for t in done) == sorted(d["rids"][:3])
    for t in done:
        check_invariants(list_call_records(store, t.rollout_id), t)
        assert t.status == "completed" and len(t.sequences) == 1
    limited = _lines(
        client.get("/api/trajectories", params={"status": "completed", "limit": 2, "page_size": 1})
    )
    assert [t.rollout_id for t in limited] == [t.rollout_id for t in done[:2]]
    everything = _lines(client.get("/api/trajectories"))
    assert len(everything) == 4


def test_bulk_by_group_and_by_ids(setup):
    client, _, d = setup
    g2 = d["groups"][1]
    by_group = _lines(client.get("/api/trajectories", params={"group_id": g2["group_id"]}))
    assert sorted(t.rollout_id for t in by_group) == sorted(g2["rollout_ids"])
    wanted = [d["rids"][3], d["rids"][0]]
    by_ids = _lines(client.get("/api/trajectories", params={"ids": ",".join(wanted), "page_size": 1}))
    assert [t.rollout_id for t in by_ids] == wanted
    completed_only = _lines(
        client.get("/api/trajectories", params={"ids": ",".join(wanted), "status": "completed"})
    )
    assert [t.rollout_id for t in completed_only] == [d["rids"][0]]
    repeated = _lines(
        client.get("/api/trajectories", params=[("ids", wanted[0]), ("ids", wanted[1]), ("since", "")])
    )
    assert [t.rollout_id for t in repeated] == wanted
    missing = client.get("/api/trajectories", params={"ids": f"{d['rids'][0]},ghost"})
    assert missing.status_code == 404 and "ghost" in missing.json()["error"]["message"]


def test_bulk_bad_filters_are_400(setup):
    client, _, d = setup
    rid = d["rids"][0]
    bad = (
        {"status": "done"},
        {"since": "yesterday"},
        {"limit": "0"},
        {"page_size": "5000"},
        {"cursor": "x"},
        {"ids": rid, "status": "done"},
        {"ids": rid, "since": "2025-01-01T00:00:00Z"},
    )
    for params in bad:
        resp = client.get("/api/trajectories", params=params)
        assert resp.status_code == 400, (params, resp.text)
        assert resp.json()["error"]["message"]


def test_time_filters_take_epoch_seconds_and_bad_numbers_are_400(setup):
    client, _, d = setup
    everything = _lines(client.get("/api/trajectories", params={"since": "1700000000"}))
    assert len(everything) == len(d["rids"])
    assert _lines(client.get("/api/trajectories", params={"until": "1700000000"})) == []
    for params in ({"limit": "²"}, {"page_size": "١٠"}, {"limit": "-1"}):  # str.isdigit() takes these
        resp = client.get("/api/trajectories", params=params)
        assert resp.status_code == 400, (params, resp.text)
    resp = client.get("/api/trajectories", params={"ids": d["rids"][0], "status": "bogus"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "status"
