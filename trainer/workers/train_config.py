"""What the workers take: the recipe's own sections (``optim``, ``algorithm``, ``lora``), as they are, and
the facts of this run that are not recipe keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracegym.trainer.recipe import TrainRecipe
from tracegym.trainer.settings import AlgorithmConfig, DistillConfig, DpoConfig, LoraConfig, OptimConfig


@dataclass(slots=True)
class TrainConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Includes the compute dtype: master weights and optimizer state are always fp32; ``bfloat16`` means
    FSDP2 mixed precision on GPU and autocast on a CPU with fast bf16 matrix units, fp32 on a CPU without
    them (``modelfiles.load.cpu_compute_dtype``)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    lora: LoraConfig | None = None
    """Train these LoRA adapters on a frozen base instead of the full model."""
    seed: int = TrainRecipe.model_fields["seed"].default
    total_steps: int | None = None
    """The run's steps, where the LR schedule decays to (``optim.schedule``)."""
    device: str | None = None
    """``cpu`` or ``cuda`` (default: cuda when present)."""
    entropy_tokens: int = 64
    """The entropy metric is averaged over at most this many sampled tokens per micro-batch, evenly
    spaced (a full-vocabulary softmax per token costs as much as the loss itself on small models);
    0 turns it off."""
    gradient_checkpointing: bool = False
    torch_threads: int | None = None
    objectives: tuple[str, ...] = ("grpo",)
    """Every objective the run trains (its phases): a ``dpo`` phase loads the frozen reference model, a
    ``distill`` phase the teacher."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    distill: DistillConfig | None = None
    teacher_path: str | None = None
    """The teacher's prepared model directory (``distill.teacher`` resolved)."""

    @classmethod
    def from_recipe(cls, recipe: Any, total_steps: int | None = None) -> TrainConfig:
        """From a ``tracegym.trainer.recipe.TrainRecipe``."""
        return cls(optim=recipe.optim, algorithm=recipe.algorithm, lora=recipe.lora, seed=recipe.seed,
                   total_steps=total_steps, objectives=tuple(sorted(recipe.objectives())), dpo=recipe.dpo,
                   distill=recipe.distill)

    def needs_reference(self) -> bool:
        """Whether a step needs the frozen start model's logprobs (the KL penalty, or DPO)."""
        return self.algorithm.kl_coef > 0 or "dpo" in self.objectives
