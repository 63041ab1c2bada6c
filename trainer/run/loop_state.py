"""What a training run restores from its checkpoint besides the model and optimizer (``LoopState``), and
where that checkpoint is (``checkpoint_dir``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracegym.trainer.recipe import RecipeError, TrainRecipe


@dataclass
class LoopState:
    """What a checkpoint must restore besides the model and optimizer (saved as the checkpoint's extra).

    ``run_id`` and ``drawn`` (training tasks drawn so far) name every group the run queues
    (``group_ids``), so a run resumed after a crash queues the same group ids again and the store hands back
    the groups it already has, with their completed rollouts, instead of running them twice. ``pending``:
    the groups async mode had queued but not trained on when the checkpoint was written."""

    step: int = 0
    data_pos: int = 0
    order: list[int] = field(default_factory=list)
    weight_version: int = 0
    rng_state: Any = None
    run_id: str = field(default_factory=lambda: f"{random.getrandbits(64):016x}")
    drawn: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)
    source_pos: int = 0
    """Offline objectives (``sft``/``dpo`` with ``runs``): the source groups taken so far."""

    FIELDS = ("step", "data_pos", "order", "weight_version", "rng_state", "run_id", "drawn", "pending",
              "source_pos")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        st = cls(**{k: d[k] for k in cls.FIELDS if k in d})  # checkpoints before run_id have none of the last 3
        if st.rng_state is not None:  # JSON turned random's tuple state into lists
            v, internal, g = st.rng_state
            st.rng_state = (v, tuple(internal), g)
        return st


def checkpoint_dir(recipe: TrainRecipe, *, resume: bool) -> Path:
    """``run_dir/checkpoint`` (moved back from its aside copy if a save was interrupted); with ``resume``
    it must hold a checkpoint."""
    from tracegym.modelfiles.folders import recover_dir

    d = recover_dir(recipe.run_dir / "checkpoint")
    if resume and not (d / "trainer_state.json").is_file():
        raise RecipeError(f"--resume: no checkpoint in {d} (a run that ended keeps one only with `keep: checkpoint`;"
                          " one stopped before its end, only after `checkpoint_interval` steps)")
    return d
