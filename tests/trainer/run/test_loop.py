"""The training loop's checks and bookkeeping without a model or services: recipe validation (at load time
and before any process starts), the task split, evaluation without held-out tasks, async trajectories
fetched once, cleanup of a partly built Trainer, and ``tracegym train``'s exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from tracegym.trainer.recipe import RecipeError, load_recipe
from tracegym.trainer.run import loop
from tracegym.trainer.run import tasks as datasets
from tracegym.trainer.run.gateway_client import Group
from tracegym.trainer.run.report import StepProgress, skipped_reason
from tracegym.types import Sequence, Trajectory


def _write(tmp: Path, n_tasks: int = 12, **fields: Any) -> Path:
    import yaml

    (tmp / "train.jsonl").write_text(
        "".join(json.dumps({"task_id": f"t{i}", "input": {"q": i}}) + "\n" for i in range(n_tasks))
    )
    recipe = {
        "model": "tiny-random",
        "data": {"path": "train.jsonl"},
        "agent": {"target": "agent:run"},
        "run_dir": str(tmp / "run"),
        **fields,
    }
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _load_error(tmp: Path, **fields: Any) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp, **fields))
    return str(err.value)


# ------------------------------------------------------------------------------------ recipe validation


def test_algorithm_names_are_checked_at_load_time(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, algorithm={"advantage": "grpoo", "loss": "ppo", "agg": "mean"})
    assert "algorithm.advantage" in msg and "unknown advantage estimator 'grpoo'" in msg and "rloo" in msg
    assert "algorithm.loss" in msg and "unknown policy loss 'ppo'" in msg and "cispo" in msg
    assert "algorithm.agg" in msg and "unknown loss aggregation 'mean'" in msg and "token-mean" in msg
    recipe = load_recipe(_write(tmp_path, algorithm={"advantage": "rloo", "loss": "gspo"}))
    assert recipe.algorithm.advantage == "rloo" and recipe.algorithm.loss == "gspo"


def test_clip_low_has_an_upper_bound(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, algorithm={"clip_low": 1.5, "cispo_clip_low": 2.0})
    assert "algorithm.clip_low" in msg and "algorithm.cispo_clip_low" in msg
    assert load_recipe(_write(tmp_path, algorithm={"clip_low": 1.0})).algorithm.clip_low == 1.0


def test_group_size_message_shows_with_the_other_errors(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, group_size=1, agent={"target": "nocolon"})
    assert "group_size" in msg and "compares rollouts of the same task" in msg
    assert "agent" in msg and "module:function" in msg


def test_check_recipe_builds_the_train_config(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, algorithm={"loss": "cispo", "clip_high": 0.28}))
    cfg = loop.check_recipe(recipe)
    assert cfg.algorithm.loss == "cispo" and cfg.algorithm.clip_high == 0.28 and cfg.total_steps == recipe.steps
    # model_copy skips validation: check_recipe still catches what the workers would reject
    bad = recipe.model_copy(update={"algorithm": recipe.algorithm.model_copy(update={"loss": "nope"})})
    with pytest.raises(RecipeError, match="unknown policy loss 'nope'"):
        loop.check_recipe(bad)
    bad = recipe.model_copy(update={"algorithm": recipe.algorithm.model_copy(update={"advantage": "x"})})
    with pytest.raises(RecipeError, match="unknown advantage estimator 'x'"):
        loop.check_recipe(bad)
    with pytest.raises(RecipeError, match="steps must be >= 1"):
        loop.check_recipe(recipe.model_copy(update={"steps": 0}))


def _no_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if ``train`` gets as far as preparing the model or starting a process."""

    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("train() must fail before preparing the model or starting any process")

    import tracegym.modelfiles.prepare as models

    monkeypatch.setattr(models, "prepare_model", forbidden)
    monkeypatch.setattr(loop, "start_services", forbidden)


def test_train_fails_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_services(monkeypatch)
    recipe = load_recipe(_write(tmp_path))
    bad = recipe.model_copy(update={"algorithm": recipe.algorithm.model_copy(update={"agg": "nope"})})
    with pytest.raises(RecipeError, match="unknown loss aggregation"):
        loop.train(bad, recipe_dir=tmp_path)
    missing = recipe.model_copy(update={"data": recipe.data.model_copy(update={"path": tmp_path / "no.jsonl"})})
    with pytest.raises(RecipeError, match="dataset not found"):
        loop.train(missing, recipe_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    empty = recipe.model_copy(update={"data": recipe.data.model_copy(update={"path": tmp_path / "empty.jsonl"})})
    with pytest.raises(RecipeError, match="dataset is empty"):
        loop.train(empty, recipe_dir=tmp_path)
    with pytest.raises(RecipeError, match="--resume: no checkpoint"):
        loop.train(recipe, recipe_dir=tmp_path, resume=True)


def _main(recipe: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--resume", action="store_true")
    old = signal.getsignal(signal.SIGTERM)
    try:
        return loop.main(parser.parse_args([str(recipe), *extra]))
    finally:
        signal.signal(signal.SIGTERM, old)


def test_main_reports_recipe_and_model_errors_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(loop, "start_services", lambda *_a, **_k: pytest.fail("no process may start"))
    assert _main(_write(tmp_path, algorithm={"loss": "nope"})) == 2
    assert "unknown policy loss 'nope'" in capsys.readouterr().err

    assert _main(_write(tmp_path), "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith("tracegym train: --resume: no checkpoint") and "Traceback" not in err

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRACEGYM_CACHE", str(tmp_path / "cache"))
    assert _main(_write(tmp_path, model="no-such-org/no-such-model")) == 2
    err = capsys.readouterr().err
    assert err.startswith("tracegym train: model 'no-such-org/no-such-model' not found")
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err


# ------------------------------------------------------------------------------------------ task split


def test_split_tasks_warns_when_the_fifth_cap_cuts_eval_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = load_recipe(_write(tmp_path, n_tasks=12, data={"path": "train.jsonl", "eval_size": 4}))
    with caplog.at_level(logging.WARNING, logger=loop.__name__):
        train, ev = datasets.split_tasks(recipe)
    assert len(ev) == 2 and len(train) == 10
    assert {t["task_id"] for t in train} | {t["task_id"] for t in ev} == {f"t{i}" for i in range(12)}
    assert "eval_size 4 cut to 2" in caplog.text

    caplog.clear()
    recipe = load_recipe(_write(tmp_path, n_tasks=4))
    with caplog.at_level(logging.WARNING, logger=loop.__name__):
        train, ev = datasets.split_tasks(recipe)
    assert ev == [] and len(train) == 4 and "no evaluation" in caplog.text

    caplog.clear()
    recipe = load_recipe(_write(tmp_path, n_tasks=12, data={"path": "train.jsonl", "eval_size": 0}))
    with caplog.at_level(logging.WARNING, logger=loop.__name__):
        train, ev = datasets.split_tasks(recipe)
    assert ev == [] and len(train) == 12 and caplog.text == ""  # asked for none: nothing to warn about


# ------------------------------------------------------------------------------ a Trainer without services


class FakeControl:
    def __init__(self, trajs: dict[str, Trajectory] | None = None) -> None:
        self.trajs = trajs or {}
        self.fetches: list[list[str]] = []
        self.enqueued: list[Any] = []
        self.group_ids: list[Any] = []
        self.closed = False

    def enqueue(self, tasks: list[dict[str, Any]], *, group_size: int, split: str,
                group_ids: list[str] | None = None) -> list[Group]:
        self.enqueued.append(tasks)
        self.group_ids.append(group_ids)
        if not tasks:
            raise AssertionError("enqueueing no tasks is a 422 from the gateway")
        return []

    def refresh(self, groups: list[Group]) -> None:
        pass

    def tool_parse(self, groups: list[Group]) -> list[dict[str, int]]:
        return []

    def trajectories(self, ids: list[str]) -> list[Trajectory]:
        self.fetches.append(list(ids))
        return [self.trajs[i] for i in ids if i in self.trajs]

    def close(self) -> None:
        self.closed = True


def test_a_resumed_run_queues_the_same_groups_again(tmp_path: Path) -> None:
    """Group ids follow the run and the tasks drawn, so the checkpointed state queues the same ids for the
    same tasks (the store then hands back the groups it has instead of running them again)."""
    ctl = FakeControl()
    t = _bare_trainer(tmp_path, ctl, batch_size=2)
    t.enqueue_train(2)
    saved = loop.LoopState.from_dict(json.loads(json.dumps({**t.state.to_dict(), "rng_state": None})))
    t.enqueue_train(2)
    resumed = _bare_trainer(tmp_path, ctl, batch_size=2)
    resumed.state = saved
    resumed.enqueue_train(2)
    assert ctl.group_ids[1] == ctl.group_ids[2] == [f"{t.state.run_id}-train-2", f"{t.state.run_id}-train-3"]
    assert ctl.enqueued[1] == ctl.enqueued[2] and ctl.group_ids[0] != ctl.group_ids[1]
    other = _bare_trainer(tmp_path, ctl, batch_size=2)  # a new run (no resume) has ids of its own
    assert other.group_ids("train", 1)[0] != ctl.group_ids[0][0]


def _bare_trainer(tmp_path: Path, ctl: FakeControl, **fields: Any) -> loop.Trainer:
    """A Trainer with its state but none of its services (``ctl`` stands in for the gateway)."""
    recipe = load_recipe(_write(tmp_path, **fields))
    t = loop.Trainer.__new__(loop.Trainer)
    t.r, t.ctl = recipe, ctl
    t.train_tasks, t.eval_tasks = datasets.split_tasks(recipe)
    t.state, t.rng = loop.LoopState(order=list(range(len(t.train_tasks)))), random.Random(0)
    t.progress = StepProgress(recipe.steps)
    t._eval_skip_noted = False
    t.services = loop.Services(gateway_url="http://unused", upstream_url="http://unused")
    return t


def test_evaluate_without_held_out_tasks_enqueues_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctl = FakeControl()
    t = _bare_trainer(tmp_path, ctl, data={"path": "train.jsonl", "eval_size": 0})
    assert t.evaluate() == {} and t.evaluate() == {}
    assert ctl.enqueued == []
    assert capsys.readouterr().err.count("evaluation is skipped") == 1


def _traj(rid: str, reward: float, version: str) -> Trajectory:
    seq = Sequence([1, 2, 3], [0, 1, 1], [None, -0.5, -0.5], weight_versions=[version])
    return Trajectory(rid, "t", reward, [seq])


def test_async_step_fetches_each_trajectory_once(tmp_path: Path) -> None:
    # at weight version 2 with max_staleness 1: group a (sampled by version 1) is fresh, b (version 0) stale
    trajs = {
        "a1": _traj("a1", 1.0, "1"), "a2": _traj("a2", 1.0, "1"),  # equal rewards: no signal, no update
        "b1": _traj("b1", 1.0, "2"), "b2": _traj("b2", 0.0, "0"),
    }  # fmt: skip
    ctl = FakeControl(trajs)
    t = _bare_trainer(tmp_path, ctl, mode="async", batch_size=2, max_staleness=1)
    t.state.weight_version = 2
    pending = [
        Group("ga", "t0", ["a1", "a2"], statuses={"a1": "completed", "a2": "completed"}),
        Group("gb", "t1", ["b1", "b2"], statuses={"b1": "completed", "b2": "completed"}),
    ]
    groups, info, rest, fetched = t.collect_async(pending)
    assert [g.group_id for g in groups] == ["ga"] and info["stale_groups"] == 1 and rest == []
    metrics = t.run_step(groups, info, fetched)
    assert len(ctl.fetches) == 1 and sorted(ctl.fetches[0]) == ["a1", "a2", "b1", "b2"]
    # only the fresh group's trajectories count: nothing was dropped, and the stale ones are not trained on
    assert metrics["dropped_rollouts"] == 0 and metrics["rollouts"] == 2 and metrics["reward_mean"] == 1.0
    # no update: the step's line says so rather than reading like a step that trained
    assert "train_s" not in metrics
    assert (skipped_reason(metrics) or "").startswith("no reward variance: every group's rollouts got equal")


# ------------------------------------------------------------------------------------------- cleanup


def test_a_failing_trainer_constructor_closes_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracegym.trainer.weights.disk as weight_sync
    import tracegym.trainer.workers.group as workers

    events: list[str] = []

    class FakeGroup:
        def __init__(self, *_: Any, **__: Any) -> None:
            events.append("workers started")

        def shutdown(self) -> None:
            events.append("workers shut down")

    class BrokenSync:
        def __init__(self, *_: Any, **__: Any) -> None:
            raise RuntimeError("weight sync failed to start")

    ctl = FakeControl()
    monkeypatch.setattr(workers, "WorkerGroup", FakeGroup)
    monkeypatch.setattr(weight_sync, "DiskWeightSync", BrokenSync)
    monkeypatch.setattr(loop, "ControlClient", lambda _url, **_kw: ctl)
    monkeypatch.setattr(loop.MetricSinks, "close", lambda self: events.append("sinks closed"))
    recipe = load_recipe(_write(tmp_path))
    services = loop.Services(gateway_url="http://unused", upstream_url="http://unused")
    recipe.run_dir.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="weight sync failed to start"):
        loop.Trainer(recipe, services, tmp_path, resume=False, train_cfg=object())
    assert events == ["workers started", "workers shut down", "sinks closed"] and ctl.closed


def test_close_closes_the_sinks_and_goes_on_after_a_failure(tmp_path: Path) -> None:
    events: list[str] = []

    class Part:
        def __init__(self, name: str, fail: bool = False) -> None:
            self.name, self.fail = name, fail

        def _done(self) -> None:
            events.append(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name} failed")

        shutdown = close = _done

    t = loop.Trainer.__new__(loop.Trainer)
    t.workers, t.swap, t.sinks, t.ctl = Part("workers", fail=True), Part("swap"), Part("sinks"), Part("ctl")
    t.close()
    t.close()  # twice is harmless
    assert events == ["workers", "swap", "sinks", "ctl"]


def test_resume_recovers_a_checkpoint_left_aside(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path))
    aside = recipe.run_dir / ".checkpoint.old"  # a save interrupted between its two renames
    aside.mkdir(parents=True)
    (aside / "trainer_state.json").write_text("{}")
    d = loop.checkpoint_dir(recipe, resume=True)
    assert d == recipe.run_dir / "checkpoint" and (d / "trainer_state.json").is_file() and not aside.exists()


def test_metrics_of_two_kinds_at_one_step_reach_the_store_together(tmp_path: Path) -> None:
    from tracegym.trainer.run.report import MetricSinks

    posted: dict[int, dict] = {}
    sinks = MetricSinks(tmp_path, to_store=lambda step, m: posted.__setitem__(step, m))
    sinks.log(5, {"reward_mean": 0.5})
    sinks.log(5, {"reward": 0.7}, kind="eval")
    sinks.log(6, {"reward_mean": 0.6})
    assert posted == {5: {"train/reward_mean": 0.5, "eval/reward": 0.7}, 6: {"train/reward_mean": 0.6}}
