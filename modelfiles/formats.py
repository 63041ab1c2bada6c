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
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
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


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
"""torch dtype name → the safetensors format's dtype code."""


def write_safetensors(tensors: Mapping[str, Any], path: Path, *, metadata: dict[str, str] | None = None,
                      reuse: Path | None = None) -> Path:
    """``tensors`` (torch, on the CPU) as one safetensors file at ``path``, each tensor's bytes written
    straight from its memory. ``reuse``: a file that may be overwritten instead of writing a new one (an
    older version's weights, no longer read by anyone): when it has exactly the size this file needs it is
    renamed to ``path`` and written in place, so the kernel copies into pages it already holds rather than
    allocating (and on a VM perhaps faulting in from the host) a fresh page for every 4 KiB of a new file.
    Otherwise it is left as it is. Tensors are laid out by element size, largest first (each aligned)."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this machine is not")
    names = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: same size keeps its order
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        code = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code here")
        if t.device.type != "cpu":
            raise ValueError(f"{name}: tensor on {t.device}, expected the CPU")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header with spaces to 8 bytes
    total = 8 + len(head) + offset
    path = Path(path)
    in_place = False
    if reuse is not None and Path(reuse).is_file() and Path(reuse).stat().st_size == total:
        os.replace(reuse, path)
        in_place = True
    with open(path, "r+b" if in_place else "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in names:
            t = tensors[name]
            if t.numel():
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return path


def write_weights_dir(tensors: dict[str, Any], model_dir: Path, out_dir: Path, reuse: Path | None = None) -> Path:
    """``out_dir`` = ``tensors`` as ``model.safetensors`` + the non-weight files of ``model_dir`` (an
    existing ``out_dir`` is replaced). ``reuse``: an older weights file to overwrite in place where it fits
    (``write_safetensors``)."""
    with writing_folder(out_dir) as tmp:
        write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"}, reuse=reuse)
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
