"""Trajectories → padded micro-batches: splitting, budgets, alignment of targets/masks/logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from tracegym.trainer.batch import (
    TrainBatch,
    TrainSample,
    collate,
    micro_batches,
    plan_step,
    split_across_ranks,
)
from tracegym.types import Sequence


def sample(prompt: int, completion: int, adv: float = 1.0, start: int = 10) -> TrainSample:
    ids = list(range(start, start + prompt + completion))
    lps = [0.0] * prompt + [-0.5 - 0.01 * i for i in range(completion)]
    return TrainSample(ids, [0] * prompt + [1] * completion, lps, adv)


def test_from_sequences_keeps_ids_mask_and_logprobs() -> None:
    seq = Sequence(
        token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 0, 1], logprobs=[None, None, -0.1, None, -0.2]
    )
    batch = TrainBatch.from_sequences([seq], [0.5])
    s = batch.samples[0]
    assert s.token_ids == [1, 2, 3, 4, 5] and s.loss_mask == [0, 0, 1, 0, 1]
    assert s.engine_logprobs == [0.0, 0.0, -0.1, 0.0, -0.2] and s.advantage == 0.5
    assert batch.num_loss_tokens == 2 and batch.num_tokens == 5


def test_from_sequences_rejects_masked_token_without_logprob() -> None:
    seq = Sequence(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[None, -0.1, None])
    with pytest.raises(ValueError, match="token 2 is in the loss mask but has no engine logprob"):
        TrainBatch.from_sequences([seq], [1.0])
    with pytest.raises(ValueError, match="2 sequences but 1 advantages"):
        TrainBatch.from_sequences([seq, seq], [1.0])


def test_sample_validation() -> None:
    with pytest.raises(ValueError, match="same length"):
        TrainSample([1, 2, 3], [0, 1], [0.0, 0.0, 0.0], 1.0)
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must be 0"):
        TrainSample([1, 2], [1, 1], [0.0, 0.0], 1.0)


def test_split_across_ranks_balances_tokens_and_covers_all() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(37)]
    parts = split_across_ranks(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(37))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)


def test_micro_batches_respect_budget() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(50)]
    groups = micro_batches(lengths, 256)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        assert max(lengths[i] for i in g) * len(g) <= 256
    # one sample longer than the budget gets its own group instead of failing
    assert micro_batches([500, 10, 10], 100) == [[0], [1, 2]]


def test_plan_step_same_count_on_every_rank() -> None:
    plan, n = plan_step([100, 90, 80, 10, 10, 10, 10], 2, 100)
    assert n == max(len(p) for p in plan)
    assert sorted(i for p in plan for g in p for i in g) == list(range(7))
    plan, n = plan_step([5, 5], 4, 100)  # more ranks than samples: two ranks run empty micro-batches
    assert n == 1 and sorted(len(p) for p in plan) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="empty batch"):
        plan_step([], 2, 100)


def test_collate_aligns_targets_with_mask_and_logprobs() -> None:
    a, b = sample(3, 2, adv=1.0, start=10), sample(5, 4, adv=-1.0, start=50)
    mb = collate([a, b], pad_id=0)
    assert mb.input_ids.shape == (2, 9)
    assert mb.attention_mask.sum(1).tolist() == [5, 9]
    # the earliest loss token is a's index 3 -> keep tokens 3..8 (K=6)
    assert mb.logits_to_keep == 6 and mb.targets.shape == (2, 6)
    for row, s in enumerate([a, b]):
        for k in range(6):
            t = 9 - 6 + k
            if t < len(s.token_ids):
                assert mb.targets[row, k] == s.token_ids[t]
                assert mb.loss_mask[row, k] == s.loss_mask[t]
                assert mb.engine_logprobs[row, k] == pytest.approx(s.engine_logprobs[t])
            else:
                assert mb.loss_mask[row, k] == 0
    assert mb.loss_mask.sum() == 6 and mb.num_tokens == 14
    assert torch.equal(mb.advantages, torch.tensor([1.0, -1.0]))


def test_collate_empty_is_a_zero_weight_dummy() -> None:
    mb = collate([], pad_id=7)
    assert mb.loss_mask.sum() == 0 and mb.num_tokens == 0 and mb.input_ids.tolist() == [[7, 7]]


def test_combine_metrics_weights_ranks_by_tokens() -> None:
    from tracegym.trainer.batch import add_loss_metrics, combine_metrics

    ranks = []
    for tokens, clip, loss in ((30.0, 0.1, 0.2), (10.0, 0.5, 0.4)):
        sums = dict.fromkeys(
            ("loss", "tokens", "loss_tokens", "mismatch", "entropy", "entropy_tokens", "nll"), 0.0
        )
        sums |= {"loss": loss, "tokens": tokens * 2, "mismatch": tokens * 0.01, "nll": tokens * 2.0}
        add_loss_metrics(sums, {"tokens": tokens, "seqs": 2.0, "clip_frac": clip, "pg_loss": loss})
        ranks.append(sums | {"grad_norm": 1.5, "lr": 1e-5, "skipped": 0.0, "cpu_s": tokens / 10})
    out = combine_metrics(ranks, wall_s=2.0, world_size=2)
    assert out["loss"] == pytest.approx(0.3) and out["pg_loss"] == pytest.approx(0.3)
    assert out["clip_frac"] == pytest.approx((30 * 0.1 + 10 * 0.5) / 40)
    assert out["mismatch"] == pytest.approx(0.01) and out["nll"] == pytest.approx(2.0)
    assert out["tokens"] == 80 and out["loss_tokens"] == 40 and out["tokens_per_s"] == 40
    assert out["grad_norm"] == 1.5 and out["kl"] == 0.0 and out["worker_cpu_s"] == 3.0


def test_ratio_max_is_a_max_over_micro_batches_and_ranks() -> None:
    from tracegym.trainer.batch import add_loss_metrics, combine_metrics

    ranks = []
    for micro in (((30.0, 1.5), (10.0, 1.1)), ((10.0, 2.5), (0.0, 0.0))):  # (tokens, ratio_max); (0, 0) = padding
        sums = dict.fromkeys(
            ("loss", "tokens", "loss_tokens", "mismatch", "entropy", "entropy_tokens", "nll"), 0.0
        )
        for tokens, rmax in micro:
            add_loss_metrics(sums, {"tokens": tokens, "seqs": 1.0, "ratio_max": rmax, "ratio_mean": 1.0})
        ranks.append(sums | {"grad_norm": 1.0, "lr": 1e-5, "skipped": 0.0, "cpu_s": 1.0})
    assert ranks[0]["max:ratio_max"] == 1.5 and ranks[1]["max:ratio_max"] == 2.5
    out = combine_metrics(ranks, wall_s=1.0, world_size=2)
    assert out["ratio_max"] == 2.5 and out["ratio_mean"] == pytest.approx(1.0)
