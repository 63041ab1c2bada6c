"""`tracegym train` with the objectives beyond GRPO, end to end on tiny-random (engine, gateway, runner and
trainer as real processes, a few steps each): a chained sft → grpo recipe, online dpo, on-policy
distillation, sft and dpo from an earlier run in the same store, and the runs that must refuse."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.procs import run_command

ROOT = Path(__file__).resolve().parents[2]


def _recipe(tmp: Path, name: str, **extra: object) -> Path:
    tasks = [{"task_id": f"t{i}", "input": {"question": f"Say {i}"}} for i in range(10)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:8]))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[8:]))
    recipe = {
        "name": name,
        "model": "tiny-random",
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl"},
        "agent": {"target": "tests.e2e.agents.length_agent:agent", "concurrency": 8},
        "group_size": 4,
        "batch_size": 2,
        "eval_interval": 0,
        "eval_samples": 1,
        "optim": {"lr": 1e-3, "dtype": "float32"},
        "upstream": {"engine_dtype": "float32"},
        "run_dir": str(tmp / name),
        **extra,
    }
    import yaml

    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _train(recipe: Path) -> subprocess.CompletedProcess:
    return run_command(["tracegym", "train", str(recipe)], cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})


def _train_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


@pytest.mark.slow
def test_sft_then_grpo_phases(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Online sft (the rollouts with reward >= 1, i.e. rejection sampling) for 2 steps, then grpo."""
    _ok(_train(_recipe(tmp_path, "phases", phases=[{"objective": "sft", "steps": 2},
                                                   {"objective": "grpo", "steps": 1}],
                       sft={"min_reward": 1.0})))
    rows = _train_rows(tmp_path / "phases")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["phase"] for r in rows] == [0.0, 0.0, 1.0]
    sft = [r for r in rows[:2] if "loss" in r]
    assert sft, rows  # 16 rollouts a step, about half rewarded: a step without any is most unlikely
    for r in sft:
        assert r["sft_loss"] == pytest.approx(r["loss"]) and r["sft_rollouts"] <= r["rollouts"]
        assert r["swap_s"] > 0
    assert "sft_loss" not in rows[2]


@pytest.mark.slow
def test_dpo_online_and_offline_from_an_earlier_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A grpo run writes to a shared store; a dpo run trains on its groups without sampling; a dpo run
    that samples its own groups; an sft run whose filter keeps nothing stops and says why."""
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    _ok(_train(_recipe(tmp_path, "first", steps=2, store=store)))
    _ok(_train(_recipe(tmp_path, "offline", steps=2, store=store, objective="dpo",
                       dpo={"runs": ["first"], "beta": 0.2})))
    rows = _train_rows(tmp_path / "offline")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "gen_s" not in r and r["pairs"] >= 1 and r["swap_s"] > 0
    assert rows[0]["dpo_loss"] == pytest.approx(0.6931, abs=2e-3)  # the policy starts as the reference

    _ok(_train(_recipe(tmp_path, "online", steps=1, objective="dpo")))
    (row,) = _train_rows(tmp_path / "online")
    assert row["rollouts"] == 8 and row["pairs"] + sum(v for k, v in row.items() if k.startswith("pairs_skipped")) == 2

    res = _train(_recipe(tmp_path, "empty", steps=1, store=store, objective="sft",
                         sft={"runs": ["first"], "min_reward": 5.0}))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "sft: 0 of the 16 completed rollouts of runs ['first'] in the store are examples with reward >= 5.0" \
        in res.stderr


@pytest.mark.slow
def test_sft_on_imported_demonstrations(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Chat demonstrations imported into a store (tracegym import through a gateway on it), then a run on
    that store trains sft on them offline: no rollout is sampled for training, the loss falls."""
    from tests.gateway.app_support import ServerThread
    from tracegym.cli import main as cli
    from tracegym.gateway.app import create_app
    from tracegym.gateway.settings import GatewaySettings

    store = f"sqlite:///{tmp_path / 'shared.db'}"
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                                      {"role": "assistant", "content": f"{i} {i} {i}"}]}) + "\n"
                             for i in range(6)))
    settings = GatewaySettings(upstream_url="http://127.0.0.1:9", model=str(tiny_model_dir), store_url=store)
    with ServerThread(create_app(settings)) as srv:
        assert cli(["import", str(demos), "--name", "demos", "--gateway", srv.url]) == 0
    _ok(_train(_recipe(tmp_path, "sftdemo", steps=3, store=store, objective="sft", batch_size=3, group_size=2,
                       sft={"runs": ["demos"]}, optim={"lr": 1e-2, "dtype": "float32"})))
    rows = _train_rows(tmp_path / "sftdemo")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert "gen_s" not in r and r["sft_rollouts"] == 6 and r["swap_s"] > 0  # every demo, every step
    assert rows[-1]["sft_loss"] < rows[0]["sft_loss"], [r["sft_loss"] for r in rows]


@pytest.mark.slow
def test_distill_from_a_teacher(tmp_path: Path, tiny_model_dir: Path) -> None:
    _ok(_train(_recipe(tmp_path, "distill", steps=2, objective="distill",
                       distill={"teacher": "tiny-random", "reward_weight": 0.5})))
    rows = _train_rows(tmp_path / "distill")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # no group is dropped for equal rewards: the teacher's signal is per token
        assert r["groups_used"] == 2 and r["swap_s"] > 0 and "pg_loss" in r
    # the first step: the teacher is the student's start, so the advantages are the engine-vs-trainer
    # mismatch (0 up to float noise) plus the reward term
    assert abs(rows[0]["pg_loss"]) < 1.0


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path: Path, tiny_model_dir: Path,
                                                     qwen3_model_dir: Path) -> None:
    res = _train(_recipe(tmp_path, "badteacher", steps=1, objective="distill", distill={"teacher": "qwen3-tiny"}))
    assert res.returncode == 2
    assert "has another tokenizer than the student" in res.stderr
    assert "token-level distillation needs one vocabulary" in res.stderr
    assert not (tmp_path / "badteacher" / "logs").exists()  # refused before any process started


def test_an_unknown_objective_lists_the_valid_ones(tmp_path: Path) -> None:
    res = _train(_recipe(tmp_path, "bad", phases=[{"objective": "sft", "steps": 1}, {"objective": "ppo", "steps": 1}]))
    assert res.returncode == 2
    assert "phases.1.objective" in res.stderr and "valid: distill, dpo, grpo, sft" in res.stderr
