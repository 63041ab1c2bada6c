"""The trainer's AdamW: fused where every trainable parameter is a plain CPU tensor, the same update as the
per-tensor loop up to float rounding, and the default implementation elsewhere."""

from __future__ import annotations

import torch

from tracegym.trainer.algorithms.optim import build_optimizer, fused_on_cpu
from tracegym.trainer.settings import OptimConfig


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 32), (32,), (7, 3, 5))]


def test_cpu_parameters_get_the_fused_kernel_and_the_same_update() -> None:
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    fused_params, loop_params = _params(0), _params(0)
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    fused = build_optimizer([*fused_params, frozen], cfg)
    assert fused.param_groups[0]["fused"] is True and len(fused.param_groups[0]["params"]) == 3
    loop = torch.optim.AdamW(loop_params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(fused_params, loop_params, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused_params[0].detach(), _params(0)[0].detach())


def test_other_parameters_keep_adamws_own_choice() -> None:
    assert fused_on_cpu(_params(0))
    meta = [torch.nn.Parameter(torch.zeros(4, device="meta"))]  # not on the CPU (as on a GPU)
    assert not fused_on_cpu(meta)
    assert build_optimizer(meta, OptimConfig()).param_groups[0]["fused"] is None
