"""The run as parameters (objective, phases, algorithm, the datasets and where they came from) and the
MLflow sink beside TensorBoard and W&B (``report.MetricSinks``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tracegym.trainer.settings import MlflowConfig


def file_digest(path: Path | None) -> str | None:
    """The first 16 hex digits of a file's sha256 (None for no file, or one that is not there)."""
    if path is None or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def run_params(recipe: Any) -> dict[str, str]:
    """What a tracker shows as the run's parameters: the recipe's objective and phases, the model, the
    algorithm and optimizer settings, and the datasets' provenance (task files with their sha256, the
    runs an offline objective reads, the teacher). Values are strings (MLflow's parameter type)."""
    objectives = sorted(recipe.objectives())
    p: dict[str, Any] = {
        "model": recipe.model, "objective": recipe.objective if not recipe.phases else "+".join(
            ph.objective for ph in recipe.phases),
        "phases": json.dumps([ph.model_dump() for ph in recipe.phases]) if recipe.phases else None,
        "steps": recipe.steps, "group_size": recipe.group_size, "batch_size": recipe.batch_size,
        "mode": recipe.mode, "lr": recipe.optim.lr, "lora_rank": recipe.lora.rank if recipe.lora else None,
        "data.path": str(recipe.data.path), "data.sha256": file_digest(recipe.data.path),
        "data.eval_path": str(recipe.data.eval_path) if recipe.data.eval_path else None,
        "data.eval_sha256": file_digest(recipe.data.eval_path), "store": recipe.store, "seed": recipe.seed,
    }
    if "grpo" in objectives or "distill" in objectives:
        a = recipe.algorithm
        p |= {"algorithm.advantage": a.advantage, "algorithm.loss": a.loss, "algorithm.agg": a.agg,
              "algorithm.kl_coef": a.kl_coef}
    if "sft" in objectives:
        p |= {"sft.runs": ",".join(recipe.sft.sources()) or "online", "sft.min_reward": recipe.sft.min_reward}
    if "dpo" in objectives:
        p |= {"dpo.runs": ",".join(recipe.dpo.sources()) or "online", "dpo.beta": recipe.dpo.beta,
              "dpo.min_margin": recipe.dpo.min_margin}
    if "distill" in objectives and recipe.distill is not None:
        p |= {"distill.teacher": recipe.distill.teacher, "distill.reward_weight": recipe.distill.reward_weight}
    return {k: str(v) for k, v in p.items() if v is not None}


class MlflowSink:
    """One MLflow run: parameters once, metrics per step, ended on ``close`` (FINISHED, or FAILED when
    the training did not finish)."""

    def __init__(self, cfg: MlflowConfig, run_dir: Path, run_name: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri.replace("{run_dir}", str(run_dir))
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.uri = uri
        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(k.replace(":", "_"), v, now, step) for k, v in metrics.items() if v == v]  # NaN left out
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def close(self, *, finished: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")
