"""Two embedded engines (``tracegym engine --model tiny-random``, real processes) behind one ``tracegym
serve --upstream A --upstream B``: each rollout's spans name one engine (``tracegym.upstream``), a disk
swap reaches both, and a checkpoint only one engine may read (engine B keeps to its own weights root,
``TRACEGYM_ENGINE_WEIGHTS_DIR``, as an engine on a host without that volume) is refused by the other: the
engine that loaded it goes back to the fleet's weights, and both serve one version."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import spans_of
from tests.procs import ManagedProcess, free_port, start_process

MODEL = "tiny-random"


def _engine(tmp: Path, root: Path | None = None) -> ManagedProcess:
    port = free_port()
    env = {"TRACEGYM_ENGINE_THREADS": "1", **({"TRACEGYM_ENGINE_WEIGHTS_DIR": str(root)} if root else {})}
    return start_process(["tracegym", "engine", "--model", MODEL, "--port", str(port), "--weight-version", "0"],
                         port=port, log_path=tmp / f"engine-{port}.log", timeout=240, env=env)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[ManagedProcess, ManagedProcess, ManagedProcess]]:
    tmp = tmp_path_factory.mktemp("e2e-fleet")
    shutil.copytree(tiny_model_dir, tmp / "shared" / "v1")  # both engines may read it
    shutil.copytree(tiny_model_dir, tmp / "ckpt")  # only engine A may
    with _engine(tmp) as a, _engine(tmp, tmp / "shared") as b:
        port = free_port()
        argv = ["tracegym", "serve", "--upstream", a.base_url, "--upstream", b.base_url, "--model", MODEL,
                "--port", str(port), "--store", f"sqlite:///{tmp / 'tracegym.db'}", "--weights-dir", str(tmp)]
        with start_process(argv, port=port, log_path=tmp / "gateway.log", health_path="/healthz",
                           timeout=240) as gw:
            yield gw, a, b


def _version(p: ManagedProcess) -> str:
    return httpx.get(p.base_url + "/model_info", timeout=30).json()["weight_version"]


@pytest.mark.slow
def test_two_engines_sticky_rollouts_and_all_or_none_swaps(fleet, tiny_model_dir: Path) -> None:
    gw, a, b = fleet
    report = httpx.get(gw.base_url + "/api/upstreams", timeout=30).json()
    assert [(e["url"], e["healthy"], e["weight_version"]) for e in report["engines"]] == [
        (a.base_url, True, "0"), (b.base_url, True, "0")]
    engines: dict[str, str] = {}
    for i in range(8):
        rid = f"fleet-{i}"
        for turn in range(2):
            r = httpx.post(f"{gw.base_url}/rollouts/{rid}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": f"say {turn}"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
        served = {s["attributes"]["tracegym.upstream"] for s in spans_of(gw.base_url, rid, 2)}
        assert len(served) == 1, served
        engines[rid] = served.pop()
    assert set(engines.values()) <= {a.base_url, b.base_url}

    ok = httpx.post(gw.base_url + "/api/weights/update", timeout=300,
                    json={"model_path": "shared/v1", "weight_version": "1"})
    assert ok.status_code == 200 and ok.json()["success"] is True, ok.text
    assert (_version(a), _version(b)) == ("1", "1")

    bad = httpx.post(gw.base_url + "/api/weights/update", timeout=300,
                     json={"model_path": "ckpt", "weight_version": "2"})
    assert bad.status_code == 400, bad.text
    msg = bad.json()["message"]
    assert b.base_url in msg and "rolled back to version 1" in msg and a.base_url in msg
    assert (_version(a), _version(b)) == ("1", "1")
    assert httpx.get(gw.base_url + "/api/weights", timeout=30).json()["weight_version"] == "1"
    r = httpx.post(f"{gw.base_url}/rollouts/fleet-0/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["tracegym"]["weight_version"] == "1"
