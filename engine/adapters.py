"""LoRA adapters in the embedded engine, applied per request (SGLang's ``lora_path`` semantics): the
target linear layers get a forward hook once; each forward adds ``scale · (x Aᵀ) Bᵀ`` of each row's adapter to
the base output, so requests with different adapters (or none) share one batch. Adapters are PEFT
directories (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked in full before
they are registered: a key naming a module the model lacks, a shape that does not fit, or a base
fingerprint (``tracegym.base`` metadata, see ``trainer/workers/lora.py``) of another model is refused with the
old adapters still served.

Why per request and not merged into a working copy of the weights: merging serves one adapter per model
copy (one per agent role, plus the base), and costs a pass over every target weight per swap; the
per-request add costs a small matmul per target layer (``benchmarks/lora_engine.py`` measures both)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tracegym.engine.weights import finite_sum
from tracegym.modelfiles.formats import BASE_KEY, base_fingerprint


class AdapterLoadError(ValueError):
    """The adapter cannot be served by this model; the message says why (one line)."""


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Module name → (Aᵀ ``[in, r]``, scale · Bᵀ ``[r, out]``), contiguous, in the engine's compute dtype
    (transposed and scaled once at load: the hook is then two matmuls and an add per layer)."""


@dataclass(slots=True)
class RowPlan:
    """What the hooked layers apply in the forward now: ``(adapter, row mask [B, 1, 1] or None = every
    row)``. A mask over all rows, not gathered row indices: the adapter's matmuls are small, and a
    gather + scatter per layer costs more than computing the masked rows."""

    groups: list[tuple[Adapter, torch.Tensor | None]] = field(default_factory=list)


def lora_hook(name: str, plan: RowPlan) -> Any:
    """A forward hook for the target ``nn.Linear`` ``name``: adds the current row plan's adapters to its
    output. A hook, not a wrapper module, so parameter names (and full-weight swaps) stay as they are."""

    def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for adapter, rows in plan.groups:
            w = adapter.weights.get(name)
            if w is None:
                continue
            at, bt = w
            delta = (x if x.dtype == at.dtype else x.to(at.dtype)) @ at @ bt
            if rows is not None:
                delta = delta * rows
            out = out + (delta if delta.dtype == out.dtype else delta.to(out.dtype))
        return out

    return hook


def _peft_module(key: str) -> tuple[str, str] | None:
    """``base_model.model.<module>.lora_A.weight`` → (``<module>``, ``A``)."""
    for part, tag in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
        if key.endswith(part):
            name = key[: -len(part)]
            return name.removeprefix("base_model.model."), tag
    return None


def read_adapter(name: str, path: str | Path, model: nn.Module, dtype: torch.dtype) -> Adapter:
    """Read and check a PEFT adapter against ``model``; raises ``AdapterLoadError``."""
    d = Path(path)
    conf_file, weights_file = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not conf_file.is_file() or not weights_file.is_file():
        raise AdapterLoadError(f"{d} is not a LoRA adapter (needs adapter_config.json and adapter_model.safetensors)")
    try:
        conf = json.loads(conf_file.read_text())
        rank, alpha = int(conf["r"]), float(conf["lora_alpha"])
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterLoadError(f"{conf_file}: not a LoRA config ({e})") from None
    if rank <= 0:
        raise AdapterLoadError(f"{conf_file}: rank must be > 0, got {rank}")
    try:
        with safe_open(str(weights_file), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as e:
        raise AdapterLoadError(f"cannot read {weights_file}: {e}") from None
    want = base_fingerprint(model.config)
    if BASE_KEY in meta and meta[BASE_KEY] != want:
        raise AdapterLoadError(f"adapter {name!r} was trained on another base model (fingerprint {meta[BASE_KEY]}, "
                               f"this engine serves {want})")
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        parsed = _peft_module(key)
        if parsed is None:
            raise AdapterLoadError(f"adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
        pairs.setdefault(parsed[0], {})[parsed[1]] = t
    same_shape: dict[tuple[Any, ...], list[str]] = {}  # modules whose A and B shapes and dtypes agree
    for mod, ab in pairs.items():
        target = modules.get(mod)
        if not isinstance(target, nn.Linear):
            raise AdapterLoadError(f"adapter {name!r}: the model has no linear module {mod!r}")
        if set(ab) != {"A", "B"}:
            raise AdapterLoadError(f"adapter {name!r}: {mod} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, target.in_features) or b.shape != (target.out_features, rank):
            raise AdapterLoadError(f"adapter {name!r}: {mod} has A {tuple(a.shape)}, B {tuple(b.shape)}; the model "
                                   f"needs ({rank}, {target.in_features}), ({target.out_features}, {rank})")
        same_shape.setdefault((tuple(a.shape), a.dtype, tuple(b.shape), b.dtype), []).append(mod)
    weights = {}
    for mods in same_shape.values():
        # one stack per kind of layer (q_proj of every block, ...): a few large ops instead of a few per
        # layer, whose fixed cost dominated the load (SmolLM2, rank 16: 420 tensors)
        a_all = torch.stack([pairs[m]["A"] for m in mods])
        b_all = torch.stack([pairs[m]["B"] for m in mods])
        if not (finite_sum(a_all) and finite_sum(b_all)):
            bad = next((m for m in mods if not (finite_sum(pairs[m]["A"]) and finite_sum(pairs[m]["B"]))),
                       f"{mods[0]} (and {len(mods) - 1} layers like it)")  # only their sum overflowed
            raise AdapterLoadError(f"adapter {name!r}: {bad} contains NaN or inf (or values too large to sum)")
        at = a_all.transpose(1, 2).to(dtype).contiguous()
        bt = (b_all.transpose(1, 2) * (alpha / rank)).to(dtype).contiguous()
        weights.update(zip(mods, zip(at.unbind(0), bt.unbind(0), strict=True), strict=True))
    if not weights:
        raise AdapterLoadError(f"adapter {name!r}: no lora weights in {weights_file}")
    return Adapter(name, str(d), rank, weights)


class EngineLora:
    """The registry of loaded adapters and the row plan the wrapped layers read. Mutated only on the
    model thread (the scheduler runs loads and unloads as commands between forwards)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.adapters: dict[str, Adapter] = {}
        self.plan = RowPlan()
        self._hooked: set[str] = set()

    def names(self) -> list[str]:
        return list(self.adapters)

    def add(self, adapter: Adapter) -> None:
        """Register a checked adapter (replacing one of the same name), hooking its layers first."""
        modules = dict(self.model.named_modules())
        for mod in adapter.weights:
            if mod not in self._hooked:
                modules[mod].register_forward_hook(lora_hook(mod, self.plan))
                self._hooked.add(mod)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterLoadError(f"no LoRA adapter named {name!r} is loaded (loaded: {self.names()})")
        del self.adapters[name]  # requests already running keep their Adapter object

    def set_rows(self, adapters: list[Adapter | None]) -> None:
        """The plan for the next forward: row ``i`` uses ``adapters[i]``."""
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                groups.setdefault(id(a), (a, []))[1].append(i)
        n = len(adapters)
        plan: list[tuple[Adapter, torch.Tensor | None]] = []
        for a, rows in groups.values():
            mask = None
            if len(rows) != n:
                mask = torch.zeros(n, 1, 1, dtype=self.dtype)
                mask[rows] = 1.0
            plan.append((a, mask))
        self.plan.groups = plan


def load_response(lora: EngineLora, ok: bool, error: str | None) -> dict[str, Any]:
    """SGLang's ``/load_lora_adapter`` answer."""
    return {"success": ok, "error_message": error, "loaded_adapters": {n: a.path for n, a in lora.adapters.items()}}
