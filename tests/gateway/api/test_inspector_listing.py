"""``GET /api/inspect/rollouts`` and ``GET /api/runs`` over a real store (SQLite and PostgreSQL): every
filter, keyset paging, text search under its time budget, and the flagged-rollout index."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.gateway.api.inspector_data import Scenario, inspector_app, make_scenario
from tracegym.gateway.api.ui import listing
from tracegym.gateway.api.ui.flags import FlaggedRollouts
from tracegym.gateway.traces.call_spans import insert_call_records


@pytest.fixture
def scene(store_url: str) -> Iterator[tuple[TestClient, Scenario]]:
    s = make_scenario(store_url)
    with TestClient(inspector_app(s.store)) as client:
        yield client, s
    s.store.close()


def _ids(client: TestClient, **params: object) -> list[str]:
    resp = client.get("/api/inspect/rollouts", params=params)
    assert resp.status_code == 200, resp.text
    return [r["rollout_id"] for r in resp.json()["rollouts"]]


def test_runs_list_their_steps_and_latest_metrics(scene) -> None:
    client, _ = scene
    runs = client.get("/api/runs").json()["runs"]
    assert [r["run"] for r in runs] == ["run-b", "run-a"]  # most recently updated first
    b = runs[0]
    assert (b["steps"], b["first_step"], b["last_step"]) == (2, 1, 2)
    assert b["latest"] == {"train/reward_mean": 0.9, "eval/reward_mean": 0.8}


def test_each_filter_selects_the_matching_rollouts(scene) -> None:
    client, s = scene
    everything = _ids(client)
    assert sorted(everything) == sorted([s.clean, s.forked, s.realigned, s.failed])
    assert _ids(client, status="failed") == [s.failed]
    assert sorted(_ids(client, task_id="t-one")) == sorted([s.clean, s.forked])
    assert sorted(_ids(client, group_id=s.groups[1]["group_id"])) == sorted([s.realigned, s.failed])
    assert _ids(client, weight_version="v2") == [s.realigned]
    assert sorted(_ids(client, reward_min=0.5)) == sorted([s.clean, s.realigned])
    assert _ids(client, reward_min=0.5, reward_max=0.5) == []
    assert sorted(_ids(client, reward_max=0.0)) == [s.forked]
    # errors: a call that ended in error, or a rollout that failed
    assert sorted(_ids(client, has_errors="true")) == sorted([s.forked, s.failed])
    assert sorted(_ids(client, has_errors="false")) == sorted([s.clean, s.realigned])
    # drift: a forked or realigned call
    assert sorted(_ids(client, has_drift="true")) == sorted([s.forked, s.realigned])
    assert sorted(_ids(client, has_drift="false", has_errors="false")) == [s.clean]


def test_flagged_filters_work_the_same_without_the_sql_id_list(scene, monkeypatch) -> None:
    client, s = scene
    monkeypatch.setattr(listing, "FLAGGED_IN_SQL", 0)  # every flagged set is tested row by row
    assert sorted(_ids(client, has_errors="true")) == sorted([s.forked, s.failed])
    assert sorted(_ids(client, has_drift="true")) == sorted([s.forked, s.realigned])


def test_run_filter_takes_the_rollouts_created_in_the_runs_window(scene) -> None:
    client, s = scene
    assert sorted(_ids(client, run="run-a")) == sorted([s.clean, s.forked])
    assert sorted(_ids(client, run="run-b")) == sorted([s.realigned, s.failed])
    resp = client.get("/api/inspect/rollouts", params={"run": "nope"})
    assert resp.status_code == 400 and "run-a" in resp.json()["error"]["message"]


def test_search_matches_ids_and_call_text(scene) -> None:
    client, s = scene
    assert _ids(client, q=s.forked[-10:]) == [s.forked]  # a piece of a rollout id
    assert sorted(_ids(client, q="t-two")) == sorted([s.realigned, s.failed])  # a task id
    assert _ids(client, q=f"{s.realigned}-c1") == [s.realigned]  # an exact call id
    assert _ids(client, q="anything ELSE") == [s.clean]  # a user message, any case
    assert _ids(client, q="upstream reset") == [s.forked]  # an error in the attributes
    assert _ids(client, q='"name": "add", broken') == [s.clean]  # quotes as the agent wrote them
    assert _ids(client, q="100%_sure") == []  # LIKE wildcards are literal


def test_an_id_in_many_rollouts_is_still_an_exact_id_search(scene, monkeypatch) -> None:
    client, s = scene
    monkeypatch.setattr(listing, "FLAGGED_IN_SQL", 1)  # too many ids for SQL: a test on each row
    assert sorted(_ids(client, q="T-")) == sorted([s.clean, s.forked, s.realigned, s.failed])  # task ids
    assert sorted(_ids(client, q="t-one", status="completed")) == sorted([s.clean, s.forked])


def test_pages_chain_by_cursor_without_gaps_or_repeats(scene) -> None:
    client, _ = scene
    seen, cursor = [], None
    for _ in range(5):
        body = client.get("/api/inspect/rollouts", params={"limit": 1, "cursor": cursor}).json()
        seen += [r["rollout_id"] for r in body["rollouts"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == _ids(client) and len(seen) == 4  # same order as one page; no dangling last cursor


def test_text_search_answers_partial_when_its_budget_runs_out(scene, monkeypatch) -> None:
    client, s = scene
    monkeypatch.setattr(listing, "SEARCH_BUDGET_S", 0.0)
    monkeypatch.setattr(listing, "CHUNK", 1)
    found, cursor, partials = [], None, 0
    for _ in range(10):
        body = client.get("/api/inspect/rollouts", params={"q": "anything else", "cursor": cursor}).json()
        found += [r["rollout_id"] for r in body["rollouts"]]
        partials += body["partial"]
        assert body["scanned"] >= 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert found == [s.clean] and partials >= 1


def test_listed_rows_carry_call_summaries(scene) -> None:
    client, s = scene
    rows = {r["rollout_id"]: r for r in client.get("/api/inspect/rollouts").json()["rollouts"]}
    assert (rows[s.clean]["calls"], rows[s.clean]["call_errors"], rows[s.clean]["drifted_calls"]) == (3, 0, 0)
    assert (rows[s.forked]["calls"], rows[s.forked]["call_errors"], rows[s.forked]["drifted_calls"]) == (3, 1, 1)
    assert rows[s.failed]["error"] == "ValueError: bad tool" and rows[s.failed]["status"] == "failed"
    assert rows[s.clean]["calls_seconds"] == pytest.approx(2.25)


def test_bad_parameters_are_400(scene) -> None:
    client, _ = scene
    for params in ({"status": "done"}, {"cursor": "zz"}, {"limit": 0}, {"has_errors": "maybe"}, {"colour": "x"}):
        resp = client.get("/api/inspect/rollouts", params=params)
        assert resp.status_code == 400, (params, resp.text)


def test_flags_read_only_the_spans_stored_since_the_last_refresh(scene) -> None:
    from tests.gateway.api.inspector_data import call

    _, s = scene
    flags = FlaggedRollouts(min_interval_s=0.0)
    flags.refresh(s.store)
    assert flags.errors() == {s.forked} and flags.drifted() == {s.forked, s.realigned}
    insert_call_records(s.store, [call(s.clean, 9, [1], [2], [], None, drift="forked")])
    flags.refresh(s.store)
    assert flags.drifted() == {s.forked, s.realigned, s.clean}
    throttled = FlaggedRollouts(min_interval_s=3600)
    throttled.refresh(s.store)
    insert_call_records(s.store, [call(s.failed, 9, [1], [2], [], None, status="error")])
    throttled.refresh(s.store)  # within its interval: not read again
    assert s.failed not in throttled.errors()


def test_opening_the_inspector_reads_the_flags_in_the_background(scene) -> None:
    import time

    client, s = scene
    flags = client.app.state.inspector.flags
    assert flags.errors() == frozenset()
    assert client.get("/ui/rollouts").status_code == 200
    deadline = time.monotonic() + 10
    while flags.errors() != {s.forked} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert flags.errors() == {s.forked} and flags.drifted() == {s.forked, s.realigned}
