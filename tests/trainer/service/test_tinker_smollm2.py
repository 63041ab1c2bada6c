"""Slow: the official ``tinker`` SDK's SFT and RL loops on SmolLM2-135M-Instruct through
``tracegym tinker-serve`` on this CPU, short runs that must learn: the SFT loss falls, and on the
quickstart's task ("What is A+B?", reward 1 when the reply's last number is the sum) the RL loop's reward
rises. The curves are written to ``$TRACEGYM_TINKER_CURVES`` (a JSON file) when that is set."""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.procs import ManagedProcess
from tests.trainer.service.conftest import SMOLLM2_KEY as KEY

pytestmark = [pytest.mark.slow, pytest.mark.learns]

MODEL = "smollm2-135m"
TASKS = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "train.jsonl"
NUMBER = re.compile(r"-?\d+")


def _tasks() -> list[dict[str, Any]]:
    return [json.loads(line)["input"] for line in TASKS.read_text().splitlines() if line.strip()]


def _record(name: str, curve: dict[str, Any]) -> None:
    path = os.environ.get("TRACEGYM_TINKER_CURVES")
    if path:
        p = Path(path)
        runs = json.loads(p.read_text()) if p.is_file() else {}
        runs.setdefault(name, []).append(curve)
        p.write_text(json.dumps(runs, indent=1))


@pytest.fixture
def client(smollm2_service: ManagedProcess) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=smollm2_service.base_url, api_key="tml-" + KEY)
    yield sc
    sc.close("success").result()


def _prompt(tokenizer: Any, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


def test_sft_loss_falls(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
    tok = tc.get_tokenizer()
    rng = random.Random(0)
    tasks = _tasks()
    losses, t0 = [], time.perf_counter()
    for _ in range(6):
        batch = []
        for task in rng.sample(tasks, 4):
            prompt = _prompt(tok, task["question"])
            answer = tok.encode(f"{task['question'][8:-1]} = {task['answer']}<|im_end|>")
            ids = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            batch.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                     loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
        fb = tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-4)).result()
        out = fb.result()
        tokens = sum(float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in batch)
        losses.append(out.metrics["loss:sum"] / tokens)
        print(f"sft step {len(losses)}: mean nll {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    elapsed = time.perf_counter() - t0
    _record("sft", {"mean_nll": losses, "seconds": elapsed, "steps": len(losses)})
    print(f"sft mean nll per step: {[round(x, 3) for x in losses]} ({elapsed:.0f} s)")
    assert np.mean(losses[-2:]) < 0.6 * np.mean(losses[:2]), losses


@pytest.mark.timeout(1500)
def test_rl_reward_rises(client: tinker.ServiceClient) -> None:
    tc = client.create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
    tok = tc.get_tokenizer()
    rng = random.Random(0)
    tasks = _tasks()
    rewards, seconds = [], []
    steps, groups, group_size = 16, 8, 4
    for _ in range(steps):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        batch = rng.sample(tasks, groups)
        prompts = [types.ModelInput.from_ints(_prompt(tok, t["question"])) for t in batch]
        futures = [sampler.sample(p, group_size, types.SamplingParams(max_tokens=20, temperature=1.0))
                   for p in prompts]
        data, step_rewards = [], []
        for task, prompt, fut in zip(batch, prompts, futures, strict=True):
            seqs = fut.result().sequences
            r = [1.0 if (n := NUMBER.findall(tok.decode(s.tokens))) and int(n[-1]) == task["answer"] else 0.0
                 for s in seqs]
            step_rewards += r
            mean = sum(r) / len(r)
            for s, reward in zip(seqs, r, strict=True):
                if reward == mean:
                    continue  # a group with one outcome has no signal
                ob = prompt.length - 1
                data.append(types.Datum(
                    model_input=prompt.append(types.EncodedTextChunk(tokens=s.tokens[:-1])),
                    loss_fn_inputs={"target_tokens": [0] * ob + s.tokens, "logprobs": [0.0] * ob + s.logprobs,
                                    "advantages": [0.0] * ob + [reward - mean] * len(s.tokens)}))
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            tc.optim_step(types.AdamParams(learning_rate=5e-4)).result()
            fb.result()
        rewards.append(float(np.mean(step_rewards)))
        seconds.append(time.perf_counter() - t0)
        print(f"rl step {len(rewards)}: reward {rewards[-1]:.3f} ({seconds[-1]:.0f} s)", flush=True)
    _record("rl", {"reward": rewards, "seconds": seconds})
    print(f"rl reward per step: {rewards} (mean step {np.mean(seconds):.1f} s)")
    quarter = steps // 4
    assert np.mean(rewards[-quarter:]) > np.mean(rewards[:quarter]) + 0.1, rewards
