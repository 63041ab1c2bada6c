"""A training process that keeps the memory it frees (``modelfiles.cpu_memory``) against glibc's defaults.

    python -m benchmarks.cpu_memory [--model smollm2-135m] [--rows 12] [--len 60] [--steps 6] [--idle 4]
                                    [--rounds 2]

Each side is a fresh process that loads the model in fp32 and runs ``--steps`` training steps of one fixed
batch (``--rows`` × ``--len`` tokens, the loss over the last 24 positions, backward, fused AdamW, gradients
set to None: the pattern of the trainer's step), idle ``--idle`` seconds between two steps as a trainer is
while the engine generates. (a) keep: ``keep_freed_memory()`` first; (b) default: glibc's malloc as it is
(``TRACEGYM_KEEP_FREED_MEMORY=0``). The sides alternate for ``--rounds``; prints, per side, the medians of
the steps after the first (page faults, system seconds, user seconds, wall seconds) and the first step's,
keep / default ratios of the medians, and each round's keep / default wall (the machine's speed drifts
between rounds; a round's two sides run back to back)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tracegym.modelfiles.cpu_memory import KEEP_FREED_MEMORY_ENV, keep_freed_memory
    from tracegym.modelfiles.prepare import prepare_model

    kept = keep_freed_memory()
    assert kept == (os.environ.get(KEEP_FREED_MEMORY_ENV) != "0"), "keep_freed_memory did not take effect"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(prepare_model(args.model), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, int(model.config.vocab_size), (args.rows, args.len))
    steps = []
    for step in range(args.steps):
        if step:
            time.sleep(args.idle)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        logits = model(input_ids=ids, logits_to_keep=25).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -24:].unsqueeze(-1))
        loss = -logp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, logp, loss
        r = resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"wall_s": time.perf_counter() - t0, "user_s": r.ru_utime - r0.ru_utime,
                      "sys_s": r.ru_stime - r0.ru_stime, "page_faults": r.ru_minflt - r0.ru_minflt})
    print(json.dumps(steps))


KEYS = ("page_faults", "sys_s", "user_s", "wall_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--len", type=int, default=60)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--idle", type=float, default=4.0, help="seconds between two steps")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from benchmarks.machine import describe

    print(describe(), flush=True)
    sides: dict[str, list[list[dict[str, float]]]] = {"keep": [], "default": []}
    for r in range(args.rounds):
        for name in sides:
            env = {**os.environ, "TRACEGYM_KEEP_FREED_MEMORY": "1" if name == "keep" else "0"}
            cmd = [sys.executable, "-m", "benchmarks.cpu_memory", "--child", "--model", args.model, "--rows",
                   str(args.rows), "--len", str(args.len), "--steps", str(args.steps), "--idle", str(args.idle)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            steps = json.loads(out.stdout.strip().splitlines()[-1])
            sides[name].append(steps)
            print(f"round {r + 1} {name:8}: " + "  ".join(
                f"{s['wall_s']:.2f} s ({s['sys_s']:.2f} sys, {s['page_faults'] / 1000:.0f}k faults)" for s in steps),
                flush=True)
    med: dict[str, dict[str, float]] = {}
    for name, runs in sides.items():
        later = [s for steps in runs for s in steps[1:]]
        first = [steps[0] for steps in runs]
        med[name] = {k: statistics.median(s[k] for s in later) for k in KEYS}
        print(f"{name:8} after the first step (medians): {med[name]['page_faults']:,.0f} page faults, "
              f"{med[name]['sys_s']:.2f} s system, {med[name]['user_s']:.2f} s user, {med[name]['wall_s']:.2f} s wall; "
              f"first step {statistics.median(s['wall_s'] for s in first):.2f} s wall, "
              f"{statistics.median(s['sys_s'] for s in first):.2f} s system")
    # the machine's speed drifts between rounds: each round's keep / default (its two sides ran back to back)
    per_round = [statistics.median(s["wall_s"] for s in k[1:]) / statistics.median(s["wall_s"] for s in d[1:])
                 for k, d in zip(sides["keep"], sides["default"], strict=True)]
    print("keep / default wall per round (medians after the first step): "
          + ", ".join(f"{x:.2f}x" for x in per_round) + f"; median {statistics.median(per_round):.2f}x")
    k, d = med["keep"], med["default"]
    ratio: dict[str, float | None] = {key: (k[key] / d[key] if d[key] else None) for key in ("sys_s", "user_s", "wall_s")}
    print("keep / default after the first step: " + ", ".join(
        f"{key} {v:.2f}x" if v is not None else f"{key} -" for key, v in ratio.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
