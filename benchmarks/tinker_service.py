"""A Tinker-API RL loop through ``tracegym tinker-serve`` against ``tracegym train`` on the same task, side by
side in one invocation.

    python -m benchmarks.tinker_service [--steps 8] [--out results.json]

Both sides: SmolLM2-135M-Instruct, LoRA rank 16, examples/quickstart's training tasks in the trainer's draw
order, 8 prompts × 4 samples per step at T=1.0, up to 24 new tokens, the "last number" reward, GRPO advantages
``(r − mean) / (std + 1e-4)`` with all-equal groups dropped, AdamW lr 1e-4, the compute dtype the trainer picks
on this CPU.

(a) tinker: the official ``tinker`` SDK against ``tracegym tinker-serve`` — per step
    ``save_weights_and_get_sampling_client`` (publish: adapters written, swapped into the engine), 8
    ``sample`` calls of 4 (through the gateway, each a span), one ``forward_backward`` with
    ``importance_sampling`` and one ``optim_step``. Its step times are measured around those calls.
(b) product: ``tracegym train examples/quickstart/recipe-lora.yaml`` with the same steps (benchmarks.learning's
    product side: its agent and runner over the gateway, its own GRPO step); times from its metrics.jsonl.

Ratio = tinker / product per-step median. The sides run one after the other on the same machine; the tinker
side's LoRA has alpha 16 (the service's), the recipe's alpha 32, which changes what is learnt, not the time."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.learning import (
    GROUP,
    MAX_NEW,
    PROMPTS,
    QUICKSTART,
    TaskOrder,
    grpo,
    last_number_reward,
    read_jsonl,
)
from benchmarks.learning import run_product as run_train

KEY = "benchmark-key"


def run_tinker(args: argparse.Namespace) -> dict[str, Any]:
    import tinker
    from tinker import types

    from tracegym.procs import free_port, start_process

    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"tracegym-tinker-bench-{os.getpid()}"
    port = free_port()
    t0 = time.monotonic()
    argv = ["tracegym", "tinker-serve", "--model", "smollm2-135m", "--port", str(port), "--state-dir", str(state)]
    with start_process(argv, port=port, log_path=state / "service.log", health_path="/healthz", timeout=600,
                       env={"TRACEGYM_ADMIN_KEY": KEY, "TINKER_TELEMETRY": "0"}) as proc:
        client = tinker.ServiceClient(base_url=proc.base_url, api_key="tml-" + KEY)
        tc = client.create_lora_training_client(base_model="smollm2-135m", rank=16, seed=args.seed).result()
        tok = tc.get_tokenizer()
        startup = time.monotonic() - t0
        train = read_jsonl(QUICKSTART / "train.jsonl")
        order = TaskOrder(len(train), args.seed)
        steps = []
        for step in range(1, args.steps + 1):
            ts = time.monotonic()
            sampler = tc.save_weights_and_get_sampling_client().result()
            tg = time.monotonic()
            tasks = [train[i] for i in order.take(PROMPTS)]
            prompts = [types.ModelInput.from_ints(list(tok.apply_chat_template(
                [{"role": "user", "content": t["question"]}], add_generation_prompt=True, tokenize=True)["input_ids"]))
                for t in tasks]
            params = types.SamplingParams(max_tokens=MAX_NEW, temperature=1.0)
            futures = [sampler.sample(p, GROUP, params) for p in prompts]
            seqs = [s for f in futures for s in f.result().sequences]
            rewards = [last_number_reward(tok.decode(s.tokens, skip_special_tokens=True), t["answer"])
                       for s, t in zip(seqs, [t for t in tasks for _ in range(GROUP)], strict=True)]
            tt = time.monotonic()
            data, tokens = [], 0
            for k, (s, adv) in enumerate(zip(seqs, grpo(rewards), strict=True)):
                if adv == 0.0:
                    continue
                prompt, ob = prompts[k // GROUP], prompts[k // GROUP].length - 1
                tokens += prompt.length + len(s.tokens)
                data.append(types.Datum(
                    model_input=prompt.append(types.EncodedTextChunk(tokens=s.tokens[:-1])),
                    loss_fn_inputs={"target_tokens": [0] * ob + s.tokens, "logprobs": [0.0] * ob + s.logprobs,
                                    "advantages": [0.0] * ob + [adv] * len(s.tokens)}))
            if data:
                fb = tc.forward_backward(data, "importance_sampling")
                tc.optim_step(types.AdamParams(learning_rate=1e-4, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)).result()
                fb.result()
            te = time.monotonic()
            steps.append({"step": step, "swap_s": tg - ts, "gen_s": tt - tg, "train_s": te - tt, "step_s": te - ts,
                          "reward": statistics.fmean(rewards), "tokens": tokens})
            print(f"  tinker step {step}: publish {tg - ts:.1f} s, sample {tt - tg:.1f} s, train {te - tt:.1f} s "
                  f"({tokens} tokens), reward {steps[-1]['reward']:.2f}", flush=True)
        client.close("success").result()
    return {"startup_s": startup, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write both sides' rows as JSON")
    args = p.parse_args(argv)

    from benchmarks.machine import describe
    from tracegym.modelfiles.load import CPU_BF16_ENV, decide_cpu_bf16
    from tracegym.modelfiles.prepare import prepare_model

    print(describe(), flush=True)
    decide_cpu_bf16()
    print(f"compute dtype on this CPU: {'bf16' if os.environ.get(CPU_BF16_ENV) == 'fast' else 'fp32'}", flush=True)
    prepare_model("smollm2-135m")
    print(f"== tinker: {args.steps} steps", flush=True)
    sides = {"tinker": run_tinker(args)}
    print(f"== product (tracegym train, LoRA): {args.steps} steps", flush=True)
    product_args = argparse.Namespace(steps=args.steps, eval_every=args.steps, seed=args.seed, lora=True, keep=False)
    sides["product"] = run_train(product_args)
    if args.out:
        args.out.write_text(json.dumps(sides, indent=1))
    med = {n: {k: statistics.median(s[k] for s in side["steps"]) for k in ("swap_s", "gen_s", "train_s", "step_s")}
           for n, side in sides.items()}
    print(f"\n{'side':8} {'swap s':>7} {'gen s':>6} {'train s':>8} {'step s':>7} {'start s':>8}  rewards per step")
    for n, side in sides.items():
        m = med[n]
        print(f"{n:8} {m['swap_s']:7.2f} {m['gen_s']:6.2f} {m['train_s']:8.2f} {m['step_s']:7.2f} "
              f"{side['startup_s']:8.1f}  {[round(s['reward'], 2) for s in side['steps']]}")
    print(f"\nmedian step: tinker / product = {med['tinker']['step_s'] / med['product']['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
