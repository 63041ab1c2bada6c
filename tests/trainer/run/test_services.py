"""``tracegym train``'s processes (``trainer/run/services.py``) for a recipe with ``upstream.engines: 2``:
two embedded engines (real ``tracegym engine`` processes on tiny-random) behind one gateway that serves
them as a fleet; everything started is stopped on exit."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from tracegym.trainer.recipe import load_recipe
from tracegym.trainer.run.services import start_services


@pytest.mark.slow
def test_a_recipe_with_two_engines_starts_a_fleet(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps({"task_id": "t0", "input": {}}) + "\n")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "model": "tiny-random", "data": {"path": "train.jsonl"}, "run_dir": str(tmp_path / "run"),
        "agent": {"target": "agent:run", "external": True}, "upstream": {"engines": 2, "engine_dtype": "float32"},
    }))
    recipe = load_recipe(tmp_path / "recipe.yaml")
    with start_services(recipe, tiny_model_dir, tmp_path) as services:
        assert len(services.upstream_urls) == 2 and services.upstream_url == services.upstream_urls[0]
        assert [p.name for p in services.procs] == ["embedded engine 1", "embedded engine 2", "gateway"]
        assert services.admin_key and (tmp_path / "run" / "admin_key").read_text().strip() == services.admin_key
        auth = {"Authorization": f"Bearer {services.admin_key}"}
        assert httpx.get(services.gateway_url + "/api/upstreams", timeout=30).status_code == 401
        report = httpx.get(services.gateway_url + "/api/upstreams", timeout=30, headers=auth).json()
        assert [(e["url"], e["healthy"], e["weight_version"]) for e in report["engines"]] == [
            (u, True, "0") for u in services.upstream_urls]
        for i in range(4):
            r = httpx.post(f"{services.gateway_url}/rollouts/r{i}/v1/chat/completions", timeout=120, headers=auth, json={
                "model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        procs = list(services.procs)
    assert not any(p.alive() for p in procs)
    assert (tmp_path / "run" / "logs" / "engine-2.log").exists()
