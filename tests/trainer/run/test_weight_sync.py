"""The weight sync a recipe chooses (``upstream.weight_sync``, ``lora``), and the trained model a
distributed run writes at its end (the disk syncs have it in the run directory already)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracegym.trainer.recipe import TrainRecipe
from tracegym.trainer.run.weight_sync import keep_last_weights, make_weight_sync
from tracegym.trainer.settings import LoraConfig
from tracegym.trainer.weights.adapters import AdapterSync
from tracegym.trainer.weights.disk import DiskWeightSync
from tracegym.trainer.weights.group_sync import GroupWeightSync


def _recipe(tmp: Path, **fields: Any) -> TrainRecipe:
    return TrainRecipe(model="tiny-random", data={"path": tmp / "t.jsonl"}, agent={"target": "a:b"},
                       run_dir=tmp / "run", **fields)


class Saves:
    """Records what a sync asks of a ``WorkerGroup`` at the end."""

    def __init__(self) -> None:
        self.saved: list[tuple[Path, str | None]] = []

    def save_weights(self, out: Path, dtype: str | None = None) -> Path:
        self.saved.append((out, dtype))
        return out


def test_the_recipe_chooses_the_sync(tmp_path: Path) -> None:
    cases = [({}, None, DiskWeightSync), ({"lora": {}}, LoraConfig(), AdapterSync),
             ({"upstream": {"weight_sync": "distributed", "weight_sync_address": "10.1.2.3", "engine_ranks": 2,
                            "engine_dtype": "float32"}}, None, GroupWeightSync)]
    for fields, lora, kind in cases:
        sync = make_weight_sync(_recipe(tmp_path, **fields), "http://127.0.0.1:9", "key", lora)
        try:
            assert type(sync) is kind
            if kind is GroupWeightSync:
                assert (sync.address, sync.engine_ranks, sync.sync.broadcast_dtype, sync.sync.api_key) == \
                    ("10.1.2.3", 2, "float32", "key")
                assert sync.root == tmp_path / "run" / "weights"
        finally:
            sync.close()


def test_only_a_distributed_run_writes_its_last_version_at_the_end(tmp_path: Path) -> None:
    distributed = {"upstream": {"weight_sync": "distributed", "engine_dtype": "float32"}}
    for fields, version, written in (({}, 3, False), ({**distributed, "keep": "none"}, 3, False),
                                     (distributed, 0, False), (distributed, 3, True),
                                     ({**distributed, "keep": "checkpoint"}, 3, True)):
        recipe = _recipe(tmp_path, **fields)
        sync, group = make_weight_sync(recipe, "http://127.0.0.1:9", None, None), Saves()
        try:
            keep_last_weights(recipe, sync, group, version)
        finally:
            sync.close()
        assert group.saved == ([(tmp_path / "run" / "weights" / "v3", "float32")] if written else []), fields
