"""LoRA adapters on the trainer's model (``peft``): settings from the recipe, the family defaults of the
target modules, checks that fail before training starts, and the adapter files a swap pushes.

One model holds every adapter (``peft``'s named adapters on one base): with ``lora.adapters`` one per
agent role, else one named ``default``. The optimizer holds only adapter parameters (the base is
frozen), and the KL reference is the same model with its adapters disabled (no second copy of the
weights). An adapter on disk is PEFT's format (``tracegym.modelfiles.formats``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tracegym.modelfiles.formats import base_fingerprint, model_fingerprint, write_adapter_dir
from tracegym.trainer.settings import AdapterConfig, LoraConfig

FAMILY_TARGETS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    # every attention and MLP projection ("all-linear" minus the output layer), as QLoRA recommends
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite"),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
})
"""Default target modules per ``config.model_type``."""



class LoraError(ValueError):
    """A LoRA setting or adapter that cannot be used; the message is one line saying why."""


def default_targets(model_type: str) -> tuple[str, ...]:
    if model_type in FAMILY_TARGETS:
        return FAMILY_TARGETS[model_type]
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    if model_type in peft_defaults:
        return tuple(peft_defaults[model_type])
    raise LoraError(f"no default LoRA target modules for model type {model_type!r}: set lora.target_modules")


def linear_leaf_names(model: Any) -> set[str]:
    """The last name part of every linear module but the output layer (what ``target_modules`` names)."""
    import torch

    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not out_layer}


def resolve_targets(model: Any, spec: AdapterConfig) -> tuple[str, ...]:
    """``spec``'s target modules (or the family's), checked against ``model``."""
    targets = spec.target_modules or default_targets(str(model.config.model_type))
    have = linear_leaf_names(model)
    missing = sorted(set(targets) - have)
    if missing:
        raise LoraError(f"lora.target_modules {missing} not found in the model's linear layers "
                        f"(it has {sorted(have)})")
    return tuple(targets)


def check_model(settings: LoraConfig, model_dir: Path) -> None:
    """Resolve every adapter's target modules on the model built on the meta device (no weights read):
    a target module the model lacks is a ``LoraError`` before any process starts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for _, spec in settings.named_specs():
        resolve_targets(model, spec)


def apply_lora(model: Any, settings: LoraConfig) -> Any:
    """``model`` wrapped in a ``peft`` model holding every adapter, all trainable, the base frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    configs = [  # resolved on the bare model: wrapping renames the linear layers
        (name, PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                          target_modules=list(resolve_targets(model, spec)), task_type="CAUSAL_LM", bias="none"))
        for name, spec in settings.named_specs()
    ]
    (first, config0), *rest = configs
    peft_model = get_peft_model(model, config0, adapter_name=first)
    for name, config in rest:
        peft_model.add_adapter(name, config)
    activate(peft_model, first)
    return peft_model


def activate(peft_model: Any, name: str) -> None:
    """Make ``name`` the adapter the forward uses. ``peft``'s ``set_adapter`` also freezes the others;
    they stay trainable here (an adapter not in the forward gets no gradient, and the optimizer and the
    FSDP2 shards keep one fixed set of trainable parameters)."""
    if getattr(peft_model, "active_adapter", None) != name:
        peft_model.set_adapter(name)
    for pname, p in peft_model.named_parameters():
        if "lora_" in pname:
            p.requires_grad_(True)


def peft_key(param_name: str, adapter: str) -> str | None:
    """The PEFT file key of a parameter of ``adapter`` (``...lora_A.<adapter>.weight`` →
    ``...lora_A.weight``), or None for parameters of the base or of other adapters."""
    for part in ("lora_A", "lora_B"):
        infix = f".{part}.{adapter}."
        if infix in param_name:
            return param_name.replace(infix, f".{part}.")
    return None


def adapter_tensors(named: Iterable[tuple[str, Any]], adapter: str) -> dict[str, Any]:
    """PEFT-keyed tensors of ``adapter`` out of ``(name, tensor)`` pairs of the whole model."""
    out = {}
    for name, t in named:
        key = peft_key(name, adapter)
        if key is not None:
            out[key] = t
    return out


def save_adapters(worker: Any, out_root: str, dtype: str | None) -> dict[str, str] | None:
    """A ``TrainWorker``'s adapters: their parameters gathered (a collective on every rank; the frozen
    base is not gathered) and, on rank 0, each adapter written as ``out_root/<name>``; ``{name: path}``
    there, None on the other ranks."""
    import torch

    from tracegym.trainer.workers.fsdp import full_tensor

    lora: LoraConfig = worker.cfg.lora
    model = worker.model
    full = [(n, full_tensor(p.detach()).cpu()) for n, p in worker.adapter_params]
    if worker.rank != 0:
        return None
    to = getattr(torch, dtype) if dtype else None
    fingerprint = base_fingerprint(model.get_base_model().config)
    out = {}
    for name, spec in lora.named_specs():
        tensors = {k: (v.to(to) if to is not None else v) for k, v in adapter_tensors(full, name).items()}
        out[name] = str(write_adapter_dir(
            tensors, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
            targets=model.peft_config[name].target_modules, fingerprint=fingerprint,
            base_path=str(worker.model_path), out_dir=Path(out_root) / name))
    return out


def check_checkpoint_base(state: dict[str, Any], ckpt: Path, model_dir: Path) -> None:
    """A LoRA checkpoint (``trainer_state.json``) resumes only onto the base its adapters were trained on."""
    saved, have = state.get("lora_base"), model_fingerprint(model_dir)
    if saved is not None and saved != have:
        raise LoraError(f"{ckpt} holds LoRA adapters trained on another base model (fingerprint {saved}; "
                        f"{model_dir} is {have})")
