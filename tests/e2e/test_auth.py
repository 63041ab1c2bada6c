"""A keyed `tracegym serve --engine embedded` (admin key from the environment, a weights root): an
unmodified OpenAI-SDK agent (`api_key="unused"`) run by `tracegym run` completes its rollouts with the
tokens the queue hands out; a runner without the key is refused; the engine's weight route refuses direct
calls while the gateway's swap (with the engine's key) works; neither the key nor a token reaches the log."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.procs import free_port, run_command, start_process
from tracegym.client import GatewayClient, SDKConfig
from tracegym.tasks import read_tasks

ROOT = Path(__file__).resolve().parents[2]


def _run(gateway_url: str, key: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEGYM_API_KEY", "TRACEGYM_ADMIN_KEY")}
    env |= {"PYTHONPATH": str(ROOT), "TRACEGYM_MODEL": "tiny-random", "TRACEGYM_MAX_TOKENS": "8"}
    if key is not None:
        env["TRACEGYM_API_KEY"] = key
    argv = [sys.executable, "-m", "tracegym.cli", "run", "examples/openai/agent.py:agent", "--gateway", gateway_url,
            "--concurrency", "3", "--exit-when-idle"]
    return run_command(argv, cwd=ROOT, env=env, timeout=180)


def test_keyed_gateway_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    key = secrets.token_urlsafe(24)
    port, engine_port = free_port(), free_port()
    weights = tmp_path / "weights"
    weights.mkdir()
    argv = ["tracegym", "serve", "--engine", "embedded", "--model", "tiny-random", "--port", str(port),
            "--engine-port", str(engine_port), "--store", f"sqlite:///{tmp_path / 'tg.db'}",
            "--weights-dir", str(weights), "--log-level", "debug"]  # fmt: skip
    log = tmp_path / "gateway.log"
    with start_process(argv, port=port, log_path=log, health_path="/healthz", timeout=240,
                       env={"TRACEGYM_ADMIN_KEY": key}) as gw:
        assert httpx.get(gw.base_url + "/api/rollouts").status_code == 401
        tasks = read_tasks(ROOT / "examples" / "openai" / "tasks.jsonl")
        with GatewayClient(SDKConfig(gw.base_url, api_key=key)) as client:
            refused = _run(gw.base_url, None)
            assert refused.returncode != 0 and "API key" in refused.stderr, refused.stderr[-2000:]

            enqueued = client.enqueue_tasks(tasks)
            rids = [rid for t in enqueued for rid in t["rollout_ids"]]
            res = _run(gw.base_url, key)
            assert res.returncode == 0, res.stderr[-4000:] + gw.log()
            assert f"done {len(rids)} | failed 0" in res.stderr, res.stderr[-4000:]
            for rid in rids:
                rollout = client.get_rollout(rid)
                assert rollout["status"] == "completed" and [r["value"] for r in rollout["rewards"]] == [
                    rollout["reward"]], rollout
                llm = [s for s in client.rollout_spans(rid) if s.get("choices")]
                assert llm and all(s["rollout_id"] == rid for s in llm)

        direct = httpx.post(f"http://127.0.0.1:{engine_port}/update_weights_from_disk",
                            json={"model_path": str(tiny_model_dir)}, timeout=30)
        assert direct.status_code == 401, direct.text
        assert httpx.post(f"http://127.0.0.1:{engine_port}/pause_generation", json={}).status_code == 401
        shutil.copytree(tiny_model_dir, weights / "v1")
        admin = {"Authorization": f"Bearer {key}"}
        swap = httpx.post(gw.base_url + "/api/weights/update", headers=admin, timeout=120,
                          json={"model_path": str(weights / "v1"), "weight_version": "1"})
        assert swap.status_code == 200 and swap.json()["success"] is True, swap.text
        outside = httpx.post(gw.base_url + "/api/weights/update", headers=admin, timeout=30,
                             json={"model_path": str(tiny_model_dir), "weight_version": "2"})
        assert outside.status_code == 403
    text = log.read_text()
    assert str(weights / "v1") in text  # the swap was logged (so the check below read a real log)
    assert key not in text and "tgr." not in text
