"""The trainer's side of a distributed weight push, run inside a tracegym container on a compose network
(``python -`` with this file on stdin: tests/e2e/test_compose_engine.py). A one-rank ``WorkerGroup``
here changes tiny-random's weights, sets up the weight-update group with the engine container through
the gateway container (``init_distributed``: this container's address as the rendezvous, gloo), pushes
(``push_distributed``: rank 0 broadcasts every bucket as the gateway announces it), then asks the engine
for its logprobs of a fixed prompt and computes the trainer's own from its gathered weights. Prints one
JSON line with what it saw; the test judges it."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import torch

from tracegym.modelfiles.load import load_model
from tracegym.modelfiles.prepare import prepare_model
from tracegym.procs import free_port
from tracegym.trainer.settings import OptimConfig
from tracegym.trainer.weights.distributed import (
    DistributedWeightSync,
    init_distributed,
    plan_buckets,
    push_distributed,
)
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig

ENGINE = "http://sglang:30000"
PROMPT = [1, 4093, 28, 2, 1, 1032, 34]
BUCKET_BYTES = 64 << 10


def generate() -> tuple[list[int], list[float], str]:
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(ENGINE + "/generate", timeout=60, headers=_engine_headers(),
                   json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp})
    r.raise_for_status()
    meta = r.json()["meta_info"]
    ids = [t[1] for t in meta["output_token_logprobs"]]
    return ids, [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def _engine_headers() -> dict[str, str]:
    key = os.environ.get("TRACEGYM_ENGINE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def trainer_logprobs(state: dict[str, torch.Tensor], model_dir: str, ids: list[int]) -> list[float]:
    model = load_model(model_dir, device="cpu", dtype="float32")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + ids])).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(ids)]


def perturb(worker: object) -> None:
    with torch.no_grad():
        for p in worker.model.parameters():  # type: ignore[attr-defined]
            p.add_(0.05 * torch.sin(p * 7.0))


def gather(worker: object) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().clone() for n, t in worker.rank0_full_params()}  # type: ignore[attr-defined]


def main() -> None:
    model_dir = str(prepare_model("tiny-random"))
    ids_before, before, version_before = generate()
    group = WorkerGroup(model_dir, num_workers=1, use_ray=False,
                        train_cfg=TrainConfig(optim=OptimConfig(dtype="float32")))
    try:
        group.run_on_ranks(perturb)
        state = group.run_on_ranks(gather)[0]
        here = socket.gethostbyname(socket.gethostname())  # this container's address on the compose network
        sync = DistributedWeightSync(os.environ["TRACEGYM_GATEWAY"], backend="gloo", broadcast_dtype="float32",
                                     bucket_bytes=BUCKET_BYTES, timeout_s=300)
        t0 = time.perf_counter()
        init_distributed(group, sync, here, free_port(), engine_world_size=1)
        t1 = time.perf_counter()
        result = push_distributed(group, sync, "7")
        t2 = time.perf_counter()
        ids, after, version_after = generate()
        model_info = httpx.get(ENGINE + "/model_info", timeout=30, headers=_engine_headers()).json()
        print(json.dumps({
            "trainer_address": here, "buckets": len(plan_buckets([(n, t.shape) for n, t in state.items()], 4,
                                                                 BUCKET_BYTES)),
            "init_s": round(t1 - t0, 2), "push_s": round(t2 - t1, 2), "result_version": result.version,
            "version_before": version_before, "version_after": version_after,
            "engine_model_version": model_info.get("weight_version"),
            "before": before, "after": after, "ids_before": ids_before, "ids": ids,
            "trainer": trainer_logprobs(state, model_dir, ids),
        }), flush=True)
    finally:
        group.shutdown()


if __name__ == "__main__":
    main()
