"""Advantage estimators: hand-computed cases, loop-vs-vectorised equivalence, dispatch errors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tracegym.trainer.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    filter_zero_signal_groups,
)
from tracegym.trainer.algorithms.registry import UnknownNameError

# Group "a" = [1, 0, 0, 0], group "b" = [1, 1, 0, 0], group "c" = [2] (a singleton).
REWARDS = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 2])
GROUPS = ["a"] * 4 + ["b"] * 4 + ["c"]
HALF_SQRT3 = math.sqrt(3) / 2  # 0.5 / unbiased std of [1, 1, 0, 0]


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert actual.shape == (len(expected),)
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol), actual.tolist()


def test_grpo_hand_computed() -> None:
    adv = compute_advantages("grpo", REWARDS, GROUPS, eps=0.0)
    # group a: mean 0.25, unbiased std 0.5
    _close(adv, [1.5, -0.5, -0.5, -0.5, HALF_SQRT3, HALF_SQRT3, -HALF_SQRT3, -HALF_SQRT3, 0.0])


def test_grpo_eps_is_added_to_the_std() -> None:
    adv = compute_advantages("grpo", REWARDS[:4], [0] * 4, eps=0.5)
    _close(adv, [0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize(("name", "norm_std"), [("dr_grpo", True), ("dr_grpo", False), ("grpo", False)])
def test_dr_grpo_hand_computed(name: str, norm_std: bool) -> None:
    adv = compute_advantages(name, REWARDS, GROUPS, norm_std=norm_std)
    _close(adv, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0.0])


def test_rloo_hand_computed() -> None:
    adv = compute_advantages("rloo", REWARDS, GROUPS)
    _close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3, 0.0])


def test_reinforce_pp_baseline_hand_computed() -> None:
    adv = compute_advantages("reinforce_pp_baseline", REWARDS, GROUPS, eps=0.0)
    centred = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0.0]
    std = math.sqrt(1.75 / 8)  # batch mean is 0; sum of squares 1.75 over 9 - 1
    _close(adv, [c / std for c in centred])
    plain = compute_advantages("reinforce_pp_baseline", REWARDS, GROUPS, norm_std=False)
    _close(plain, centred)


def test_group_ids_may_be_a_tensor_and_any_order() -> None:
    perm = [4, 0, 8, 1, 5, 2, 6, 3, 7]
    ids = torch.tensor([[0, 0, 0, 0, 7, 7, 7, 7, 3][i] for i in perm])
    expected = compute_advantages("grpo", REWARDS, GROUPS)[perm]
    assert torch.allclose(compute_advantages("grpo", REWARDS[perm], ids), expected)


def _loop_reference(name: str, rewards: list[float], groups: list[int], eps: float) -> list[float]:
    """Straightforward per-group loops, written independently of the vectorised code."""
    out = [0.0] * len(rewards)
    centred = [0.0] * len(rewards)
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        n = len(members)
        if n < 2:
            continue
        mean = sum(rewards[i] for i in members) / n
        std = math.sqrt(sum((rewards[i] - mean) ** 2 for i in members) / (n - 1))
        for i in members:
            others = sum(rewards[j] for j in members if j != i) / (n - 1)
            centred[i] = rewards[i] - mean
            out[i] = {
                "grpo": (rewards[i] - mean) / (std + eps),
                "dr_grpo": rewards[i] - mean,
                "rloo": rewards[i] - others,
                "reinforce_pp_baseline": 0.0,
            }[name]
    if name == "reinforce_pp_baseline":
        m = sum(centred) / len(centred)
        s = math.sqrt(sum((c - m) ** 2 for c in centred) / (len(centred) - 1))
        out = [(c - m) / (s + eps) for c in centred]
    return out


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loop_vs_vectorised(name: str, seed: int) -> None:
    rng = random.Random(seed)
    groups = [g for g in range(12) for _ in range(rng.randint(1, 6))]
    rng.shuffle(groups)
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in groups]
    got = compute_advantages(name, torch.tensor(rewards, dtype=torch.float64), groups, eps=1e-6)
    _close(got, _loop_reference(name, rewards, groups, 1e-6), tol=1e-9)


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError, match="dr_grpo, grpo, reinforce_pp_baseline, rloo"):
        compute_advantages("ppo", REWARDS, GROUPS)


@pytest.mark.parametrize(
    ("rewards", "groups", "message"),
    [
        (torch.tensor([1.0, 0.0]), [0], "2 rewards"),
        (torch.tensor([1.0, float("nan")]), [0, 0], "NaN"),
        (torch.tensor([[1.0, 0.0]]), [0, 0], "1-D"),
        (torch.tensor([1.0, 0.0]), [0, None], "None"),
    ],
)
def test_bad_input_fails_clearly(rewards: torch.Tensor, groups: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_advantages("grpo", rewards, groups)


def test_filter_zero_signal_groups() -> None:
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 2, 0.5, 0.5])
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] + ["d"] * 2
    keep = filter_zero_signal_groups(rewards, groups)
    assert keep.tolist() == [True] * 4 + [False] * 4 + [False] + [False] * 2
    # every dropped sequence has advantage 0 under every estimator
    for name in ADVANTAGE_ESTIMATORS:
        assert torch.all(compute_advantages(name, rewards, groups)[~keep] == 0), name

