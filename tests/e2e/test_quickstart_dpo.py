"""DPO from a finished run's groups (``examples/quickstart/recipe-dpo.yaml``), shortened: SmolLM2-135M learns
the quickstart task offline, from the preference pairs exported from one finished quickstart run (the best
against the worst answer of each of its training groups whose rewards differed). No rollout is sampled for
training; the held-out split is evaluated before and after, and its reward must rise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import train_example_shortened

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
STEPS = 12  # x 16 pairs: the recipe's own steps
EVAL_TASKS = 64  # all of them, x EVAL_SAMPLES
EVAL_SAMPLES = 4  # 256 sampled answers an evaluation: the standard error of the rise is ~0.04


@pytest.mark.slow
@pytest.mark.learns
def test_dpo_on_a_finished_runs_pairs_raises_the_held_out_reward(tmp_path: Path) -> None:
    _, rows = train_example_shortened(QUICKSTART, tmp_path, STEPS, timeout=900, eval_tasks=EVAL_TASKS,
                                      recipe_file="recipe-dpo.yaml", eval_samples=EVAL_SAMPLES)
    train = [r for r in rows if r["kind"] == "train"]
    before, after = evals = [r for r in rows if r["kind"] == "eval"]
    print(f"quickstart dpo: held-out reward {before['reward_mean']:.3f} -> {after['reward_mean']:.3f}")
    assert [r["step"] for r in evals] == [0, STEPS]
    # every step trains on 16 imported pairs and samples nothing
    assert len(train) == STEPS and all(r["pairs"] == 16 and "gen_s" not in r for r in train), train
    assert after["reward_mean"] >= before["reward_mean"] + 0.15, (before, after)
