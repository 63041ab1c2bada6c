"""The sft, dpo and distill objectives through one in-process ``WorkerGroup`` on ``tiny-random``: each
moves what it should (the demonstrations' NLL, the pairs' implicit reward margin), and distillation from
a teacher identical to the student has nothing to teach."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tracegym.trainer.settings import DistillConfig, DpoConfig, OptimConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample, pair_units, plan_pairs
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig

OPTIM = OptimConfig(lr=3e-3, micro_batch_tokens=64, dtype="float32")


def _samples(n: int, seed: int, lp: float = -4.0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(4, 12), rng.randint(3, 8)
        ids = [rng.randint(3, 2000) for _ in range(p + c)]
        out.append(TrainSample(ids, [0] * p + [1] * c, [lp] * (p + c), 0.0))
    return out


def _pairs(n: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    samples = []
    for k in range(n):
        prompt = [rng.randint(3, 2000) for _ in range(rng.randint(4, 10))]
        for chosen in (True, False):
            reply = [rng.randint(3, 2000) for _ in range(rng.randint(3, 6))]
            ids = prompt + reply
            samples.append(TrainSample(ids, [0] * len(prompt) + [1] * len(reply), [0.0] * len(ids), 0.0,
                                       pair=k, chosen=chosen))
    return TrainBatch(samples)


def test_pairs_stay_whole_in_the_plan() -> None:
    batch = _pairs(5, 0)
    plan, n_micro = plan_pairs(batch.samples, world_size=2, token_budget=40)
    units = {tuple(u) for u in pair_units(batch.samples)}
    seen = []
    for rank in plan:
        for mb in rank:
            got = {batch.samples[i].pair for i in mb}
            assert all(tuple(sorted(i for i in mb if batch.samples[i].pair == p)) in {tuple(sorted(u)) for u in units}
                       for p in got)
            seen += mb
    assert sorted(seen) == list(range(10)) and n_micro >= 1


def test_a_broken_pair_is_refused() -> None:
    batch = _pairs(2, 1)
    with pytest.raises(ValueError, match="pair 1 needs one chosen and one rejected"):
        pair_units(batch.samples[:3])


def test_sft_lowers_the_demonstrations_nll(tiny_model_dir: Path) -> None:
    g = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=TrainConfig(optim=OPTIM, objectives=("sft",)),
                    use_ray=False)
    try:
        batch = TrainBatch(_samples(4, 0))
        losses = [g.train_step(batch, "sft") for _ in range(4)]
    finally:
        g.shutdown()
    assert losses[0]["sft_loss"] == pytest.approx(losses[0]["nll"], rel=1e-4)  # token-mean CE is the NLL
    assert losses[-1]["nll"] < losses[0]["nll"] - 0.05, [m["nll"] for m in losses]


def test_dpo_starts_at_log2_and_raises_the_margin(tiny_model_dir: Path) -> None:
    cfg = TrainConfig(optim=OPTIM, objectives=("dpo",), dpo=DpoConfig(beta=0.5))
    g = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg, use_ray=False)
    try:
        batch = _pairs(3, 2)
        steps = [g.train_step(batch, "dpo") for _ in range(4)]
    finally:
        g.shutdown()
    assert steps[0]["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is the reference at first
    assert steps[-1]["dpo_loss"] < steps[0]["dpo_loss"] - 0.01, [m["dpo_loss"] for m in steps]
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["reward_accuracy"] > 0.5


def _own_logprobs(g: WorkerGroup, samples: list[TrainSample]) -> list[TrainSample]:
    """``samples`` with the model's own logprob of each token as its engine logprob."""
    import torch

    from tracegym.trainer.workers.batches import collate
    from tracegym.trainer.workers.worker import token_logprobs

    worker = g._workers[0]
    mb = collate(samples)
    with torch.no_grad():
        own = token_logprobs(worker._forward(worker.model, mb), mb.targets)
    first = mb.input_ids.shape[1] - mb.logits_to_keep  # column 0 of ``own`` is token ``first``
    out = []
    for r, s in enumerate(samples):
        lps = s.engine_logprobs.copy()
        for j in range(max(first, 0), len(s.token_ids)):
            lps[j] = float(own[r, j - first])
        out.append(TrainSample(s.token_ids, s.loss_mask, lps, 0.0))
    return out


def test_distill_from_an_identical_teacher_has_no_signal(tiny_model_dir: Path) -> None:
    """Teacher = student and engine logprobs = the student's own: every advantage is 0, so the loss and
    the gradient are 0; with the engine's logprobs far below the teacher's, every sampled token is pushed
    up (the loss is -mean(A) at ratio 1) and the NLL falls."""
    cfg = TrainConfig(optim=OPTIM, objectives=("distill",), distill=DistillConfig(teacher="same"),
                      teacher_path=str(tiny_model_dir))
    g = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=cfg, use_ray=False)
    try:
        samples = _samples(3, 4)
        same = g.train_step(TrainBatch(_own_logprobs(g, samples)), "distill")
        low = [g.train_step(TrainBatch(_samples(3, 4, lp=-30.0)), "distill") for _ in range(3)]
    finally:
        g.shutdown()
    assert abs(same["loss"]) < 1e-4 and same["grad_norm"] < 1e-3
    assert low[0]["loss"] < -10  # A = teacher - (-30) > 0 on every token
    assert low[-1]["nll"] < low[0]["nll"]
