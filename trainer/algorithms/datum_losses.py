"""Losses by the names of the Tinker API (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``),
over per-token inputs: each returns the per-token loss ``[B, T]``; the loss of a batch is its sum.

Every input is a padded ``[B, T]`` tensor aligned with the targets: position ``t`` of a row holds what
concerns ``target_tokens[t]``, the token predicted from ``model_input[: t + 1]``. Padding carries zero
weights and zero advantages, so it adds nothing. ``logprobs`` carries the gradient; every other input is a
constant. ``DATUM_LOSSES`` is the registry the training service looks names up in (``registry.lookup``).

- ``cross_entropy``: ``-weights * log p(target)``. Weights may be any real numbers (a client-side custom
  loss arrives as its gradient with respect to the logprobs, sent as weights).
- ``importance_sampling``: ``-(p / q) * A`` with ``q`` the sampler's probability (input ``logprobs``).
- ``ppo``: ``-min((p / q) A, clip(p / q, clip_low_threshold, clip_high_threshold) A)``; the thresholds
  are ratios (config keys, defaults 0.8 and 1.2), not offsets from 1 as in ``losses.ppo_clip_loss``.
- ``cispo``: ``-sg(clip(p / q, clip_low_threshold, clip_high_threshold)) * A * log p``; its value is
  written ``-sg(w) A exp(log p - sg(log p))`` as in ``losses.cispo_loss`` (same gradient).

Where this departs from the papers: nothing is normalised (no token or sequence mean), as the API defines
these losses: the caller scales its weights or advantages. Log-ratios are clamped to
``±losses.MAX_LOG_RATIO`` before ``exp``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tracegym.trainer.algorithms.losses import MAX_LOG_RATIO

PPO_CLIP_LOW = 0.8
"""Default ``clip_low_threshold`` of ``ppo`` and ``cispo``: the smallest ratio that still moves."""
PPO_CLIP_HIGH = 1.2
"""Default ``clip_high_threshold`` of ``ppo`` and ``cispo``."""


def _ratio(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp((logprobs - sampling_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _thresholds(config: Mapping[str, float | str]) -> tuple[float, float]:
    low = float(config.get("clip_low_threshold", PPO_CLIP_LOW))
    high = float(config.get("clip_high_threshold", PPO_CLIP_HIGH))
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
    return low, high


def cross_entropy(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                  config: Mapping[str, float | str]) -> torch.Tensor:
    return -logprobs * inputs["weights"]


def importance_sampling(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                        config: Mapping[str, float | str]) -> torch.Tensor:
    return -_ratio(logprobs, inputs["logprobs"]) * inputs["advantages"]


def ppo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float | str]) -> torch.Tensor:
    low, high = _thresholds(config)
    ratio, adv = _ratio(logprobs, inputs["logprobs"]), inputs["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def cispo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, float | str]) -> torch.Tensor:
    low, high = _thresholds(config)
    weight = _ratio(logprobs, inputs["logprobs"]).detach().clamp(low, high)
    return -weight * inputs["advantages"] * torch.exp(logprobs - logprobs.detach())


@dataclass(frozen=True, slots=True)
class DatumLoss:
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float | str]], torch.Tensor]
    required: tuple[str, ...]
    """``loss_fn_inputs`` a datum must carry besides ``target_tokens``."""
    defaults: Mapping[str, float]
    """Inputs that may be left out, and the value every position then gets."""
    config: tuple[str, ...] = ()
    """The ``loss_fn_config`` keys it reads."""


DATUM_LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(cross_entropy, (), {"weights": 1.0}),
    "importance_sampling": DatumLoss(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": DatumLoss(ppo, ("logprobs", "advantages"), {}, ("clip_low_threshold", "clip_high_threshold")),
    "cispo": DatumLoss(cispo, ("logprobs", "advantages"), {}, ("clip_low_threshold", "clip_high_threshold")),
}
