"""AdamW and the learning-rate schedule (linear warmup, then constant, linear or cosine decay).

The schedule is a pure function of the step (``lr_multiplier``) so that resuming from a checkpoint needs
only the step count, and so that it can be tested without an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

Schedule = Literal["constant", "linear", "cosine"]


@dataclass(slots=True, frozen=True)
class OptimSettings:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    total_steps: int | None = None
    """Needed by the ``linear`` and ``cosine`` decays (they reach ``min_lr_ratio × lr`` at this step)."""
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule must be one of constant, linear, cosine; got {self.schedule!r}")
        if self.schedule != "constant" and (
            self.total_steps is None or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"schedule {self.schedule!r} needs total_steps > warmup_steps "
                f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})"
            )
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")


def lr_multiplier(step: int, s: OptimSettings) -> float:
    """Factor on ``s.lr`` for optimizer step ``step`` (0-based). Warmup goes linearly from ``1/(w+1)``
    (never 0, so step 0 already learns) to 1 over ``warmup_steps`` steps."""
    if step < s.warmup_steps:
        return (step + 1) / (s.warmup_steps + 1)
    if s.schedule == "constant":
        return 1.0
    assert s.total_steps is not None  # checked in OptimSettings
    progress = min(1.0, (step - s.warmup_steps) / (s.total_steps - s.warmup_steps))
    decay = 1.0 - progress if s.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * decay


def build_optimizer(params: Iterable[torch.nn.Parameter], s: OptimSettings) -> torch.optim.AdamW:
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters")
    return torch.optim.AdamW(trainable, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)


def set_lr(opt: torch.optim.Optimizer, step: int, s: OptimSettings) -> float:
    """Set every group's lr for ``step`` and return it."""
    lr = s.lr * lr_multiplier(step, s)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr
