"""Full fine-tuning through the HTTP API on a service of its own (tiny-random; one engine serves adapters or
full weights, and the shared service's serves adapters): a run without ``lora_config`` steps, publishes
its weights, and the published version is what the gateway samples (its prompt logprobs are the run's
own, its span carries the version); a LoRA publish on the same engine is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.trainer.service.conftest import Service, create_run, datum, fb_body, result, tiny_service

TOKENS = [1, 504, 3300, 28, 253, 1848, 1102, 30, 2]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


@pytest.fixture(scope="module")
def full_service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with tiny_service(tmp_path_factory.mktemp("tinker-full")) as svc:
        yield svc


def _logprobs(c: httpx.Client, run: str) -> np.ndarray:
    """The run's logprobs of ``TOKENS[1:]``, from its own forward."""
    out = result(c, c.post("/api/v1/forward", json=fb_body(run, [datum(TOKENS[:-1], TOKENS[1:])])))
    return np.asarray(out["loss_fn_outputs"][0]["logprobs"]["data"])


def test_a_full_fine_tuning_run_publishes_the_weights_the_gateway_samples(full_service: Service) -> None:
    with full_service.client() as c:
        run = create_run(c, lora_rank=None)
        info = c.post("/api/v1/get_info", json={"model_id": run}).json()
        assert (info["is_lora"], info["lora_rank"]) == (False, None)
        before = _logprobs(c, run)
        result(c, c.post("/api/v1/forward_backward", json=fb_body(run, [datum(TOKENS[:-1], TOKENS[1:])])))
        result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))
        trained = _logprobs(c, run)
        pub = result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": run,
                                                                         "sampling_session_seq_id": 0}))
        version, sampler = pub["path"].rsplit("/", 1)[1], pub["sampling_session_id"]
        out = result(c, c.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "num_samples": 1, "prompt_logprobs": True,
            "prompt": {"chunks": [{"tokens": TOKENS}]}, "sampling_params": {"max_tokens": 2, "seed": 0}}))
        lora = create_run(c)
        refused = result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": lora}))
    assert pub["path"] == f"tinker://{run}/sampler_weights/{version}"
    assert np.abs(trained - before).max() > 1e-2  # the step moved the weights
    sampled = np.asarray(out["prompt_logprobs"][1:], dtype=float)
    assert out["prompt_logprobs"][0] is None
    assert np.abs(sampled - trained).max() < 2e-3  # fp32 both: the engine serves the trained weights
    with full_service.gateway() as gw:
        [span] = gw.get(f"/api/rollouts/tinker-{sampler}-1/spans").json()["spans"]
    assert span["attributes"]["tracegym.weight_version"] == version
    assert span["prompt_ids"] == TOKENS
    assert "serves full weight versions and cannot also serve lora ones" in refused["error"]
