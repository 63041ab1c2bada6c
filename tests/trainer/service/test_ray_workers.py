"""What ``tinker-serve --ray`` decides without a Ray: its flags, whether a run's ranks fit a cluster's
resources, and how one call's datums are split over a run's ranks and put back together."""

from __future__ import annotations

import numpy as np
import pytest

from tracegym.errors import UserError
from tracegym.trainer.service.ray_workers import ray_settings, shortfall
from tracegym.trainer.service.steps import merge_ranks, rank_plan
from tracegym.trainer.settings import RayConfig


def _flags(**kw: object) -> dict[str, object]:
    return {"use_ray": True, "address": None, "num_workers": 1, "cpus_per_worker": None,
            "gpus_per_worker": None} | kw


@pytest.mark.parametrize(("flags", "message"), [
    (_flags(use_ray=False, num_workers=2), "--num-workers 2 place each run's ranks as Ray actors, and --ray is not"),
    (_flags(use_ray=False, address="auto"), "--ray-address place each run's ranks as Ray actors"),
    (_flags(address="head"), "--ray-address: Value error, must be HOST:PORT"),
    (_flags(cpus_per_worker=0.0), "--cpus-per-worker: Input should be greater than 0"),
    (_flags(num_workers=0), "--num-workers must be >= 1, got 0"),
])
def test_flags_that_cannot_work_are_refused_naming_the_flag(flags: dict, message: str) -> None:
    with pytest.raises(UserError) as e:
        ray_settings(**flags)
    assert str(e.value).startswith(message)


def test_flags_become_the_trainers_ray_settings() -> None:
    assert ray_settings(**_flags(use_ray=False)) is None
    got = ray_settings(**_flags(address="10.0.0.5:6379", num_workers=2, cpus_per_worker=2.0, gpus_per_worker=1.0))
    assert got == RayConfig(address="10.0.0.5:6379", cpus_per_worker=2.0, gpus_per_worker=1.0)
    assert ray_settings(**_flags()) == RayConfig()


def test_a_shortfall_names_what_is_missing() -> None:
    settings = RayConfig(cpus_per_worker=1.0, gpus_per_worker=1.0)
    assert shortfall(2, settings, {"CPU": 2.0, "GPU": 2.0}, "free") is None
    assert shortfall(2, settings, {"CPU": 1.0}, "free") == \
        "a training run's 2 Ray workers need 2 CPUs (1 free) and 2 GPUs (0 free)"


def test_one_rank_runs_the_call_in_order_and_ranks_share_it_with_the_same_count() -> None:
    lengths = [40, 10, 30, 20, 5]
    assert rank_plan(lengths, 0, 1, 64) == ([[0, 1], [2, 3, 4]], 2)
    plans = [rank_plan(lengths, r, 2, 64) for r in range(2)]
    assert plans[0][1] == plans[1][1] == max(len(p) for p, _ in plans)
    assert sorted(i for p, _ in plans for g in p for i in g) == list(range(5))
    assert rank_plan([7], 1, 2, 64) == ([], 1)  # fewer datums than ranks: only empty micro-batches there


def test_the_ranks_answers_are_put_back_in_the_calls_order() -> None:
    a, b, c = ({"logprobs": np.array([float(i)])} for i in range(3))
    per_rank = [([a, {}, c], {"loss:sum": 1.5, "tokens:sum": 4.0}), ([{}, b, {}], {"loss:sum": 2.0, "tokens:sum": 3.0})]
    outputs, metrics = merge_ranks(per_rank)
    assert [o["logprobs"][0] for o in outputs] == [0.0, 1.0, 2.0]
    assert metrics == {"loss:sum": 3.5, "tokens:sum": 7.0}
