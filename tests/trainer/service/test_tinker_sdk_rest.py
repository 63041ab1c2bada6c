"""The official ``tinker`` SDK against ``tracegym tinker-serve`` (tiny-random), beyond the training loop: the
``dro`` and ``gspo`` losses (their ``loss:sum`` against the formula over the logprobs the service answered),
and the ``RestClient``'s listings of training runs and checkpoints, ``weights_info`` and checkpoint deletion."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.trainer.service.conftest import ADMIN_KEY, MODEL, Service

TOKENS = [1, 504, 3300, 28, 253, 1848, 1102, 30, 2]


@pytest.fixture
def client(service: Service) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + ADMIN_KEY)
    yield sc
    sc.close("success").result()


def _datum(**inputs: list[float]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], **inputs})


def test_dro_and_gspo_losses_are_their_formulas(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    n = len(TOKENS) - 1
    lp = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy().astype(float)
    q = (lp - np.linspace(-0.2, 0.2, n)).tolist()  # a sampler that differs a little from the trainer
    adv = [0.0, 0.0] + [1.0, -0.5] * ((n - 2) // 2) + [1.0] * ((n - 2) % 2)
    beta = 0.3
    out = tc.forward_backward([_datum(logprobs=q, advantages=adv)], "dro", {"beta": beta}).result()
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(float)
    want = -(got * np.asarray(adv) - 0.5 * beta * (got - np.asarray(q)) ** 2).sum()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)

    mask = [0.0, 0.0] + [1.0] * (n - 2)
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    out = tc.forward_backward([_datum(logprobs=q, advantages=adv, sequence_ratio_mask=mask)], "gspo",
                              config).result()
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(float)
    s = math.exp(float(np.mean((got - np.asarray(q))[2:])))
    assert 0.5 < s < 2.0  # inside the thresholds: every token's loss is -s * A
    assert out.metrics["loss:sum"] == pytest.approx(-s * sum(adv), rel=1e-5)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["step"] == 1

    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' needs loss_fn_config 'beta'"):
        tc.forward_backward([_datum(logprobs=q, advantages=adv)], "dro").result()
    with pytest.raises(tinker.BadRequestError, match=r"lacks \['sequence_ratio_mask'\]"):
        tc.forward_backward([_datum(logprobs=q, advantages=adv)], "gspo", config).result()


def test_rest_client_lists_runs_and_checkpoints_and_deletes_them(service: Service,
                                                                 client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    run = tc.model_id
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = tc.save_state("rest-a").result().path
    sampler = tc.save_weights_for_sampler("rest-s").result().path
    rest = tinker.RestClient(base_url=service.url, api_key="tml-" + ADMIN_KEY)

    got = rest.get_training_run(run).result()
    assert (got.training_run_id, got.base_model, got.is_lora, got.lora_rank) == (run, MODEL, True, 4)
    assert got.last_checkpoint is not None and got.last_checkpoint.tinker_path == state
    assert got.last_sampler_checkpoint is not None and got.last_sampler_checkpoint.tinker_path == sampler
    listed = rest.list_training_runs(limit=100).result()
    assert run in [r.training_run_id for r in listed.training_runs]
    assert listed.cursor.total_count >= 1
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run

    checkpoints = rest.list_checkpoints(run).result().checkpoints
    assert {(c.checkpoint_type, c.tinker_path) for c in checkpoints} == {("training", state), ("sampler", sampler)}
    assert all(c.size_bytes and c.size_bytes > 0 for c in checkpoints)
    assert state in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (MODEL, True, 4)

    # the version the engine serves now cannot go: a swap back would need its files
    with pytest.raises(tinker.BadRequestError, match="is the one the engine serves now"):
        rest.delete_checkpoint_from_tinker_path(sampler).result()
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints] == [sampler]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):
        rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint at"):
        client.create_training_client_from_state(state).result()
    with pytest.raises(tinker.NotFoundError, match="unknown training run 'nope:train:0'"):
        rest.get_training_run("nope:train:0").result()
    with pytest.raises(tinker.NotFoundError, match="tracegym does not offer publishing"):
        rest.publish_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.NotFoundError, match="tracegym does not offer checkpoint TTLs"):
        rest.set_checkpoint_ttl_from_tinker_path(sampler, 7200).result()


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda rest: rest.whoami(), RuntimeError, "whoami requires JWT auth, but the server has it disabled"),
    (lambda rest: rest.get_audit_log(), tinker.NotFoundError, r"tracegym does not offer an audit log"),
    (lambda rest: rest.get_current_checkpoint_storage_usage(), tinker.NotFoundError,
     "tracegym does not offer billing or storage usage"),
    (lambda rest: rest.export_session_trace("s-0"), tinker.NotFoundError,
     "tracegym does not offer session listings, search, projects or trace exports"),
    (lambda rest: rest.search_sessions(types.SessionSearchRequest()), tinker.NotFoundError,
     "tracegym does not offer session listings, search, projects or trace exports"),
    (lambda rest: rest.assign_session_project("s-0", "p"), tinker.NotFoundError,
     "tracegym does not offer session listings, search, projects or trace exports"),
    (lambda rest: rest.get_external_weights_urls("tinker://s-0:train:0/external_weights/w"), tinker.NotFoundError,
     "tracegym does not offer external weights checkpoints"),
])
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::tinker.ExperimentalWarning")
def test_rest_operations_not_offered_answer_what_the_docs_say(service: Service, call: Any, error: type,
                                                              message: str) -> None:
    rest = tinker.RestClient(base_url=service.url, api_key="tml-" + ADMIN_KEY)
    with pytest.raises(error, match=message):
        call(rest).result()
