"""A training run's first steps on a CPU: the micro-batch budget and torch's huge pages, side by side.

    python -m benchmarks.first_steps [--model smollm2-135m] [--rows 16] [--len 250] [--steps 4] [--rounds 2]

Each variant is a fresh process that trains with the product's trainer (``WorkerGroup``, one rank in process,
bf16 where this CPU runs it fast) ``--steps`` steps of one fixed batch (``--rows`` sequences of about ``--len``
tokens, a fifth of each sampled): its first steps touch their activations, gradients and AdamW state for the
first time, and on a virtual machine each fresh page is a fault the host serves. The variants:
``optim.micro_batch_tokens`` 4096 or 1024 (the CPU default), each with torch's allocator on 4 KB pages (its
default) and on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``: fewer faults, but each still a fresh
page the host serves). They alternate for ``--rounds``; prints each process's steps, then per variant the
medians of its first step, of its first two and of the later ones, and its peak resident memory, and each
against 4096 on 4 KB pages."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = {"4096, 4 KB pages": (4096, "0"), "4096, huge pages": (4096, "1"), "1024, 4 KB pages": (1024, "0"),
            "1024, huge pages": (1024, "1")}
BASE = "4096, 4 KB pages"


def child(args: argparse.Namespace) -> None:
    from benchmarks.trainer import make_batch
    from tracegym.modelfiles.prepare import prepare_model
    from tracegym.trainer.settings import OptimConfig
    from tracegym.trainer.workers.group import WorkerGroup
    from tracegym.trainer.workers.train_config import TrainConfig

    model_dir = prepare_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = make_batch(args.rows, args.len * 4 // 5, args.len // 5, vocab)
    optim = OptimConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, dtype="bfloat16")
    group = WorkerGroup(model_dir, num_workers=1, train_cfg=TrainConfig(optim=optim), use_ray=False)
    steps = []
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            m = group.train_step(batch)
            steps.append({"wall_s": time.perf_counter() - t0, "sys_s": m["worker_sys_s"],
                          "page_faults": m["worker_page_faults"], "micro_batches": m["micro_batches"]})
    finally:
        group.shutdown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"steps": steps, "peak_mb": peak, "bf16": os.environ.get("TRACEGYM_CPU_BF16")}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--len", type=int, default=250)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be 3 or more (the first two, then the later ones)")
    if args.child:
        child(args)
        return 0

    from benchmarks.machine import describe
    from tracegym.modelfiles.load import decide_cpu_bf16

    decide_cpu_bf16()  # once for every variant's process, as tracegym train decides for its trainer
    print(describe(), flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, (budget, thp) in VARIANTS.items():
            env = {**os.environ, "THP_MEM_ALLOC_ENABLE": thp}
            cmd = [sys.executable, "-m", "benchmarks.first_steps", "--child", "--model", args.model, "--rows",
                   str(args.rows), "--len", str(args.len), "--steps", str(args.steps), "--micro-batch-tokens",
                   str(budget)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"round {r + 1} {name:17}: " + "  ".join(
                f"{s['wall_s']:.1f} s ({s['sys_s']:.1f} sys, {s['page_faults'] / 1000:.0f}k faults)"
                for s in run["steps"]) + f"; {run['steps'][0]['micro_batches']:.0f} micro-batches, peak "
                f"{run['peak_mb']:,.0f} MB, bf16 {run['bf16']}", flush=True)
    med: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        med[name] = {
            "first": statistics.median(r["steps"][0]["wall_s"] for r in rs),
            "first_two": statistics.median(r["steps"][0]["wall_s"] + r["steps"][1]["wall_s"] for r in rs),
            "later": statistics.median(s["wall_s"] for r in rs for s in r["steps"][2:]),
            "peak_mb": statistics.median(r["peak_mb"] for r in rs),
        }
    base = med[BASE]
    for name, m in med.items():
        print(f"{name:17} medians: first step {m['first']:.1f} s ({m['first'] / base['first']:.2f}x), first two "
              f"{m['first_two']:.1f} s ({m['first_two'] / base['first_two']:.2f}x), later steps {m['later']:.1f} s "
              f"({m['later'] / base['later']:.2f}x), peak {m['peak_mb']:,.0f} MB ({m['peak_mb'] / base['peak_mb']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
