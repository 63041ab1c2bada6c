"""What a training run shows and leaves behind: a line per step with ETA (``StepProgress``), metric sinks
(JSONL in the run dir, the store through the gateway, optional TensorBoard/W&B), a summary table and a
reward-curve PNG. (The runner's progress line is ``tracegym.progress``.)"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from tracegym.trainer.run.eta import eta_seconds, evals_left

SHOWN = ("reward_mean", "pass_rate", "loss", "kl", "clip_frac", "mismatch", "swap_s", "tokens_per_s",
         "tool_parse_failed")
TOOL_PARSE_WARN_RATE = 0.2
"""A step (or evaluation) whose ``tool_parse_failed`` is at least this, over at least
``TOOL_PARSE_WARN_ATTEMPTS`` replies that wrote a tool call, prints a warning line (docs/model-families.md)."""
TOOL_PARSE_WARN_ATTEMPTS = 5


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def fmt_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def live_label(*, step: int, total: int, evaluating: bool, done: int, n: int, elapsed_s: float) -> str:
    """The live line while rollouts run. ``step`` is the number of steps finished: a training step in
    progress is ``step + 1``; an evaluation is labelled with the step whose weights it samples."""
    what = f"eval @ step {step}" if evaluating else f"step {min(step + 1, total)}/{total}"
    return f"{what} | generating {done}/{n} | {fmt_duration(elapsed_s)}"


def tool_parse_warning(metrics: dict[str, Any], what: str) -> str | None:
    """The warning line for ``what`` (``step 3``, ``eval @ step 4``) when many of its tool calls did not parse
    (``TOOL_PARSE_WARN_RATE``), else None."""
    rate, attempts = metrics.get("tool_parse_failed"), metrics.get("tool_parse_attempts", 0)
    if rate is None or attempts < TOOL_PARSE_WARN_ATTEMPTS or rate < TOOL_PARSE_WARN_RATE:
        return None
    return (f"warning: {what}: {round(rate * attempts)} of {int(attempts)} replies that wrote a tool call did not "
            f"parse (tool_parse_failed {rate:.2f} >= {TOOL_PARSE_WARN_RATE}): those calls reached the agent as "
            "text, not as tool calls; the spans' tracegym.tool_parse says why (trace inspector; "
            "docs/model-families.md)")


def skipped_reason(metrics: dict[str, Any]) -> str | None:
    """Why a step did not train (its metrics have no ``train_s``: no update and no weight swap), or None
    when it trained. Read from the batch statistics the step logged."""
    if "train_s" in metrics or "loss" in metrics:
        return None
    rollouts = int(metrics.get("rollouts", 0))
    if not rollouts:
        return "no completed rollouts"
    if "pairs" in metrics:
        return f"no preference pair: no group's rewards differ enough ({rollouts} rollouts)"
    if "sft_rollouts" in metrics and not metrics["sft_rollouts"]:
        return f"no example: none of the {rollouts} rollouts passes sft.min_reward"
    if metrics.get("groups_used") == 0:
        return f"no reward variance: every group's rollouts got equal rewards ({rollouts} rollouts)"
    return f"no sampled tokens to train on ({rollouts} rollouts)"


class StepProgress:
    """One line per step: ``step 12/60 | reward 0.41 | loss ... | eta 3m05s``, and a live line while
    rollouts run (``live``): redrawn in place on a TTY, otherwise printed at most every ``interval``
    seconds and at least that often while polls keep coming (so a log file shows the run is alive)."""

    def __init__(
        self,
        total: int,
        *,
        out: TextIO | None = None,
        start_step: int = 0,
        eval_interval: int = 0,
        eval_steps: Sequence[int] = (),
        evaluates: bool = True,
        step_rollouts: int = 0,
        eval_rollouts: int = 0,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``step_rollouts`` and ``eval_rollouts``: the rollouts a step and an evaluation sample (they
        scale the steps' generation time into an evaluation's until an evaluation after the first ran);
        ``eval_steps``: steps evaluated besides every ``eval_interval``-th (the ends of phases)."""
        from tracegym.progress import Progress

        self.total = total
        self.out = out or sys.stderr
        self.start_step = start_step
        self.eval_interval = eval_interval
        self.eval_steps = tuple(eval_steps)
        self.evaluates = evaluates
        self.step_rollouts = step_rollouts
        self.eval_rollouts = eval_rollouts
        self.clock = clock
        self.step_s: list[float] = []
        self.gen_s: list[float] = []
        self.eval_s: list[float] = []
        self._live = Progress(self.out, interval=interval, clock=clock)
        self.tty = self._live.tty

    def eta_s(self, step: int) -> float | None:
        """Seconds left once step ``step``'s line is printed (``eta.eta_seconds``); None: no estimate yet."""
        return eta_seconds(
            self.step_s, self.total - step, gen_s=self.gen_s, eval_s=self.eval_s,
            evals=evals_left(step, self.total, self.eval_interval, evaluates=self.evaluates, also=self.eval_steps),
            eval_rollouts=self.eval_rollouts, step_rollouts=self.step_rollouts,
        )

    def eta(self, step: int) -> str:
        left = self.eta_s(step)
        return "?" if left is None else fmt_duration(left)

    def status(self, text: str) -> None:
        """A live status (e.g. from ``live_label``)."""
        self._live.update(text)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Print step ``step``'s line; ``metrics["step_s"]`` (the step's wall time) and ``gen_s`` (its
        rollouts' part) feed the ETA."""
        if isinstance(metrics.get("step_s"), int | float):
            self.step_s.append(float(metrics["step_s"]))
            if isinstance(metrics.get("gen_s"), int | float):
                self.gen_s.append(float(metrics["gen_s"]))
        parts = [f"step {step}/{self.total}"]
        if (why := skipped_reason(metrics)) is not None:
            parts.append(f"skipped: {why}")
        parts += [f"{k} {_fmt(metrics[k])}" for k in SHOWN if k in metrics]
        parts.append(f"eta {self.eta(step)}")
        self._live.print(" | ".join(parts))
        if (warning := tool_parse_warning(metrics, f"step {step}")) is not None:
            self._live.print(warning)

    def evaluated(self, text: str, seconds: float) -> None:
        """Print an evaluation's line; its duration feeds the ETA."""
        self.eval_s.append(seconds)
        self._live.print(text)

    def message(self, text: str) -> None:
        self._live.print(text)


class MetricSinks:
    """Fans metrics out to metrics.jsonl, the store (via a callback), TensorBoard, W&B and MLflow when
    enabled. ``params`` (``tracking.run_params``) go to each tracker once: W&B's config, MLflow's
    parameters, a TensorBoard text."""

    def __init__(
        self,
        run_dir: Path,
        *,
        to_store: Callable[[int, dict], None] | None = None,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        run_name: str = "run",
        mlflow: Any = None,
        params: dict[str, str] | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.run_name = run_name
        self.to_store = to_store
        self._posted: tuple[int, dict[str, float]] = (-1, {})
        """The step last sent to the store and its metrics: the store keeps one row per step, so a second
        kind logged at the same step (an evaluation after training) is sent merged with the first."""
        self.tb = None
        self.wandb = None
        self.mlflow = None
        self.completed = False
        """Set once the run finished: ``close`` then ends the tracker runs as finished, not failed."""
        params = params or {}
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            self.tb = SummaryWriter(str(run_dir / "tb"))
            if params:
                self.tb.add_text("params", "\n".join(f"    {k}: {v}" for k, v in sorted(params.items())), 0)
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name, dir=str(run_dir), config=params)
        if mlflow is not None:  # a ``settings.MlflowConfig``
            from tracegym.trainer.run.tracking import MlflowSink

            self.mlflow = MlflowSink(mlflow, run_dir, run_name, params)

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train") -> None:
        row = {"step": step, "kind": kind, "time": time.time(), "run": self.run_name, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {f"{kind}/{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self.to_store:
            last_step, last = self._posted
            merged = {**last, **numeric} if last_step == step else numeric
            self._posted = (step, merged)
            self.to_store(step, dict(merged))
        if self.tb:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(numeric, step=step)
        if self.mlflow:
            self.mlflow.log(step, numeric)

    def close(self, *, finished: bool | None = None) -> None:
        """Flush and close TensorBoard, W&B and MLflow (safe to call twice). The tracker runs end as
        finished when ``finished`` (default: ``completed``, which the trainer sets once the run is done),
        else as failed."""
        finished = self.completed if finished is None else finished
        tb, wb, ml, self.tb, self.wandb, self.mlflow = self.tb, self.wandb, self.mlflow, None, None, None
        try:
            if tb:
                tb.close()
        finally:
            try:
                if wb:
                    wb.finish(exit_code=0 if finished else 1)
            finally:
                if ml:
                    ml.close(finished=finished)


def read_metrics(path: Path, *, run: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (of run ``run`` only, when given: rows name their run), one per
    kind and step: a step logged twice (a resumed run repeating the steps after its checkpoint) keeps
    its last row. Ordered by step, training before the evaluation of the same step."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if run is not None:
        rows = [r for r in rows if r.get("run", run) == run]
    last = {(r.get("kind"), r.get("step")): r for r in rows}
    return sorted(last.values(), key=lambda r: (r.get("step", 0), r.get("kind") == "eval"))


def plot_rewards(rows: list[dict[str, Any]], out: Path) -> Path:
    """Reward curve (train per step, eval points) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["reward_mean"]) for r in rows if r.get("kind") == "train" and "reward_mean" in r]
    ev = [(r["step"], r["reward_mean"]) for r in rows if r.get("kind") == "eval" and "reward_mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train (sampled, per step)", alpha=0.6)
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", label="eval (held out)", linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def summary_row(label: str, value: str) -> str:
    return f"| {label} | {value} |"


def summary_table(rows: list[dict[str, Any]], *, wall_s: float) -> str:
    """The run's summary (a Markdown table; ``train`` appends the run directory's size as a last row)."""
    ev = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    lines = ["| | value |", "|---|---|"]
    if ev:
        lines.append(f"| eval reward before (step {ev[0]['step']}) | {ev[0]['reward_mean']:.3f} |")
        lines.append(f"| eval reward after (step {ev[-1]['step']}) | {ev[-1]['reward_mean']:.3f} |")
        for key in sorted({k for r in ev for k in r if k.startswith("emitted/")}):
            seen = [r for r in ev if key in r]  # what the agent reported with tg.emit: before -> after
            lines.append(f"| eval {key.removeprefix('emitted/')} (tg.emit mean) | {seen[0][key]:.3f} (step "
                         f"{seen[0]['step']}) -> {seen[-1][key]:.3f} (step {seen[-1]['step']}) |")
    if train:
        lines.append(f"| steps | {train[-1]['step']} |")
        for k in ("step_s", "gen_s", "train_s", "swap_s"):
            vals = [r[k] for r in train if k in r]
            if vals:
                label = "wall time (step_s)" if k == "step_s" else k
                lines.append(f"| mean {label} per step | {sum(vals) / len(vals):.2f} |")
        mm = [r["mismatch"] for r in train if "mismatch" in r]
        if mm:
            lines.append(f"| mean engine/trainer logprob mismatch | {sum(mm) / len(mm):.2e} |")
        tp = [r for r in train if r.get("tool_parse_attempts")]
        if tp:  # the replies that wrote a tool call and did not parse, over the whole run
            failed = sum(r["tool_parse_failed"] * r["tool_parse_attempts"] for r in tp)
            attempts = sum(r["tool_parse_attempts"] for r in tp)
            lines.append(f"| tool calls that did not parse (tool_parse_failed) | {failed / attempts:.3f} "
                         f"({round(failed)} of {round(attempts)}) |")
    lines.append(f"| wall time | {wall_s:.0f} s |")
    return "\n".join(lines)
