"""Weight updates from disk: read and validate a checkpoint fully before touching the served model, so a
bad checkpoint leaves the old weights in place (SGLang's rollback semantics)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class WeightLoadError(ValueError):
    """The checkpoint cannot replace the served weights; the message says why."""


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier parameter (e.g. a tied ``lm_head.weight``)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        ptr = p.data_ptr()
        if ptr in seen:
            tied.add(name)
        else:
            seen[ptr] = name
    return tied


def read_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (a directory or one file), checked against
    ``model``: same names (tied copies may be absent), same shapes, finite; in the file's dtypes
    (``apply_state`` casts as it copies: no second copy of the weights in the model's dtypes)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise WeightLoadError(f"no safetensors checkpoint at {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device="cpu"))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise WeightLoadError(f"cannot read {f}: {e}") from e
    return validate_state(state, model)


def validate_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` checked against ``model`` (``read_checkpoint``), each tensor in its own dtype."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = tied_parameter_names(model)
    missing = sorted(set(params) - set(state) - tied)
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    return checked_tensors(state.items(), params, cast=False)


FINITE_CHUNK = 1 << 20
"""Elements summed at a time by ``finite_sum``."""


def finite_sum(t: torch.Tensor) -> bool:
    """False when ``t`` holds a NaN or an inf: the fp32 sum of a chunk holding one is then NaN or inf (and
    also when finite values are so large that their sum overflows, which no trained weight holds). A
    reduction per chunk of ``FINITE_CHUNK`` elements: cheaper than ``isfinite(t).all()``, which makes a
    boolean copy of the tensor first, and than one reduction over a whole bf16 tensor, whose fp32 working
    copy is fresh memory, faulted in page by page, at every update)."""
    flat = t.reshape(-1)
    return all(math.isfinite(c.sum(dtype=torch.float32)) for c in flat.split(FINITE_CHUNK))


def checked_tensors(
    items: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.nn.Parameter], *, cast: bool = True
) -> dict[str, torch.Tensor]:
    """Each named tensor against its served parameter (every name must be one): the same shape, finite,
    cast to the parameter's dtype (with ``cast``); ``WeightLoadError`` naming the first that is not."""
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        target = params[name]
        if tuple(t.shape) != tuple(target.shape):
            raise WeightLoadError(f"{name}: shape {tuple(t.shape)} != served {tuple(target.shape)}")
        if not finite_sum(t):
            raise WeightLoadError(f"{name}: contains NaN or inf")
        out[name] = t.to(dtype=target.dtype) if cast else t
    return out


@torch.no_grad()
def apply_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a validated state into ``model`` in place, casting to each parameter's dtype as it copies. Every
    tensor on another device is first moved to its parameter's (the step that can fail, e.g. out of device
    memory) before any parameter is written, so a failure leaves the served weights untouched."""
    params: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    staged = {name: t if t.device == params[name].device else t.to(device=params[name].device)
              for name, t in state.items()}
    for name, t in staged.items():
        params[name].copy_(t)
