"""`tracegym train` end to end on tiny-random: engine, gateway, runner and trainer as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import metrics_rows

ROOT = Path(__file__).resolve().parents[2]


def _write_recipe(tmp: Path, steps: int, **extra: object) -> Path:
    tasks = [{"task_id": f"t{i}", "input": {"question": f"Say {i}"}} for i in range(12)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:8]))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[8:]))
    recipe = {
        "name": "looptest",
        "model": "tiny-random",
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl"},
        "agent": {"target": "tests.e2e.agents.length_agent:agent", "concurrency": 8},
        "group_size": 4,
        "batch_size": 2,
        "steps": steps,
        "eval_interval": 0,
        "eval_samples": 1,
        "optim": {"lr": 1e-3, "dtype": "float32"},
        "upstream": {"engine_dtype": "float32"},
        "run_dir": str(tmp / "run"),
        **extra,
    }
    import yaml

    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _train(recipe: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(recipe), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


def _trained(recipe: Path, *args: str, steps: list[int]) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """``_train`` that must succeed and leave train rows for ``steps`` in the run directory's metrics (the
    recipe's ``run`` folder): the process, all metrics rows and the train rows."""
    res = _train(recipe, *args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = metrics_rows(recipe.parent / "run")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == steps
    return res, rows, train_rows


@pytest.mark.slow
def test_train_loop_swaps_weights_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _write_recipe(tmp_path, steps=2, keep="checkpoint")  # the resume below extends the ended run
    res, rows, train_rows = _trained(recipe, steps=[1, 2])
    run = tmp_path / "run"
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2]
    for r in train_rows:
        assert r["rollouts"] == 8
        if "loss" in r:  # a step whose groups all had equal rewards trains nothing
            assert r["swap_s"] >= r["swap_save_s"] + r["swap_update_s"] - 1e-6 and r["swap_update_s"] > 0
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert "eval reward after" in (run / "summary.md").read_text()
    assert (run / "checkpoint" / "trainer_state.json").is_file()
    # The run's gateway had a random admin key: kept for the inspector's login, never in a log.
    key = (run / "admin_key").read_text().strip()
    assert len(key) >= 32 and (run / "admin_key").stat().st_mode & 0o777 == 0o600
    assert f"admin key: {run / 'admin_key'}" in res.stderr
    for log in ("engine.log", "gateway.log", "runner.log"):
        assert key not in (run / "logs" / log).read_text(), log

    # Every swap became a weight version, and the final evaluation ran on the last one.
    from tracegym.gateway.traces.reads import list_call_records
    from tracegym.gateway.traces.store import Store

    store = Store.open(f"sqlite:///{run / 'tracegym.db'}")
    try:
        swaps = sum(1 for r in train_rows if "loss" in r)
        versions = {v["version"] for v in store.list_weight_versions()}
        assert {str(i) for i in range(1, swaps + 1)} <= versions
        final_eval, _ = store.list_rollouts(status="completed", limit=500)
        last = max(final_eval, key=lambda r: r["finished_at"])
        calls = list_call_records(store, last["rollout_id"])
        assert calls and calls[-1].weight_version == str(swaps if swaps else 0)
        assert store.list_metrics("looptest"), "per-step metrics must reach the store"
    finally:
        store.close()

    # Resume: continue to step 3 from the checkpoint, against a fresh gateway on the same store.
    _trained(recipe, "--resume", "--steps", "3", steps=[1, 2, 3])


def test_bad_recipe_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("model: tiny-random\ndata: {path: x.jsonl}\nagent: {target: nocolon}\ngroup_size: 1\n")
    res = _train(p)
    assert res.returncode == 2
    assert "agent.target" in res.stderr or "agent" in res.stderr
    assert "group_size" in res.stderr


@pytest.mark.slow
def test_async_mode_trains_on_fresh_groups(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Asynchronous mode: runners never stop, the queue stays two batches deep, and each step trains on
    finished groups within ``max_staleness`` weight versions of the current one."""
    recipe = _write_recipe(tmp_path, steps=3, mode="async", max_staleness=1)
    _, _, train_rows = _trained(recipe, steps=[1, 2, 3])
    for r in train_rows:
        assert r["stale_groups"] >= 0 and r["rollouts"] <= 8  # at most batch_size groups of 4 are trained
