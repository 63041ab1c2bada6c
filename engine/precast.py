"""Linear weights cast once per weight load for CPU autocast, instead of at every forward.

On the CPU the engine computes in bf16 as ``torch.autocast`` over fp32 weights (the trainer's numerics). Autocast
casts a Linear's fp32 weight to bf16 each time the Linear runs: its cast cache keeps only tensors that require
grad, and served weights do not. Every decode step thus read all the fp32 weights and wrote a fresh bf16 copy,
whose new pages the kernel had to clear. Here each Linear keeps a bf16 copy of its weight, made once and
refreshed in place after every weight update, and uses it while autocast computes in that dtype. The copy holds
the values autocast's cast gives (the same rounding), so outputs are the same to the bit; the fp32 weights stay
the served parameters that checkpoints, tied weights and updates address.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def _forward(module: nn.Linear, cast: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype:
            return F.linear(x, cast, module.bias)
        return F.linear(x, module.weight, module.bias)  # outside autocast (or another dtype): the weight itself

    return forward


class LinearCasts:
    """The ``dtype`` copies of ``model``'s fp32 Linear weights, used by those Linears under CPU autocast in
    ``dtype``; ``refresh`` after the weights change."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._casts: list[tuple[nn.Linear, torch.Tensor]] = []
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
                cast = module.weight.detach().to(dtype)
                module.forward = _forward(module, cast, dtype)  # type: ignore[method-assign]
                self._casts.append((module, cast))

    def __len__(self) -> int:
        return len(self._casts)

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the current weights into the copies, in place (no new memory)."""
        for module, cast in self._casts:
            cast.copy_(module.weight)
