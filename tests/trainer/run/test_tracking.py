"""The run's parameters and the trackers beside metrics.jsonl, each with the real library writing real
files: MLflow (a local store file in the run directory), W&B in offline mode, TensorBoard when installed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tracegym.trainer.recipe import TrainRecipe, validate_recipe
from tracegym.trainer.run.report import MetricSinks
from tracegym.trainer.run.tracking import file_digest, run_params
from tracegym.trainer.settings import MlflowConfig


def _recipe(tmp: Path, **extra: object) -> TrainRecipe:
    (tmp / "train.jsonl").write_text('{"input": 1}\n')
    raw = {"model": "tiny-random", "data": {"path": str(tmp / "train.jsonl")}, "agent": {"target": "a:b"}, **extra}
    return validate_recipe(raw)


def test_params_name_the_objective_phases_and_the_datasets(tmp_path: Path) -> None:
    r = _recipe(tmp_path, phases=[{"objective": "sft", "steps": 2}, {"objective": "grpo", "steps": 3}],
                sft={"runs": ["demos", "quickstart"], "min_reward": 1.0})
    p = run_params(r)
    assert p["objective"] == "sft+grpo" and p["steps"] == "5"
    assert json.loads(p["phases"]) == [{"objective": "sft", "steps": 2}, {"objective": "grpo", "steps": 3}]
    assert p["sft.runs"] == "demos,quickstart" and p["sft.min_reward"] == "1.0"
    assert p["data.sha256"] == file_digest(tmp_path / "train.jsonl") and len(p["data.sha256"]) == 16
    assert p["algorithm.advantage"] == "grpo" and "dpo.beta" not in p and "distill.teacher" not in p
    d = run_params(_recipe(tmp_path, objective="distill", distill={"teacher": "smollm2-135m"}))
    assert d["distill.teacher"] == "smollm2-135m" and d["objective"] == "distill" and "phases" not in d
    assert run_params(_recipe(tmp_path, objective="dpo"))["dpo.runs"] == "online"


def test_mlflow_gets_params_metrics_and_the_end_of_the_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    sinks = MetricSinks(tmp_path, mlflow=MlflowConfig(experiment="tests"), run_name="r1",
                        params={"objective": "sft", "data.sha256": "abc"})
    sinks.log(1, {"loss": 1.5, "reward_mean": 0.25})
    sinks.log(2, {"loss": 1.0, "reward_mean": 0.5})
    sinks.log(2, {"reward_mean": 0.75}, kind="eval")
    run_id = sinks.mlflow.run_id
    sinks.completed = True  # what the trainer sets once the run is done
    sinks.close()
    sinks.close(finished=False)  # a second close does nothing
    assert (tmp_path / "mlflow.db").stat().st_size > 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # read back from the file
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params == {"objective": "sft", "data.sha256": "abc"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 1.5), (2, 1.0)]
    assert run.data.metrics["eval/reward_mean"] == 0.75
    assert client.get_experiment(run.info.experiment_id).name == "tests"


def test_a_run_closed_before_it_was_done_is_failed_in_mlflow(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    sinks = MetricSinks(tmp_path, mlflow=MlflowConfig(), run_name="r2")
    sinks.log(1, {"loss": 2.0})
    run_id = sinks.mlflow.run_id
    sinks.close()  # closed before the run was done (an error, Ctrl-C)
    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FAILED"


def test_wandb_offline_writes_the_run_with_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = MetricSinks(tmp_path, wandb_project="tg-tests", run_name="r3", params={"objective": "dpo"})
    sinks.log(1, {"loss": 0.69})
    sinks.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")  # the run's records (protobuf): its config and history in it
    deadline = time.monotonic() + 30  # wandb's service process may still be writing it when finish returns
    while b"train/loss" not in (data := log.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"objective" in data and b"dpo" in data and b"train/loss" in data


def test_tensorboard_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sinks = MetricSinks(tmp_path, tensorboard=True, params={"objective": "grpo"})
    sinks.log(1, {"loss": 0.5})
    sinks.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
