"""The objectives beyond GRPO (sft, dpo, distill) as pure functions on CPU: values against plain-Python
loops, gradients against their definitions, micro-batch sums against the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.trainer.algorithms.losses import loss_scales, policy_loss
from tracegym.trainer.algorithms.objectives import (
    OBJECTIVES,
    check_objective,
    distill_advantages,
    distill_advantages_loop,
    dpo_loss,
    dpo_loss_loop,
    sequence_logprobs,
    sft_loss,
)
from tracegym.trainer.algorithms.registry import UnknownNameError
from tracegym.trainer.settings import AlgorithmConfig


def _batch(seed: int = 0, b: int = 4, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g) * 3
    mask = (torch.rand(b, t, generator=g) > 0.4).float()
    mask[:, 0] = 0
    mask[0, 3] = 1
    return logprobs, mask


def test_sft_loss_is_the_mean_negative_logprob_of_the_mask_tokens() -> None:
    lp, mask = _batch()
    loss, m = sft_loss(AlgorithmConfig(), lp, mask)
    want = sum(-float(lp[i, j]) for i in range(4) for j in range(7) if mask[i, j]) / float(mask.sum())
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["tokens"] == float(mask.sum())


def test_sft_loss_ignores_nan_under_mask_zero_and_its_gradient_is_minus_one_per_token() -> None:
    lp, mask = _batch(1)
    lp = lp.masked_fill(mask == 0, float("nan")).requires_grad_(True)
    loss, _ = sft_loss(AlgorithmConfig(), lp, mask)
    loss.backward()
    n = float(mask.sum())
    assert torch.isfinite(loss)
    assert torch.allclose(lp.grad, torch.where(mask.bool(), -1.0 / n, 0.0))


def test_sft_micro_batches_sum_to_the_whole_batch() -> None:
    lp, mask = _batch(2, b=6)
    whole, _ = sft_loss(AlgorithmConfig(), lp, mask)
    parts = [(lp[:2], mask[:2]), (lp[2:], mask[2:])]
    scales = loss_scales(*(m for _, m in parts))
    total = sum(sft_loss(AlgorithmConfig(), x, m, **scales)[0] for x, m in parts)
    assert float(total) == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_sft_follows_the_aggregation_setting(agg: str) -> None:
    lp, mask = _batch(3)
    loss, _ = sft_loss(AlgorithmConfig(agg=agg), lp, mask)
    rows = [[-float(lp[i, j]) for j in range(7) if mask[i, j]] for i in range(4)]
    per = [sum(r) if agg.endswith("sum") else sum(r) / len(r) for r in rows if r]
    assert loss.item() == pytest.approx(sum(per) / len(per), rel=1e-6)


def test_dpo_loss_matches_the_loop_and_log2_at_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-torch.rand(5, generator=g) * 20 for _ in range(4))
    loss, m = dpo_loss(c, r, rc, rr, beta=0.3)
    assert loss.item() == pytest.approx(dpo_loss_loop(c.tolist(), r.tolist(), rc.tolist(), rr.tolist(), beta=0.3))
    at_ref, m0 = dpo_loss(c, r, c, r, beta=0.3)
    assert at_ref.item() == pytest.approx(math.log(2))
    assert m0["reward_margin"] == 0.0 and m["pairs"] == 5.0


def test_dpo_gradient_raises_chosen_and_lowers_rejected() -> None:
    c = torch.tensor([-10.0, -4.0], requires_grad=True)
    r = torch.tensor([-9.0, -6.0], requires_grad=True)
    ref = torch.tensor([-9.5, -5.0])
    loss, _ = dpo_loss(c, r, ref, ref, beta=0.5)
    loss.backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()  # descent raises log π(chosen), lowers log π(rejected)
    # d/dc of -log σ(β(c - r)) / P is -β σ(-β(c - r)) / P
    want = -0.5 * torch.sigmoid(-0.5 * (c.detach() - r.detach())) / 2
    assert torch.allclose(c.grad, want)


def test_dpo_micro_batches_sum_to_the_mean_over_pairs() -> None:
    g = torch.Generator().manual_seed(4)
    c, r, rc, rr = (-torch.rand(6, generator=g) * 5 for _ in range(4))
    whole, _ = dpo_loss(c, r, rc, rr, beta=0.1)
    parts = sum(dpo_loss(c[s], r[s], rc[s], rr[s], beta=0.1, num_pairs=6)[0] for s in (slice(0, 2), slice(2, 6)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


def test_dpo_refuses_bad_settings() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(x, torch.zeros(3), x, x, beta=0.1)


def test_sequence_logprobs_sums_the_mask_tokens() -> None:
    lp, mask = _batch(5)
    assert torch.allclose(sequence_logprobs(lp, mask), (lp * mask).sum(-1))


def test_distill_advantages_match_the_loop() -> None:
    t, mask = _batch(6)
    s, _ = _batch(7)
    ra = torch.tensor([1.0, -1.0, 0.5, 0.0])
    got = distill_advantages(t, s, mask, reward_advantages=ra, reward_weight=0.25)
    want = distill_advantages_loop(t.tolist(), s.tolist(), mask.int().tolist(), ra.tolist(), 0.25)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert torch.equal(distill_advantages(t, s, mask), torch.tensor(distill_advantages_loop(
        t.tolist(), s.tolist(), mask.int().tolist())))


def test_distill_pushes_up_tokens_the_teacher_prefers() -> None:
    """Through policy_loss, a token the teacher likes more than the student gets a gradient that raises
    its logprob, and one it likes less is lowered."""
    student = torch.tensor([[0.0, -2.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, -0.5, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = distill_advantages(teacher, student, mask)
    loss, _ = policy_loss(AlgorithmConfig(), student, student.detach(), adv, mask)
    loss.backward()
    assert student.grad[0, 1] < 0 < student.grad[0, 2]
    assert student.grad[0, 0] == 0


def test_distill_zeroes_nan_under_mask_zero() -> None:
    t = torch.tensor([[float("nan"), -1.0]])
    s = torch.tensor([[float("inf"), -2.0]])
    assert torch.equal(distill_advantages(t, s, torch.tensor([[0.0, 1.0]])), torch.tensor([[0.0, 1.0]]))


def test_unknown_objective_lists_the_valid_ones() -> None:
    assert set(OBJECTIVES) == {"grpo", "sft", "dpo", "distill"}
    with pytest.raises(UnknownNameError, match="valid: distill, dpo, grpo, sft"):
        check_objective("ppo")
