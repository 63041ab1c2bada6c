"""Trajectories → padded micro-batches: splitting, budgets, alignment of targets/masks/logprobs."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from tracegym.trainer.workers.batches import (
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
    assert s.token_ids.tolist() == [1, 2, 3, 4, 5] and s.loss_mask.tolist() == [0, 0, 1, 0, 1]
    assert s.engine_logprobs.tolist() == [0.0, 0.0, -0.1, 0.0, -0.2] and s.advantage == 0.5
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
    with pytest.raises(ValueError, match="loss_mask must hold 0 or 1"):
        TrainSample([1, 2], [0, 2], [0.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="token_ids must be integers"):
        TrainSample([1, 2.5], [0, 1], [0.0, 0.0], 1.0)


def test_sample_holds_numpy_arrays_from_lists_or_arrays_and_collates_them_alike() -> None:
    """Lists are converted once (``tracegym.arrays`` types); arrays of those types are kept; either way the
    tensors are the same, from int32 ids and read-only arrays too (Ray hands workers read-only views)."""
    ids, mask, lps = [5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.25, -0.5]
    listed = TrainSample(ids, mask, lps, 1.0)
    assert (listed.token_ids.dtype, listed.loss_mask.dtype, listed.engine_logprobs.dtype) == (
        np.int64, np.int8, np.float64)
    a = (np.array(ids, dtype=np.int32), np.array(mask, dtype=np.int8), np.array(lps))
    for arr in a:
        arr.setflags(write=False)
    held = TrainSample(*a, 1.0)
    assert all(x is y for x, y in zip((held.token_ids, held.loss_mask, held.engine_logprobs), a, strict=True))
    assert held.num_loss_tokens == listed.num_loss_tokens == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning from torch
        got = [collate([s, sample(2, 3)]) for s in (listed, held)]
    for name in ("input_ids", "attention_mask", "targets", "loss_mask", "engine_logprobs", "advantages"):
        x, y = getattr(got[0], name), getattr(got[1], name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert got[0].input_ids.dtype == torch.long and got[0].loss_mask.dtype == torch.float32
    assert got[0].logits_to_keep == got[1].logits_to_keep and got[0].num_tokens == got[1].num_tokens == 9


def test_from_sequences_of_lists_and_of_arrays_give_one_sample() -> None:
    """A sequence of lists (as parsed from JSON) and one of arrays (as the assembly builds it: int32 ids,
    int8 mask, NaN for no logprob) give the same sample and the same tensors."""
    listed = Sequence([1, 2, 3, 7, 8], [0, 0, 0, 1, 1], [None, None, None, -0.5, -0.25])
    held = Sequence(np.array([1, 2, 3, 7, 8], dtype=np.int32), np.array([0, 0, 0, 1, 1], dtype=np.int8),
                    np.array([np.nan, np.nan, np.nan, -0.5, -0.25]))
    a, b = (TrainBatch.from_sequences([s], [1.0]).samples[0] for s in (listed, held))
    assert a.engine_logprobs.tolist() == b.engine_logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25]
    mb_a, mb_b = collate([a]), collate([b])
    for name in ("input_ids", "targets", "loss_mask", "engine_logprobs"):
        assert torch.equal(getattr(mb_a, name), getattr(mb_b, name)), name
    bad = Sequence([1, 2], [0, 1], ["x", -0.5])
    with pytest.raises(ValueError, match="sequence 0: logprobs must be numbers or None"):
        TrainBatch.from_sequences([bad], [1.0])


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
    from tracegym.trainer.workers.batches import add_loss_metrics, combine_metrics

    ranks = []
    for tokens, clip, loss in ((30.0, 0.1, 0.2), (10.0, 0.5, 0.4)):
        sums = dict.fromkeys(
            ("loss", "tokens", "loss_tokens", "mismatch", "entropy", "entropy_tokens", "nll"), 0.0
        )
        sums |= {"loss": loss, "tokens": tokens * 2, "mismatch": tokens * 0.01, "nll": tokens * 2.0}
        add_loss_metrics(sums, {"tokens": tokens, "seqs": 2.0, "clip_frac": clip, "pg_loss": loss})
        ranks.append(sums | {"grad_norm": 1.5, "lr": 1e-5, "skipped": 0.0, "cpu_s": tokens / 10,
                             "sys_s": tokens / 100, "page_faults": tokens * 1000})
    out = combine_metrics(ranks, wall_s=2.0, world_size=2)
    assert out["loss"] == pytest.approx(0.3) and out["pg_loss"] == pytest.approx(0.3)
    assert out["clip_frac"] == pytest.approx((30 * 0.1 + 10 * 0.5) / 40)
    assert out["mismatch"] == pytest.approx(0.01) and out["nll"] == pytest.approx(2.0)
    assert out["tokens"] == 80 and out["loss_tokens"] == 40 and out["tokens_per_s"] == 40
    assert out["grad_norm"] == 1.5 and out["kl"] == 0.0 and out["worker_cpu_s"] == 3.0
    # the slowest rank's kernel time and page faults, as for its CPU time
    assert out["worker_sys_s"] == pytest.approx(0.3) and out["worker_page_faults"] == 30000


def test_ratio_max_is_a_max_over_micro_batches_and_ranks() -> None:
    from tracegym.trainer.workers.batches import add_loss_metrics, combine_metrics

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
