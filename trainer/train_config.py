"""The trainer's settings, as the workers take them (built from a recipe by ``TrainConfig.from_recipe``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tracegym.trainer.lora import LoraSettings
from tracegym.trainer.losses import PolicyLossConfig
from tracegym.trainer.optim import OptimSettings


@dataclass(slots=True)
class TrainConfig:
    optim: OptimSettings = field(default_factory=OptimSettings)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward (rows × longest row)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. Master weights and optimizer state are always fp32; ``bfloat16`` means FSDP2 mixed
    precision on GPU and autocast on a CPU with fast bf16 matrix units (AMX/AVX512-BF16); a CPU without
    them (AVX2 only: a bf16 matmul there is tens of times slower than fp32) computes in fp32
    (``models.cpu_compute_dtype``)."""
    device: str | None = None
    """``cpu`` or ``cuda`` (default: cuda when present)."""
    seed: int = 0
    entropy_tokens: int = 64
    """The entropy metric is averaged over at most this many sampled tokens per micro-batch, evenly
    spaced (a full-vocabulary softmax per token costs as much as the loss itself on small models);
    0 turns it off."""
    gradient_checkpointing: bool = False
    torch_threads: int | None = None
    lora: LoraSettings | None = None
    """Train these LoRA adapters (``trainer/lora.py``) on a frozen base instead of the full model."""

    @classmethod
    def from_recipe(cls, recipe: Any, total_steps: int | None = None) -> TrainConfig:
        """From a ``tracegym.trainer.config.TrainRecipe``."""
        o, a = recipe.optim, recipe.algorithm
        optim = OptimSettings(
            lr=o.lr,
            betas=tuple(o.betas),
            total_steps=total_steps,
            **{k: getattr(o, k) for k in ("weight_decay", "warmup_steps", "grad_clip")},
        )
        loss_keys = ("clip_low", "clip_high", "agg", "kl_coef", "kl_estimator", "tis_cap", "cispo_clip_low", "cispo_clip_high")
        loss = PolicyLossConfig(name=a.loss, **{k: getattr(a, k) for k in loss_keys})
        return cls(
            optim=optim, loss=loss, micro_batch_tokens=o.micro_batch_tokens, dtype=o.dtype, seed=recipe.seed,
            lora=LoraSettings.from_recipe(getattr(recipe, "lora", None)),
        )
