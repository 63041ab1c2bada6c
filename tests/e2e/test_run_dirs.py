"""Run directories end to end, with real processes on tiny-random: a second quickstart run
leaves the first one's results alone, the quickstart keeps no model files (`keep: none`), a run keeps
its last weight version and no checkpoint by default, and with `keep: checkpoint` only the last
checkpoint and weight version and still resumes from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
QS = ROOT / "examples" / "quickstart"


def _train(recipe: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(recipe), *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _tiny_quickstart(tmp: Path) -> Path:
    """The quickstart recipe as shipped (its run_dir default included), on tiny-random, 1 step, 4 tasks."""
    recipe = yaml.safe_load((QS / "recipe.yaml").read_text())
    lines = (QS / "train.jsonl").read_text().splitlines()
    (tmp / "train.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (tmp / "eval.jsonl").write_text("\n".join(lines[4:6]) + "\n")
    recipe.update(model="tiny-random", steps=1, batch_size=2, group_size=2, eval_samples=1)
    recipe["agent"].update(target=f"{QS / 'agent.py'}:agent", concurrency=4)
    recipe["upstream"]["max_batch_size"] = 8
    assert "run_dir" not in recipe, "the quickstart runs under ./runs by default"
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_a_second_quickstart_run_leaves_the_first_runs_results_unchanged(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    recipe = _tiny_quickstart(tmp_path)
    work = tmp_path / "work"  # the current directory: runs go under ./runs, not next to the recipe
    work.mkdir()
    first = _train(recipe, cwd=work)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    runs = work / "runs" / "quickstart"
    (run1,) = [p for p in runs.iterdir() if not p.is_symlink()]
    saved = {n: (run1 / n).read_bytes() for n in ("summary.md", "metrics.jsonl", "reward_curve.png")}

    second = _train(recipe, cwd=work)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    run2 = (runs / "latest").resolve()
    assert run2 != run1 and run2.parent == runs and sorted(p.name for p in runs.iterdir()) == sorted(
        [run1.name, run2.name, "latest"]
    )
    assert {n: (run1 / n).read_bytes() for n in saved} == saved, "the second run changed the first's results"
    # the second run's files hold only the second run: one step-0 evaluation, one training step
    rows = _rows(run2)
    assert [(r["kind"], r["step"]) for r in rows if r["kind"] == "train"] == [("train", 1)]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1]
    assert {r["run"] for r in rows} == {f"quickstart-{run2.name}"}
    assert f"run dir: {run2}" in second.stderr and "run directory size" in (run2 / "summary.md").read_text()
    # the quickstart keeps no model files (recipe `keep: none`): its record, and the tokenizer to read it
    for run in (run1, run2):
        assert not (run / "checkpoint").exists() and not (run / "weights").exists()
        assert (run / "tokenizer" / "tokenizer.json").is_file()
    (size,) = [line for line in second.stderr.splitlines() if line.startswith(f"run dir: {run2} (")]
    assert "store" in size and "checkpoint" not in size and "weights" not in size, size
    assert not (QS / "runs").exists() and not (tmp_path / "runs").exists()
    assert "UserWarning" not in first.stderr + second.stderr

    from tracegym.gateway.traces.store import Store

    for run, other in ((run1, run2), (run2, run1)):  # each store holds its own run only
        store = Store.open(f"sqlite:///{run / 'tracegym.db'}")
        try:
            assert store.list_metrics(f"quickstart-{run.name}") and not store.list_metrics(f"quickstart-{other.name}")
        finally:
            store.close()


def _length_recipe(tmp: Path, **extra: object) -> Path:
    tasks = [{"task_id": f"t{i}", "input": {"question": f"Say {i}"}} for i in range(10)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:8]))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[8:]))
    recipe = {
        "name": "keep", "model": "tiny-random",
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl"},
        "agent": {"target": "tests.e2e.agents.length_agent:agent", "concurrency": 8},
        "group_size": 4, "batch_size": 2, "eval_interval": 0, "eval_samples": 1,
        "optim": {"lr": 1e-3, "dtype": "float32"}, "upstream": {"engine_dtype": "float32"},
        "run_dir": "run", **extra,
    }  # fmt: skip
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _versions(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "weights").iterdir()) if (run / "weights").is_dir() else []


@pytest.mark.slow
def test_only_the_last_checkpoint_and_weight_version_remain_and_resume_works(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    recipe = _length_recipe(tmp_path, steps=3, checkpoint_interval=1, keep="checkpoint")
    res = _train(recipe, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    run = tmp_path / "run"  # run_dir is relative to the recipe, not to the current directory (ROOT)
    swaps = sum(1 for r in _rows(run) if r["kind"] == "train" and "loss" in r)
    assert sorted(p.name for p in run.iterdir()) == [
        "admin_key", "checkpoint", "logs", "metrics.jsonl", "reward_curve.png", "summary.md", "tracegym.db",
        *(["weights"] if swaps else []),
    ]  # fmt: skip
    assert _versions(run) == ([f"v{swaps}"] if swaps else [])
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["extra"]["step"] == 3  # the checkpoint of the last step replaced those of steps 1 and 2

    again = _train(recipe, cwd=ROOT)  # a second run into the same fixed directory is refused
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--resume" in again.stderr

    res = _train(recipe, "--resume", "--steps", "4", cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = _rows(run)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    swaps = sum(1 for r in rows if r["kind"] == "train" and "loss" in r)
    assert _versions(run) == ([f"v{swaps}"] if swaps else [])
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "no aside or temporary copies left"


@pytest.mark.slow
def test_by_default_an_ended_run_keeps_its_weights_and_no_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = _length_recipe(tmp_path, steps=2, checkpoint_interval=1)
    res = _train(recipe, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    run = tmp_path / "run"
    swaps = sum(1 for r in _rows(run) if r["kind"] == "train" and "loss" in r)
    assert sorted(p.name for p in run.iterdir()) == [
        "admin_key", "logs", "metrics.jsonl", "reward_curve.png", "summary.md", "tracegym.db",
        *(["weights"] if swaps else []),
    ]  # fmt: skip
    assert _versions(run) == ([f"v{swaps}"] if swaps else [])
    res = _train(recipe, "--resume", "--steps", "3", cwd=ROOT)  # an ended run without a checkpoint
    assert res.returncode == 2 and "--resume: no checkpoint" in res.stderr and "keep: checkpoint" in res.stderr
