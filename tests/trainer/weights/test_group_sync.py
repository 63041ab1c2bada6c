"""The distributed weight sync of a training run (``GroupWeightSync``) against a real ``tracegym engine``
process behind a real gateway, with an in-process ``WorkerGroup`` on tiny-random whose weights change
before each push: the group is set up on the first push only; an engine restarted between two pushes
(it serves version 0 again, in no group) makes the next push set the group up anew; a push that fails
because the trainer's side of the group is gone sets it up again and is repeated once; after each push
the engine serves the trainer's logprobs under the pushed version; ``save_last`` writes the weights the
engine serves. Also: an engine that refuses the group (NCCL asked of an engine on the CPU) fails the
set-up at once, without waiting out the rendezvous."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.gateway.app_support import ServerThread
from tests.procs import ManagedProcess, free_port, start_process
from tests.trainer.weights.gateway_support import engine_greedy, logprobs_under, weights_gateway
from tracegym.trainer.weights.distributed import DistributedWeightSync, weight_update_group
from tracegym.trainer.weights.gateway import WeightSyncError
from tracegym.trainer.weights.group_sync import GroupWeightSync, _leave_on_rank, route_address


def _start_engine(model_dir: Path, port: int, log: Path) -> ManagedProcess:
    return start_process(["tracegym", "engine", "--model", str(model_dir), "--port", str(port),
                          "--weight-version", "0"], port=port, log_path=log, env={"TRACEGYM_ENGINE_THREADS": "1"})


@pytest.fixture
def engine_gateway(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[list[ManagedProcess], ServerThread]]:
    """The engine in a list, so a test can restart it on the same port behind the same gateway."""
    port = free_port()
    engine = [_start_engine(tiny_model_dir, port, tmp_path / "engine.log")]
    try:
        with weights_gateway(engine[0].base_url, tiny_model_dir) as gw:
            yield engine, gw
    finally:
        engine[0].stop()


@pytest.fixture
def workers(tiny_model_dir: Path) -> Iterator[Any]:
    from tracegym.trainer.settings import OptimConfig
    from tracegym.trainer.workers.group import WorkerGroup
    from tracegym.trainer.workers.train_config import TrainConfig

    group = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=TrainConfig(optim=OptimConfig(dtype="float32")),
                        use_ray=False)
    try:
        yield group
    finally:
        group.run_on_ranks(_leave_on_rank)
        group.shutdown()


def _perturb(worker: Any, k: int) -> None:
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.03 * torch.sin(p * (5.0 + k)))


def _gather(worker: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone() for n, t in worker.rank0_full_params()}


def _serves_the_trainers(engine: ManagedProcess, workers: Any, model_dir: Path, version: str) -> None:
    ids, got, served = engine_greedy(engine.base_url, 5)
    assert served == version
    assert got == pytest.approx(logprobs_under(workers.run_on_ranks(_gather)[0], model_dir, ids), abs=1e-4)


def test_route_address_of_loopback_is_loopback() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("localhost") in ("127.0.0.1", "::1")


def test_set_up_once_again_after_an_engine_restart_and_after_a_failed_push(
        engine_gateway, workers, tiny_model_dir: Path, tmp_path: Path) -> None:
    engine, gw = engine_gateway
    said: list[str] = []
    sync = GroupWeightSync(DistributedWeightSync(gw.url, broadcast_dtype="float32", timeout_s=120),
                           tmp_path / "weights", save_dtype="float32", say=said.append)
    try:
        for v in (1, 2):
            workers.run_on_ranks(_perturb, v)
            result = sync.push(workers, v)
            assert result.version == str(v) and result.path is None
            _serves_the_trainers(engine[0], workers, tiny_model_dir, str(v))
        assert len(said) == 1 and "(first push)" in said[0] and "distributed (gloo), rank 0 at 127.0.0.1:" in said[0]
        status = httpx.get(gw.url + "/api/weights", timeout=30).json()
        assert status["last_swap"]["kind"] == "distributed" and status["last_swap"]["model_path"] is None

        # the engine restarts (on its port, behind the same gateway): version 0 again, in no group
        port = int(engine[0].base_url.rsplit(":", 1)[1])
        engine[0].stop()
        engine[0] = _start_engine(tiny_model_dir, port, tmp_path / "engine-2.log")
        workers.run_on_ranks(_perturb, 3)
        sync.push(workers, 3)
        assert len(said) == 2 and "do not serve version 2, pushed last: restarted" in said[1], said
        _serves_the_trainers(engine[0], workers, tiny_model_dir, "3")

        # the trainer's side of the group is gone: the push fails, the group is set up again, pushed once more
        workers.run_on_ranks(_leave_on_rank)
        workers.run_on_ranks(_perturb, 4)
        sync.push(workers, 4)
        assert len(said) == 3 and "the push to version 4 failed (rank 0 has no weight-update group" in said[2], said
        _serves_the_trainers(engine[0], workers, tiny_model_dir, "4")
        assert sync.setups == 3

        out = sync.save_last(workers, 4)
        assert out == tmp_path / "weights" / "v4" and (out / "model.safetensors").is_file()
        from tracegym.modelfiles.load import load_model

        saved = {n: p.detach() for n, p in load_model(out, device="cpu", dtype="float32").named_parameters()}
        ids, got, _ = engine_greedy(engine[0].base_url, 5)
        assert got == pytest.approx(logprobs_under(saved, tiny_model_dir, ids), abs=1e-4)
    finally:
        sync.close()


def test_an_engine_that_refuses_the_group_fails_the_set_up_at_once(engine_gateway) -> None:
    _, gw = engine_gateway
    sync = DistributedWeightSync(gw.url, backend="nccl", timeout_s=120)
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="backend nccl needs an engine on CUDA"):
        sync.init_group("127.0.0.1", port, 2,
                        lambda: weight_update_group("127.0.0.1", port, 2, "weight_update_group", "gloo", timeout_s=20))
    assert time.monotonic() - t0 < 15  # not the rendezvous' 20 s, nor the sync's 120
