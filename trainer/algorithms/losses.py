"""Policy losses, loss aggregation, KL to a reference model and truncated importance sampling.

Everything works on a padded token batch ``[B, T]`` with a 0/1 ``mask`` that is 1 exactly on the tokens
the policy sampled. Variants are settings of the recipe's ``algorithm`` section (``AlgorithmConfig``), resolved through four registries
(``POLICY_LOSSES``, ``AGGREGATIONS``, ``KL_ESTIMATORS``; advantages live in ``advantages.py``) and one
entry point, ``policy_loss``:

    per-token policy-gradient loss   (POLICY_LOSSES[cfg.loss])
      × truncated IS weight           (cfg.tis_cap, against the engine's sampling logprobs)
      + kl_coef × per-token KL        (KL_ESTIMATORS[cfg.kl_estimator], against ref_logprobs)
      → scalar                        (AGGREGATIONS[cfg.agg], with global normalisers for micro-batching)

Where this departs from the papers:

- The log-ratio ``logprobs - old_logprobs`` is clamped to ``±MAX_LOG_RATIO`` before ``exp`` (as
  verl does) so a single diverged token cannot produce inf.
- GSPO uses the "GSPO-token" form: every token carries the detached sequence ratio times
  ``exp(logp - logp.detach())``. Its value and gradient equal the paper's sequence-level objective under
  ``seq-mean-token-mean`` aggregation (the paper's choice) and allow per-token advantages. The paper's
  clip range is tiny (3e-4 / 4e-4), set it with ``clip_low`` / ``clip_high``.
- CISPO's loss is written ``-A * sg(w) * exp(logp - sg(logp))`` instead of ``-A * sg(w) * logp``: the
  same gradient, but its value is ``-A * w`` and reads like the other losses.
- Truncated importance sampling (Yao et al. 2025) multiplies the policy-gradient term only (not the KL
  term) by ``min(exp(old_logprobs - engine_logprobs), tis_cap)``, detached. It needs ``old_logprobs``
  recomputed by the trainer; with ``old_logprobs = engine_logprobs`` every weight is 1.
- ``k3`` (Schulman's low-variance estimator) is clamped to ``[-10, 10]``, as verl's ``low_var_kl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from tracegym.trainer.algorithms.registry import lookup
from tracegym.trainer.settings import AlgorithmConfig

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±this before ``exp``, so one diverged token cannot produce inf."""

# ---------------------------------------------------------------- masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1. Values under mask 0 (even NaN or inf) do not leak in."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1; an empty mask gives 0 (the sum of nothing over 1)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the softmax over the last dim, shape ``logits.shape[:-1]``, in float32.

    Computed ``chunk_size`` rows at a time so a bf16 ``[B, T, V]`` batch is never upcast whole (a
    49k-token vocabulary makes that ~200 KB per row). Call it under ``torch.no_grad()`` for a metric;
    with grad it still works, but autograd keeps every chunk's softmax.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        x = flat[start : start + chunk_size].float()
        parts.append(torch.logsumexp(x, -1) - (torch.softmax(x, -1) * x).sum(-1))
    if not parts:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(logits.shape[:-1])


# ---------------------------------------------------------------- aggregation


def _check_scale(value: float | None, name: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def token_mean(
    loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> torch.Tensor:
    """Sum over all mask tokens / ``num_tokens`` (default: this batch's mask tokens). DAPO's choice."""
    _check_scale(num_tokens, "num_tokens")
    denom = num_tokens if num_tokens is not None else max(int(mask.bool().sum()), 1)
    return masked_sum(loss, mask) / denom


def _default_num_seqs(mask: torch.Tensor, num_seqs: float | None) -> float:
    _check_scale(num_seqs, "num_seqs")
    if num_seqs is not None:
        return num_seqs
    return max(int(mask.bool().any(-1).sum()), 1)


def seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> torch.Tensor:
    """Each sequence's token sum, averaged over ``num_seqs`` (default: sequences with a mask token)."""
    return masked_sum(loss, mask, -1).sum() / _default_num_seqs(mask, num_seqs)


def seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> torch.Tensor:
    """Each sequence's token mean, averaged over ``num_seqs`` (default: sequences with a mask token).
    The original GRPO and GSPO normalisation."""
    return masked_mean(loss, mask, -1).sum() / _default_num_seqs(mask, num_seqs)


Aggregation = Callable[..., torch.Tensor]
AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
}


def loss_scales(*masks: torch.Tensor, world_size: int = 1) -> dict[str, float]:
    """Global normalisers of a mini-batch given as one or more masks (e.g. its micro-batches):
    ``{"loss_scale_tokens", "loss_scale_seqs"}``, each divided by ``world_size``.

    Pass ``**loss_scales(...)`` of the whole mini-batch to every micro-batch's ``policy_loss``: the
    micro-batch losses then sum to the mini-batch loss, and so do their gradients. When data-parallel
    ranks average their gradients (FSDP does), the division by the world size makes the average of the
    rank sums the global mean."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens = sum(int(m.bool().sum()) for m in masks)
    seqs = sum(int(m.bool().any(-1).sum()) for m in masks)
    return {"loss_scale_tokens": max(tokens, 1) / world_size, "loss_scale_seqs": max(seqs, 1) / world_size}


# ---------------------------------------------------------------- KL estimators (Schulman 2020)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``log p - log q``: unbiased for KL(p‖q) but high variance, and may be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``(log p - log q)² / 2``: biased, low variance; its gradient is the true KL gradient on-policy."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``q/p - 1 - log(q/p)``: unbiased, non-negative, low variance; clamped to [-10, 10] as verl."""
    log_ratio = ref_logprobs - logprobs
    return (torch.exp(log_ratio) - 1 - log_ratio).clamp(-10.0, 10.0)


KlEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KlEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# ---------------------------------------------------------------- configuration


# ---------------------------------------------------------------- policy losses


class TokenLoss(NamedTuple):
    """A policy loss before aggregation: all ``[B, T]``."""

    loss: torch.Tensor
    ratio: torch.Tensor
    """The importance ratio the loss used (detached), for metrics."""
    clipped: torch.Tensor
    """Bool: the token's ratio was clipped (its gradient is zero or truncated)."""


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> TokenLoss:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - low, 1 + high)
    is_clipped = clipped > unclipped
    return TokenLoss(torch.where(is_clipped, clipped, unclipped), ratio.detach(), is_clipped)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> TokenLoss:
    """PPO-clip (Schulman 2017) per token, ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``;
    separate low/high clip is DAPO's clip-higher."""
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), adv, cfg.clip_low, cfg.clip_high)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> TokenLoss:
    """GSPO (Zheng et al. 2025): the ratio is the sequence's geometric-mean token ratio
    ``exp(mean_t(log p - log p_old))``, clipped per sequence (GSPO-token form, see module docstring)."""
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, -1).detach()
    log_ratio = seq_log_ratio[:, None] + logprobs - logprobs.detach()
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), adv, cfg.clip_low, cfg.clip_high)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the detached, clipped IS ratio, so clipped tokens
    still get a (bounded) gradient: ``-A * sg(clip(r, 1 - cispo_clip_low, 1 + cispo_clip_high)) * log p``."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    low, high = 1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high
    weight = ratio.clamp(low, high)
    loss = -adv * weight * torch.exp(logprobs - logprobs.detach())
    return TokenLoss(loss, ratio, (ratio < low) | (ratio > high))


PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig], TokenLoss]
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}


# ---------------------------------------------------------------- entry point


def _check_batch(logprobs: torch.Tensor, mask: torch.Tensor, **others: torch.Tensor | None) -> None:
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"need logprobs and mask of one shape [B, T], got {tuple(logprobs.shape)}, {tuple(mask.shape)}"
        )
    for name, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)}")


def _truncated_is(
    cfg: AlgorithmConfig, old: torch.Tensor, engine: torch.Tensor | None, mask: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The detached TIS weight ``min(p_old / p_engine, tis_cap)`` (None when TIS is off) and metrics."""
    if engine is None:
        if cfg.tis_cap is not None:
            raise ValueError("tis_cap is set but engine_logprobs were not given")
        return None, {}
    log_w = (old - engine).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    raw = torch.exp(log_w)
    metrics = {"engine_mismatch_kl": masked_mean(raw - 1 - log_w, mask)}
    if cfg.tis_cap is None:
        return None, metrics
    metrics["tis_frac"] = masked_mean((raw > cfg.tis_cap).float(), mask)
    weight = raw.clamp(max=cfg.tis_cap)
    metrics["tis_weight_mean"] = masked_mean(weight, mask)
    return weight, metrics


def policy_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
    loss_scale_tokens: float | None = None,
    loss_scale_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of a padded batch ``[B, T]`` and its metrics.

    ``logprobs`` carries the gradient; ``old_logprobs`` (the policy that sampled, or the trainer's
    recomputation of it), ``ref_logprobs`` (frozen reference, needed when ``kl_coef > 0``) and
    ``engine_logprobs`` (what the inference engine reported, needed for TIS) are treated as constants.
    ``advantages`` is per token ``[B, T]`` or per sequence ``[B]`` (broadcast over the mask). Entries
    under mask 0 are ignored entirely, even NaN or inf. ``loss_scale_tokens`` / ``loss_scale_seqs``
    are the global normalisers for micro-batching (see ``loss_scales``); by default this batch's own.

    Metrics: ``pg_loss`` and ``kl_loss`` are scaled like the loss (sum them over micro-batches); the
    others (``clip_frac``, ``ratio_mean``, ``ratio_max``, ``approx_kl`` = k3 estimate of KL(old‖new),
    ``kl`` to the reference, ``tis_frac``, ``tis_weight_mean``, ``engine_mismatch_kl``) are means over
    this call's mask tokens; ``tokens`` and ``seqs`` count them, for weighting.
    """
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages [B] has {advantages.shape[0]} rows, logprobs has {logprobs.shape[0]}"
            )
        advantages = advantages[:, None].expand_as(logprobs)
    _check_batch(
        logprobs,
        mask,
        old_logprobs=old_logprobs,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        engine_logprobs=engine_logprobs,
    )
    m = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(m, t, zero)

    logprobs, old = clean(logprobs), clean(old_logprobs.detach())
    tok = lookup(POLICY_LOSSES, cfg.loss, "policy loss")(logprobs, old, clean(advantages.detach()), m, cfg)
    weight, metrics = _truncated_is(
        cfg, old, None if engine_logprobs is None else clean(engine_logprobs.detach()), m
    )
    pg = tok.loss if weight is None else tok.loss * weight
    aggregate = lookup(AGGREGATIONS, cfg.agg, "loss aggregation")
    scales = {"num_tokens": loss_scale_tokens, "num_seqs": loss_scale_seqs}
    loss = pg_loss = aggregate(pg, m, **scales)
    log_ratio = (logprobs - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).detach()
    metrics |= {
        "pg_loss": pg_loss.detach(),
        "clip_frac": masked_mean(tok.clipped.float(), m),
        "ratio_mean": masked_mean(tok.ratio, m),
        "ratio_max": tok.ratio.masked_fill(~m, -math.inf).max() if m.any() else zero,
        "approx_kl": masked_mean(torch.exp(log_ratio) - 1 - log_ratio, m),
    }
    if ref_logprobs is not None:
        kl = lookup(KL_ESTIMATORS, cfg.kl_estimator, "KL estimator")(logprobs, clean(ref_logprobs.detach()))
        kl_loss = aggregate(kl, m, **scales)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
        metrics |= {"kl": masked_mean(kl.detach(), m), "kl_loss": kl_loss.detach()}
    elif cfg.kl_coef > 0:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs")
    out = {k: float(v) for k, v in metrics.items()}
    out |= {"tokens": float(m.sum()), "seqs": float(m.any(-1).sum())}
    return loss, out
