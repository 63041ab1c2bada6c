"""``tracegym train RECIPE.yaml``: the whole loop.

sync:  enqueue a batch of groups → runners execute → wait for complete groups (timeout; late or failed
       rollouts dropped and counted) → fetch trajectories → advantages → update → swap weights.
async: runners never stop; the queue is kept ``2 × batch_size`` groups deep and each step trains on the
       oldest finished groups whose weight version is within ``max_staleness`` of the current one.
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tracegym.models import ModelNotFoundError, check_model_name
from tracegym.trainer.recipe import RecipeError, TrainRecipe, load_recipe, validate_recipe
from tracegym.trainer.run.build_batch import emitted_means, reward_stats, tool_parse_stats
from tracegym.trainer.run.gateway_client import TERMINAL, ControlClient, Group
from tracegym.trainer.run.loop_state import LoopState, checkpoint_dir
from tracegym.trainer.run.objective_steps import ObjectiveSteps
from tracegym.trainer.run.report import (
    MetricSinks,
    StepProgress,
    live_label,
    plot_rewards,
    read_metrics,
    summary_row,
    summary_table,
    tool_parse_warning,
)
from tracegym.trainer.run.run_dirs import (
    check_run_dir,
    disk_use,
    format_disk_use,
    open_run_dir,
    resume_dir,
    trim_run_dir,
)
from tracegym.trainer.run.services import Services, start_services
from tracegym.trainer.run.tasks import split_tasks
from tracegym.trainer.run.tracking import run_params
from tracegym.trainer.run.weight_sync import keep_last_weights, make_weight_sync
from tracegym.types import Trajectory

log = logging.getLogger(__name__)

def check_recipe(recipe: TrainRecipe) -> Any:
    """What the recipe validator cannot see on its own, checked before any process starts: the workers'
    ``TrainConfig`` is built here (a loss setting it rejects fails now, not after the engine, gateway
    and runner are up) and the advantage estimator is looked up. Returns the ``TrainConfig``."""
    from tracegym.trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from tracegym.trainer.algorithms.optim import check_schedule
    from tracegym.trainer.algorithms.registry import lookup
    from tracegym.trainer.workers.train_config import TrainConfig

    if recipe.steps < 1:
        raise RecipeError(f"steps must be >= 1, got {recipe.steps}")
    validate_recipe(recipe.model_dump())  # a recipe changed in code (model_copy) is checked like a file
    try:
        lookup(ADVANTAGE_ESTIMATORS, recipe.algorithm.advantage, "advantage estimator")
        check_schedule(recipe.optim, recipe.steps)
        return TrainConfig.from_recipe(recipe, total_steps=recipe.steps)
    except ValueError as e:
        raise RecipeError(f"invalid recipe: {e}") from None


class Trainer(ObjectiveSteps):
    judge: Any = None
    """The group judge (``tracegym.trainer.run.judge.GroupJudge``) when the recipe has ``reward.judge``."""

    def __init__(
        self,
        recipe: TrainRecipe,
        services: Services,
        model_dir: Path,
        *,
        resume: bool,
        train_cfg: Any = None,
        tasks: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
        run_id: str | None = None,
    ) -> None:
        """``train_cfg`` (from ``check_recipe``) and ``tasks`` (from ``split_tasks``) are computed here
        when not given; ``run_id`` names the run in the store (default: the recipe's name). If
        construction fails, whatever was already started is closed again."""
        self.r = recipe
        self.run_id = run_id or recipe.name
        self.services = services
        self.model_dir = model_dir
        self.train_tasks, self.eval_tasks = tasks if tasks is not None else split_tasks(recipe)
        self.rng = random.Random(recipe.data.shuffle_seed)
        order = list(range(len(self.train_tasks)))
        self.rng.shuffle(order)
        # the run's groups are ``NAME-<id>-...``: later runs name this one as an sft/dpo source by its name
        self.state = LoopState(order=order, run_id=f"{recipe.name}-{random.getrandbits(64):016x}")
        self._sources: dict[str, list[tuple[str, list[Trajectory]]]] = {}
        self.ckpt_dir = checkpoint_dir(recipe, resume=resume)
        train_cfg = train_cfg if train_cfg is not None else check_recipe(recipe)
        self._eval_skip_noted = False
        try:
            self._start(recipe, services, model_dir, train_cfg, resume=resume)
        except BaseException:
            self.close()
            raise

    def _start(self, recipe: TrainRecipe, services: Services, model_dir: Path, train_cfg: Any, *, resume: bool) -> None:
        self.ctl = ControlClient(services.gateway_url, api_key=services.admin_key)
        self.sinks = MetricSinks(
            recipe.run_dir,
            to_store=lambda step, m: self.ctl.add_metrics(self.run_id, step, m),
            tensorboard=recipe.tensorboard,
            wandb_project=recipe.wandb_project,
            run_name=self.run_id,
            mlflow=recipe.mlflow,
            params=run_params(recipe),
        )
        from tracegym.trainer.workers.group import WorkerGroup
        from tracegym.trainer.workers.ray_cluster import JoinError, PlacementError

        try:
            self.workers = WorkerGroup(
                model_dir,
                num_workers=recipe.workers,
                train_cfg=train_cfg,
                use_ray=recipe.use_ray or recipe.workers > 1 or recipe.ray is not None,
                ray_settings=recipe.ray,
            )
        except (PlacementError, JoinError) as e:  # one line, exit 2: the recipe's ray section or environment
            raise RecipeError(str(e)) from None
        if recipe.ray is not None and recipe.ray.address is not None:
            print(f"ray: joined the cluster at {recipe.ray.address}", file=sys.stderr, flush=True)
        if recipe.ray is not None and recipe.ray.placement is not None:
            print(f"ray: {recipe.workers} ranks placed {recipe.ray.placement} on nodes {', '.join(self.workers.nodes)}",
                  file=sys.stderr, flush=True)
        self.lora = getattr(train_cfg, "lora", None)
        self.swap = make_weight_sync(recipe, services.gateway_url, services.admin_key, self.lora)
        if resume:
            from tracegym.trainer.workers.lora import LoraError

            try:
                self.state = LoopState.from_dict(self.workers.load_checkpoint(self.ckpt_dir))
            except LoraError as e:
                raise RecipeError(f"--resume: {e}") from None
            self.rng.setstate(self.state.rng_state)
            if len(self.state.order) != len(self.train_tasks):
                raise RecipeError("--resume: the training data changed since the checkpoint was written")
            if self.state.weight_version:
                self._swap_to_current()  # the upstream may have restarted with the base weights
        self.progress = StepProgress(
            recipe.steps,
            start_step=self.state.step,
            eval_interval=recipe.eval_interval,
            eval_steps=recipe.phase_ends(),
            evaluates=bool(self.eval_tasks),
            step_rollouts=recipe.batch_size * recipe.group_size,
            eval_rollouts=len(self.eval_tasks) * recipe.eval_samples,
        )
        if recipe.reward.judge is not None:  # docs/agents.md: group judge rewards
            from tracegym.trainer.run.judge import GroupJudge

            self.judge = GroupJudge(self.ctl, recipe.reward, gateway_url=services.gateway_url, model=recipe.model)

    # --- data -------------------------------------------------------------------------------------
    def group_ids(self, kind: str, n: int) -> list[str]:
        """Ids of the next ``n`` groups: training groups by the count of tasks drawn (``next_tasks``, call
        it after), evaluation groups by step."""
        if kind == "train":
            return [f"{self.state.run_id}-train-{self.state.drawn + k}" for k in range(n)]
        return [f"{self.state.run_id}-{kind}{self.state.step}-{k}" for k in range(n)]

    def enqueue_train(self, n: int) -> list[Group]:
        ids = self.group_ids("train", n)
        tasks = self.next_tasks(n)
        self.state.drawn += n
        return self.ctl.enqueue(tasks, group_size=self.r.group_size, split="train", group_ids=ids)

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
    def _gen_status(self, *, evaluating: bool = False) -> Callable[[list[Group]], None]:
        """The poll callback while groups run: checks the children are alive, shows the live line."""
        t0 = time.monotonic()

        def poll(groups: list[Group]) -> None:
            self.services.check_alive()
            n = sum(len(g.rollout_ids) for g in groups)
            done = sum(1 for g in groups for s in g.statuses.values() if s in TERMINAL)
            self.progress.status(live_label(step=self.state.step, total=self.r.steps, evaluating=evaluating,
                                            done=done, n=n, elapsed_s=time.monotonic() - t0))  # fmt: skip

        return poll

    def collect_sync(self) -> tuple[list[Group], dict[str, float]]:
        groups = self.enqueue_train(self.r.batch_size)
        t0 = time.monotonic()
        self.ctl.wait(groups, timeout=self.r.group_timeout_s, on_poll=self._gen_status())
        return groups, {"gen_s": time.monotonic() - t0}

    def run_step(
        self, groups: list[Group], info: dict[str, float], fetched: dict[str, Trajectory] | None = None
    ) -> dict[str, float]:
        """Train on ``groups``' completed rollouts with the step's objective. ``fetched`` holds
        trajectories already downloaded (async mode fetches them to check staleness); without it they
        are fetched here."""
        ids = [rid for g in groups for rid, s in g.statuses.items() if s == "completed"]
        if fetched is None:
            trajs = {t.rollout_id: t for t in self.ctl.trajectories(ids)}
        else:
            trajs = {rid: fetched[rid] for rid in ids if rid in fetched}
        judged: dict[str, float] = {}
        if self.judge is not None:  # rewards become agent_weight * agent + weight * judge; failures left out
            trajs, judged = self.judge.apply([(g.group_id, [trajs[r] for r in g.rollout_ids if r in trajs])
                                              for g in groups])
        metrics: dict[str, float] = {**info, **judged, **tool_parse_stats(self.ctl.tool_parse(groups))}
        metrics["dropped_rollouts"] = float(sum(len(g.rollout_ids) for g in groups) - len(trajs))
        return self.train_groups(
            self.objective(), [(g.group_id, [trajs[r] for r in g.rollout_ids if r in trajs]) for g in groups], metrics
        )

    def _swap_to_current(self) -> dict[str, float]:
        """Write the weights and load them into the upstream as the current version; returns its seconds:
        ``swap_s`` in all, ``swap_save_s`` writing (or broadcasting) them, ``swap_update_s`` the gateway's swap."""
        r = self.swap.push(self.workers, self.state.weight_version)
        return {"swap_s": r.total_s, "swap_save_s": r.save_s, "swap_update_s": r.update_s}

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Sample the held-out tasks and log their rewards; ``{}`` (nothing enqueued) without any."""
        if not self.eval_tasks:
            if not self._eval_skip_noted:
                self.progress.message("no held-out tasks: evaluation is skipped for this run")
                self._eval_skip_noted = True
            return {}
        t0 = time.monotonic()
        groups = self.ctl.enqueue(self.eval_tasks, group_size=self.r.eval_samples, split="eval",
                                  group_ids=self.group_ids("eval", len(self.eval_tasks)))
        self.ctl.wait(groups, timeout=self.r.group_timeout_s * 2, on_poll=self._gen_status(evaluating=True))
        rewards = [v if v is not None else 0.0 for g in groups for v in g.rewards.values()]
        n = sum(len(g.rollout_ids) for g in groups)
        done = self.ctl.completed_rollouts(groups)
        m = {
            **reward_stats(rewards),
            "completed": float(len(rewards)),
            "failed": float(n - len(rewards)),
            **emitted_means(done),  # the agent's tg.emit numbers, averaged
            **tool_parse_stats(r["tool_parse"] for r in done if "tool_parse" in r),
            "eval_s": time.monotonic() - t0,
        }
        self.sinks.log(self.state.step, m, kind="eval")
        self.progress.evaluated(
            f"eval @ step {self.state.step}: reward {m['reward_mean']:.3f} pass {m['pass_rate']:.2f} "
            f"({len(rewards)}/{n} rollouts, {m['eval_s']:.0f}s)",
            m["eval_s"],
        )
        if (warning := tool_parse_warning(m, f"eval @ step {self.state.step}")) is not None:
            self.progress.message(warning)
        return m

    # --- the loop ---------------------------------------------------------------------------------
    def checkpoint(self, pending: list[Group] | None = None) -> None:
        self.state.rng_state = self.rng.getstate()
        self.state.pending = [{"group_id": g.group_id, "task_id": g.task_id, "rollout_ids": g.rollout_ids,
                               "split": g.split} for g in pending or []]
        self.workers.save_checkpoint(self.ckpt_dir, extra=self.state.to_dict())

    def run(self) -> dict[str, Any]:
        t_start = time.monotonic()
        if self.state.step == 0:
            self.evaluate()
        pending = [Group(**g) for g in self.state.pending]
        while self.state.step < self.r.steps:
            fetched: dict[str, Trajectory] | None = None
            t_step = time.monotonic()
            objective = self.objective()
            if self.offline(objective):
                metrics = self.run_offline_step(objective)
            else:
                if self.r.mode == "sync":
                    groups, info = self.collect_sync()
                else:
                    groups, info, pending, fetched = self.collect_async(pending)
                metrics = self.run_step(groups, info, fetched)
            if self.r.phases:
                metrics["phase"] = float(self.r.phase_index(self.state.step - 1))
            metrics["step_s"] = time.monotonic() - t_step
            self.sinks.log(self.state.step, metrics)
            self.progress.step(self.state.step, metrics)
            if (
                (self.r.eval_interval and self.state.step % self.r.eval_interval == 0)
                or self.state.step in self.r.phase_ends()
            ) and self.state.step < self.r.steps:
                self.evaluate()
            if self.r.checkpoint_interval and self.state.step % self.r.checkpoint_interval == 0:
                self.checkpoint(pending)
        final = self.evaluate()
        keep_last_weights(self.r, self.swap, self.workers, self.state.weight_version)
        if self.r.keep == "checkpoint":  # else the run directory keeps no checkpoint once the run has ended
            self.checkpoint(pending)
        return self.finish(final, time.monotonic() - t_start)

    def collect_async(
        self, pending: list[Group]
    ) -> tuple[list[Group], dict[str, float], list[Group], dict[str, Trajectory]]:
        """Up to ``batch_size`` finished groups within ``max_staleness``, the step info, the groups still
        pending, and the trajectories fetched on the way (for ``run_step``)."""
        want = 2 * self.r.batch_size
        if len(pending) < want:
            pending += self.enqueue_train(want - len(pending))
        t0 = time.monotonic()
        deadline = t0 + self.r.group_timeout_s
        poll = self._gen_status()
        while True:
            self.ctl.refresh(pending)
            poll(pending)
            done = [g for g in pending if g.done]
            if len(done) >= self.r.batch_size or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        take = done[: self.r.batch_size]
        rest = [g for g in pending if g not in take]
        fresh, stale, fetched = self._split_stale(take)
        info = {"gen_s": time.monotonic() - t0, "stale_groups": float(len(stale))}
        return fresh, info, rest, fetched

    def _split_stale(
        self, groups: list[Group]
    ) -> tuple[list[Group], list[Group], dict[str, Trajectory]]:
        """Groups whose oldest weight version is within ``max_staleness`` of the current one, the others,
        and the completed trajectories of all of them by rollout id (fetched once, reused for training)."""
        ids = [rid for g in groups for rid, s in g.statuses.items() if s == "completed"]
        fetched = {t.rollout_id: t for t in self.ctl.trajectories(ids)}
        oldest: dict[str, int] = {}
        for rid, t in fetched.items():
            vs = [int(v) for s in t.sequences for v in s.weight_versions if str(v).isdigit()]
            if vs:
                oldest[rid] = min(vs)
        floor = self.state.weight_version - self.r.max_staleness
        fresh, stale = [], []
        for g in groups:
            (stale if any(oldest.get(r, floor) < floor for r in g.rollout_ids) else fresh).append(g)
        return fresh, stale, fetched

    def finish(self, final: dict[str, float], wall_s: float) -> dict[str, Any]:
        """Summary and plot, from this run's own rows only (``read_metrics(run=...)``). The directory's
        size is added by ``train`` once the gateway has stopped (its SQLite WAL is folded in by then)."""
        rows = read_metrics(self.r.run_dir / "metrics.jsonl", run=self.run_id)
        png = plot_rewards(rows, self.r.run_dir / "reward_curve.png")
        table = summary_table(rows, wall_s=wall_s)
        (self.r.run_dir / "summary.md").write_text(table + "\n")
        self.progress.message("\n" + table + f"\n\nreward curve: {png}")
        self.sinks.completed = True
        self.sinks.close()
        return {"final": final, "wall_s": wall_s, "run_dir": str(self.r.run_dir)}

    def close(self) -> None:
        """Stop the workers and close the clients and metric sinks, in reverse order of creation. Best
        effort (one failing does not keep the others open), safe on a partly built Trainer and twice."""
        for attr, method in (("workers", "shutdown"), ("swap", "close"), ("judge", "close"), ("sinks", "close"),
                             ("ctl", "close")):
            obj = self.__dict__.pop(attr, None)
            if obj is None:
                continue
            try:
                getattr(obj, method)()
            except Exception:
                log.warning("closing the trainer's %s failed", attr, exc_info=True)


def train(
    recipe: TrainRecipe, *, recipe_dir: Path, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Run the recipe in its own run directory (``run_dirs``). Everything that can be checked without the
    services is checked before any of them starts (``RecipeError``): the algorithm settings, the datasets,
    the run directory, the checkpoint to resume from."""
    from tracegym.modelfiles.load import decide_cpu_bf16
    from tracegym.modelfiles.prepare import prepare_model

    assert recipe.run_dir is not None, "load_recipe resolves run_dir"
    check_model_name(recipe.model)  # a misspelt name fails with a "did you mean" before torch is imported
    train_cfg = check_recipe(recipe)
    tasks = split_tasks(recipe)
    check_run_dir(recipe.run_dir, resume=resume, overwrite=overwrite)
    if resume:
        checkpoint_dir(recipe.model_copy(update={"run_dir": resume_dir(recipe.run_dir)}), resume=True)
    model_dir = prepare_model(recipe.model)
    if recipe.distill is not None and "distill" in recipe.objectives():  # a teacher of another vocabulary fails here
        from tracegym.trainer.run.teacher import prepare_teacher

        train_cfg.teacher_path = str(prepare_teacher(recipe.distill.teacher, model_dir))
    if train_cfg.lora is not None:  # target modules the model lacks fail here, before any process starts
        from tracegym.trainer.workers.lora import LoraError, check_model

        try:
            check_model(train_cfg.lora, model_dir)
        except LoraError as e:
            raise RecipeError(str(e)) from None
    run = open_run_dir(recipe.run_dir, recipe.name, resume=resume, overwrite=overwrite)
    store = recipe.store.replace("{run_dir}", str(run.path))
    recipe = recipe.model_copy(update={"run_dir": run.path, "store": store})
    print(f"run dir: {run.path}", file=sys.stderr, flush=True)
    if "bfloat16" in (recipe.optim.dtype, recipe.upstream.engine_dtype):  # else nothing asks: no timing
        decide_cpu_bf16()  # one bf16-or-fp32 decision for this process, its engines and its Ray workers
    with start_services(recipe, model_dir, recipe_dir) as services:
        key_note = f" (admin key: {recipe.run_dir / 'admin_key'})" if services.admin_key else ""
        print(f"trace inspector: {services.gateway_url}/ui/runs/{quote(run.run_id, safe='')}{key_note}",
              file=sys.stderr, flush=True)
        trainer = Trainer(
            recipe, services, model_dir, resume=resume, train_cfg=train_cfg, tasks=tasks, run_id=run.run_id
        )
        try:
            result = trainer.run()
        finally:
            trainer.close()
    trim_run_dir(run.path, recipe.keep, model_dir)  # the engine has stopped: the weights are free to go
    disk = format_disk_use(disk_use(run.path))
    with (run.path / "summary.md").open("a") as f:  # the summary ends with its table: one more row
        f.write(summary_row("run directory size", disk) + "\n")
    print(f"run dir: {run.path} ({disk})", file=sys.stderr, flush=True)
    return result


def main(args: argparse.Namespace) -> int:
    """``tracegym train``. A recipe, dataset, checkpoint or model that cannot be used is a one-line error
    on stderr and exit code 2 (no traceback)."""
    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"tracegym train: {e}", file=sys.stderr)
        return 2
    # SIGTERM (e.g. from a job scheduler) unwinds like Ctrl-C, so the engine, gateway and runner are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.steps is not None:
        recipe = recipe.model_copy(update={"steps": args.steps})
    try:
        train(recipe, recipe_dir=Path(args.recipe).resolve().parent, resume=args.resume,
              overwrite=getattr(args, "overwrite", False))  # fmt: skip
    except (RecipeError, ModelNotFoundError) as e:
        print(f"tracegym train: {e}", file=sys.stderr)
        return 2
    return 0
