"""The Tinker API's losses by name: values and gradients against the formulas written out per token."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.trainer.algorithms.datum_losses import DATUM_LOSSES, PPO_CLIP_HIGH, PPO_CLIP_LOW


def _lp(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64, requires_grad=True)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


def test_cross_entropy_is_the_weighted_sum_and_takes_any_real_weights() -> None:
    lp = _lp(-1.0, -2.0, -3.0)
    loss = DATUM_LOSSES["cross_entropy"].fn(lp, {"weights": _t(0.0, 1.0, -0.5)}, {})
    assert loss.sum().item() == pytest.approx(2.0 - 1.5)
    loss.sum().backward()
    assert lp.grad.tolist() == [[-0.0, -1.0, 0.5]]


def test_importance_sampling_gradient_is_ratio_times_advantage() -> None:
    lp, q, adv = _lp(-1.0, -2.0), _t(-1.5, -2.0), _t(2.0, -1.0)
    loss = DATUM_LOSSES["importance_sampling"].fn(lp, {"logprobs": q, "advantages": adv}, {})
    ratio = [math.exp(0.5), 1.0]
    assert loss.sum().item() == pytest.approx(-(ratio[0] * 2.0) + ratio[1] * 1.0)
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-ratio[0] * 2.0, ratio[1] * 1.0])


def test_ppo_clips_the_ratio_where_the_advantage_would_push_it_further() -> None:
    # ratios 2.0 (A > 0: clipped at 1.2, no gradient), 0.5 (A > 0: unclipped), 2.0 (A < 0: unclipped)
    lp = _lp(math.log(2.0), math.log(0.5), math.log(2.0))
    inputs = {"logprobs": _t(0.0, 0.0, 0.0), "advantages": _t(1.0, 1.0, -1.0)}
    loss = DATUM_LOSSES["ppo"].fn(lp, inputs, {})
    assert loss[0].tolist() == pytest.approx([-PPO_CLIP_HIGH, -0.5, 2.0])
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -0.5, 2.0])
    narrow = DATUM_LOSSES["ppo"].fn(lp.detach(), inputs, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert narrow[0, 0].item() == pytest.approx(-1.1)
    assert PPO_CLIP_LOW == 0.8


def test_cispo_keeps_a_bounded_gradient_on_clipped_tokens() -> None:
    lp = _lp(math.log(2.0), math.log(0.5))
    loss = DATUM_LOSSES["cispo"].fn(lp, {"logprobs": _t(0.0, 0.0), "advantages": _t(1.0, 1.0)}, {})
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-PPO_CLIP_HIGH, -PPO_CLIP_LOW])


def test_thresholds_that_do_not_bracket_one_are_refused() -> None:
    with pytest.raises(ValueError, match="clip_low_threshold"):
        DATUM_LOSSES["ppo"].fn(_lp(0.0), {"logprobs": _t(0.0), "advantages": _t(1.0)}, {"clip_low_threshold": 1.5})


def test_dro_is_the_advantage_term_less_a_quadratic_penalty_on_the_log_ratio() -> None:
    # per token: -(A log p - beta/2 (log p - log q)^2); gradient: -(A - beta (log p - log q))
    lp, q, adv = _lp(-1.0, -2.0), _t(-1.5, -2.0), _t(2.0, -1.0)
    loss = DATUM_LOSSES["dro"].fn(lp, {"logprobs": q, "advantages": adv}, {"beta": 0.4})
    assert loss[0].tolist() == pytest.approx([-(2.0 * -1.0 - 0.2 * 0.25), -(-1.0 * -2.0 - 0.0)])
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-(2.0 - 0.4 * 0.5), -(-1.0 - 0.0)])


def test_gspo_gives_every_token_the_sequence_ratio_and_clips_it_whole() -> None:
    # row 0: masked log-ratios 0.1 and 0.3 (the third token is outside the mask) -> s = exp(0.2),
    # inside [0.9, 1.3]: every token's gradient is -s * A. Row 1: s = exp(0.5) = 1.65 > 1.3 with A > 0:
    # clipped, no gradient, value -1.3 * A.
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    q = _t(-1.1, -2.3, -9.0).repeat(2, 1)
    q[1] = torch.tensor([-1.5, -1.5, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 0.5], [1.0, 1.0, 0.0]], dtype=torch.float64)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}
    loss = DATUM_LOSSES["gspo"].fn(lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}, config)
    s = math.exp(0.2)
    assert loss[0].tolist() == pytest.approx([-s * 1.0, s * 2.0, -s * 0.5])
    assert loss[1].tolist() == pytest.approx([-1.3, -1.3, 0.0])
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-s * 1.0, s * 2.0, -s * 0.5])
    assert lp.grad[1].tolist() == pytest.approx([0.0, 0.0, 0.0])
