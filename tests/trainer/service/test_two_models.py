"""A service of two base models (``--model tiny-random --model qwen3-tiny``), each on its own gateway and
embedded engine: capabilities list both, an unknown name is refused listing both, the second model's base
sampler samples with no training run (as a distillation teacher would be sampled), and a LoRA run of each
model steps, publishes and samples its own version on its own model's engine (the engine's prompt logprobs
are the run's own; the span carries the version and the model), while the other engine keeps serving what
it served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.trainer.service.conftest import MODEL, Service, create_run, datum, fb_body, result, tiny_service
from tracegym.errors import UserError
from tracegym.trainer.service.main import check_model_names

SECOND = "qwen3-tiny"
TOKENS = [1, 504, 3300, 28, 253, 1848, 1102, 30, 2]
"""Ids inside both vocabularies."""
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


@pytest.fixture(scope="module")
def two_models(tiny_model_dir: Path, qwen3_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with tiny_service(tmp_path_factory.mktemp("tinker-two"), "--model", SECOND) as svc:
        yield svc


def _sample(c: httpx.Client, sampler: str) -> dict[str, Any]:
    return result(c, c.post("/api/v1/asample", json={
        "sampling_session_id": sampler, "num_samples": 1, "prompt_logprobs": True,
        "prompt": {"chunks": [{"tokens": TOKENS}]}, "sampling_params": {"max_tokens": 2, "seed": 0}}))


def _span(svc: Service, model: str, sampler: str) -> dict[str, Any]:
    """The span of ``sampler``'s first sample, read from ``model``'s gateway."""
    with svc.gateway(model) as gw:
        [span] = gw.get(f"/api/rollouts/tinker-{sampler}-1/spans").json()["spans"]
    return span


def _base_sampler(c: httpx.Client, model: str) -> str:
    r = c.post("/api/v1/create_sampling_session", json={"base_model": model})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _train_and_publish(c: httpx.Client, model: str) -> tuple[str, str, str, np.ndarray]:
    """A LoRA run of ``model`` stepped once and published: (run, version, its sampler, the run's own
    logprobs of ``TOKENS[1:]`` after the step)."""
    run = create_run(c, model=model)
    data = [datum(TOKENS[:-1], TOKENS[1:])]
    result(c, c.post("/api/v1/forward_backward", json=fb_body(run, data)))
    result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))
    out = result(c, c.post("/api/v1/forward", json=fb_body(run, data)))
    logprobs = np.asarray(out["loss_fn_outputs"][0]["logprobs"]["data"])
    pub = result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": run, "sampling_session_seq_id": 0}))
    version = pub["path"].rsplit("/", 1)[1]
    assert pub["path"] == f"tinker://{run}/sampler_weights/{version}"
    return run, version, pub["sampling_session_id"], logprobs


def test_capabilities_list_both_models_and_an_unknown_one_is_refused(two_models: Service) -> None:
    with two_models.client() as c:
        caps = c.get("/api/v1/get_server_capabilities").json()["supported_models"]
        for body, path in (({"base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}}, "/api/v1/create_model"),
                           ({"base_model": "Qwen/Qwen3-8B"}, "/api/v1/create_sampling_session")):
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            assert f"unknown base model 'Qwen/Qwen3-8B'; this service trains: {MODEL}, {SECOND}" in r.json()["detail"]
    assert [(m["model_name"], m["max_context_length"]) for m in caps] == [(MODEL, 8192), (SECOND, 32768)]


def test_each_model_trains_publishes_and_samples_on_its_own_engine(two_models: Service) -> None:
    with two_models.client() as c:
        teacher = _base_sampler(c, SECOND)  # the second model's base, with no run of it
        assert c.get(f"/api/v1/samplers/{teacher}").json()["base_model"] == SECOND
        base = _sample(c, teacher)
        run_a, v_a, sampler_a, own_a = _train_and_publish(c, MODEL)
        after_a = _sample(c, _base_sampler(c, SECOND))  # the first model's publish left this engine alone
        run_b, v_b, sampler_b, own_b = _train_and_publish(c, SECOND)
        again_a = _sample(c, sampler_a)  # after the second model's publish: still version v_a, no swap
        sampled_b = _sample(c, sampler_b)
        info_a = c.post("/api/v1/get_info", json={"model_id": run_a}).json()
        info_b = c.post("/api/v1/get_info", json={"model_id": run_b}).json()
        by_path = c.post("/api/v1/create_sampling_session",
                         json={"model_path": f"tinker://{run_a}/sampler_weights/{v_a}"}).json()["sampling_session_id"]
        by_path_model = c.get(f"/api/v1/samplers/{by_path}").json()["base_model"]
        refused = c.post("/api/v1/create_sampling_session", json={"base_model": SECOND})
    assert v_a != v_b
    assert (info_a["model_name"], info_b["model_name"], info_b["model_data"]["arch"]) == (MODEL, SECOND, "qwen3")
    assert by_path_model == MODEL
    assert base["prompt_logprobs"] == after_a["prompt_logprobs"]
    for out, own in ((again_a, own_a), (sampled_b, own_b)):
        assert np.abs(np.asarray(out["prompt_logprobs"][1:], dtype=float) - own).max() < 2e-3
    assert refused.status_code == 404 and "base model can be sampled only until the first publish" in refused.text
    upstreams: dict[str, set[str]] = {}
    for model, sampler, version in ((SECOND, teacher, "default"), (MODEL, sampler_a, v_a), (SECOND, sampler_b, v_b)):
        span = _span(two_models, model, sampler)
        assert span["attributes"]["tracegym.weight_version"] == version
        assert span["attributes"]["gen_ai.response.model"] == model
        assert span["prompt_ids"] == TOKENS
        upstreams.setdefault(model, set()).add(span["attributes"]["tracegym.upstream"])
    assert len(upstreams[SECOND]) == 1 and upstreams[SECOND] != upstreams[MODEL]  # one engine per model


def test_model_flags_are_checked() -> None:
    assert check_model_names([MODEL, SECOND], None) == [MODEL, SECOND]
    with pytest.raises(UserError, match="--model tiny-random is given twice"):
        check_model_names([MODEL, SECOND, MODEL], None)
    with pytest.raises(UserError, match="--gateway samples one model; 2 --model given"):
        check_model_names([MODEL, SECOND], "http://127.0.0.1:8000")
