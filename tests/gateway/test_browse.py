"""Browsing a finished run's store without an upstream: ``tracegym inspect RUN_DIR`` and ``tracegym serve
--store URL`` alone serve the trace inspector read-only (its pages and JSON routes, and the control and
trajectory API's reads, which ``tracegym export`` uses; no inference, no writes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from tests.gateway.api.inspector_data import Scenario, make_scenario
from tests.procs import free_port, run_command, start_process
from tracegym.errors import UserError
from tracegym.gateway.browse import browse_settings, create_browse_app, run_store, run_tokenizer


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[tuple[Path, Scenario]]:
    """``runs/demo/<time>/`` holding a store with two runs' rollouts and metrics, ``latest`` pointing at it."""
    d = tmp_path / "runs" / "demo" / "20261127T000000Z"
    d.mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "latest").symlink_to(d.name)
    scenario = make_scenario(f"sqlite:///{d / 'tracegym.db'}")
    scenario.store.close()
    yield d, scenario


def test_run_store_and_tokenizer(run_dir: tuple[Path, Scenario], tmp_path: Path) -> None:
    d, _ = run_dir
    assert run_store(d) == (f"sqlite:///{d / 'tracegym.db'}", d)
    assert run_store(d.parent) == (f"sqlite:///{(d.parent / 'latest').resolve() / 'tracegym.db'}", d)
    with pytest.raises(UserError, match="no run directory"):
        run_store(tmp_path / "nope")
    with pytest.raises(UserError, match=r"holds no tracegym\.db"):
        run_store(tmp_path)
    assert run_tokenizer(d) is None
    (d / "tokenizer").mkdir()  # a run that kept no weights (keep: none) left its tokenizer files
    (d / "tokenizer" / "tokenizer.json").write_text("{}")
    assert run_tokenizer(d) == d / "tokenizer"
    (d / "weights" / "v3").mkdir(parents=True)
    (d / "weights" / "v3" / "tokenizer.json").write_text("{}")
    assert run_tokenizer(d) == d / "weights" / "v3"


def test_the_inspector_is_served_read_only(run_dir: tuple[Path, Scenario]) -> None:
    d, s = run_dir
    url, _ = run_store(d)
    with TestClient(create_browse_app(browse_settings(url, None, {}), None)) as client:
        assert {r["run"] for r in client.get("/api/runs").json()["runs"]} >= {"run-a", "run-b"}
        view = client.get(f"/api/inspect/rollouts/{s.clean}")
        assert view.status_code == 200 and view.json()["rollout"]["reward"] == 1.0
        listing = client.get("/api/inspect/rollouts").json()
        assert len(listing["rollouts"]) == 4
        system = client.get("/api/inspect/system").json()
        assert system["upstream"]["kind"] == "none" and system["upstream"]["health"]["reachable"] is False
        assert client.get("/api/weight_versions").status_code == 200
        # the control and trajectory API's reads, for tracegym export
        rollouts = client.get("/api/rollouts", params={"limit": 100}).json()["rollouts"]
        assert s.clean in {r["rollout_id"] for r in rollouts}
        assert client.get(f"/api/rollouts/{s.clean}").json()["rollout_id"] == s.clean
        assert client.get(f"/api/rollouts/{s.clean}/spans").json()["spans"]
        assert client.get(f"/api/rollouts/{s.clean}/trajectory").status_code == 200
        assert "<html" in client.get("/ui/runs/run-b").text.lower()
        assert client.get("/healthz").json()["browsing"] is True
        # nothing that writes or samples
        assert client.post("/api/tasks", json={"tasks": [{"input": 1}]}).status_code in (404, 405)
        assert client.post(f"/api/rollouts/{s.clean}/rewards", json={"value": 0}).status_code in (404, 405)
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code in (404, 405)
        assert client.post("/v1/traces", content=b"").status_code in (404, 405)


@pytest.mark.parametrize("how", ["inspect", "serve"])
def test_cli_browses_a_finished_run(run_dir: tuple[Path, Scenario], tmp_path: Path, how: str) -> None:
    d, s = run_dir
    port = free_port()
    if how == "inspect":
        args = ["tracegym", "inspect", str(d.parent), "--port", str(port)]
    else:
        args = ["tracegym", "serve", "--store", f"sqlite:///{d / 'tracegym.db'}", "--port", str(port)]
    with start_process(args, port=port, log_path=tmp_path / f"{how}.log", health_path="/healthz", timeout=120):
        base = f"http://127.0.0.1:{port}"
        runs = httpx.get(base + "/api/runs").json()["runs"]
        assert {r["run"] for r in runs} >= {"run-a", "run-b"}
        out = tmp_path / f"{how}.jsonl"  # a finished run's rollouts export from the browsing gateway
        res = run_command(["tracegym", "export", "--gateway", base, "--out", str(out)], timeout=120)
        assert res.returncode == 0, res.stderr
        assert s.clean in out.read_text()
        assert httpx.get(f"{base}/api/inspect/rollouts/{s.failed}").status_code == 200
        assert httpx.get(base + "/ui").status_code == 200
        assert httpx.post(base + "/api/tasks", json={"tasks": [{"input": 1}]}).status_code in (404, 405)
    log = (tmp_path / f"{how}.log").read_text()
    assert f"trace inspector: http://127.0.0.1:{port}/ui (read-only" in log
