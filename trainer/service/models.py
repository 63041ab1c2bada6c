"""The base models a service serves (``tinker-serve --model``, repeatable; the first is the default) and the
inference of each: every base model has its own gateway and embedded engine (``inference.Inference``),
which its samplers draw from and its runs' weight versions are swapped into.

Weight version names come from one counter for the whole service (1, 2, 3, ...), so a version name, and
``tinker://RUN/sampler_weights/VERSION``, names one version of one engine; an engine only ever holds
versions published by runs of its own base model. ``--keep`` applies per engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.inference import Inference, Published


@dataclass(frozen=True, slots=True)
class BaseModel:
    """One base model the service trains and samples."""

    name: str
    """As given to ``--model`` (a ``tracegym models`` name, a hub id or a folder): what ``base_model`` names
    in the API."""
    model_dir: Path
    """The folder it was prepared in (its weights, config and tokenizer)."""
    arch: str
    """Its config's ``model_type``."""
    max_length: int
    """Its context in tokens (the config's ``max_position_embeddings``; 0: unknown)."""

    @classmethod
    def read(cls, name: str, model_dir: Path) -> BaseModel:
        """The model prepared in ``model_dir``, described from its ``config.json``."""
        config = json.loads((model_dir / "config.json").read_text())
        return cls(name, model_dir, str(config.get("model_type", "")),
                   int(config.get("max_position_embeddings") or 0))


class InferenceByModel:
    """Each served base model's ``Inference``, by model name, in ``--model`` order."""

    def __init__(self, by_model: dict[str, Inference]) -> None:
        if not by_model:
            raise ValueError("a service serves at least one base model")
        self.by_model = by_model

    def __getitem__(self, model: str) -> Inference:
        return self.by_model[model]

    def published(self) -> dict[str, Published]:
        """Every kept weight version of every engine, by version name (unique across the service)."""
        return {v: p for inference in self.by_model.values() for v, p in inference.published.items()}

    def holder(self, version: str) -> Inference:
        """The engine that keeps ``version`` (``UserFault``: never published, or its files were pruned)."""
        for inference in self.by_model.values():
            if version in inference.published:
                return inference
        keep = next(iter(self.by_model.values())).keep
        raise UserFault(f"weight version {version!r} was never published or its files were pruned (the service "
                        f"keeps the last {keep}{' of each base model' if len(self.by_model) > 1 else ''}; kept: "
                        f"{self._kept()}): publish with save_weights_for_sampler / "
                        "save_weights_and_get_sampling_client")

    def _kept(self) -> str:
        if len(self.by_model) == 1:
            return next(iter(self.by_model.values())).kept()
        return "; ".join(f"{m} {inference.kept()}" for m, inference in self.by_model.items())

    async def close(self) -> None:
        for inference in self.by_model.values():
            await inference.close()
