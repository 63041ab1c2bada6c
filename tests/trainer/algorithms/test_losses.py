"""Policy losses, aggregation, KL, TIS: hand-computed cases, loop-vs-vectorised, micro-batch equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.trainer.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    entropy_from_logits,
    loss_scales,
    masked_mean,
    masked_sum,
    policy_loss,
)
from tracegym.trainer.settings import AlgorithmConfig

LN = math.log
# 2x3 batch: row 0 has 3 sampled tokens (advantage +1), row 1 has 2 (advantage -1) and one padding token.
RATIOS = [[1.5, 0.5, 1.0], [1.1, 0.7, 2.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.5]], dtype=torch.float64)
    new = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_(True)
    return new, old


def _run(cfg: AlgorithmConfig, **kw: object) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    new, old = _batch()
    loss, metrics = policy_loss(cfg, new, old, ADV.double(), MASK, **kw)
    loss.backward()
    return loss, metrics, new.grad


def test_ppo_clip_dapo_hand_computed() -> None:
    # tokens: row0 A=+1: r=1.5 clipped to 1.28 -> -1.28, r=0.5 -> -0.5, r=1 -> -1;
    #         row1 A=-1: r=1.1 -> 1.1, r=0.7 clipped up to 0.8 -> 0.8
    per_seq = [[-1.28, -0.5, -1.0], [1.1, 0.8]]
    expected = {
        "token-mean": (sum(per_seq[0]) + sum(per_seq[1])) / 5,
        "seq-mean-token-sum": (sum(per_seq[0]) + sum(per_seq[1])) / 2,
        "seq-mean-token-mean": (sum(per_seq[0]) / 3 + sum(per_seq[1]) / 2) / 2,
    }
    for agg, value in expected.items():
        loss, metrics, grad = _run(AlgorithmConfig(clip_low=0.2, clip_high=0.28, agg=agg))
        assert loss.item() == pytest.approx(value), agg
        assert metrics["clip_frac"] == pytest.approx(2 / 5)
        assert metrics["ratio_max"] == pytest.approx(1.5)
        assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1 + 1.1 + 0.7) / 5)
        assert (metrics["tokens"], metrics["seqs"]) == (5.0, 2.0)
    # gradient under token-mean: -A * r / 5 on unclipped tokens, 0 on clipped and padding tokens
    _, _, grad = _run(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    expected_grad = torch.tensor([[0.0, -0.5 / 5, -1 / 5], [1.1 / 5, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected_grad)


def test_gspo_hand_computed() -> None:
    s0, s1 = 0.75 ** (1 / 3), 0.77 ** (1 / 2)  # geometric-mean ratios of the two sequences
    loss, metrics, grad = _run(AlgorithmConfig(loss="gspo", agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx((-s0 + s1) / 2)
    assert metrics["clip_frac"] == 0.0
    # each token of sequence i gets -A_i * s_i / (|y_i| * B)
    expected_grad = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected_grad)
    # paper clip range: sequence 1 (A<0, s=0.877) is clipped up to 0.9997; sequence 0 (A>0, s<1) is not
    loss, metrics, grad = _run(
        AlgorithmConfig(loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean")
    )
    assert loss.item() == pytest.approx((-s0 + (1 - 3e-4)) / 2)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert torch.all(grad[1] == 0)


def test_gspo_token_form_matches_the_sequence_objective() -> None:
    """Loop over sequences with the paper's formula (ratio with grad, min of clipped/unclipped)."""
    torch.manual_seed(0)
    old = torch.randn(3, 4, dtype=torch.float64) - 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    new = (old + 0.05 * torch.randn(3, 4, dtype=torch.float64)).requires_grad_(True)
    cfg = AlgorithmConfig(loss="gspo", clip_low=0.02, clip_high=0.03, agg="seq-mean-token-mean")
    loss, _ = policy_loss(cfg, new, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, new)
    ref_new = new.detach().clone().requires_grad_(True)
    terms = []
    for i in range(3):
        idx = mask[i].bool()
        s = torch.exp((ref_new[i][idx] - old[i][idx]).mean())
        terms.append(-torch.min(s * adv[i], s.clamp(1 - 0.02, 1 + 0.03) * adv[i]))
    ref_loss = torch.stack(terms).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_new)
    assert loss.item() == pytest.approx(ref_loss.item())
    assert torch.allclose(grad, ref_grad)


def test_cispo_hand_computed() -> None:
    # weights clip(r, 0, 1.28): row0 [1.28, 0.5, 1], row1 [1.1, 0.7]; loss -A*w, grad -A*w/5 (token-mean)
    loss, metrics, grad = _run(AlgorithmConfig(loss="cispo"))
    assert loss.item() == pytest.approx((-1.28 - 0.5 - 1.0 + 1.1 + 0.7) / 5)
    assert metrics["clip_frac"] == pytest.approx(1 / 5)
    expected_grad = torch.tensor([[-1.28, -0.5, -1.0], [1.1, 0.7, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(grad, expected_grad)


def test_cispo_gradient_equals_paper_form() -> None:
    """``-A sg(w) log p`` (paper) and our ``-A sg(w) exp(log p - sg(log p))`` have the same gradient."""
    new, old = _batch()
    _, _, grad = _run(AlgorithmConfig(loss="cispo", cispo_clip_low=0.1, cispo_clip_high=0.2))
    w = torch.exp(new.detach() - old).clamp(0.9, 1.2)
    paper = -(ADV.double()[:, None] * w * new)
    (paper_grad,) = torch.autograd.grad(masked_sum(paper, MASK) / 5, new)
    assert torch.allclose(grad, paper_grad)


KL_CASES = {  # d = log p - log q for three tokens: 0, ln 2, -ln 2
    "k1": [0.0, LN(2), -LN(2)],
    "k2": [0.0, 0.5 * LN(2) ** 2, 0.5 * LN(2) ** 2],
    "k3": [0.0, 0.5 - 1 + LN(2), 2 - 1 - LN(2)],
}


@pytest.mark.parametrize("name", sorted(KL_CASES))
def test_kl_estimators_hand_computed(name: str) -> None:
    ref = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = ref + torch.tensor([[0.0, LN(2), -LN(2)]], dtype=torch.float64)
    got = KL_ESTIMATORS[name](logp, ref)
    assert torch.allclose(got, torch.tensor([KL_CASES[name]], dtype=torch.float64))


def test_kl_term_is_added_with_its_coefficient() -> None:
    new, old = _batch()
    ref = old.clone()
    base, _ = policy_loss(AlgorithmConfig(), new, old, ADV.double(), MASK)
    for est in KL_ESTIMATORS:
        cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator=est)
        loss, metrics = policy_loss(cfg, new, old, ADV.double(), MASK, ref_logprobs=ref)
        kl = KL_ESTIMATORS[est](new.detach(), ref)
        assert metrics["kl"] == pytest.approx(masked_mean(kl, MASK).item())
        assert loss.item() == pytest.approx(base.item() + 0.1 * metrics["kl_loss"])
        assert metrics["kl_loss"] == pytest.approx(metrics["kl"])  # token-mean of the same tokens
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(AlgorithmConfig(kl_coef=0.1), new, old, ADV.double(), MASK)


def test_truncated_importance_sampling_hand_computed() -> None:
    new, old = _batch()
    # old/engine ratios: row0 [3, 1, 0.5], row1 [2.5, 1, (pad)]; cap 2 -> weights [2, 1, 0.5], [2, 1]
    engine = old - torch.tensor([[LN(3), 0.0, LN(0.5)], [LN(2.5), 0.0, 5.0]], dtype=torch.float64)
    loss, metrics = policy_loss(
        AlgorithmConfig(tis_cap=2.0), new, old, ADV.double(), MASK, engine_logprobs=engine
    )
    per_tok = [[-1.2 * 2, -0.5 * 1, -1.0 * 0.5], [1.1 * 2, 0.8 * 1]]  # ppo_clip 0.2/0.2, times weights
    assert loss.item() == pytest.approx((sum(per_tok[0]) + sum(per_tok[1])) / 5)
    assert metrics["tis_frac"] == pytest.approx(2 / 5)
    assert metrics["tis_weight_mean"] == pytest.approx(6.5 / 5)
    assert metrics["engine_mismatch_kl"] > 0
    with pytest.raises(ValueError, match="engine_logprobs"):
        policy_loss(AlgorithmConfig(tis_cap=2.0), new, old, ADV.double(), MASK)
    # engine logprobs without a cap: reported, not applied
    plain, _ = policy_loss(AlgorithmConfig(), new, old, ADV.double(), MASK)
    loss, metrics = policy_loss(AlgorithmConfig(), new, old, ADV.double(), MASK, engine_logprobs=engine)
    assert loss.item() == pytest.approx(plain.item())
    assert "tis_frac" not in metrics and metrics["engine_mismatch_kl"] > 0


def test_aggregations_loop_vs_vectorised() -> None:
    torch.manual_seed(1)
    loss = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    rows = [[loss[i, j].item() for j in range(4) if mask[i, j]] for i in range(3)]
    nonempty = [r for r in rows if r]
    expected = {
        "token-mean": sum(sum(r) for r in rows) / sum(len(r) for r in rows),
        "seq-mean-token-sum": sum(sum(r) for r in nonempty) / len(nonempty),
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in nonempty) / len(nonempty),
    }
    for name, value in expected.items():
        got = AGGREGATIONS[name](loss, mask, num_tokens=None, num_seqs=None)
        assert got.item() == pytest.approx(value, rel=1e-6), name
        scaled = AGGREGATIONS[name](loss, mask, num_tokens=10.0, num_seqs=4.0)
        denominator_ratio = (6 / 10) if name == "token-mean" else (2 / 4)
        assert scaled.item() == pytest.approx(value * denominator_ratio, rel=1e-6), name
    with pytest.raises(ValueError, match="num_tokens"):
        AGGREGATIONS["token-mean"](loss, mask, num_tokens=0.0, num_seqs=None)


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[2] = 0  # a sequence with no sampled token
    return {
        "old": old,
        "new": old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "ref": old + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "engine": old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "adv": torch.randn(b, generator=g, dtype=torch.float64),
        "mask": mask,
    }


ALL_CONFIGS = [
    AlgorithmConfig(loss=name, agg=agg, kl_coef=0.05, tis_cap=1.5, clip_high=0.28)
    for name in POLICY_LOSSES
    for agg in AGGREGATIONS
]


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.loss}-{c.agg}")
def test_micro_batches_sum_to_the_full_batch(cfg: AlgorithmConfig) -> None:
    d = _random_batch(3)

    def run(rows: slice, scales: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
        new = d["new"][rows].clone().requires_grad_(True)
        loss, _ = policy_loss(
            cfg,
            new,
            d["old"][rows],
            d["adv"][rows],
            d["mask"][rows],
            ref_logprobs=d["ref"][rows],
            engine_logprobs=d["engine"][rows],
            **scales,
        )
        loss.backward()
        return loss.detach(), new.grad

    full_loss, full_grad = run(slice(0, 6), {})
    parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
    scales = loss_scales(*(d["mask"][p] for p in parts))
    results = [run(p, scales) for p in parts]
    assert sum(r[0] for r in results).item() == pytest.approx(full_loss.item(), rel=1e-9)
    assert torch.allclose(torch.cat([r[1] for r in results]), full_grad)
    # two data-parallel ranks whose gradients are averaged: divide the scales by the world size
    ranks = [slice(0, 3), slice(3, 6)]
    scales = loss_scales(*(d["mask"][p] for p in ranks), world_size=2)
    rank_grads = [run(p, scales)[1] for p in ranks]
    assert torch.allclose(torch.cat(rank_grads) / 2, full_grad)


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.loss}-{c.agg}")
def test_gradients_flow_only_through_mask_tokens(cfg: AlgorithmConfig) -> None:
    d = _random_batch(4)
    pad = ~d["mask"].bool()
    poison = torch.tensor(float("nan"), dtype=torch.float64)
    new = torch.where(pad, poison, d["new"]).requires_grad_(True)
    old, ref, engine = (torch.where(pad, -math.inf, d[k]) for k in ("old", "ref", "engine"))
    adv = torch.where(pad, math.inf, d["adv"][:, None].expand(6, 5))
    loss, metrics = policy_loss(cfg, new, old, adv, d["mask"], ref_logprobs=ref, engine_logprobs=engine)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert torch.all(new.grad[pad] == 0)
    assert torch.all(torch.isfinite(new.grad)) and new.grad[~pad].abs().sum() > 0


def test_ratio_one_reduces_to_reinforce() -> None:
    """On-policy (new == old) every loss has gradient -A / N_tokens on each token (token-mean)."""
    d = _random_batch(5)
    for name in POLICY_LOSSES:
        new = d["old"].clone().requires_grad_(True)
        loss, metrics = policy_loss(AlgorithmConfig(loss=name), new, d["old"], d["adv"], d["mask"])
        (grad,) = torch.autograd.grad(loss, new)
        n = d["mask"].sum()
        expected = torch.where(d["mask"].bool(), -d["adv"][:, None] / n, torch.zeros(()).double())
        assert torch.allclose(grad, expected), name
        assert metrics["clip_frac"] == 0 and metrics["approx_kl"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("loss", "ppo", "cispo, gspo, ppo_clip"),
        ("agg", "mean", "seq-mean-token-mean, seq-mean-token-sum, token-mean"),
        ("kl_estimator", "k4", "'k1', 'k2' or 'k3'"),
    ],
)
def test_unknown_names_list_valid_ones(field: str, value: str, valid: str) -> None:
    with pytest.raises(ValueError, match=valid):
        AlgorithmConfig(**{field: value})


@pytest.mark.parametrize(
    "kw",
    [{"clip_low": 1.5}, {"clip_high": -0.1}, {"kl_coef": -1.0}, {"tis_cap": 0.0}],
)
def test_bad_settings_fail(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AlgorithmConfig(**kw)


def test_shape_mismatch_fails() -> None:
    new, old = _batch()
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(AlgorithmConfig(), new, old[:, :2], ADV, MASK)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(AlgorithmConfig(), new, old, torch.ones(3), MASK)


def test_masked_reductions() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 2.0, 4.0]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert masked_sum(x, mask).item() == 6.0
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0, 2.0]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_entropy_from_logits(chunk: int) -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 11) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk), expected, atol=1e-5)
    bf16 = entropy_from_logits(logits.bfloat16(), chunk_size=chunk)
    assert bf16.dtype == torch.float32 and bf16.shape == (2, 5)
    assert torch.allclose(bf16, expected, atol=5e-2)
    uniform = entropy_from_logits(torch.zeros(4, 8), chunk_size=chunk)
    assert torch.allclose(uniform, torch.full((4,), math.log(8)))
