"""The part of a training step that depends on its objective (``Trainer`` inherits it): which objective a
step trains (``phases``), whether it samples or reads examples of earlier runs from the store, and the
batch, update and weight swap of one step (``objective_batches``)."""

from __future__ import annotations

import time
from typing import Any

from tracegym.types import Trajectory


class ObjectiveSteps:
    """Needs the ``Trainer``'s ``r`` (recipe), ``state``, ``ctl``, ``workers``, ``progress``, ``_sources``
    and ``_swap_to_current``."""

    r: Any
    state: Any
    ctl: Any
    workers: Any
    progress: Any
    _sources: dict[str, list[tuple[str, list[Trajectory]]]]

    def _swap_to_current(self) -> dict[str, float]:
        raise NotImplementedError

    def objective(self) -> str:
        """The objective of the next step (``phases``)."""
        return self.r.objective_at(self.state.step)

    def offline(self, objective: str) -> bool:
        """Whether ``objective``'s steps read examples from runs in the store instead of sampling."""
        return objective in ("sft", "dpo") and bool(getattr(self.r, objective).sources())

    def source_groups(self, objective: str) -> list[tuple[str, list[Trajectory]]]:
        """The next groups of the offline source (``objective_batches.take_groups``), read from the store
        once per run (``EmptySourceError`` when it has nothing)."""
        from tracegym.trainer.run.objective_batches import load_source, take_groups

        if objective not in self._sources:
            self._sources[objective] = load_source(self.ctl.client, objective, self.r)
            n = sum(len(ts) for _, ts in self._sources[objective])
            self.progress.message(f"{objective}: {len(self._sources[objective])} groups ({n} rollouts) of runs "
                                  f"{getattr(self.r, objective).sources()} to train on")
        groups, self.state.source_pos = take_groups(self._sources[objective], self.state.source_pos, objective,
                                                    batch_size=self.r.batch_size, group_size=self.r.group_size)
        return groups

    def run_offline_step(self, objective: str) -> dict[str, float]:
        """One step of an offline objective: no rollouts, examples from the source runs."""
        t0 = time.monotonic()
        groups = self.source_groups(objective)
        return self.train_groups(objective, groups, {"read_s": time.monotonic() - t0})

    def train_groups(self, objective: str, groups: list[tuple[str, list[Trajectory]]],
                     metrics: dict[str, float]) -> dict[str, float]:
        """Build ``objective``'s batch from ``groups``, train on it and swap the new weights in."""
        from tracegym.trainer.run.objective_batches import objective_batch

        batch, stats = objective_batch(
            objective, groups, advantage=self.r.algorithm.advantage,
            drop_zero_signal=self.r.algorithm.drop_zero_signal_groups, sft=self.r.sft, dpo=self.r.dpo,
            lora=getattr(self, "lora", None),
        )
        metrics = {**metrics, **stats}
        if batch is not None:
            t0 = time.monotonic()
            metrics.update(self.workers.train_step(batch, objective))
            metrics["train_s"] = time.monotonic() - t0
            self.state.weight_version += 1
            metrics.update(self._swap_to_current())
        self.state.step += 1
        return metrics

