"""``/openapi.json`` says what the gateway answers (``api/openapi.py``): no FastAPI 422 (validation is a
400), every body-taking route declares 413, the inference routes are listed with their request
bodies, errors point at ``ErrorBody``; and 405s name the allowed methods in ``Allow``. The running
gateway is fuzzed against the schema in ``tests/e2e/test_openapi_fuzz.py``."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.front import INFERENCE_ROUTES
from tracegym.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    db = tmp_path_factory.mktemp("openapi") / "t.db"
    app = create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", store_url=f"sqlite:///{db}"))
    return app.openapi()  # built from the routes; no lifespan needed


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), p, op) for p, item in schema["paths"].items() for m, op in item.items()]


def test_no_operation_declares_422_and_validated_ones_declare_400(schema: dict[str, Any]) -> None:
    ops = _operations(schema)
    assert [(m, p) for m, p, op in ops if "422" in op["responses"]] == []
    with_input = [(m, p) for m, p, op in ops if op.get("parameters") or op.get("requestBody")]
    assert [(m, p) for m, p in with_input if "400" not in schema["paths"][p][m.lower()]["responses"]] == []
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_every_body_route_declares_413_and_errors_are_error_bodies(schema: dict[str, Any]) -> None:
    for method, path, op in _operations(schema):
        if "requestBody" in op:
            assert "413" in op["responses"], (method, path)
        for status, answer in op["responses"].items():
            if status.startswith(("4", "5")) and not path.endswith(("/messages", "/count_tokens")):
                schemas = [c["schema"] for c in answer["content"].values()]
                assert any("ErrorBody" in str(s) for s in schemas), (method, path, status)
    assert schema["components"]["schemas"]["ErrorBody"]["required"] == ["error"]


@pytest.mark.parametrize("path", sorted(INFERENCE_ROUTES))
def test_inference_routes_are_documented_with_their_bodies(schema: dict[str, Any], path: str) -> None:
    for documented in (path, "/rollouts/{rollout_id}" + path):
        op = schema["paths"][documented]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert "model" in body["required"] and body["type"] == "object", documented
        assert body.get("additionalProperties", True) is True  # other fields pass, as OpenAI's do
        assert {"200", "400", "404", "413"} <= set(op["responses"]), documented
        if documented.startswith("/rollouts/"):
            assert [p["name"] for p in op["parameters"]] == ["rollout_id"]


def test_statuses_the_routes_send_are_declared(schema: dict[str, Any]) -> None:
    responses = {(m, p): set(op["responses"]) for m, p, op in _operations(schema)}
    assert {"201", "400", "409"} <= responses[("POST", "/api/tasks")]
    assert {"201", "404"} <= responses[("POST", "/api/rollouts/{rollout_id}/rewards")]
    assert {"400", "404", "409"} <= responses[("POST", "/api/rollouts/{rollout_id}/complete")]
    assert {"400", "413", "415"} <= responses[("POST", "/v1/traces")]
    trajectories = schema["paths"]["/api/trajectories"]["get"]["responses"]
    assert list(trajectories["200"]["content"]) == ["application/x-ndjson"]
    assert list(trajectories["400"]["content"]) == ["application/json"]
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def test_optional_query_parameters_may_be_empty(schema: dict[str, Any]) -> None:
    [limit] = [p for p in schema["paths"]["/api/rollouts"]["get"]["parameters"] if p["name"] == "limit"]
    assert {"const": ""} in limit["schema"]["anyOf"]


def test_a_405_names_every_method_of_the_path(sqlite_url: str) -> None:
    app = create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", store_url=sqlite_url))
    client = TestClient(app)  # no lifespan: the routers only need the store for requests that reach them
    r = client.request("TRACE", "/api/weight_versions")  # a GET and a POST route share the path
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}
    assert r.json()["error"]["type"] == "invalid_request_error"
    # the documented methods of the most literal template: not GET, which /api/rollouts/{rollout_id} takes
    assert client.options("/api/rollouts/claim").headers["allow"] == "POST"
    for path in ("/v1/chat/completions", "/rollouts/r1/v1/messages"):  # inference routes, answered by the front
        r = client.get(path)
        assert r.status_code == 405 and r.headers["allow"] == "POST", path
        assert r.json()["error"]["type"] == "invalid_request_error", path


def test_the_inference_operations_are_fastapi_shaped(schema: dict[str, Any]) -> None:
    """Declared without FastAPI, they still look like its operations: tagged, named, one rollout parameter."""
    ops = [op for item in schema["paths"].values() for op in item.values()]
    assert len({op["operationId"] for op in ops}) == len(ops)
    op = schema["paths"]["/rollouts/{rollout_id}/v1/responses"]["post"]
    assert op["tags"] == ["inference"] and op["operationId"] == "v1_responses_rollout"
    assert op["summary"] == "Responses (calls attributed to the rollout)"


def test_inference_examples_name_the_served_model(tmp_path) -> None:
    """The examples are real calls (schemathesis sends them first): they name the model being served."""
    from types import SimpleNamespace

    app = create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", store_url=f"sqlite:///{tmp_path / 't.db'}"))
    app.state.services = SimpleNamespace(served_model="tiny-random")
    for path in INFERENCE_ROUTES:
        body = app.openapi()["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["example"]["model"] == "tiny-random", path
