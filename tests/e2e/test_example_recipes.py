"""Every example's recipe starts and completes a training step: `tracegym train` on the recipe as shipped,
with tiny-random in place of SmolLM2 and a step of 2 tasks × 2 rollouts (real engine, gateway, store,
runner and trainer; the example's own agent, tasks and settings otherwise). Whether they learn on SmolLM2
is measured in docs/agents.md; tests/e2e/test_example_learns.py trains one of them.

A run on tiny-random keeps about one of two cores busy (it is mostly its processes starting), so the selected
recipes train ``RECIPES_AT_ONCE`` at a time: the test of one recipe starts the next one's run beside its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# the quickstart has tests of its own (test_quickstart.py, test_run_dirs.py)
EXAMPLE_NAMES = sorted(p.parent.name for p in EXAMPLES.glob("*/recipe.yaml") if p.parent.name != "quickstart")
# every recipe of those examples, as NAME/FILE: recipe.yaml and its variants (recipe-*.yaml)
RECIPES = sorted(f"{name}/{p.name}" for name in EXAMPLE_NAMES for p in (EXAMPLES / name).glob("recipe*.yaml"))
RECIPES_AT_ONCE = 2
"""Recipes trained side by side (a tiny-random run uses about one core)."""


def tiny_recipe(name: str, tmp: Path) -> Path:
    """``examples/NAME/FILE`` on tiny-random, one step of 2 tasks × 2 rollouts (one of each phase of a chained
    recipe), 2 held-out tasks."""
    src = (EXAMPLES / name).parent
    recipe = yaml.safe_load((EXAMPLES / name).read_text())
    tasks = (src / recipe["data"]["path"]).read_text().splitlines()
    (tmp / "train.jsonl").write_text("\n".join(tasks[:4]) + "\n")
    held = (src / recipe["data"]["eval_path"]).read_text().splitlines() if recipe["data"].get("eval_path") else tasks[4:]
    (tmp / "eval.jsonl").write_text("\n".join(held[:2]) + "\n")
    module, function = recipe["agent"]["target"].split(":")
    recipe.update(model="tiny-random", batch_size=2, group_size=2, eval_samples=1, eval_interval=0,
                  run_dir=str(tmp / "run"), data={"path": "train.jsonl", "eval_path": "eval.jsonl"})
    if "phases" in recipe:  # one step of each phase
        recipe["phases"] = [{**phase, "steps": 1} for phase in recipe["phases"]]
    else:
        recipe["steps"] = 1
    for key in ("sft", "dpo"):  # dataset files stay the example's
        if recipe.get(key, {}).get("files"):
            recipe[key]["files"] = [str(src / f) for f in recipe[key]["files"]]
    recipe["agent"].update(target=f"{src / (module + '.py')}:{function}", concurrency=8)
    recipe["upstream"] = {**recipe.get("upstream", {}), "max_batch_size": 8}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_every_example_agent_has_a_recipe() -> None:
    agents = sorted(p.parent.name for p in EXAMPLES.glob("*/agent.py") if p.parent.name != "quickstart")
    assert agents and agents == EXAMPLE_NAMES, "an example agent without a recipe.yaml cannot be trained"


def train_tiny(name: str, tmp: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """``tracegym train`` on ``tiny_recipe(name, tmp)``: the recipe's path and the finished process."""
    recipe = tiny_recipe(name, tmp)
    res = subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(recipe)], cwd=tmp, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), "TRACEGYM_MAX_TOKENS": "8"},
    )  # fmt: skip
    return recipe, res


class RecipeRuns:
    """The selected recipes' training runs, in the order their tests run: asking for one starts it (if it has
    not started) and the ``ahead`` after it, in a pool of ``ahead + 1`` threads, each run in a folder of its own."""

    def __init__(self, names: list[str], tmp: pytest.TempPathFactory, ahead: int) -> None:
        self.names, self.tmp, self.ahead = names, tmp, ahead
        self.pool = ThreadPoolExecutor(ahead + 1, thread_name_prefix="recipe")
        self.runs: dict[str, Future[tuple[Path, subprocess.CompletedProcess]]] = {}

    def result(self, name: str) -> tuple[Path, subprocess.CompletedProcess]:
        at = self.names.index(name)
        for n in self.names[at:at + 1 + self.ahead]:
            if n not in self.runs:
                self.runs[n] = self.pool.submit(train_tiny, n, self.tmp.mktemp(n.replace("/", "-")))
        return self.runs[name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def recipe_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                tiny_model_dir: Path) -> Iterator[RecipeRuns]:
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_example_recipe_completes_a_step"
                and item.module is request.module]
    # a pytest-xdist worker runs only some of them: it starts no other recipe's run
    runs = RecipeRuns(selected, tmp_path_factory, 0 if hasattr(request.config, "workerinput") else RECIPES_AT_ONCE - 1)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_example_recipe_completes_a_step(name: str, recipe_runs: RecipeRuns) -> None:
    recipe, res = recipe_runs.result(name)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    rows = [json.loads(x) for x in (recipe.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = len(yaml.safe_load(recipe.read_text()).get("phases") or [1])
    *_, step = train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1)), train
    assert step["rollouts"] == 4 and step["dropped_rollouts"] == 0, step  # the last step samples (grpo)
    evals = [r for r in rows if r["kind"] == "eval"]
    # before, after every step (a phase of one step ends there), and at the end
    assert [r["step"] for r in evals] == list(range(steps + 1)) and all(r["failed"] == 0 for r in evals), evals
