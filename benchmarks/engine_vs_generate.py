"""The embedded engine against transformers' ``generate`` on one batch: N prompts of the same length, each
sampled to exactly K new tokens (T=1.0), as a ``tracegym train`` step asks of its engine.

    python -m benchmarks.engine_vs_generate [--model smollm2-135m] [--requests 32] [--prompt-len 40]
                                            [--tokens 24] [--rounds 5]

(a) engine: a ``tracegym engine`` process with every core for its model thread (``$TRACEGYM_ENGINE_THREADS``,
    as ``tracegym train`` starts it in sync mode), the N requests sent at once over HTTP (``/generate``,
    ``ignore_eos``); it batches them as they arrive.
(b) generate: ``model.generate`` in this process on the same N prompts as one batch (KV cache,
    ``min_new_tokens`` = K), the same number of threads.
Both compute in the dtype the engine picks on this CPU (bf16 autocast over fp32 weights where bf16 is
faster, else fp32). The first round of each side is a warm-up; prints each side's median seconds per
round, their ratio (engine / generate), and the engine's prefill batches and decode steps per round."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import httpx

from tracegym.procs import free_port, start_process


def prompts(n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` token ids (the engine's work does not depend on their text)."""
    return [[1] + [100 + (i * 7 + j) % 5000 for j in range(length - 1)] for i in range(n)]


def engine_rounds(
    model_dir: Path, batch: list[list[int]], tokens: int, rounds: int, threads: int
) -> dict[str, Any]:
    port = free_port()
    argv = ["tracegym", "engine", "--model", str(model_dir), "--port", str(port), "--dtype", "bfloat16",
            "--max-batch-size", str(max(64, len(batch)))]  # fmt: skip

    def one(client: httpx.Client, i: int) -> int:
        body = {"input_ids": batch[i], "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True,
                                                           "temperature": 1.0, "sampling_seed": i}}  # fmt: skip
        r = client.post("/generate", json=body)
        r.raise_for_status()
        return len(r.json()["output_ids"])

    times = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_process(
            argv,
            port=port,
            log_path=Path(tmp) / "engine.log",
            health_path="/health",
            timeout=600,
            env={"TRACEGYM_ENGINE_THREADS": str(threads)},
        ) as eng,
        httpx.Client(base_url=eng.base_url, timeout=600) as client,
        concurrent.futures.ThreadPoolExecutor(len(batch)) as pool,
    ):
        for _ in range(rounds):
            t0 = time.perf_counter()
            generated = sum(pool.map(lambda i: one(client, i), range(len(batch))))
            times.append(time.perf_counter() - t0)
            assert generated == tokens * len(batch), generated
        stats = client.get("/get_server_info").json()["internal_states"][0]
    return {
        "times": times,
        "prefill_batches": stats["prefill_batches"] / rounds,
        "decode_steps": stats["decode_steps"] / rounds,
    }


def generate_rounds(
    model_dir: Path, batch: list[list[int]], tokens: int, rounds: int, threads: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tracegym.modelfiles.load import cpu_compute_dtype

    torch.set_num_threads(threads)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = cpu_compute_dtype(torch.bfloat16) is torch.bfloat16
    ids = torch.tensor(batch)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            out = lm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=0,
            )
        times.append(time.perf_counter() - t0)
        assert out.shape == (len(batch), ids.shape[1] + tokens), out.shape
    return {"times": times, "bf16": bf16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: the first round of each side is a warm-up")
    from tracegym.modelfiles.prepare import prepare_model

    model_dir = prepare_model(args.model)  # one directory for both sides (prepared once if missing)
    threads = os.cpu_count() or 1
    batch = prompts(args.requests, args.prompt_len)
    eng = engine_rounds(model_dir, batch, args.tokens, args.rounds, threads)
    gen = generate_rounds(model_dir, batch, args.tokens, args.rounds, threads)
    e, g = statistics.median(eng["times"][1:]), statistics.median(gen["times"][1:])
    print(
        f"model={args.model} {args.requests} prompts x {args.prompt_len} tokens, {args.tokens} new tokens each, "
        f"{threads} threads, {'bf16 autocast' if gen['bf16'] else 'fp32'}"
    )
    print(
        f"engine   : median {e:.2f} s a round {[round(t, 2) for t in eng['times']]}; per round "
        f"{eng['prefill_batches']:.1f} prefill batches, {eng['decode_steps']:.1f} decode steps"
    )
    print(f"generate : median {g:.2f} s a round {[round(t, 2) for t in gen['times']]}")
    print(f"engine / generate: {e / g:.2f}x")


if __name__ == "__main__":
    main()
