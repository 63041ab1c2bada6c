"""Linear weights cast once for CPU autocast (``engine/precast.py``): the same logits to the bit as autocast's
own casts, the fp32 weights outside autocast, and copies that follow a weight update through the scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tracegym.engine.precast import LinearCasts
from tracegym.engine.scheduler import Scheduler
from tracegym.modelfiles.load import load_model

BF16 = torch.bfloat16


def _logits(model: torch.nn.Module, ids: torch.Tensor, autocast: bool = True) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        return model(input_ids=ids).logits


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + torch.randn(p.shape, generator=gen) * 0.05 for n, p in model.named_parameters()}


def test_the_cast_copies_give_autocasts_logits_to_the_bit_and_fp32_outside_autocast(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    ids = torch.randint(5, 500, (3, 11), generator=torch.Generator().manual_seed(1))
    reference, fp32 = _logits(model, ids), _logits(model, ids, autocast=False)
    casts = LinearCasts(model, BF16)
    assert len(casts) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(_logits(model, ids), reference)
    assert torch.equal(_logits(model, ids, autocast=False), fp32)  # the fp32 weights themselves

    with torch.no_grad():  # new weights: stale copies until refreshed
        for name, p in model.named_parameters():
            p.copy_(_perturbed(model, 2)[name])
    stale = _logits(model, ids)
    casts.refresh()
    fresh = _logits(model, ids)
    plain = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(dict(model.named_parameters())[name])
    assert torch.equal(fresh, _logits(plain, ids)) and not torch.equal(stale, fresh)


@pytest.mark.parametrize("autocast_dtype", [BF16, None])
def test_a_weight_update_through_the_scheduler_refreshes_the_copies(
    tiny_model_dir: Path, autocast_dtype: torch.dtype | None
) -> None:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    scheduler = Scheduler(model, tokenizer, device=torch.device("cpu"), max_batch_size=4, weight_version="v0",
                          autocast_dtype=autocast_dtype)
    assert (scheduler.casts is not None) == (autocast_dtype is not None)
    state = _perturbed(model, 3)
    scheduler.start()
    try:
        assert scheduler.update_weights(state, "v1", abort_all=False).result(timeout=60) == 0
    finally:
        scheduler.stop()
    ids = torch.randint(5, 500, (2, 7), generator=torch.Generator().manual_seed(4))
    plain = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(state[name])
    assert torch.equal(_logits(model, ids), _logits(plain, ids))
