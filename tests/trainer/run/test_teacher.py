"""The distillation teacher named in a recipe: a model directory, a finished run's directory (the newest
weights it kept), or a model name; found beside the recipe like the model; refused with what to do when
a run kept no weights or the vocabularies differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tracegym.trainer.recipe import RecipeError, load_recipe
from tracegym.trainer.run.teacher import kept_weights, prepare_teacher


def _run_dir(tmp: Path, model: Path, versions: list[int]) -> Path:
    run = tmp / "runs" / "quickstart" / "20261129-120000"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "kind": "eval"}) + "\n")
    for v in versions:
        (run / "weights").mkdir(exist_ok=True)
        (run / "weights" / f"v{v}").symlink_to(model, target_is_directory=True)
    return run


def test_a_run_directory_teaches_with_the_newest_weights_it_kept(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = _run_dir(tmp_path, tiny_model_dir, [2, 10, 9])
    assert kept_weights(run) == run / "weights" / "v10"  # by number, not by name
    assert prepare_teacher(str(run), tiny_model_dir) == run / "weights" / "v10"
    assert kept_weights(tiny_model_dir) is None  # a model directory is not a run directory
    assert prepare_teacher(str(tiny_model_dir), tiny_model_dir) == tiny_model_dir


def test_a_run_that_kept_no_weights_says_how_to_keep_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = _run_dir(tmp_path, tiny_model_dir, [])
    with pytest.raises(RecipeError, match=r"kept no weights: train the teacher with `keep: weights`"):
        prepare_teacher(str(run), tiny_model_dir)
    (run / "weights" / "v3").mkdir(parents=True)  # what a LoRA run keeps: adapters, no config.json
    (run / "weights" / "v3" / "adapter_config.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"not whole models \(a LoRA run keeps adapters\)"):
        prepare_teacher(str(run), tiny_model_dir)


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 10**6, "content": "<|not-the-student's|>"})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(RecipeError, match=r"another tokenizer than the student.*needs one vocabulary"):
        prepare_teacher(str(other), tiny_model_dir)


def test_a_relative_teacher_is_looked_for_beside_the_recipe(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = _run_dir(tmp_path, tiny_model_dir, [4])
    (tmp_path / "t.jsonl").write_text("{}\n")
    recipe = {"model": "tiny-random", "data": {"path": "t.jsonl"}, "agent": {"target": "a:b"},
              "objective": "distill", "distill": {"teacher": "runs/quickstart/20261129-120000"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert load_recipe(tmp_path / "recipe.yaml").distill.teacher == str(run)
    recipe["distill"]["teacher"] = "smollm2-135m"  # a name stays a name
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert load_recipe(tmp_path / "recipe.yaml").distill.teacher == "smollm2-135m"
