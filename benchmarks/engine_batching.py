"""Dynamic batching in the embedded engine: the same N requests sent one after another vs all at once, to
a real ``tracegym engine`` process. Prints generated tokens/s of both and their ratio, and the largest
batch the engine reports.

    python -m benchmarks.engine_batching [--model tiny-random] [--requests 16] [--tokens 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

import httpx

from tracegym.procs import free_port, start_process


def one(client: httpx.Client, i: int, tokens: int) -> int:
    body = {
        "input_ids": [1, 9690, 314, 253, 100 + i, 30],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": i},
    }
    r = client.post("/generate", json=body)
    r.raise_for_status()
    return len(r.json()["output_ids"])


def measure(client: httpx.Client, n: int, tokens: int, concurrent_: bool) -> float:
    t0 = time.perf_counter()
    if concurrent_:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            total = sum(pool.map(lambda i: one(client, i, tokens), range(n)))
    else:
        total = sum(one(client, i, tokens) for i in range(n))
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    port = free_port()
    argv = ["tracegym", "engine", "--model", args.model, "--port", str(port)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_process(argv, port=port, log_path=Path(tmp) / "e.log") as eng,
        httpx.Client(base_url=eng.base_url, timeout=600) as client,
    ):
        one(client, 0, 4)  # warm-up
        seq = measure(client, args.requests, args.tokens, concurrent_=False)
        par = measure(client, args.requests, args.tokens, concurrent_=True)
        stats = client.get("/server_info").json()["internal_states"][0]
    print(f"model={args.model} dtype={args.dtype or 'default'} requests={args.requests} tokens={args.tokens}")
    print(f"one at a time : {seq:8.1f} tok/s")
    print(f"all at once   : {par:8.1f} tok/s   (max batch seen {stats['max_batch_size_seen']})")
    print(f"ratio         : {par / seq:8.2f}x")


if __name__ == "__main__":
    main()
