"""Weight export and the trainer's side of the weight pushes, always through a real gateway (the trainer
never talks to the engine's weight or pause routes; the gateway's coordinator runs the sequences).

Distributed: the client against the gateway and the SGLang fake — the buckets it announces, that it
broadcasts each one only once the gateway has cued it, in order, and that it consumes every gathered
parameter even when the swap fails. There the "broadcast" tells the fake a bucket was sent; it is no
collective. Then one real gloo broadcast: a ``WorkerGroup`` pushes through the gateway to
``weight_receiver.py``, a stand-in that joins the group as SGLang does and receives what is announced.
The embedded engine as the receiver: ``tests/engine/test_dist_weights.py`` and
``tests/e2e/test_distributed_swap.py``. Not exercised anywhere: NCCL, GPUs, and SGLang's own receiving
code."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.gateway.app_support import REPO, ServerThread, start_fake
from tests.procs import ManagedProcess, free_port, start_process
from tests.trainer.weights.gateway_support import weights_gateway
from tracegym.trainer.weights.distributed import (
    DistributedWeightSync,
    init_distributed,
    plan_buckets,
    push_distributed,
)
from tracegym.trainer.weights.gateway import WeightSyncError


@pytest.fixture(scope="module")
def fake_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[ManagedProcess, ServerThread]]:
    with start_fake(tmp_path_factory.mktemp("fake"), tokenizer=tiny_model_dir) as fake, \
            weights_gateway(fake.base_url, tiny_model_dir, weights_dir=tmp_path_factory.getbasetemp()) as gw:
        yield fake, gw


def _controls(fake: ManagedProcess) -> list[dict[str, Any]]:
    return httpx.get(fake.base_url + "/debug").json()["controls"]


class Model:
    """Parameters as a worker's ``param_specs`` and ``rank0_full_params`` give them; records which were
    consumed (gathered)."""

    def __init__(self, specs: list[tuple[str, list[int]]]) -> None:
        self.specs = specs
        self.consumed: list[str] = []

    def params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, shape) in enumerate(self.specs):
            self.consumed.append(name)
            yield name, torch.full(shape, float(i))


def test_plan_buckets_keeps_order_and_budget() -> None:
    specs = [(f"t{i}", [n]) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    buckets = plan_buckets(specs, 4, 80)  # fp32
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert buckets[1] == [("t2", [30])]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 4, 0)


def test_distributed_push_announces_buckets_and_broadcasts_on_cue(fake_gateway) -> None:
    fake, gw = fake_gateway
    sync = DistributedWeightSync(gw.url, backend="gloo", broadcast_dtype="bfloat16", bucket_bytes=24)
    c0 = len(_controls(fake))
    assert sync.init_group("127.0.0.1", 29999, 2, join=lambda: "joined") == "joined"
    assert _controls(fake)[c0:] == [{"path": "/init_weights_update_group", "body": {
        "master_address": "127.0.0.1", "master_port": 29999, "world_size": 2, "rank_offset": 1,
        "group_name": "weight_update_group", "backend": "gloo"}}]

    model = Model([("a", [4, 2]), ("b", [4]), ("c", [3])])  # bf16: a+b = 24 bytes, then c
    expected = [["a", "b"], ["c"]]
    sent: list[list[tuple[torch.dtype, list[int]]]] = []
    c0 = len(_controls(fake))

    def broadcast(tensors: list[torch.Tensor]) -> None:
        k = len(sent)
        # cued: the gateway has paused, flushed, begun, and the engine took every earlier bucket
        paths = [c["path"] for c in _controls(fake)[c0:]]
        assert paths[:3] == ["/pause_generation", "/flush_cache", "/begin_weight_update"], paths
        assert paths[3:].count("/update_weights_from_distributed") in (k, k + 1), paths
        sent.append([(t.dtype, list(t.shape)) for t in tensors])
        httpx.post(fake.base_url + "/debug/broadcast", json={"names": expected[k]}).raise_for_status()

    result = sync.push(model.specs, model.params(), 12, broadcast)
    assert result.version == "12" and result.path is None and result.total_s >= result.save_s
    assert sent == [[(torch.bfloat16, [4, 2]), (torch.bfloat16, [4])], [(torch.bfloat16, [3])]]
    updates = [c["body"] for c in _controls(fake)[c0:] if c["path"] == "/update_weights_from_distributed"]
    assert updates == [
        {"names": ["a", "b"], "dtypes": ["bfloat16", "bfloat16"], "shapes": [[4, 2], [4]],
         "group_name": "weight_update_group", "flush_cache": False},
        {"names": ["c"], "dtypes": ["bfloat16"], "shapes": [[3]], "group_name": "weight_update_group",
         "flush_cache": False, "weight_version": "12"}]
    assert model.consumed == ["a", "b", "c"]
    assert httpx.get(gw.url + "/api/weights").json()["weight_version"] == "12"


def test_a_failed_distributed_push_raises_and_still_consumes_every_parameter(fake_gateway) -> None:
    fake, gw = fake_gateway
    sync = DistributedWeightSync(gw.url, broadcast_dtype="float32", bucket_bytes=8)
    model = Model([("a", [2]), ("b.fail", [2]), ("c", [2])])
    cued: list[int] = []

    def broadcast(tensors: list[torch.Tensor]) -> None:
        cued.append(len(tensors))
        name = model.specs[len(cued) - 1][0]
        httpx.post(fake.base_url + "/debug/broadcast", json={"names": [name]}).raise_for_status()

    with pytest.raises(WeightSyncError, match=r"failed after 2 of 3 bucket\(s\): .*bucket 2 of 3"):
        sync.push(model.specs, model.params(), "13", broadcast)
    assert cued == [1, 1]  # no broadcast for the bucket the engine was never asked for
    assert model.consumed == ["a", "b.fail", "c"]  # the other ranks' gathers are not left waiting
    assert httpx.get(gw.url + "/api/weights").json()["weight_version"] != "13"


def test_a_gateway_that_refuses_before_any_bucket_gets_no_broadcast(fake_gateway, tiny_model_dir: Path) -> None:
    fake, _ = fake_gateway
    with weights_gateway(fake.base_url + "/v1", tiny_model_dir, kind="openai") as gw:  # cannot swap: 400
        model = Model([("a", [2])])
        with pytest.raises(WeightSyncError, match=r"answered 400: .*sglang-kind upstream"):
            DistributedWeightSync(gw.url).push(model.specs, model.params(), "1", lambda _: pytest.fail("sent"))
        assert model.consumed == ["a"]


# --- distributed: one real gloo broadcast ------------------------------------------------------------


def test_a_gloo_push_from_a_worker_group_reaches_the_receiver(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tracegym.trainer.settings import OptimConfig
    from tracegym.trainer.workers.fsdp import iter_full_params
    from tracegym.trainer.workers.group import WorkerGroup
    from tracegym.trainer.workers.train_config import TrainConfig

    port = free_port()
    receiver = start_process([sys.executable, "-m", "tests.trainer.weights.weight_receiver", "--port", str(port)],
                             port=port, log_path=tmp_path / "receiver.log", env={"PYTHONPATH": str(REPO)},
                             timeout=120)
    group = None
    try:
        with weights_gateway(receiver.base_url, tiny_model_dir) as gw:
            group = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=TrainConfig(optim=OptimConfig(dtype="float32")), use_ray=False)
            sync = DistributedWeightSync(gw.url, backend="gloo", broadcast_dtype="float32", bucket_bytes=1 << 20)
            init_distributed(group, sync, "127.0.0.1", free_port(), engine_world_size=1)
            result = push_distributed(group, sync, "7")
            assert result.version == "7"
            assert httpx.get(gw.url + "/api/weights").json()["weight_version"] == "7"
        want = group.run_on_ranks(lambda w: [(n, list(t.shape), float(t.double().sum()))
                                             for n, t in iter_full_params(w.model)])[0]
        got = httpx.get(receiver.base_url + "/debug/weights").json()
        assert [(n, w["shape"], w["sum"]) for n, w in got["weights"].items()] == want
        assert {w["dtype"] for w in got["weights"].values()} == {"float32"}
        n_buckets = got["paths"].count("/update_weights_from_distributed")
        assert n_buckets == len(plan_buckets([(n, s) for n, s, _ in want], 4, 1 << 20)) > 1
        assert got["paths"] == ["/init_weights_update_group", "/pause_generation", "/flush_cache",
                                "/begin_weight_update", *["/update_weights_from_distributed"] * n_buckets,
                                "/end_weight_update", "/continue_generation"]
    finally:
        if group is not None:
            group.run_on_ranks(_destroy_weight_group)
            group.shutdown()
        receiver.stop()


def _destroy_weight_group(worker: Any) -> None:
    if worker.weight_group is not None:
        torch.distributed.destroy_process_group(worker.weight_group)
        worker.weight_group = None
