"""Training objectives beyond the GRPO family: supervised fine-tuning, DPO and on-policy distillation.

Each is a pure function over the same padded token batch ``[B, T]`` that ``losses.policy_loss`` takes
(``logprobs`` carrying the gradient, a 0/1 ``mask`` on the trained tokens), so all of them share the
trainer's micro-batching and its global loss normalisers (``losses.loss_scales``). ``OBJECTIVES`` is
the registry the recipe's ``objective`` (and each of its ``phases``) is looked up in.

- ``grpo``: the policy-gradient family of ``losses.policy_loss`` (advantage estimator, policy loss,
  aggregation and KL from the recipe's ``algorithm`` section).
- ``sft``: token-level cross-entropy on the mask-1 tokens, ``-log p(token)``, aggregated like the policy
  loss (``token-mean`` by default).
- ``dpo`` (Rafailov et al. 2023): ``-log σ(β [(log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))])``
  per chosen/rejected pair, where ``log π(x)`` is the sum of a sequence's mask-1 token logprobs and
  ``π_ref`` the frozen start model; averaged over pairs (``num_pairs`` globally, for micro-batching).
- ``distill`` (on-policy distillation, as in Agarwal et al. 2024 and Thinking Machines' write-up): the
  student samples, the teacher scores the same tokens, and the per-token advantage is
  ``log p_teacher - log p_student`` (the negative per-token reverse KL), optionally plus
  ``reward_weight`` × the group advantage of the rollout's reward; the loss is then the policy
  gradient of ``losses.policy_loss`` with those per-token advantages.

Where this departs from the papers: DPO's log-likelihoods are sums over the sampled (mask-1) tokens
only, so a multi-turn pair compares only the assistant's tokens; ``distill`` uses the sampling
engine's logprobs as the student's (the policy that produced the tokens), not the trainer's
recomputation (they differ by the ``mismatch`` metric).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tracegym.trainer.algorithms.losses import AGGREGATIONS, masked_sum
from tracegym.trainer.algorithms.registry import lookup
from tracegym.trainer.settings import AlgorithmConfig


def sft_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_scale_tokens: float | None = None,
    loss_scale_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy ``-log p`` of the mask-1 tokens, aggregated with ``cfg.agg`` (the normalisers as
    in ``policy_loss``). Metrics: ``sft_loss`` (scaled like the loss), ``tokens``, ``seqs``."""
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"need logprobs and mask of one shape [B, T], got {tuple(logprobs.shape)}, "
                         f"{tuple(mask.shape)}")
    m = mask.bool()
    nll = torch.where(m, -logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    aggregate = lookup(AGGREGATIONS, cfg.agg, "loss aggregation")
    loss = aggregate(nll, m, num_tokens=loss_scale_tokens, num_seqs=loss_scale_seqs)
    return loss, {"sft_loss": float(loss.detach()), "tokens": float(m.sum()), "seqs": float(m.any(-1).sum())}


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's sum of mask-1 token logprobs, ``[B, T] → [B]`` (the log-likelihood DPO compares)."""
    return masked_sum(logprobs, mask, -1)


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    num_pairs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO over ``[P]`` pairs of sequence log-likelihoods (policy, carrying the gradient; reference,
    constants). The loss is the sum over pairs / ``num_pairs`` (default: this call's ``P``), so the
    micro-batches of a step sum to the step's mean. Metrics: ``dpo_loss`` (scaled like the loss),
    ``reward_accuracy`` (pairs whose implicit reward margin is > 0), ``reward_margin`` (its mean),
    ``pairs``."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {t.shape for t in (chosen, rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or chosen.dim() != 1:
        raise ValueError(f"need four [P] tensors of one shape, got {[tuple(s) for s in shapes]}")
    if num_pairs is not None and not num_pairs > 0:
        raise ValueError(f"num_pairs must be > 0, got {num_pairs}")
    margin = beta * ((chosen - ref_chosen.detach()) - (rejected - ref_rejected.detach()))
    per_pair = -F.logsigmoid(margin)
    n = num_pairs if num_pairs is not None else max(chosen.numel(), 1)
    loss = per_pair.sum() / n
    p = chosen.numel()
    return loss, {
        "dpo_loss": float(loss.detach()),
        "reward_accuracy": float((margin > 0).float().mean()) if p else 0.0,
        "reward_margin": float(margin.detach().mean()) if p else 0.0,
        "pairs": float(p),
    }


def dpo_loss_loop(
    chosen: list[float], rejected: list[float], ref_chosen: list[float], ref_rejected: list[float], *, beta: float
) -> float:
    """The DPO loss pair by pair in plain Python (the reference the vectorised ``dpo_loss`` is tested
    against)."""
    import math

    total = 0.0
    for c, r, rc, rr in zip(chosen, rejected, ref_chosen, ref_rejected, strict=True):
        z = beta * ((c - rc) - (r - rr))
        total += math.log1p(math.exp(-z)) if z > -30 else -z  # -log σ(z)
    return total / max(len(chosen), 1)


def distill_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    reward_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> torch.Tensor:
    """Per-token advantages ``[B, T]`` of on-policy distillation: ``teacher - student`` logprob of each
    sampled token (0 under mask 0, NaN or inf there included), plus ``reward_weight`` × the per-sequence
    ``reward_advantages`` ``[B]`` when given."""
    if teacher_logprobs.shape != student_logprobs.shape or mask.shape != teacher_logprobs.shape:
        raise ValueError(f"teacher, student and mask must have one shape [B, T], got "
                         f"{tuple(teacher_logprobs.shape)}, {tuple(student_logprobs.shape)}, {tuple(mask.shape)}")
    m = mask.bool()
    zero = torch.zeros((), dtype=teacher_logprobs.dtype, device=teacher_logprobs.device)
    adv = torch.where(m, teacher_logprobs.detach() - student_logprobs.detach(), zero)
    if reward_advantages is not None and reward_weight:
        if reward_advantages.shape != teacher_logprobs.shape[:1]:
            raise ValueError(f"reward_advantages must be [B] = {teacher_logprobs.shape[0]}, got "
                             f"{tuple(reward_advantages.shape)}")
        adv = adv + torch.where(m, reward_weight * reward_advantages[:, None].to(adv.dtype), zero)
    return adv


def distill_advantages_loop(
    teacher: list[list[float]], student: list[list[float]], mask: list[list[int]],
    reward_advantages: list[float] | None = None, reward_weight: float = 0.0,
) -> list[list[float]]:
    """``distill_advantages`` token by token in plain Python (the test reference)."""
    out = []
    for b, (t_row, s_row, m_row) in enumerate(zip(teacher, student, mask, strict=True)):
        extra = reward_weight * reward_advantages[b] if reward_advantages is not None else 0.0
        out.append([(t - s + extra) if m else 0.0 for t, s, m in zip(t_row, s_row, m_row, strict=True)])
    return out


Objective = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def _policy(cfg: AlgorithmConfig, *args: torch.Tensor, **kw: object) -> tuple[torch.Tensor, dict[str, float]]:
    from tracegym.trainer.algorithms.losses import policy_loss

    return policy_loss(cfg, *args, **kw)  # type: ignore[arg-type]


OBJECTIVES: dict[str, Objective] = {
    "grpo": _policy,  # policy_loss with the estimator's per-sequence advantages
    "sft": sft_loss,
    "dpo": dpo_loss,
    "distill": _policy,  # policy_loss with distill_advantages per token
}
"""The loss each objective trains with (the worker prepares its inputs: advantages, pairs, teacher)."""


def check_objective(name: str) -> str:
    """``name`` if it is an objective, else ``UnknownNameError`` listing the valid ones."""
    lookup(OBJECTIVES, name, "objective")
    return name
