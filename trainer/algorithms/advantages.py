"""Advantage estimators: one reward per sequence and its group id in, one advantage per sequence out.

All estimators are vectorised over groups (``index_add_`` on a dense group index), so a batch of any
number of groups of any sizes costs a handful of tensor ops. The registry is ``ADVANTAGE_ESTIMATORS``;
``compute_advantages`` is the one dispatch path.

Choices shared by all estimators (and where they depart from the papers or from verl):

- A group of one sequence carries no relative signal, so its advantage is 0. verl instead passes the raw
  reward through (mean 0, std 1 for singleton groups), which pushes every lone sample up when rewards
  are positive.
- The group standard deviation is the unbiased (Bessel-corrected) one, as in verl's ``torch.std``.
- ``reinforce_pp_baseline`` whitens over sequences, not over tokens: verl whitens the token-broadcast
  advantages under the response mask, which weights each sequence by its length. Here every sequence
  counts once; the caller broadcasts the result over its tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch

from tracegym.trainer.algorithms.registry import lookup


class AdvantageEstimator(Protocol):
    def __call__(
        self, rewards: torch.Tensor, index: torch.Tensor, *, eps: float, norm_std: bool
    ) -> torch.Tensor: ...


def group_index(group_ids: torch.Tensor | Sequence[Hashable], num_seqs: int) -> torch.Tensor:
    """Map arbitrary group ids (ints, strings, a tensor) to dense ``0..G-1`` indices, shape ``[num_seqs]``.

    Groups are numbered in order of first appearance for lists, in sorted order for tensors.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        index = torch.unique(group_ids, return_inverse=True)[1]
    else:
        ids = list(group_ids)
        if any(g is None for g in ids):
            raise ValueError("group_ids contains None; every sequence needs a group id")
        dense: dict[Hashable, int] = {}
        index = torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)
    if index.numel() != num_seqs:
        raise ValueError(f"got {index.numel()} group ids for {num_seqs} rewards")
    return index


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_seqs], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    return rewards


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def group_stats(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sequence ``(group size, group mean, unbiased group std)``, each gathered to shape ``[N]``.

    The std of a group of one is 0 (it is never divided by: those sequences get advantage 0).
    """
    num_groups = int(index.max()) + 1 if index.numel() else 0
    counts = _group_sum(torch.ones_like(rewards), index, num_groups)
    mean = _group_sum(rewards, index, num_groups) / counts
    centred = rewards - mean[index]
    sq = _group_sum(centred * centred, index, num_groups)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return counts[index], mean[index], std[index]


def grpo_advantages(
    rewards: torch.Tensor, index: torch.Tensor, *, eps: float, norm_std: bool
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``(r - group mean) / (group std + eps)``; without the division when
    ``norm_std`` is False (that is Dr.GRPO's estimator)."""
    counts, mean, std = group_stats(rewards, index)
    adv = rewards - mean
    if norm_std:
        adv = adv / (std + eps)
    return torch.where(counts > 1, adv, torch.zeros_like(adv))


def dr_grpo_advantages(
    rewards: torch.Tensor, index: torch.Tensor, *, eps: float, norm_std: bool
) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): ``r - group mean``, never divided by the std (``norm_std`` is ignored).

    The paper's other half, a length-independent loss normaliser, is a loss-aggregation setting
    (``token-mean`` over the whole batch here, a fixed constant in the paper), not part of this function.
    """
    return grpo_advantages(rewards, index, eps=eps, norm_std=False)


def rloo_advantages(
    rewards: torch.Tensor, index: torch.Tensor, *, eps: float, norm_std: bool
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean of the other rewards of the group``.

    Equals ``n/(n-1) * (r_i - group mean)``. No std normalisation (``norm_std`` is ignored).
    """
    counts, mean, _ = group_stats(rewards, index)
    adv = (rewards - mean) * counts / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, adv, torch.zeros_like(adv))


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, index: torch.Tensor, *, eps: float, norm_std: bool
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): subtract the group mean, then whiten over the whole batch.

    Whitening is over sequences (see the module docstring); with ``norm_std`` False only the group mean
    is subtracted (which then equals Dr.GRPO). The batch std is unbiased.
    """
    counts, mean, _ = group_stats(rewards, index)
    adv = torch.where(counts > 1, rewards - mean, torch.zeros_like(rewards))
    if not norm_std or adv.numel() < 2:
        return adv
    return (adv - adv.mean()) / (adv.std() + eps)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    *,
    eps: float = 1e-6,
    norm_std: bool = True,
) -> torch.Tensor:
    """Advantage per sequence, shape ``[num_seqs]``, with the estimator registered under ``name``.

    ``group_ids`` holds one id per sequence (any hashable values, or a 1-D tensor); sequences sharing an
    id form a group (the samples of one task). ``norm_std`` switches the std division of ``grpo`` and
    ``reinforce_pp_baseline``; ``dr_grpo`` and ``rloo`` never divide.
    """
    fn: Callable[..., torch.Tensor] = lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    rewards = _check_rewards(torch.as_tensor(rewards))
    index = group_index(group_ids, rewards.numel()).to(rewards.device)
    return fn(rewards, index, eps=eps, norm_std=norm_std)


def filter_zero_signal_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]
) -> torch.Tensor:
    """Bool keep-mask ``[num_seqs]``: False for every sequence of a group whose rewards are all equal.

    That is DAPO's dynamic sampling filter: such groups (including groups of one) have advantage 0 under
    every estimator here, so training on them costs compute and only dilutes the token-mean. DAPO also
    re-samples until the batch is full again; that is the loop's job, not this function's.
    """
    rewards = _check_rewards(torch.as_tensor(rewards))
    index = group_index(group_ids, rewards.numel()).to(rewards.device)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    empty = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    gmax = empty.scatter_reduce(0, index, rewards, reduce="amax", include_self=False)
    gmin = empty.scatter_reduce(0, index, rewards, reduce="amin", include_self=False)
    return (gmax > gmin)[index]

