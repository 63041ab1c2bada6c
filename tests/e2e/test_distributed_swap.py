"""The distributed weight swap, really run on CPU: two embedded engines (``tracegym engine``, real
processes) behind one gateway (``tracegym serve --upstream A --upstream B``), a trainer ``WorkerGroup`` in
this process (one in-process worker, or two Ray workers with FSDP2) whose weights are changed, then
``init_distributed`` + ``push_distributed``: the trainer (rank 0) broadcasts bucketed tensors over gloo,
both engines (ranks 1 and 2) receive every bucket through the gateway's swap sequence and swap them in at
``/end_weight_update``. Checked: both engines report the new version, their logprobs of a fixed prompt are
the trainer's (computed here from the trainer's gathered weights), and a call streaming through the
gateway while the swap runs completes without error, its later tokens from the new weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.gateway.app_support import sse_payloads
from tests.procs import ManagedProcess, free_port, start_process
from tests.trainer.weights.gateway_support import engine_greedy, logprobs_under
from tracegym.trainer.weights.distributed import (
    DistributedWeightSync,
    init_distributed,
    plan_buckets,
    push_distributed,
)

MODEL = "tiny-random"
Q = [{"role": "user", "content": "Tell me a long story."}]


def _engine(tmp: Path) -> ManagedProcess:
    port = free_port()
    return start_process(["tracegym", "engine", "--model", MODEL, "--port", str(port), "--weight-version", "0"],
                         port=port, log_path=tmp / f"engine-{port}.log", timeout=240,
                         env={"TRACEGYM_ENGINE_THREADS": "1"})


@pytest.fixture
def fleet(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[ManagedProcess, ManagedProcess, ManagedProcess]]:
    """Fresh per test: a distributed swap leaves the engines in the trainer's group and on its weights."""
    with _engine(tmp_path) as a, _engine(tmp_path) as b:
        port = free_port()
        argv = ["tracegym", "serve", "--upstream", a.base_url, "--upstream", b.base_url, "--model", MODEL,
                "--port", str(port), "--store", f"sqlite:///{tmp_path / 'tracegym.db'}"]
        with start_process(argv, port=port, log_path=tmp_path / "gateway.log", health_path="/healthz",
                           timeout=240) as gw:
            yield gw, a, b


def _perturb(worker: Any) -> None:
    """A deterministic change of every weight that works on full tensors and FSDP2 shards alike."""
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.05 * torch.sin(p * 7.0))


def _gather(worker: Any) -> dict[str, torch.Tensor] | None:
    params = worker.rank0_full_params()
    return None if params is None else {n: t.detach().float().clone() for n, t in params}


def _stream(url: str, out: dict[str, Any], started: threading.Event) -> None:
    body = {"model": MODEL, "messages": Q, "max_tokens": 1500, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, timeout=300) as resp:
        out["status"] = resp.status_code
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            started.set()
        out["events"] = sse_payloads(lines)
    started.set()


def _destroy(worker: Any) -> None:
    if worker.weight_group is not None:
        torch.distributed.destroy_process_group(worker.weight_group)
        worker.weight_group = None


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-ray-workers"])
def test_a_distributed_push_reaches_both_engines_through_the_gateway(
        fleet, tiny_model_dir: Path, workers: int) -> None:
    from tracegym.trainer.settings import OptimConfig
    from tracegym.trainer.workers.group import WorkerGroup
    from tracegym.trainer.workers.train_config import TrainConfig

    gw, a, b = fleet
    ids_a, before_a, v_a = engine_greedy(a.base_url, 6)
    assert engine_greedy(b.base_url, 6)[1:] == (before_a, v_a) and v_a == "0"
    if workers > 1:  # Ray pickles the per-rank functions by value: its workers need not import tests/
        import sys

        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = WorkerGroup(tiny_model_dir, num_workers=workers, train_cfg=TrainConfig(optim=OptimConfig(dtype="float32")), use_ray=workers > 1)
    try:
        group.run_on_ranks(_perturb)
        state = group.run_on_ranks(_gather)[0]
        assert logprobs_under(state, tiny_model_dir, ids_a) != pytest.approx(before_a, abs=1e-3)

        sync = DistributedWeightSync(gw.base_url, backend="gloo", broadcast_dtype="float32", bucket_bytes=64 << 10)
        assert len(plan_buckets([(n, list(t.shape)) for n, t in state.items()], 4, sync.bucket_bytes)) > 2
        init_distributed(group, sync, "127.0.0.1", free_port(), engine_world_size=2)

        out: dict[str, Any] = {}
        started = threading.Event()
        caller = threading.Thread(target=_stream, args=(gw.base_url + "/rollouts/dist/v1/chat/completions",
                                                        out, started))
        caller.start()
        assert started.wait(120), "the streaming call produced nothing"
        t0 = time.perf_counter()
        result = push_distributed(group, sync, "7")
        push_s = time.perf_counter() - t0
        caller.join(timeout=300)
        assert result.version == "7"
        print(f"push: {push_s:.2f} s ({result.save_s:.2f} s gathering + broadcasting), workers={workers}")

        assert httpx.get(gw.base_url + "/api/weights", timeout=30).json()["weight_version"] == "7"
        for engine in (a, b):
            assert httpx.get(engine.base_url + "/model_info", timeout=30).json()["weight_version"] == "7"
            ids, got, version = engine_greedy(engine.base_url, 6)
            assert version == "7"
            assert got == pytest.approx(logprobs_under(state, tiny_model_dir, ids), abs=1e-4)

        assert out.get("status") == 200, out
        events = out["events"]
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
        assert finishes[-1] in ("stop", "length")
        assert events[-2]["tracegym"]["weight_version"] == "7"  # it ran across the swap
    finally:
        group.run_on_ranks(_destroy)
        group.shutdown()
