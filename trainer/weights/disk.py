"""Pushing the trainer's weights into the inference server, stamped with a ``weight_version``, through the
gateway. The gateway's ``SwapCoordinator`` owns every swap sequence (pause, load, continue, the version
stamp) and continues the calls a pause cut short; the trainer only writes or broadcasts weights and asks
the gateway. It never calls the engine's weight or pause routes itself.

Disk (everywhere; what a training run uses unless ``upstream.weight_sync: distributed``): gather the full weights, write a directory the engine
can ``from_pretrained`` (``model.safetensors`` + config/tokenizer files copied from the model dir) into a
fresh ``v<version>`` directory — written under a temporary name and renamed, so a load never reads a
half-written file — then ``POST /api/weights/update {model_path, weight_version}``. Only the last
``keep`` version directories are kept; the weights file of the last one pruned stays as ``.spare.safetensors``
beside them, to be overwritten in place by the next version (``formats.write_safetensors``: the kernel copies
into pages it holds instead of allocating a new file's: several times faster on a VM), and is deleted by
``close()``.

What runs here: the disk path against the real embedded engine behind a real gateway (the distributed
path: ``distributed``'s docstring). Not run here: SGLang's own loading code.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracegym.trainer.weights.gateway import post_checked, weights_client

DISK_ROUTE = "/api/weights/update"
SPARE_FILE = ".spare.safetensors"
"""A pruned version's weights file, kept under the root to be overwritten by the next version."""


@dataclass(slots=True)
class SwapResult:
    version: str
    path: Path | None
    save_s: float
    """Gathering + writing (disk) or gathering + broadcasting (distributed)."""
    update_s: float
    """The rest: the gateway's swap (pause, load, continue) outside this side's own work."""
    total_s: float


class DiskWeightSync:
    """Save → ``POST /api/weights/update`` on the gateway → prune. ``push(group, version)`` with any
    object that has ``save_weights(out_dir, dtype, reuse=None) -> Path`` (a ``WorkerGroup``; ``reuse``: a
    file it may overwrite in place, if there)."""

    def __init__(
        self,
        gateway_url: str,
        root: Path,
        *,
        keep: int = 2,
        timeout: float = 600.0,
        save_dtype: str | None = None,
        api_key: str | None = None,
    ) -> None:
        """``root`` must be under the gateway's weights root (``--weights-dir``); ``api_key``: the gateway's
        admin key (default ``$TRACEGYM_API_KEY`` / ``$TRACEGYM_ADMIN_KEY``)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.gateway_url, self.root, self.keep = gateway_url.rstrip("/"), Path(root), keep
        self.save_dtype = save_dtype
        self._client = weights_client(self.gateway_url, api_key, timeout)
        # directories of earlier runs (a resumed loop) count towards ``keep`` too, oldest first
        earlier = [p for p in self.root.glob("v*") if p.is_dir()] if self.root.is_dir() else []
        self._written: list[Path] = sorted(earlier, key=lambda p: p.stat().st_mtime)
        self.spare = self.root / SPARE_FILE

    def version_dir(self, version: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", version):
            raise ValueError(f"weight_version {version!r} must match [A-Za-z0-9._-]+ (it names a directory)")
        return self.root / f"v{version}"

    def push(self, group: Any, version: str | int) -> SwapResult:
        version = str(version)
        t0 = time.perf_counter()
        out = self.version_dir(version)
        saved = self.save(group, out)
        t1 = time.perf_counter()
        self.load(saved, version)
        t2 = time.perf_counter()
        if out in self._written:
            self._written.remove(out)
        self._written.append(out)
        self._prune()
        return SwapResult(version, out, t1 - t0, t2 - t1, t2 - t0)

    def save(self, group: Any, out: Path) -> Any:
        """Write this version under ``out``; what ``load`` is given (here: the weights directory)."""
        return group.save_weights(out, self.save_dtype, reuse=self.spare)  # used only where it is there and fits

    def load(self, path: Path, version: str) -> dict[str, Any]:
        """Ask the gateway to swap to ``path`` (it pauses, loads, continues); its answer, or raise."""
        body = {"model_path": str(Path(path).resolve()), "weight_version": version}
        return post_checked(self._client, DISK_ROUTE, body)

    def _prune(self) -> None:
        while len(self._written) > self.keep:
            old = self._written.pop(0)
            weights = old / "model.safetensors"
            if weights.is_file():  # every engine has loaded a newer version: nothing reads this file now
                os.replace(weights, self.spare)
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self._client.close()
        self.spare.unlink(missing_ok=True)
