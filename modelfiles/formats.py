"""The two directories the trainer writes and the engines load: a weights directory (``model.safetensors``
beside the model's config and tokenizer files, which an engine can ``from_pretrained``) and a LoRA adapter
directory in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight``, which SGLang's ``/load_lora_adapter`` and the embedded engine
read). An adapter's safetensors metadata also carries ``tracegym.base`` (``base_fingerprint``), so an engine
can refuse an adapter trained on another base model. Both are written atomically (``folders.writing_folder``),
so a load never reads a half-written file."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tracegym.modelfiles.folders import writing_folder

BASE_KEY = "tracegym.base"
"""The safetensors metadata key holding the base model's fingerprint."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".index.json")
"""Files of a model directory that hold weights (not copied next to new weights)."""


def base_fingerprint(config: Any) -> str:
    """A short hash of the base model's shape-defining config fields (a dict or a HF config): adapters
    trained on one base refuse to load onto another."""
    d = config if isinstance(config, dict) else config.to_dict()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim")
    picked = {k: d.get(k) for k in keys}
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def model_fingerprint(model_dir: Path) -> str:
    """``base_fingerprint`` of the model directory's ``config.json``."""
    return base_fingerprint(json.loads((Path(model_dir) / "config.json").read_text()))


def write_weights_dir(tensors: dict[str, Any], model_dir: Path, out_dir: Path) -> Path:
    """``out_dir`` = ``tensors`` as ``model.safetensors`` + the non-weight files of ``model_dir`` (an
    existing ``out_dir`` is replaced)."""
    from safetensors.torch import save_file

    with writing_folder(out_dir) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, tmp / f.name)
        if not (tmp / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json to copy next to the weights")
    return Path(out_dir)


def write_adapter_dir(tensors: dict[str, Any], *, rank: int, alpha: float, dropout: float,
                      targets: Iterable[str], fingerprint: str, base_path: str, out_dir: Path) -> Path:
    """``out_dir`` = one adapter in PEFT's format (PEFT-keyed ``tensors``)."""
    from safetensors.torch import save_file

    with writing_folder(out_dir) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt", BASE_KEY: fingerprint})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                  "lora_dropout": dropout, "target_modules": sorted(targets), "bias": "none",
                  "base_model_name_or_path": base_path}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return Path(out_dir)
