"""The recipe's objective keys: phases and their steps, the valid objectives, and what each needs."""

from __future__ import annotations

import pytest

from tracegym.trainer.recipe import RecipeError, validate_recipe
from tracegym.trainer.workers.train_config import TrainConfig

BASE = {"model": "tiny-random", "data": {"path": "t.jsonl"}, "agent": {"target": "a:b"}}


def test_phases_set_the_steps_and_each_steps_objective() -> None:
    r = validate_recipe({**BASE, "phases": [{"objective": "sft", "steps": 2}, {"objective": "grpo", "steps": 3}]})
    assert r.steps == 5 and r.objectives() == {"sft", "grpo"}
    assert [r.objective_at(i) for i in range(6)] == ["sft", "sft", "grpo", "grpo", "grpo", "grpo"]
    assert [r.phase_index(i) for i in range(5)] == [0, 0, 1, 1, 1]
    assert r.phase_ends() == [2]  # the held-out split is evaluated after the sft phase too
    again = validate_recipe(r.model_dump())  # what check_recipe does with a recipe changed in code
    assert again.steps == 5
    cfg = TrainConfig.from_recipe(r)
    assert cfg.objectives == ("grpo", "sft") and not cfg.needs_reference()


def test_the_default_is_grpo_for_steps_steps() -> None:
    r = validate_recipe({**BASE, "steps": 7})
    assert r.objective == "grpo" and r.objective_at(6) == "grpo" and r.phase_index(3) == 0
    assert r.phase_ends() == []


@pytest.mark.parametrize(("extra", "message"), [
    ({"objective": "ppo"}, "objective: Value error, unknown objective 'ppo'; valid: distill, dpo, grpo, sft"),
    ({"phases": [{"objective": "sft", "steps": 1}, {"objective": "rl", "steps": 1}]},
     "phases.1.objective: Value error, unknown objective 'rl'; valid: distill, dpo, grpo, sft"),
    ({"phases": []}, "phases: an empty list"),
    ({"phases": [{"objective": "sft", "steps": 0}]}, "phases.0.steps"),
    ({"steps": 3, "phases": [{"objective": "sft", "steps": 2}]}, "steps (3) differs from the sum of the phases' steps (2)"),
    ({"objective": "distill"}, "objective distill needs a `distill` section naming the teacher"),
    ({"objective": "sft", "mode": "async"}, "objective(s) ['sft'] train in mode sync only"),
    ({"objective": "dpo", "lora": {"adapters": {"a": {}}}}, "objective dpo trains one adapter"),
    ({"dpo": {"beta": 0}}, "dpo.beta"),
    ({"sft": {"min_rewad": 1}}, "sft.min_rewad: unknown field; did you mean 'min_reward'?"),
])
def test_bad_objective_settings_name_the_field(extra: dict, message: str) -> None:
    with pytest.raises(RecipeError) as e:
        validate_recipe({**BASE, **extra})
    assert message in str(e.value)


def test_dpo_needs_the_reference_model() -> None:
    r = validate_recipe({**BASE, "objective": "dpo", "dpo": {"beta": 0.2}})
    cfg = TrainConfig.from_recipe(r)
    assert cfg.needs_reference() and cfg.dpo.beta == 0.2
