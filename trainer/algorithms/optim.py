"""AdamW and the learning-rate schedule (linear warmup, then constant, linear or cosine decay).

The schedule is a pure function of the step (``lr_multiplier``) so that resuming from a checkpoint needs
only the step count, and so that it can be tested without an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from tracegym.trainer.settings import OptimConfig


def check_schedule(s: OptimConfig, total_steps: int | None) -> None:
    """A decaying schedule needs to know where it ends: ``total_steps`` past the warmup."""
    if s.schedule != "constant" and (total_steps is None or total_steps <= s.warmup_steps):
        raise ValueError(f"optim.schedule {s.schedule!r} needs more steps than optim.warmup_steps "
                         f"(got steps={total_steps}, warmup_steps={s.warmup_steps})")


def lr_multiplier(step: int, s: OptimConfig, total_steps: int | None = None) -> float:
    """Factor on ``s.lr`` for optimizer step ``step`` (0-based). Warmup goes linearly from ``1/(w+1)``
    (never 0, so step 0 already learns) to 1 over ``warmup_steps`` steps; the ``linear`` and ``cosine``
    decays reach ``min_lr_ratio × lr`` at step ``total_steps``."""
    if step < s.warmup_steps:
        return (step + 1) / (s.warmup_steps + 1)
    if s.schedule == "constant":
        return 1.0
    check_schedule(s, total_steps)
    assert total_steps is not None
    progress = min(1.0, (step - s.warmup_steps) / (total_steps - s.warmup_steps))
    decay = 1.0 - progress if s.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * decay


def build_optimizer(params: Iterable[torch.nn.Parameter], s: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad; fused where they are all plain CPU tensors
    (``fused_on_cpu``)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters")
    return torch.optim.AdamW(trainable, lr=s.lr, betas=tuple(s.betas), eps=s.eps, weight_decay=s.weight_decay,
                             fused=True if fused_on_cpu(trainable) else None)


def fused_on_cpu(params: Iterable[torch.nn.Parameter]) -> bool:
    """AdamW's fused kernel for these parameters: all plain (not sharded) floating-point CPU tensors. Left to
    itself, AdamW picks its multi-tensor implementation on CUDA and its per-tensor loop on the CPU, which
    walks each parameter's moments in several passes; the fused CPU kernel updates a parameter in one
    vectorized pass (the same update up to float rounding): for SmolLM2-135M's parameters a step took
    0.06–0.09 s against 0.31–0.38 s on two cores."""
    return all(p.device.type == "cpu" and type(p.data) is torch.Tensor and p.is_floating_point() for p in params)


def set_lr(opt: torch.optim.Optimizer, step: int, s: OptimConfig, total_steps: int | None = None) -> float:
    """Set every group's lr for ``step`` and return it."""
    lr = s.lr * lr_multiplier(step, s, total_steps)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr
