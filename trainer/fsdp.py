"""FSDP2 wrapping, gathering full weights, and sharded checkpoints.

- ``init_distributed``: the torch process group of the trainer ranks (gloo on CPU, NCCL on GPU).
- ``shard_model``: ``fully_shard`` on every decoder layer, then on the root (so embeddings, final norm
  and a tied ``lm_head`` share the root's group). With one rank nothing is sharded and no process group
  exists: sharding over one rank is the identity, and skipping it keeps the in-process worker free of
  FSDP hooks (it is what makes 1 worker as fast as a bare loop). The code path is otherwise the same.
- ``iter_full_params``: ``(name, full fp32 tensor)`` per parameter, in ``named_parameters`` order (tied
  weights once); a collective, so every rank must iterate it.
- ``save_sharded`` / ``load_sharded``: model + optimizer state with ``torch.distributed.checkpoint``
  (each rank writes its shard; loading can reshard to another world size).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join the trainer's process group (no-op for one rank)."""
    if world_size == 1:
        return
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a HF causal LM (``model.model.layers`` and common variants)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod: object = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.ModuleList):
            return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard them")


def shard_model(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2-shard ``model`` in place over the default process group (identity without one).

    ``param_dtype`` (GPU bf16) becomes FSDP2's mixed-precision compute dtype, with fp32 gradient
    reduction and fp32 master weights."""
    if not is_distributed() or dist.get_world_size() == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient: a collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every parameter whole, detached, on CPU. Every rank must consume the whole iterator."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p.detach()).cpu()


FRESH_OPTIMIZER_MARK = "OPTIMIZER_NOT_STEPPED"


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, d: Path) -> None:
    """Model + optimizer state into the DCP directory ``d``. An optimizer that has not stepped yet is
    saved as a mark only: ``get_state_dict`` would initialise it with a zero-lr step, which advances
    Adam's step count and so changes its bias correction on the first real step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optimizer.state:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(d))
        if not is_distributed() or dist.get_rank() == 0:
            (d / FRESH_OPTIMIZER_MARK).touch()
        return
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, d: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not d.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {d}")
    if (d / FRESH_OPTIMIZER_MARK).exists():
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(d))
        set_model_state_dict(model, state["model"])
        optimizer.state.clear()
        return
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(d))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_rng(path: Path) -> None:
    """This process's torch (and CUDA) and Python RNG states."""
    rng: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, path)


def load_rng(path: Path) -> None:
    """Restore ``save_rng``; a missing file (resuming on more ranks than were saved) keeps fresh seeds."""
    if not path.is_file():
        return
    rng = torch.load(path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
