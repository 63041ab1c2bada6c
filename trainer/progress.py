"""What a run shows and leaves behind: a progress line per step (with ETA), metric sinks (JSONL in the
run dir, the store through the gateway, optional TensorBoard/W&B), a summary table and a reward-curve PNG."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

SHOWN = ("reward_mean", "pass_rate", "loss", "kl", "clip_frac", "mismatch", "swap_s", "tokens_per_s")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Progress:
    """One line per step: ``step 12/60 | reward 0.41 | loss ... | eta 3m05s``; redrawn in place on a TTY."""

    def __init__(self, total: int, *, out: TextIO | None = None, start_step: int = 0) -> None:
        self.total = total
        self.out = out or sys.stderr
        self.t0 = time.monotonic()
        self.start_step = start_step
        self.tty = self.out.isatty()

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        left = (time.monotonic() - self.t0) / done * (self.total - step)
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def status(self, text: str) -> None:
        """A transient status (e.g. 'generating 17/32') on a TTY; nothing otherwise."""
        if self.tty:
            self.out.write(f"\r\033[K{text}")
            self.out.flush()

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        parts = [f"step {step}/{self.total}"]
        parts += [f"{k} {_fmt(metrics[k])}" for k in SHOWN if k in metrics]
        parts.append(f"eta {self.eta(step)}")
        line = " | ".join(parts)
        self.out.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.out.flush()

    def message(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()


class MetricSinks:
    """Fans metrics out to metrics.jsonl, the store (via a callback), TensorBoard and W&B when enabled."""

    def __init__(
        self,
        run_dir: Path,
        *,
        to_store: Callable[[int, dict], None] | None = None,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        run_name: str = "run",
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.to_store = to_store
        self.tb = None
        self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            self.tb = SummaryWriter(str(run_dir / "tb"))
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train") -> None:
        row = {"step": step, "kind": kind, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {f"{kind}/{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self.to_store:
            self.to_store(step, {**numeric})
        if self.tb:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(numeric, step=step)

    def close(self) -> None:
        """Flush and close TensorBoard and W&B (safe to call twice)."""
        tb, wb, self.tb, self.wandb = self.tb, self.wandb, None, None
        try:
            if tb:
                tb.close()
        finally:
            if wb:
                wb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def summary_table(rows: list[dict[str, Any]], *, wall_s: float) -> str:
    ev = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    lines = ["| | value |", "|---|---|"]
    if ev:
        lines.append(f"| eval reward before (step {ev[0]['step']}) | {ev[0]['reward_mean']:.3f} |")
        lines.append(f"| eval reward after (step {ev[-1]['step']}) | {ev[-1]['reward_mean']:.3f} |")
    if train:
        lines.append(f"| steps | {train[-1]['step']} |")
        for k in ("gen_s", "train_s", "swap_s"):
            vals = [r[k] for r in train if k in r]
            if vals:
                lines.append(f"| mean {k} per step | {sum(vals) / len(vals):.2f} |")
        mm = [r["mismatch"] for r in train if "mismatch" in r]
        if mm:
            lines.append(f"| mean engine/trainer logprob mismatch | {sum(mm) / len(mm):.2e} |")
    lines.append(f"| wall time | {wall_s:.0f} s |")
    return "\n".join(lines)
