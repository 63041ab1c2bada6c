"""FSDP2 for the trainer ranks: the process group (gloo on CPU, NCCL on GPU), sharding, gathering full
weights (a collective: every rank takes part), and sharded checkpoints with ``torch.distributed.checkpoint``
(each rank writes its shard; loading can reshard to another world size)."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
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
    """FSDP2-shard ``model`` in place over the default process group: ``fully_shard`` on every decoder
    layer, then on the root (so embeddings, final norm and a tied ``lm_head`` share the root's group).

    With one rank (no process group) it is the identity: sharding over one rank would change nothing but
    add FSDP's hooks to every forward and backward of the in-process worker. ``param_dtype`` (GPU bf16)
    becomes FSDP2's mixed-precision compute dtype, with fp32 gradient reduction and fp32 master weights."""
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
    """Yield ``(name, tensor)`` for every parameter whole, detached, on CPU, in ``named_parameters`` order
    (tied weights once). Every rank must consume the whole iterator."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p.detach()).cpu()


FRESH_OPTIMIZER_MARK = "OPTIMIZER_NOT_STEPPED"


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group, DCP warns on every save and load that it assumes one process; that is
    the intended use here (one rank), so the warning is dropped (noise at the end of a run)."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def tied_aliases(state: dict[str, object]) -> dict[str, str]:
    """``{alias: key}`` for the tensors of a model state dict that are an earlier entry's very tensor
    (same storage, offset, shape and dtype): tied input/output embeddings, as in SmolLM2 and tiny-random.
    A checkpoint writes them once (the duplicate was 4 bytes per embedding parameter: 113 MB of
    SmolLM2-135M's 1.7 GB) and a load restores both names from the one copy."""
    first: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    out: dict[str, str] = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor's shard on this rank
        if local.numel() == 0:
            continue
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype)
        if ident in first:
            out[k] = first[ident]
        else:
            first[ident] = k
    return out


def _untied(state: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    aliases = tied_aliases(state)
    return {k: v for k, v in state.items() if k not in aliases}, aliases


def _saved_entries(model: nn.Module, state: dict[str, object], frozen: bool) -> dict[str, object]:
    """What a checkpoint holds of ``state``: with ``frozen=False`` only the trainable parameters.
    ``ignore_frozen_params`` alone keeps a frozen output layer tied to the embeddings (SmolLM2's
    28.3M-parameter table: 113 MB of a LoRA checkpoint that needs 12 bytes per adapter parameter)."""
    if frozen:
        return state
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def _options(frozen: bool) -> object:
    """``frozen=False``: leave parameters without gradients out (a LoRA run saves only its adapters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, d: Path, *, frozen: bool = True) -> None:
    """Model + optimizer state into the DCP directory ``d``. An optimizer that has not stepped yet is
    saved as a mark only: ``get_state_dict`` would initialise it with a zero-lr step, which advances
    Adam's step count and so changes its bias correction on the first real step. ``frozen=False``
    saves only the trainable parameters (and their optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    opts = _options(frozen)
    if not optimizer.state:
        with _single_process_quiet():
            msd = _saved_entries(model, _untied(get_model_state_dict(model, options=opts))[0], frozen)
            dcp.save({"model": msd}, checkpoint_id=str(d))
        if not is_distributed() or dist.get_rank() == 0:
            (d / FRESH_OPTIMIZER_MARK).touch()
        return
    msd, osd = get_state_dict(model, optimizer, options=opts)
    with _single_process_quiet():
        dcp.save({"model": _saved_entries(model, _untied(msd)[0], frozen), "optim": osd}, checkpoint_id=str(d))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, d: Path, *, frozen: bool = True) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not d.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {d}")
    opts = _options(frozen)
    if (d / FRESH_OPTIMIZER_MARK).exists():
        full, aliases = _untied(get_model_state_dict(model, options=opts))
        msd = _saved_entries(model, full, frozen)
        with _single_process_quiet():
            dcp.load({"model": msd}, checkpoint_id=str(d))
        msd = {**full, **msd}
        set_model_state_dict(model, {**msd, **{a: msd[k] for a, k in aliases.items()}}, options=opts)
        optimizer.state.clear()
        return
    full, osd = get_state_dict(model, optimizer, options=opts)
    msd, aliases = _untied(full)  # checkpoints written before tied entries were deduplicated load too
    saved = _saved_entries(model, msd, frozen)
    with _single_process_quiet():
        dcp.load({"model": saved, "optim": osd}, checkpoint_id=str(d))
    msd.update(saved)
    msd.update({a: msd[k] for a, k in aliases.items()})
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=opts)


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
