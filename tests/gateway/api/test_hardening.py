"""Bad input the control and OTLP routes refuse with a clear 4xx before any SQL, and 500s that leak
nothing (issue: safe on a network). Each case once against SQLite and once against PostgreSQL."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.gateway.helpers import make_app
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings
from tracegym.gateway.traces.store import Store


@pytest.fixture
def client(store: Store):
    with TestClient(make_app(store), raise_server_exceptions=False) as c:
        yield c


def _post(client: TestClient, path: str, raw: str) -> object:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def _claimed(client: TestClient) -> str:
    client.post("/api/tasks", json={"tasks": [{"input": 1}]})
    [r] = client.post("/api/rollouts/claim", json={"worker_id": "w"}).json()["rollouts"]
    return r["rollout_id"]


@pytest.mark.parametrize("lease", ["1e308", "1e400", "-1", "0", "604801"])
def test_leases_are_bounded_and_a_bad_one_claims_nothing(client: TestClient, lease: str) -> None:
    client.post("/api/tasks", json={"tasks": [{"input": 1}]})
    r = _post(client, "/api/rollouts/claim", f'{{"worker_id": "w", "lease_seconds": {lease}}}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lease_seconds"
    listed = client.get("/api/rollouts")
    assert listed.status_code == 200 and [x["status"] for x in listed.json()["rollouts"]] == ["queued"]


def test_heartbeat_lease_is_bounded(client: TestClient) -> None:
    rid = _claimed(client)
    r = client.post(f"/api/rollouts/{rid}/heartbeat", json={"worker_id": "w", "lease_seconds": 1e12})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lease_seconds"


@pytest.mark.parametrize("value", ['"1.5"', "true", "null", '"nan"'])
def test_rewards_must_be_real_numbers(client: TestClient, value: str) -> None:
    rid = _claimed(client)
    r = _post(client, f"/api/rollouts/{rid}/rewards", f'{{"value": {value}, "idempotency_key": "k"}}')
    assert r.status_code == 400, r.text
    r = _post(client, f"/api/rollouts/{rid}/complete", f'{{"worker_id": "w", "reward": {value}}}')
    assert r.status_code == 400 if value != "null" else 200, r.text


def test_integer_rewards_are_still_numbers(client: TestClient) -> None:
    rid = _claimed(client)
    r = client.post(f"/api/rollouts/{rid}/rewards", json={"value": 1, "idempotency_key": "k"})
    assert r.status_code == 201, r.text


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("path", "body"), [
    ("/api/tasks", '{"tasks": [{"input": 18446744073709551616}]}'),
    ("/api/tasks", '{"tasks": [{"input": {"a": [1, -9223372036854775809]}}]}'),
    ("/api/tasks", '{"tasks": [{"input": ' + _nested(100) + "}]}"),
    ("/api/tasks", '{"tasks": [{"input": ' + _nested(100_000) + "}]}"),
    ("/api/tasks", '{"tasks": [{"input": 1, "metadata": {"n": 99999999999999999999}}]}'),
    ("/api/runs/r/metrics", '{"step": 1, "metrics": {"loss": 123456789012345678901234567890}}'),
])
def test_big_integers_and_deep_nesting_are_400_without_sql(client: TestClient, path: str, body: str) -> None:
    r = _post(client, path, body)
    assert r.status_code == 400, r.text[:300]
    assert "INSERT" not in r.text and "SELECT" not in r.text


def test_event_values_are_checked(client: TestClient) -> None:
    rid = _claimed(client)
    for value in ("18446744073709551616", _nested(80)):
        r = _post(client, f"/api/rollouts/{rid}/events", f'{{"name": "x", "value": {value}, "idempotency_key": "k"}}')
        assert r.status_code == 400, r.text[:300]
    ok = client.post(f"/api/rollouts/{rid}/events", json={"name": "x", "value": {"a": [1, 2**62]},
                                                         "idempotency_key": "k"})
    assert ok.status_code == 201, ok.text


def test_ids_must_be_clean_path_segments(client: TestClient) -> None:
    for bad in ("a%ffb", "a%00b", "a%0Ab"):
        r = client.post(f"/api/rollouts/{bad}/heartbeat", json={"worker_id": "w"})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "rollout_id"


def test_a_500_names_a_request_id_and_leaks_nothing(client: TestClient, store: Store,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("SELECT * FROM secrets WHERE token = 'sk-very-secret'")

    monkeypatch.setattr(store, "list_weight_versions", broken)
    r = client.get("/api/weight_versions")
    assert r.status_code == 500
    err = r.json()["error"]
    assert "sk-very-secret" not in r.text and "SELECT" not in r.text
    assert err["code"] == "internal_error" and "request id" in err["message"]
    request_id = err["message"].split("request id ")[1].split(")")[0]
    assert any(request_id in rec.getMessage() for rec in caplog.records)


def test_body_and_inflated_size_limits(tmp_path: Path, tiny_model_dir: Path) -> None:
    limit = 64 * 1024
    settings = GatewaySettings(upstream_url="http://127.0.0.1:9", model="tiny-random",
                               store_url=f"sqlite:///{tmp_path / 'db.sqlite'}", max_body_bytes=limit)
    with TestClient(create_app(settings)) as client:
        big = json.dumps({"tasks": [{"input": "x" * (limit + 1)}]})
        r = _post(client, "/api/tasks", big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunks = (big[i:i + 4096].encode() for i in range(0, len(big), 4096))  # no Content-Length
        r = client.post("/api/tasks", content=chunks, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        bomb = zlib.compress(b"\0" * (limit * 64))
        assert len(bomb) < limit
        r = client.post("/v1/traces", content=bomb, headers={"Content-Type": "application/x-protobuf",
                                                             "Content-Encoding": "deflate"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert client.post("/api/tasks", json={"tasks": [{"input": 1}]}).status_code == 201


def test_a_store_out_of_reach_is_a_503_to_retry(client: TestClient, store: Store,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A database that is stopped or restarting (SQLAlchemy's OperationalError) is a 503 in the API's
    shape, naming no SQL: the client retries (tests/e2e/test_store_restart.py restarts a real PostgreSQL)."""
    import sqlalchemy as sa

    def down(*a: object, **k: object) -> None:
        raise sa.exc.OperationalError("SELECT secret FROM t", {"p": "sk-very-secret"},
                                      Exception("the database system is shutting down"))

    monkeypatch.setattr(store, "list_weight_versions", down)
    r = client.get("/api/weight_versions")
    assert r.status_code == 503, r.text
    assert r.json()["error"] == {"message": "the trace store is unavailable (its database did not answer): retry "
                                 "shortly", "type": "server_error", "param": None, "code": "store_unavailable"}
    assert "sk-very-secret" not in r.text and "SELECT" not in r.text
