"""Losses by the names of the Tinker API (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
``dro``, ``gspo``), over per-token inputs: each returns the per-token loss ``[B, T]``; the loss of a batch is its sum.

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
- ``dro``: ``-(A log p - beta/2 (log p - log q)^2)``; ``beta`` (config) has no default here: the caller
  names it.
- ``gspo`` (its token-level form, GSPO-token): each row's sequence ratio
  ``s = exp(mean over the row's sequence_ratio_mask of (sg(log p) - log q))`` carries every token's own
  gradient, ``s_t = sg(s) * p / sg(p)``, clipped PPO-style: ``-min(s_t A, clip(s_t, low, high) A)``. The
  thresholds (config, ratios like ``ppo``'s) have no default here: GSPO's are far tighter than PPO's, so
  the caller names them. A row whose mask is all zero has ``s = 1``.

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
    return _bracket(low, high)


def _bracket(low: float, high: float) -> tuple[float, float]:
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


def dro(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float | str]) -> torch.Tensor:
    beta = float(config["beta"])
    if beta < 0:
        raise ValueError(f"dro's beta must be >= 0, got {beta}")
    penalty = (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - 0.5 * beta * penalty)


def gspo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
         config: Mapping[str, float | str]) -> torch.Tensor:
    low, high = _bracket(float(config["clip_low_threshold"]), float(config["clip_high_threshold"]))
    mask = (inputs["sequence_ratio_mask"] != 0).to(logprobs.dtype)
    count = mask.sum(dim=-1, keepdim=True)
    log_ratio = ((logprobs.detach() - inputs["logprobs"]) * mask).sum(dim=-1, keepdim=True) / count.clamp(min=1)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    adv = inputs["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


@dataclass(frozen=True, slots=True)
class DatumLoss:
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float | str]], torch.Tensor]
    required: tuple[str, ...]
    """``loss_fn_inputs`` a datum must carry besides ``target_tokens``."""
    defaults: Mapping[str, float]
    """Inputs that may be left out, and the value every position then gets."""
    config: tuple[str, ...] = ()
    """The ``loss_fn_config`` keys it reads."""
    config_required: tuple[str, ...] = ()
    """The ``loss_fn_config`` keys a call must give (no default)."""


DATUM_LOSSES: dict[str, DatumLoss] = {
    "cross_entropy": DatumLoss(cross_entropy, (), {"weights": 1.0}),
    "importance_sampling": DatumLoss(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": DatumLoss(ppo, ("logprobs", "advantages"), {}, ("clip_low_threshold", "clip_high_threshold")),
    "cispo": DatumLoss(cispo, ("logprobs", "advantages"), {}, ("clip_low_threshold", "clip_high_threshold")),
    "dro": DatumLoss(dro, ("logprobs", "advantages"), {}, ("beta",), ("beta",)),
    "gspo": DatumLoss(gspo, ("logprobs", "advantages", "sequence_ratio_mask"), {},
                      ("clip_low_threshold", "clip_high_threshold"), ("clip_low_threshold", "clip_high_threshold")),
}
