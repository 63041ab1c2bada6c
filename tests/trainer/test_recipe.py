"""Recipe loading: 'did you mean' for misspelt keys, every path relative to the recipe file
(a local model directory and a SQLite store too), and the default run directory under the current one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracegym.trainer.recipe import RecipeError, load_recipe


def _recipe(d: Path, **fields: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text('{"task_id": "t0", "input": {}}\n')
    p = d / "recipe.yaml"
    p.write_text(yaml.safe_dump({"model": "tiny-random", "data": {"path": "train.jsonl"},
                                 "agent": {"target": "agent:agent"}, **fields}))  # fmt: skip
    return p


def test_a_misspelt_key_gets_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(_recipe(tmp_path, optim={"lrr": 1e-5}, eval_intervall=5, bogus_thing=1))
    msg = str(err.value)
    assert "optim.lrr: unknown field; did you mean 'lr'?" in msg
    assert "eval_intervall: unknown field; did you mean 'eval_interval'?" in msg
    assert "bogus_thing: unknown field; the fields here are model, data, agent," in msg
    with pytest.raises(RecipeError) as err:  # a single typo is a single line
        load_recipe(_recipe(tmp_path, optim={"lrr": 1e-5}))
    assert str(err.value) == f"{tmp_path / 'recipe.yaml'}: invalid recipe: optim.lrr: unknown field; did you mean 'lr'?"


def test_a_local_model_directory_is_relative_to_the_recipe(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "mine")
    p = _recipe(tmp_path / "exp", model="../models/mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the current directory no longer decides
    recipe = load_recipe(p)
    assert recipe.model == str(tmp_path / "models" / "mine")
    from tracegym.modelfiles.prepare import prepare_model

    assert prepare_model(recipe.model) == tmp_path / "models" / "mine"
    # a bare directory name next to the recipe, too; names and hub ids stay as they are
    shutil.copytree(tiny_model_dir, tmp_path / "exp" / "local-model")
    assert load_recipe(_recipe(tmp_path / "exp", model="local-model")).model == str(tmp_path / "exp" / "local-model")
    assert load_recipe(_recipe(tmp_path / "exp", model="tiny-random")).model == "tiny-random"
    assert load_recipe(_recipe(tmp_path / "exp", model="Org/Some-Model")).model == "Org/Some-Model"
    # a path that does not exist is still resolved against the recipe, so its error names the right place
    assert load_recipe(_recipe(tmp_path / "exp", model="./missing")).model == str(tmp_path / "exp" / "missing")


def test_store_and_run_dir_paths_are_relative_to_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    r = load_recipe(_recipe(tmp_path / "exp", store="sqlite:///db/traces.db", run_dir="out/{name}", name="x"))
    assert r.store == f"sqlite:///{tmp_path / 'exp' / 'db' / 'traces.db'}"
    assert r.run_dir == tmp_path / "exp" / "out" / "x"
    r = load_recipe(_recipe(tmp_path / "exp", run_dir="out/{name}"))
    assert r.store == f"sqlite:///{tmp_path / 'exp' / 'out' / 'run'}/tracegym.db"
    # unset: a new directory per run under ./runs (not inside the recipe's folder); the store follows it
    r = load_recipe(_recipe(tmp_path / "exp", name="qs"))
    assert r.run_dir == Path(os.getcwd()) / "runs" / "qs" / "{timestamp}"
    assert r.store == "sqlite:///{run_dir}/tracegym.db"
    with pytest.raises(RecipeError, match="may only be the last part of run_dir"):
        load_recipe(_recipe(tmp_path / "exp", run_dir="runs/{timestamp}/x"))


def test_the_ray_section(tmp_path: Path) -> None:
    r = load_recipe(_recipe(tmp_path, ray={"address": "10.0.0.5:6379", "namespace": "exp", "gpus_per_worker": 1,
                                           "runtime_env": {"env_vars": {"HF_HOME": "/cache"}}}))  # fmt: skip
    assert r.ray is not None and r.ray.address == "10.0.0.5:6379" and r.ray.namespace == "exp"
    assert r.ray.runtime_env == {"env_vars": {"HF_HOME": "/cache"}} and r.ray.gpus_per_worker == 1
    assert r.ray.cpus_per_worker == 1.0
    assert load_recipe(_recipe(tmp_path)).ray is None  # unset: today's local Ray, only with workers > 1
    for ok in ("auto", "head:6379", "ray://raycluster-head-svc.default.svc:10001", "[::1]:6379"):
        assert load_recipe(_recipe(tmp_path, ray={"address": ok})).ray.address == ok
    p = tmp_path / "recipe.yaml"
    for bad in ("10.0.0.5", "http://head:8265", "head:0", "head:99999", "head:port", ""):
        with pytest.raises(RecipeError) as err:
            load_recipe(_recipe(tmp_path, ray={"address": bad}))
        assert str(err.value) == (
            f"{p}: invalid recipe: ray.address: Value error, must be HOST:PORT (a cluster's head, e.g."
            f" 10.0.0.5:6379), ray://HOST:PORT or auto, got {bad!r}"
        ), bad
    with pytest.raises(RecipeError) as err:
        load_recipe(_recipe(tmp_path, ray={"adress": "head:6379"}))
    assert str(err.value) == f"{p}: invalid recipe: ray.adress: unknown field; did you mean 'address'?"
    with pytest.raises(RecipeError, match=r"ray.cpus_per_worker: Input should be greater than 0"):
        load_recipe(_recipe(tmp_path, ray={"cpus_per_worker": 0}))
    with pytest.raises(RecipeError, match=r"ray.gpus_per_worker: Input should be greater than or equal to 0"):
        load_recipe(_recipe(tmp_path, ray={"gpus_per_worker": -1}))
    with pytest.raises(RecipeError, match=r"ray.runtime_env: Input should be a valid dictionary"):
        load_recipe(_recipe(tmp_path, ray={"runtime_env": ["pip"]}))


def test_the_weight_sync_and_what_it_cannot_go_with(tmp_path: Path) -> None:
    assert load_recipe(_recipe(tmp_path)).upstream.weight_sync == "disk"
    r = load_recipe(_recipe(tmp_path, upstream={"weight_sync": "distributed", "weight_sync_address": "10.0.0.7",
                                                "engine_ranks": 2, "urls": ["http://a:30000"]}))
    assert (r.upstream.weight_sync, r.upstream.weight_sync_address, r.upstream.engine_ranks) == \
        ("distributed", "10.0.0.7", 2)
    p = tmp_path / "recipe.yaml"
    for extra, why in (({"lora": {}}, "a `lora` run pushes only its adapters (from disk): drop one of them"),
                       ({"upstream": {"weight_sync": "distributed", "kind": "openai"}},
                        "needs an SGLang-protocol upstream (SGLang or the embedded engine), and upstream.kind is 'openai'")):
        fields = {"upstream": {"weight_sync": "distributed"}, **extra}
        with pytest.raises(RecipeError) as err:
            load_recipe(_recipe(tmp_path, **fields))
        assert str(err.value).startswith(f"{p}: invalid recipe: ") and why in str(err.value), str(err.value)
    with pytest.raises(RecipeError, match=r"upstream.weight_sync: Input should be 'disk' or 'distributed'"):
        load_recipe(_recipe(tmp_path, upstream={"weight_sync": "nccl"}))
    with pytest.raises(RecipeError, match=r"upstream.engine_ranks: Input should be greater than or equal to 1"):
        load_recipe(_recipe(tmp_path, upstream={"engine_ranks": 0}))


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").glob("*/recipe*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_example_recipe_loads_and_checks(path: Path) -> None:
    from tracegym.trainer.run.loop import check_recipe

    recipe = load_recipe(path)
    assert recipe.data.path.is_file()
    cfg = check_recipe(recipe)
    assert (cfg.lora is not None) == (recipe.lora is not None)
