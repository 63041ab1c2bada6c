"""Adapter hot-swap, the LoRA counterpart of ``disk.DiskWeightSync``: after a step the trainer
writes only the adapters (PEFT directories, safetensors) and asks the gateway to load them
(``POST /api/weights/lora``); the gateway pauses generation, loads each adapter into the upstream under
a new name (``<adapter>-v<version>``, SGLang's ``/load_lora_adapter``), stamps the new weight version,
routes later calls to the new names, unloads the old ones and continues. A refused load (an adapter for
another base model, a missing file) keeps the old adapters serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracegym.trainer.settings import LoraConfig
from tracegym.trainer.weights.disk import DiskWeightSync
from tracegym.trainer.weights.gateway import post_checked

LORA_ROUTE = "/api/weights/lora"


class AdapterSync(DiskWeightSync):
    """Save the adapters → ``POST /api/weights/lora`` → prune (``DiskWeightSync``'s steps, with adapters).
    ``push(group, version)`` with any object that has ``save_adapters(out_root, dtype) -> {name: path}``
    (a ``WorkerGroup`` of a LoRA run)."""

    def __init__(self, gateway_url: str, root: Path, lora: LoraConfig, *, keep: int = 2,
                 timeout: float = 600.0, save_dtype: str | None = None, api_key: str | None = None) -> None:
        """``root`` must be under the gateway's weights root (``--weights-dir``)."""
        super().__init__(gateway_url, root, keep=keep, timeout=timeout, save_dtype=save_dtype, api_key=api_key)
        self.lora = lora

    def save(self, group: Any, out: Path) -> dict[str, Path]:
        return group.save_adapters(out, self.save_dtype)

    def load(self, paths: dict[str, Path], version: str) -> dict[str, Any]:  # type: ignore[override]
        """Ask the gateway to serve ``paths`` (adapter name → directory) as ``version``; its answer."""
        body = {"weight_version": version, "per_agent": self.lora.per_agent,
                "adapters": {name: str(Path(p).resolve()) for name, p in paths.items()}}
        return post_checked(self._client, LORA_ROUTE, body)
