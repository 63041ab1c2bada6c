"""A batch of sequences sharing one KV cache: left-padded prefill, one-token decode steps, dropping rows,
and merging a newly prefilled batch into a running one.

Rows are left-padded: ``mask[B, T]`` marks real tokens, positions count real tokens only, and the cached
keys already carry their rotary position, so rows of different lengths (and rows prefilled at different
times) can share one cache once their time axes are left-padded to the same length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

PAD_ID = 0


@dataclass
class KVBatch:
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] long, 1 = real token
    next_pos: torch.Tensor  # [B] long, position id of the next token

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _forward(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache, keep: int = 1
) -> torch.Tensor:
    """The logits of the last ``keep`` positions, ``[B, keep, V]``."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    return out.logits


def prefill(model: Any, prompts: list[list[int]], device: torch.device) -> tuple[KVBatch, torch.Tensor]:
    """Run the prompts (left-padded) through the model; returns the batch and next-token logits[B, V]."""
    batch, logits = prefill_keep(model, prompts, device, 1)
    return batch, logits[:, -1, :]


def prefill_keep(
    model: Any, prompts: list[list[int]], device: torch.device, keep: int
) -> tuple[KVBatch, torch.Tensor]:
    """``prefill`` keeping the logits of the last ``keep`` columns, ``[B, keep, V]`` (``[:, -1]`` are the
    next-token logits). Rows are left-padded: row ``i``'s own positions are its last ``len(prompts[i])``
    columns, so its logits of prompt positions ``s`` .. the last are ``[i, keep - (len(prompts[i]) - s):]``."""
    width = max(len(p) for p in prompts)
    if not 1 <= keep <= width:
        raise ValueError(f"keep={keep} logit columns of a batch {width} tokens wide")
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = _forward(model, ids, mask, pos, cache, keep)
    return KVBatch(cache, mask, pos[:, -1] + 1), logits


def decode(model: Any, batch: KVBatch, tokens: list[int]) -> torch.Tensor:
    """Feed one token per row; updates ``batch`` in place and returns next-token logits[B, V]."""
    device = batch.mask.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    batch.mask = torch.cat([batch.mask, torch.ones((batch.size, 1), dtype=torch.long, device=device)], dim=1)
    logits = _forward(model, ids, batch.mask, batch.next_pos[:, None], batch.cache)
    batch.next_pos = batch.next_pos + 1
    return logits[:, -1, :]


def _rebuild(kv: list[tuple[torch.Tensor, torch.Tensor]], config: Any) -> DynamicCache:
    return DynamicCache(ddp_cache_data=kv, config=config)


def select(batch: KVBatch, keep: list[int], config: Any) -> KVBatch:
    """The rows ``keep`` of ``batch``, with time columns that are padding in every kept row dropped."""
    idx = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
    mask = batch.mask.index_select(0, idx)
    real_cols = mask.any(dim=0).nonzero()
    start = int(real_cols[0]) if real_cols.numel() else mask.shape[1]
    kv = [
        (k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
        for k, v in _kv(batch.cache)
    ]
    return KVBatch(_rebuild(kv, config), mask[:, start:], batch.next_pos.index_select(0, idx))


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def merge(a: KVBatch, b: KVBatch, config: Any) -> KVBatch:
    """Rows of ``a`` followed by rows of ``b``, time axes left-padded to the longer one."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    kv = []
    for (ka, va), (kb, vb) in zip(_kv(a.cache), _kv(b.cache), strict=True):
        k = torch.cat([_left_pad(ka, width, 2), _left_pad(kb, width, 2)], dim=0)
        v = torch.cat([_left_pad(va, width, 2), _left_pad(vb, width, 2)], dim=0)
        kv.append((k, v))
    mask = torch.cat([_left_pad(a.mask, width, 1), _left_pad(b.mask, width, 1)], dim=0)
    return KVBatch(_rebuild(kv, config), mask, torch.cat([a.next_pos, b.next_pos]))
