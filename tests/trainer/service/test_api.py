"""The service's HTTP API on a real ``tracegym tinker-serve`` (tiny-random): bad input answered with what
is valid, the ordering rule (409 for a second stepper), a client that disconnects, keys, save/load of
state, samples recorded as spans, and one ``forward_backward`` + ``optim_step`` moving the weights exactly
as the trainer's own step on the same batch."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.service.conftest import MODEL, Service, create_run, datum, fb_body, result, session
from tracegym.trainer.settings import OptimConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample, plan_step
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}
TOKENS = [1, 504, 3300, 28, 253, 1848, 1102, 30, 2]


def _sft_datum() -> dict:
    return datum(TOKENS[:-1], TOKENS[1:], weights=[0.0, 0.0] + [1.0] * (len(TOKENS) - 3))


def test_capabilities_name_the_model_and_every_loss(service: Service) -> None:
    with service.client() as c:
        caps = c.get("/api/v1/get_server_capabilities").json()
    assert [m["model_name"] for m in caps["supported_models"]] == [MODEL]
    assert caps["supported_models"][0]["max_context_length"] == 8192
    assert {"cross_entropy", "importance_sampling", "ppo", "tracegym/sft"} <= set(caps["losses"])


def test_bad_service_input_is_refused_with_what_is_valid(service: Service) -> None:
    with service.client() as c:
        r = c.post("/api/v1/create_model", json={"session_id": session(c), "model_seq_id": 0,
                                                 "base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 8}})
        assert r.status_code == 400 and "unknown base model 'Qwen/Qwen3-8B'; this service trains: tiny-random" \
            in r.json()["detail"]
        r = c.post("/api/v1/create_sampling_session", json={"base_model": "Qwen/Qwen3-8B"})
        assert r.status_code == 400 and "unknown base model 'Qwen/Qwen3-8B'; this service trains: tiny-random" \
            in r.json()["detail"]
        r = c.post("/api/v1/copy_weights", json={})
        assert r.status_code == 404 and "tracegym does not offer copying weights" in r.json()["detail"]
        r = c.post("/api/v1/cancel_future", json={"request_id": "req-0"})
        assert r.status_code == 404 and "tracegym does not offer cancelling a request" in r.json()["detail"]
        r = c.post("/api/v1/forward_backward", json=fb_body("s-0:train:9", [_sft_datum()]))
        assert r.status_code == 404 and "unknown model_id" in r.json()["detail"]


def test_bad_training_input_is_refused_with_what_is_valid(service: Service) -> None:
    with service.client() as c:
        run = create_run(c)
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()], loss="stable_reinforce"))
        assert r.status_code == 400
        assert "unknown loss_fn 'stable_reinforce' (it needs samples recorded with record_stability_info" \
               in r.json()["detail"]
        assert "valid: cispo, cross_entropy, dro, gspo, importance_sampling, ppo, tracegym/grpo, tracegym/sft" \
               in r.json()["detail"]
        long = list(range(3, 8196))  # 8192 input tokens: one more than fits with its target
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [datum(long[:-1], long[1:])]))
        assert r.status_code == 400 and "takes at most 8191 input tokens" in r.json()["detail"]
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [datum([1, 2, 3], [2, 3, 4], weights=[1.0])]))
        assert r.status_code == 400
        assert "loss_fn_inputs['weights'] has 1 values but model_input has 3 tokens" in r.json()["detail"]
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [datum([1, 2], [2, 3])], loss="ppo"))
        assert r.status_code == 400 and "lacks ['logprobs', 'advantages']" in r.json()["detail"]
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [datum([1, 2], [2, 99999])]))
        assert r.status_code == 400 and "outside the vocabulary [0, 49152)" in r.json()["detail"]
        out = result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))
        assert out["category"] == "user" and "optim_step without gradients" in out["error"]
        r = c.post("/api/v1/create_sampling_session", json={
            "session_id": "x", "sampling_session_seq_id": 0, "model_path": f"tinker://{run}/sampler_weights/99"})
        assert r.status_code == 404 and "weight version '99' was never published" in r.json()["detail"]
        # the refused requests used up their seq_ids: the next one runs at once
        out = result(c, c.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()])), timeout=30)
        assert out["metrics"]["loss:sum"] > 0


def test_a_second_stepper_gets_409_and_the_first_goes_on(service: Service) -> None:
    with service.client() as a, service.client() as b:
        run = create_run(a)
        first = a.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()], seq_id=1))
        r = b.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()], seq_id=1))
        assert r.status_code == 409 and "another client is stepping this run" in r.json()["detail"]
        later = a.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM, "seq_id": 3})
        second = a.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()], seq_id=2))
        fb1, fb2 = result(a, first), result(a, second)
        assert fb2["metrics"]["loss:sum"] == pytest.approx(fb1["metrics"]["loss:sum"])  # no step between them
        assert result(a, later)["metrics"]["step"] == 1


def _raw_post(service: Service, path: str, body: bytes, send: int) -> None:
    """POST ``body`` with a socket that sends only its first ``send`` bytes, then hangs up unread."""
    host, port = service.url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-API-Key: service-test-key\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body[:send])


def test_a_client_that_hangs_up_never_half_applies_a_step(service: Service) -> None:
    with service.client() as c:
        run = create_run(c)
        body = orjson.dumps(fb_body(run, [_sft_datum()], seq_id=1))
        _raw_post(service, "/api/v1/forward_backward", body, send=len(body) // 2)  # cut mid-body: nothing ran
        time.sleep(0.5)
        _raw_post(service, "/api/v1/forward_backward", body, send=len(body))  # whole, then gone: it runs
        step = c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM, "seq_id": 2})
        assert result(c, step)["metrics"]["step"] == 1  # the gradients of seq_id 1 were all there
        r = c.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()], seq_id=1))
        assert r.status_code == 409  # seq_id 1 ran once, from the client that hung up


def test_keys_admin_and_per_run(service: Service) -> None:
    with service.client(None) as anon:
        assert anon.get("/api/v1/get_server_capabilities").status_code == 401
        assert anon.get("/healthz").status_code == 200
    with service.client("tml-service-test-key") as c:  # the SDK's prefix is accepted
        run, other = create_run(c), create_run(c)
        key = c.get(f"/api/v1/training_runs/{run}/key").json()["key"]
    with service.client(key) as r:
        assert result(r, r.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()])))["metrics"]
        assert r.post("/api/v1/forward_backward", json=fb_body(other, [_sft_datum()])).status_code == 403
        assert r.post("/api/v1/create_model", json={"base_model": MODEL}).status_code == 403


def _unknown(c: httpx.Client, rid: str) -> bool:
    """Whether ``rid`` is answered exactly as a request id that never existed."""
    r = c.post("/api/v1/retrieve_future", json={"request_id": rid})
    return r.status_code == 404 and r.json()["detail"] == f"unknown request_id {rid!r} (results are kept for an hour)"


def _admin_and_keys(service: Service, runs: int) -> tuple[list[str], list[str]]:
    with service.client() as c:
        names = [create_run(c) for _ in range(runs)]
        return names, [c.get(f"/api/v1/training_runs/{n}/key").json()["key"] for n in names]


def test_a_runs_key_reads_only_its_own_runs_results_and_checkpoints(service: Service) -> None:
    (run, other), (key, other_key) = _admin_and_keys(service, 2)
    with service.client() as admin:
        theirs = admin.post("/api/v1/forward_backward", json=fb_body(other, [_sft_datum()]))
        mine = admin.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()]))
        result(admin, theirs)
        saved = result(admin, admin.post("/api/v1/save_weights", json={"model_id": other, "path": "theirs"}))["path"]
    rid = theirs.json()["request_id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", rid)  # random: the next one's id cannot be guessed
    with service.client(key) as r:
        assert _unknown(r, rid)  # another run's result: not even confirmed to exist
        assert result(r, mine)["metrics"]["loss:sum"] > 0  # its own run's, though the admin sent it
        refused = r.post("/api/v1/load_weights", json={"model_id": run, "path": saved, "optimizer": False})
        assert refused.status_code == 403 and "is another run's checkpoint" in refused.json()["detail"]
        assert r.post("/api/v1/load_weights", json={"session_id": "x", "path": saved}).status_code == 403
        r.post(f"/api/v1/sessions/{other.split(':')[0]}/finish")  # not its session's runs to release
        # the refused load used up its seq_id: the next request runs at once
        assert result(r, r.post("/api/v1/forward", json=fb_body(run, [_sft_datum()])), timeout=30)["metrics"]
    with service.client(other_key) as r:
        assert result(r, theirs)["metrics"]["loss:sum"] > 0
    with service.client() as admin:
        assert "error" not in result(admin, admin.post("/api/v1/load_weights", json={
            "model_id": run, "path": saved, "optimizer": False}))  # the admin key loads any run's state
        assert result(admin, admin.post("/api/v1/forward", json=fb_body(other, [_sft_datum()])))["metrics"]


def test_a_runs_key_samples_its_versions_after_its_session_finished(service: Service) -> None:
    (run, _), (key, other_key) = _admin_and_keys(service, 2)
    with service.client() as admin:
        path = result(admin, admin.post("/api/v1/save_weights_for_sampler", json={"model_id": run}))["path"]
        admin.post(f"/api/v1/sessions/{run.split(':')[0]}/finish")
        deadline = time.monotonic() + 30
        while admin.get(f"/api/v1/training_runs/{run}/key").status_code != 404:  # its workers released
            assert time.monotonic() < deadline
            time.sleep(0.1)
    body = {"model_path": path, "num_samples": 1, "prompt": {"chunks": [{"tokens": TOKENS[:4]}]},
            "sampling_params": {"max_tokens": 2}}
    with service.client(key) as r:
        sampler = r.post("/api/v1/create_sampling_session", json={"model_path": path})
        assert sampler.status_code == 200, sampler.text
        sample = r.post("/api/v1/asample", json=body)
        assert len(result(r, sample)["sequences"]) == 1
    with service.client(other_key) as r:
        assert _unknown(r, sample.json()["request_id"])
        assert r.post("/api/v1/asample", json=body).status_code == 403
        sid = sampler.json()["sampling_session_id"]
        assert r.post("/api/v1/asample", json=body | {"sampling_session_id": sid}).status_code == 403


def test_state_saved_and_loaded_into_a_new_run_gives_the_same_logprobs(service: Service) -> None:
    with service.client() as c:
        run = create_run(c)
        result(c, c.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()])))
        result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM | {"learning_rate": 0.05}}))
        path = result(c, c.post("/api/v1/save_weights", json={"model_id": run, "path": "after-one"}))["path"]
        assert path == f"tinker://{run}/weights/after-one"
        out = result(c, c.post("/api/v1/load_weights", json={
            "session_id": session(c), "model_seq_id": 0, "path": path, "optimizer": True}))
        fresh = create_run(c)
        lps = {}
        for name in (run, out["model_id"], fresh):
            fwd = result(c, c.post("/api/v1/forward", json=fb_body(name, [_sft_datum()])))
            lps[name] = fwd["loss_fn_outputs"][0]["logprobs"]["data"]
        assert lps[run] == lps[out["model_id"]] != lps[fresh]
        missing = c.post("/api/v1/load_weights", json={"model_id": fresh, "path": f"tinker://{run}/weights/nope",
                                                       "optimizer": False})
        assert result(c, missing)["error"].startswith(f"no checkpoint at tinker://{run}/weights/nope")


def test_a_state_loaded_with_its_optimizer_steps_on_as_if_never_saved(service: Service) -> None:
    """Adam's moments (and step count) come back with ``optimizer``: one more step after the load equals one
    more step of the run that saved it; without them it does not."""
    step = ADAM | {"learning_rate": 0.05}
    with service.client() as c:
        def one_step(run: str) -> None:
            result(c, c.post("/api/v1/forward_backward", json=fb_body(run, [_sft_datum()])))
            result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": step}))

        run = create_run(c)
        one_step(run)
        path = result(c, c.post("/api/v1/save_weights", json={"model_id": run, "path": "adam"}))["path"]
        one_step(run)
        lps = {}
        for optimizer in (True, False):
            loaded = result(c, c.post("/api/v1/load_weights", json={
                "session_id": session(c), "model_seq_id": 0, "path": path, "optimizer": optimizer}))["model_id"]
            one_step(loaded)
            lps[optimizer] = loaded
        got = {name: result(c, c.post("/api/v1/forward", json=fb_body(name, [_sft_datum()])))
               ["loss_fn_outputs"][0]["logprobs"]["data"] for name in (run, lps[True], lps[False])}
    assert got[run] == got[lps[True]] != got[lps[False]]


def test_samples_go_through_the_gateway_as_spans_of_the_published_version(service: Service) -> None:
    with service.client() as c:
        run = create_run(c)
        pub = result(c, c.post("/api/v1/save_weights_for_sampler", json={
            "model_id": run, "sampling_session_seq_id": 0}))
        version = pub["path"].rsplit("/", 1)[1]
        sampler = pub["sampling_session_id"]
        out = result(c, c.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": 0, "num_samples": 2,
            "prompt": {"chunks": [{"tokens": TOKENS[:4], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 5, "temperature": 1.0, "seed": 3}}))
        long = c.post("/api/v1/asample", json={"sampling_session_id": sampler, "num_samples": 1,
                                                "prompt": {"chunks": [{"tokens": [5] * 8192}]}})
        assert long.status_code == 400
        assert "the prompt has 8192 tokens; tiny-random's context is 8192 tokens" in long.json()["detail"]
        over = c.post("/api/v1/asample", json={"sampling_session_id": sampler, "num_samples": 1,
                                                "prompt": {"chunks": [{"tokens": [5] * 8000}]},
                                                "sampling_params": {"max_tokens": 200}})
        assert over.status_code == 400
        assert "the prompt's 8000 tokens and max_tokens 200 make 8200, more than tiny-random's context of 8192" \
            in over.json()["detail"]
    seqs = out["sequences"]
    assert len(seqs) == 2 and all(len(s["tokens"]) == len(s["logprobs"]) >= 1 for s in seqs)
    with service.gateway() as gw:
        spans = gw.get(f"/api/rollouts/tinker-{sampler}-1/spans").json()["spans"]
    assert len(spans) == 1
    span = spans[0]
    assert span["attributes"]["tracegym.weight_version"] == version
    assert span["prompt_ids"] == TOKENS[:4]
    choices = sorted(span["choices"], key=lambda ch: ch["index"])
    assert [ch["output_ids"] for ch in choices] == [s["tokens"] for s in seqs]
    for ch, s in zip(choices, seqs, strict=True):
        assert ch["output_logprobs"] == pytest.approx(s["logprobs"])


def test_one_step_through_the_api_moves_the_weights_exactly_as_the_trainer(service: Service, tiny_model_dir: Path,
                                                                         trainer_imports: None) -> None:
    rng = np.random.default_rng(7)
    samples = []
    for n, prompt in ((13, 4), (8, 2), (17, 6)):
        mask = np.zeros(n, np.int8)
        mask[prompt:] = 1
        samples.append(TrainSample(rng.integers(3, 4000, n), mask, np.zeros(n), 0.0))
    optim = OptimConfig(lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                        grad_clip=ADAM["grad_clip_norm"], dtype="float32")
    trainer = WorkerGroup(tiny_model_dir, num_workers=1, train_cfg=TrainConfig(optim=optim, device="cpu"),
                          use_ray=False)
    trainer.train_step(TrainBatch(samples), objective="sft")
    expected = {k: v.detach().clone() for k, v in trainer._workers[0].model.named_parameters()}
    (groups,), _ = plan_step([len(s.token_ids) for s in samples], 1, optim.micro_batch_budget("cpu"))
    data = [datum(s.token_ids[:-1].tolist(), s.token_ids[1:].tolist(), weights=s.loss_mask[1:].tolist())
            for s in (samples[i] for i in groups[0])]  # the trainer's row order
    with service.client() as c:
        run = create_run(c, lora_rank=None)
        result(c, c.post("/api/v1/forward_backward", json=fb_body(run, data, loss="tracegym/sft")))
        result(c, c.post("/api/v1/optim_step", json={"model_id": run, "adam_params": ADAM}))
        path = result(c, c.post("/api/v1/save_weights", json={"model_id": run, "path": "eq"}))["path"]
    assert path.endswith("/weights/eq")
    trainer.load_checkpoint(service.state_dir / "checkpoints" / run.replace(":", "_") / "eq")  # the trainer's format
    got = {k: v.detach() for k, v in trainer._workers[0].model.named_parameters()}
    trainer.shutdown()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((got[k] - start[k]).abs().max()) for k in start if k in got) > 5e-4


def test_one_engine_serves_adapters_or_full_weights_not_both(service: Service) -> None:
    with service.client() as c:
        lora, full = create_run(c), create_run(c, lora_rank=None)
        assert "path" in result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": lora, "path": "a"}))
        refused = result(c, c.post("/api/v1/save_weights_for_sampler", json={"model_id": full, "path": "b"}))
    assert "serves lora weight versions and cannot also serve full ones" in refused["error"]
