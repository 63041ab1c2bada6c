"""How a run's weights reach the engines, chosen from the recipe (``upstream.weight_sync``, ``lora``):
LoRA adapters from disk (``weights.adapters``), the full model from disk (``weights.disk``), or the full
model broadcast over a weight-update group (``weights.group_sync``). Each keeps one version: once the
engines have loaded a version only the newest is needed (a resumed run pushes its checkpoint's weights
again), and it is the run's trained model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tracegym.trainer.recipe import TrainRecipe


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_weight_sync(recipe: TrainRecipe, gateway_url: str, api_key: str | None, lora: Any) -> Any:
    """The object whose ``push(workers, version)`` swaps the engines to the trainer's weights (and
    ``close()``); ``lora``: the workers' LoRA settings, None for full fine-tuning."""
    assert recipe.run_dir is not None, "load_recipe resolves run_dir"
    up = recipe.upstream
    root = Path(recipe.run_dir) / "weights"
    if lora is not None:  # only the adapters travel
        from tracegym.trainer.weights.adapters import AdapterSync

        return AdapterSync(gateway_url, root / "adapters", lora, keep=1, save_dtype=up.engine_dtype, api_key=api_key)
    if up.weight_sync == "distributed":
        from tracegym.trainer.weights.distributed import DistributedWeightSync
        from tracegym.trainer.weights.group_sync import GroupWeightSync

        sync = DistributedWeightSync(gateway_url, broadcast_dtype=up.engine_dtype, api_key=api_key)
        return GroupWeightSync(sync, root, address=up.weight_sync_address, engine_ranks=up.engine_ranks,
                               save_dtype=up.engine_dtype, say=_say)
    from tracegym.trainer.weights.disk import DiskWeightSync

    return DiskWeightSync(gateway_url, root, keep=1, save_dtype=up.engine_dtype, api_key=api_key)


def keep_last_weights(recipe: TrainRecipe, swap: Any, workers: Any, version: int) -> None:
    """At the end of a run: the distributed sync wrote no weights directory, so the last version is
    written now and the run directory keeps the trained model as ``keep`` says (the disk syncs have it
    there already)."""
    if recipe.upstream.weight_sync == "distributed" and recipe.lora is None and recipe.keep != "none" and version:
        swap.save_last(workers, version)
