"""The embedded engine with a key (``TRACEGYM_ENGINE_API_KEY``): the routes that change it (weights,
pause/continue, flush, abort) need it as a Bearer token; generation, model info and health do not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tracegym.engine.runtime import EngineConfig
from tracegym.engine.server import create_app

KEY = "engine-key-5Tq"


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    config = EngineConfig(model_path=tiny_model_dir, served_model_name="tiny-random", device="cpu")
    with TestClient(create_app(config, api_key=KEY)) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), [
    ("/update_weights_from_disk", {"model_path": "/"}), ("/pause_generation", {}), ("/continue_generation", {}),
    ("/flush_cache", {}), ("/abort_request", {"rid": "x"}),
])
def test_changing_routes_need_the_key(client: TestClient, path: str, body: dict) -> None:
    assert client.post(path, json=body).status_code == 401
    assert client.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code != 401, ok.text  # past the key (a bad model_path is the route's own 400)


def test_reading_and_generating_need_no_key(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/model_info").status_code == 200
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_no_key_set_means_no_key_needed(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEGYM_ENGINE_API_KEY", raising=False)
    config = EngineConfig(model_path=tiny_model_dir, served_model_name="tiny-random", device="cpu")
    assert create_app(config).state.api_key is None
    monkeypatch.setenv("TRACEGYM_ENGINE_API_KEY", "from-env")
    assert create_app(config).state.api_key == "from-env"


def test_a_weights_root_keeps_loads_under_it(client: TestClient, tiny_model_dir: Path, tmp_path: Path) -> None:
    """``TRACEGYM_ENGINE_WEIGHTS_DIR``: weights and adapters outside it are refused, the old weights kept."""
    auth = {"Authorization": f"Bearer {KEY}"}
    client.app.state.weights_root = str(tmp_path)  # what create_app reads from the environment
    before = client.get("/model_info").json()["weight_version"]
    try:
        for path, body in (("/update_weights_from_disk", {"model_path": str(tiny_model_dir)}),
                           ("/update_weights_from_disk", {"model_path": str(tmp_path / ".." / "elsewhere")}),
                           ("/load_lora_adapter", {"lora_name": "a", "lora_path": str(tiny_model_dir)})):
            r = client.post(path, json=body, headers=auth)
            assert r.status_code == 400 and "outside this engine's weights root" in r.text, r.text
        assert client.get("/model_info").json()["weight_version"] == before  # nothing was loaded
    finally:
        client.app.state.weights_root = None
