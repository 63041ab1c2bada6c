"""Prompt logprobs, top-k logprobs and top-k sampling through the official ``tinker`` SDK and
``tracegym tinker-serve`` on tiny-random: ``compute_logprobs`` equals the trainer's own forward of the same
tokens, ``include_prompt_logprobs`` / ``topk_prompt_logprobs`` / ``topk_sample_logprobs`` come back one per
prompt or sampled token, and the sample is still one span in the gateway's store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.trainer.service.conftest import ADMIN_KEY, MODEL, Service

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
def client(service: Service) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + ADMIN_KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture
def trained(client: tinker.ServiceClient) -> tuple[Any, Any, list[int]]:
    """A LoRA run after one step (so its adapter is not the identity), its sampler, and a prompt."""
    tc = client.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    ids = tc.get_tokenizer().encode(TEXT)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc, tc.save_weights_and_get_sampling_client().result(), ids


def _trainer_logprobs(tc: Any, ids: list[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_compute_logprobs_equals_the_trainers_forward(trained: tuple[Any, Any, list[int]]) -> None:
    tc, sampler, ids = trained
    prompt = types.ModelInput.from_ints(ids)
    got = sampler.compute_logprobs(prompt).result()
    assert len(got) == len(ids) and got[0] is None
    expected = _trainer_logprobs(tc, ids)
    assert np.abs(np.asarray(got[1:]) - expected).max() < 2e-3  # fp32 both; the engine's and trainer's LoRA
    tail = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert tail[:-3] == [None] * (len(ids) - 3)
    assert tail[-3:] == pytest.approx(got[-3:], abs=1e-6)


def test_prompt_and_topk_logprobs_come_back_per_token(service: Service, trained: tuple[Any, Any, list[int]]) -> None:
    _, sampler, ids = trained
    prompt = types.ModelInput.from_ints(ids)
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, temperature=1.0, seed=1),
                         include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2).result()
    scored = sampler.compute_logprobs(prompt).result()
    assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == len(ids)
    assert res.prompt_logprobs[0] is None and res.prompt_logprobs[1:] == pytest.approx(scored[1:], abs=1e-5)
    tops = res.topk_prompt_logprobs
    assert tops is not None and len(tops) == len(ids) and tops[0] is None
    for tid, lp, row in zip(ids[1:], res.prompt_logprobs[1:], tops[1:], strict=True):
        assert len(row) == 3 and [x[1] for x in row] == sorted((x[1] for x in row), reverse=True)
        assert lp <= row[0][1] + 1e-6
        if tid in dict(row):
            assert dict(row)[tid] == pytest.approx(lp, abs=1e-5)
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == len(seq.topk_logprobs) >= 1
        for tok, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert len(row) == 2 and row[0][1] >= row[1][1] and lp <= row[0][1] + 1e-6
            if tok in dict(row):
                assert dict(row)[tok] == pytest.approx(lp, abs=1e-5)
    only_top = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=2).result()
    assert only_top.prompt_logprobs is None and len(only_top.topk_prompt_logprobs) == len(ids)
    # the sample (this sampler's first) is one span of the gateway's store, recorded as every sample is
    with service.gateway() as gw:
        [span] = gw.get(f"/api/rollouts/tinker-{sampler._sampling_session_id}-1/spans").json()["spans"]
    assert span["prompt_ids"] == ids
    choices = sorted(span["choices"], key=lambda ch: ch["index"])
    assert [ch["output_ids"] for ch in choices] == [seq.tokens for seq in res.sequences]


def test_top_k_sampling(trained: tuple[Any, Any, list[int]]) -> None:
    _, sampler, ids = trained
    prompt = types.ModelInput.from_ints(ids[:5])
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    top1 = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1)).result()
    assert [s.tokens for s in top1.sequences] == [greedy.sequences[0].tokens] * 2
    top3 = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=3),
                          topk_sample_logprobs=3).result()
    for seq in top3.sequences:
        assert all(tok in dict(row) for tok, row in zip(seq.tokens, seq.topk_logprobs, strict=True))


def test_what_the_sampler_still_refuses(trained: tuple[Any, Any, list[int]]) -> None:
    _, sampler, ids = trained
    prompt = types.ModelInput.from_ints(ids)
    params = types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k is not supported by tracegym's sampler"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=2).result()
    target = types.TensorData(data=[5] * (len(ids) - 1), dtype="int64", shape=[len(ids) - 1, 1])
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs is not supported"):
        sampler.sample(prompt, 1, params, include_prompt_logprobs=True, target_prompt_logprobs=target).result()
    with pytest.raises(tinker.BadRequestError, match=r"topk_prompt_logprobs must be an integer in 0\.\.20"):
        sampler.sample(prompt, 1, params, topk_prompt_logprobs=21).result()
    with pytest.raises(tinker.BadRequestError, match=r"prompt_logprobs_last_n must be an integer in 1\.\."):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(ids)).result()
