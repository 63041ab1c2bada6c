"""``tracegym train RECIPE.yaml``: the whole loop.

sync:  enqueue a batch of groups → runners execute → wait for complete groups (timeout; late or failed
       rollouts dropped and counted) → fetch trajectories → advantages → update → swap weights.
async: runners never stop; the queue is kept ``2 × batch_size`` groups deep and each step trains on the
       oldest finished groups whose weight version is within ``max_staleness`` of the current one.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracegym.trainer.config import RecipeError, TrainRecipe, load_recipe
from tracegym.trainer.control import ControlClient, Group
from tracegym.trainer.infra import Infra, start_infra
from tracegym.trainer.progress import MetricSinks, Progress, plot_rewards, read_metrics, summary_table


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The recipe's JSONL tasks (the same format as ``tracegym enqueue``), with recipe-level errors."""
    from tracegym.runner import read_tasks

    if not path.is_file():
        raise RecipeError(f"dataset not found: {path}")
    try:
        tasks = read_tasks(path)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if not tasks:
        raise RecipeError(f"dataset is empty: {path}")
    return tasks


@dataclass
class LoopState:
    """What a checkpoint must restore besides the model and optimizer (saved as the checkpoint's extra)."""

    step: int = 0
    data_pos: int = 0
    order: list[int] = field(default_factory=list)
    weight_version: int = 0
    rng_state: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "data_pos", "order", "weight_version", "rng_state")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        st = cls(**{k: d[k] for k in ("step", "data_pos", "order", "weight_version", "rng_state")})
        if st.rng_state is not None:  # JSON turned random's tuple state into lists
            v, internal, g = st.rng_state
            st.rng_state = (v, tuple(internal), g)
        return st


class Trainer:
    def __init__(self, recipe: TrainRecipe, infra: Infra, model_dir: Path, *, resume: bool) -> None:
        self.r = recipe
        self.infra = infra
        self.model_dir = model_dir
        self.ctl = ControlClient(infra.gateway_url)
        self.train_tasks = load_tasks(recipe.data.path)
        if recipe.data.eval_path:
            self.eval_tasks = load_tasks(recipe.data.eval_path)
        else:
            rng = random.Random(recipe.data.shuffle_seed)
            rng.shuffle(self.train_tasks)
            n = min(recipe.data.eval_size, len(self.train_tasks) // 5)
            self.eval_tasks, self.train_tasks = self.train_tasks[:n], self.train_tasks[n:]
        self.rng = random.Random(recipe.data.shuffle_seed)
        order = list(range(len(self.train_tasks)))
        self.rng.shuffle(order)
        self.state = LoopState(order=order)
        self.ckpt_dir = recipe.run_dir / "checkpoint"
        if resume and not (self.ckpt_dir / "trainer_state.json").is_file():
            raise RecipeError(f"--resume: no checkpoint in {self.ckpt_dir}")
        self.sinks = MetricSinks(
            recipe.run_dir,
            to_store=lambda step, m: self.ctl.add_metrics(recipe.name, step, m),
            tensorboard=recipe.tensorboard,
            wandb_project=recipe.wandb_project,
            run_name=recipe.name,
        )
        from tracegym.trainer.weight_sync import DiskWeightSync  # torch/ray imported only here
        from tracegym.trainer.workers import TrainConfig, WorkerGroup

        self.workers = WorkerGroup(
            model_dir,
            num_workers=recipe.workers,
            train_cfg=TrainConfig.from_recipe(recipe, total_steps=recipe.steps),
            use_ray=recipe.use_ray or recipe.workers > 1,
        )
        self.swap = DiskWeightSync(
            infra.gateway_url, recipe.run_dir / "weights", keep=2, save_dtype=recipe.upstream.engine_dtype,
            update_path="/api/weights/update",
        )
        if resume:
            self.state = LoopState.from_dict(self.workers.load_checkpoint(self.ckpt_dir))
            self.rng.setstate(self.state.rng_state)
            if len(self.state.order) != len(self.train_tasks):
                raise RecipeError("--resume: the training data changed since the checkpoint was written")
            if self.state.weight_version:
                self._swap_to_current()  # the upstream may have restarted with the base weights
        self.progress = Progress(recipe.steps, start_step=self.state.step)

    # --- data -------------------------------------------------------------------------------------
    def next_tasks(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            if self.state.data_pos >= len(self.state.order):  # new epoch, new order
                self.state.data_pos = 0
                self.rng.shuffle(self.state.order)
            out.append(self.train_tasks[self.state.order[self.state.data_pos]])
            self.state.data_pos += 1
        return out

    # --- one step ---------------------------------------------------------------------------------
    def _gen_status(self, groups: list[Group]) -> None:
        self.infra.check_alive()
        total = sum(len(g.rollout_ids) for g in groups)
        done = sum(1 for g in groups for s in g.statuses.values() if s in ("completed", "failed"))
        self.progress.status(f"step {self.state.step + 1}/{self.r.steps} | generating {done}/{total}")

    def collect_sync(self) -> tuple[list[Group], dict[str, float]]:
        groups = self.ctl.enqueue(
            self.next_tasks(self.r.batch_size), group_size=self.r.group_size, split="train"
        )
        t0 = time.monotonic()
        self.ctl.wait(groups, timeout=self.r.group_timeout_s, on_poll=self._gen_status)
        return groups, {"gen_s": time.monotonic() - t0}

    def run_step(self, groups: list[Group], info: dict[str, float]) -> dict[str, float]:
        from tracegym.trainer.step_batch import build_train_batch

        ids = [rid for g in groups for rid, s in g.statuses.items() if s == "completed"]
        trajs = {t.rollout_id: t for t in self.ctl.trajectories(ids)}
        batch, stats = build_train_batch(
            [(g.group_id, [trajs[r] for r in g.rollout_ids if r in trajs]) for g in groups],
            advantage=self.r.algorithm.advantage,
            drop_zero_signal=self.r.algorithm.drop_zero_signal_groups,
        )
        metrics: dict[str, float] = {**info, **stats}
        metrics["dropped_rollouts"] = float(sum(len(g.rollout_ids) for g in groups) - len(trajs))
        if batch is not None:
            t0 = time.monotonic()
            metrics.update(self.workers.train_step(batch))
            metrics["train_s"] = time.monotonic() - t0
            self.state.weight_version += 1
            metrics["swap_s"] = self._swap_to_current()
        self.state.step += 1
        return metrics

    def _swap_to_current(self) -> float:
        """Write the weights and load them into the upstream as the current version; returns seconds."""
        return self.swap.push(self.workers, self.state.weight_version).total_s

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        t0 = time.monotonic()
        groups = self.ctl.enqueue(self.eval_tasks, group_size=self.r.eval_samples, split="eval")
        self.ctl.wait(groups, timeout=self.r.group_timeout_s * 2, on_poll=self._gen_status)
        rewards = [v if v is not None else 0.0 for g in groups for v in g.rewards.values()]
        n = sum(len(g.rollout_ids) for g in groups)
        m = {
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "pass_rate": sum(1 for v in rewards if v > 0) / max(1, len(rewards)),
            "completed": float(len(rewards)),
            "failed": float(n - len(rewards)),
            "eval_s": time.monotonic() - t0,
        }
        self.sinks.log(self.state.step, m, kind="eval")
        self.progress.message(
            f"eval @ step {self.state.step}: reward {m['reward_mean']:.3f} pass {m['pass_rate']:.2f} "
            f"({len(rewards)}/{n} rollouts, {m['eval_s']:.0f}s)"
        )
        return m

    # --- the loop ---------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        self.state.rng_state = self.rng.getstate()
        self.workers.save_checkpoint(self.ckpt_dir, extra=self.state.to_dict())

    def run(self) -> dict[str, Any]:
        t_start = time.monotonic()
        if self.state.step == 0:
            self.evaluate()
        pending: list[Group] = []
        while self.state.step < self.r.steps:
            if self.r.mode == "sync":
                groups, info = self.collect_sync()
            else:
                groups, info, pending = self.collect_async(pending)
            metrics = self.run_step(groups, info)
            self.sinks.log(self.state.step, metrics)
            self.progress.step(self.state.step, metrics)
            if (
                self.r.eval_interval
                and self.state.step % self.r.eval_interval == 0
                and self.state.step < self.r.steps
            ):
                self.evaluate()
            if self.r.checkpoint_interval and self.state.step % self.r.checkpoint_interval == 0:
                self.checkpoint()
        final = self.evaluate()
        self.checkpoint()
        return self.finish(final, time.monotonic() - t_start)

    def collect_async(self, pending: list[Group]) -> tuple[list[Group], dict[str, float], list[Group]]:
        want = 2 * self.r.batch_size
        if len(pending) < want:
            pending += self.ctl.enqueue(
                self.next_tasks(want - len(pending)), group_size=self.r.group_size, split="train"
            )
        t0 = time.monotonic()
        deadline = t0 + self.r.group_timeout_s
        while True:
            self.ctl.refresh(pending)
            self._gen_status(pending)
            done = [g for g in pending if g.done]
            if len(done) >= self.r.batch_size or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        take = done[: self.r.batch_size]
        rest = [g for g in pending if g not in take]
        fresh, stale = self._split_stale(take)
        return fresh, {"gen_s": time.monotonic() - t0, "stale_groups": float(len(stale))}, rest

    def _split_stale(self, groups: list[Group]) -> tuple[list[Group], list[Group]]:
        """Groups whose oldest weight version is within ``max_staleness`` of the current one."""
        ids = [rid for g in groups for rid, s in g.statuses.items() if s == "completed"]
        oldest: dict[str, int] = {}
        for t in self.ctl.trajectories(ids):
            vs = [int(v) for s in t.sequences for v in s.weight_versions if str(v).isdigit()]
            if vs:
                oldest[t.rollout_id] = min(vs)
        floor = self.state.weight_version - self.r.max_staleness
        fresh, stale = [], []
        for g in groups:
            (stale if any(oldest.get(r, floor) < floor for r in g.rollout_ids) else fresh).append(g)
        return fresh, stale

    def finish(self, final: dict[str, float], wall_s: float) -> dict[str, Any]:
        rows = read_metrics(self.r.run_dir / "metrics.jsonl")
        png = plot_rewards(rows, self.r.run_dir / "reward_curve.png")
        table = summary_table(rows, wall_s=wall_s)
        (self.r.run_dir / "summary.md").write_text(table + "\n")
        self.progress.message("\n" + table + f"\n\nreward curve: {png}\nrun dir: {self.r.run_dir}")
        self.sinks.close()
        return {"final": final, "wall_s": wall_s, "run_dir": str(self.r.run_dir)}

    def close(self) -> None:
        self.workers.shutdown()
        self.swap.close()
        self.ctl.close()


def train(recipe: TrainRecipe, *, recipe_dir: Path, resume: bool = False) -> dict[str, Any]:
    from tracegym.trainer.models import prepare_model

    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(recipe.model)
    with start_infra(recipe, model_dir, recipe_dir) as infra:
        trainer = Trainer(recipe, infra, model_dir, resume=resume)
        try:
            return trainer.run()
        finally:
            trainer.close()


def main(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"tracegym train: {e}", file=sys.stderr)
        return 2
    # SIGTERM (e.g. from a job scheduler) unwinds like Ctrl-C, so the engine, gateway and runner are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.steps is not None:
        recipe = recipe.model_copy(update={"steps": args.steps})
    train(recipe, recipe_dir=Path(args.recipe).resolve().parent, resume=args.resume)
    return 0
