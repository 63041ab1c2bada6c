"""The official ``tinker`` SDK, unchanged, pointed at ``tracegym tinker-serve``: Tinker's supervised loop
(forward_backward with cross_entropy, optim_step) and its RL loop (save weights and get a sampling client,
sample, importance_sampling on the sampled tokens, step), on tiny-random; errors reach the SDK's caller
with the service's message. The only setting: ``api_key='tml-' + the admin key`` (the SDK requires the
prefix)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.trainer.service.conftest import ADMIN_KEY, MODEL, Service

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
             "Actions speak louder than words."]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The model's tokenizer, as ``TrainingClient.get_tokenizer`` loads it (transformers imported once)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def client(service: Service, tokenizer: Any) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + ADMIN_KEY)
    yield sc
    sc.close("success").result()


def _sft_datum(tokenizer: object, text: str) -> types.Datum:
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    weights = [0.0] + [1.0] * (len(ids) - 2)  # the first target is not trained, as after a prompt
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def test_the_sdk_runs_an_sft_loop(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    info = tc.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (True, 8, MODEL)
    tokenizer = tc.get_tokenizer()  # from the model's own folder: get_info's tokenizer_id
    batch = [_sft_datum(tokenizer, s) for s in SENTENCES]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(batch, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result()
        assert step.result().metrics["step"] >= 1
        weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in batch])
        logprobs = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
        assert out.metrics["loss:sum"] == pytest.approx(-(logprobs * weights).sum(), rel=1e-4)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 1.0, losses
    saved = tc.save_state("sdk-sft").result()
    assert saved.path.endswith("/weights/sdk-sft")
    resumed = client.create_training_client_from_state_with_optimizer(saved.path).result()
    again = [tc.forward(batch, "cross_entropy"), resumed.forward(batch, "cross_entropy")]
    a, b = (f.result().loss_fn_outputs for f in again)
    assert all(np.array_equal(x["logprobs"].to_numpy(), y["logprobs"].to_numpy()) for x, y in zip(a, b, strict=True))


def test_the_sdk_runs_an_rl_loop_on_policy(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("Count: one two"))
    versions = []
    for _ in range(2):
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=6, temperature=1.0)).result()
        assert len({s.sequence_id for s in res.sequences}) == 4
        rewards = [float(np.mean(np.asarray(s.tokens) < 20000)) for s in res.sequences]
        advantages = [r - float(np.mean(rewards)) for r in rewards]
        data = []
        for seq, adv in zip(res.sequences, advantages, strict=True):
            ob = prompt.length - 1
            tokens = seq.tokens
            data.append(types.Datum(
                model_input=prompt.append(types.EncodedTextChunk(tokens=tokens[:-1])),
                loss_fn_inputs={"target_tokens": [0] * ob + tokens, "logprobs": [0.0] * ob + seq.logprobs,
                                "advantages": [0.0] * ob + [adv] * len(tokens)}))
        fb = tc.forward_backward(data, "importance_sampling").result()
        # on policy: the trainer's logprobs of the sampled tokens are the engine's (fp32 both)
        for seq, out in zip(res.sequences, fb.loss_fn_outputs, strict=True):
            trained = out["logprobs"].to_numpy()[prompt.length - 1:]
            assert np.abs(trained - np.asarray(seq.logprobs)).max() < 2e-3
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        versions.append(sampler)
    assert versions[0]._sampling_session_id != versions[1]._sampling_session_id


def test_sdk_callers_get_the_service_message(client: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.BadRequestError, match="unknown base model 'Qwen/Qwen3-8B'; this service trains"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B").result()
    tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn 'custom' \\(server-side custom losses"):
        tc.forward_backward([_sft_datum(tc.get_tokenizer(), SENTENCES[0])], "custom").result()
    with pytest.raises(tinker.RequestFailedError, match="optim_step without gradients"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.NotFoundError, match="weight version '77' was never published"):
        client.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/77").result()


def test_the_docs_example_runs(service: Service, tmp_path: Path) -> None:
    """docs/tinker.md's client example, as written, against this service: only its address, key and model
    name are this test's."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "tinker.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "tinker.ServiceClient(" in b]
    code = (code.replace("http://127.0.0.1:8100", service.url).replace("tml-choose-a-key", "tml-" + ADMIN_KEY)
            .replace('"smollm2-135m"', f'"{MODEL}"'))
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TINKER_TELEMETRY": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("loss ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # one line per sampled sequence ends with its first three logprobs (the decoded text may hold newlines)
    assert len(re.findall(r"\[-?\d[-\d.e, ]*\]$", out.stdout, flags=re.M)) == 2, out.stdout
