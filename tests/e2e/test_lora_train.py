"""`tracegym train` with one LoRA adapter per agent role on tiny-random (engine, gateway, runner and
trainer as real processes): a two-role agent (planner, then executor, in one rollout), both adapters
change, each role's calls are served by its own adapter (and recorded so on the spans), the swaps stamp
weight versions, and ``--resume`` continues from the adapters and optimizer of the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.e2e.conftest import metrics_rows
from tests.e2e.test_train_loop import _train, _trained, _write_recipe
from tracegym.trainer.recipe import load_recipe


def test_two_agent_recipe_example_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    recipe = load_recipe(root / "examples/two_agents/recipe.yaml")
    s = recipe.lora
    assert s is not None and s.per_agent and s.names == ["planner", "executor"]


@pytest.mark.slow
def test_two_roles_two_adapters(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _write_recipe(
        tmp_path, steps=2, name="loratest",
        agent={"target": "tests.e2e.agents.two_agents:agent", "concurrency": 8},
        lora={"rank": 4, "alpha": 8, "adapters": {"planner": {}, "executor": {"target_modules": ["q_proj", "v_proj"]}}},
        optim={"lr": 5e-3, "dtype": "float32"}, keep="checkpoint")
    res = _train(recipe)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    run = tmp_path / "run"
    rows = metrics_rows(run)
    trained = [r for r in rows if r["kind"] == "train" and "loss" in r]
    assert trained, "no step carried signal"
    for r in trained:
        assert r["loss_tokens/planner"] > 0 and r["loss_tokens/executor"] > 0
        assert r["loss_tokens/planner"] + r["loss_tokens/executor"] == r["loss_tokens"]
    last = max(int(p.name[1:]) for p in (run / "weights" / "adapters").iterdir() if p.name.startswith("v"))
    for role, targets in (("planner", 7), ("executor", 2)):
        tensors = load_file(str(run / "weights" / "adapters" / f"v{last}" / role / "adapter_model.safetensors"))
        assert len({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}) == targets
        # lora_B starts at zero: any non-zero value is the adapter's training
        assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k), role
    assert (run / "checkpoint" / "trainer_state.json").is_file()
    assert [p.name for p in (run / "weights").iterdir()] == ["adapters"]  # only adapters travel, no full weights

    from tracegym.gateway.traces.reads import list_call_records
    from tracegym.gateway.traces.store import Store

    store = Store.open(f"sqlite:///{run / 'tracegym.db'}")
    try:
        done, _ = store.list_rollouts(status="completed", limit=500)
        late = max(done, key=lambda r: r["finished_at"])
        calls = list_call_records(store, late["rollout_id"])
        assert [c.agent_name for c in calls] == ["planner", "executor"]
        assert [c.lora_adapter for c in calls] == ["planner", "executor"]
        assert {c.weight_version for c in calls} == {str(last)}
        versions = {v["version"] for v in store.list_weight_versions()}
        assert str(last) in versions
    finally:
        store.close()

    _trained(recipe, "--resume", "--steps", "3", steps=[1, 2, 3])
