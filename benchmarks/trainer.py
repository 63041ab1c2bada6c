"""Trainer throughput against a bare PyTorch loop, and the cost of a weight swap, measured side by side.

    python -m benchmarks.trainer [--model tiny-random|smollm2-135m] [--steps 5] [--dtype bfloat16]
                                 [--ray] [--no-swap]

Throughput: the same model, the same batch (``--prompts`` × ``--group`` sequences of random tokens,
``--prompt-len`` prompt + ``--completion-len`` sampled tokens) and the same settings (AdamW, grad clip
1.0, bf16 autocast or fp32) for (a) a bare single-process loop — forward with ``logits_to_keep``,
token-mean ``-A·logprob``, backward, clip, AdamW — and (b) ``WorkerGroup(num_workers=1)`` in process
(``--ray``: also as one Ray actor). Steps alternate between the two so that machine noise hits both;
the report is median tokens/s and the ratio to the bare loop (target ≥ 0.85), both by wall time (median of
the per-step ratios) and by CPU time per step (``time.process_time`` of the process that trains; steadier
than wall time when other work shares the machine).

Swap: a real ``tracegym serve --engine embedded`` process (gateway + engine); ``DiskWeightSync.push``
(gather + write safetensors, then the gateway's swap: pause, ``/update_weights_from_disk``, continue)
a few times; median seconds of each part.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from tracegym.modelfiles.load import default_device
from tracegym.modelfiles.prepare import prepare_model
from tracegym.trainer.settings import OptimConfig, RayConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample
from tracegym.trainer.workers.group import WorkerGroup
from tracegym.trainer.workers.train_config import TrainConfig
from tracegym.trainer.workers.worker import token_logprobs


def make_batch(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> TrainBatch:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        p = prompt_len + rng.randint(-4, 4)
        c = max(2, completion_len + rng.randint(-completion_len // 2, completion_len // 2))
        ids = [rng.randint(3, vocab - 1) for _ in range(p + c)]
        samples.append(TrainSample(ids, [0] * p + [1] * c, [-1.0] * (p + c), 1.0 if i % 2 else -1.0))
    return TrainBatch(samples)


class BareLoop:
    """The yardstick: what a single-process script would do, no framework."""

    def __init__(self, model_dir: Path, batch: TrainBatch, dtype: str, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(default_device())  # where the worker trains too
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.dtype = dtype
        s = batch.samples
        length = max(len(x.token_ids) for x in s)
        self.ids = torch.zeros((len(s), length), dtype=torch.long)
        self.attn = torch.zeros_like(self.ids)
        mask = torch.zeros((len(s), length))
        for r, x in enumerate(s):
            self.ids[r, : len(x.token_ids)] = torch.from_numpy(x.token_ids)
            self.attn[r, : len(x.token_ids)] = 1
            mask[r, : len(x.token_ids)] = torch.from_numpy(x.loss_mask)
        first = min(int(x.loss_mask.argmax()) for x in s)  # each sample's first loss token
        self.keep = length - first
        self.targets = self.ids[:, first:]
        self.mask = mask[:, first:]
        self.adv = torch.tensor([x.advantage for x in s])[:, None]
        self.tokens = int(self.attn.sum())
        self.ids, self.attn, self.targets, self.mask, self.adv = (
            t.to(self.device) for t in (self.ids, self.attn, self.targets, self.mask, self.adv)
        )

    def step(self) -> float:
        t0 = time.perf_counter()
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.dtype == "bfloat16" else nullcontext()
        with ctx:
            logits = self.model(
                input_ids=self.ids, attention_mask=self.attn, logits_to_keep=self.keep + 1, use_cache=False
            ).logits[:, :-1]
        lp = token_logprobs(logits, self.targets)
        loss = -(self.adv * lp * self.mask).sum() / self.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self.tokens / (time.perf_counter() - t0)


def throughput(args: argparse.Namespace, model_dir: Path) -> None:
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = make_batch(args.prompts * args.group, args.prompt_len, args.completion_len, vocab)
    cfg = TrainConfig(optim=OptimConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, dtype=args.dtype))
    threads = torch.get_num_threads()
    print(
        f"model {args.model}, dtype {args.dtype}, batch {len(batch)} seqs, {batch.num_tokens} tokens "
        f"({batch.num_loss_tokens} sampled), micro_batch_tokens {args.micro_batch_tokens or 'default'}, torch threads {threads}"
    )
    bare = BareLoop(model_dir, batch, args.dtype, 1e-5)
    groups = {"workergroup": WorkerGroup(model_dir, num_workers=1, train_cfg=cfg, use_ray=False)}
    if args.ray:
        import ray

        ray.init(num_cpus=threads, include_dashboard=False, log_to_driver=False)
        groups["workergroup_ray"] = WorkerGroup(
            model_dir, num_workers=1, train_cfg=cfg, use_ray=True, ray_settings=RayConfig(cpus_per_worker=threads)
        )
    wall: dict[str, list[float]] = {k: [] for k in ["bare", *groups]}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    for i in range(args.steps + args.warmup):  # interleaved, so load changes hit every variant alike
        c0 = time.process_time()
        b = bare.step()
        if i >= args.warmup:
            wall["bare"].append(b)
            cpu["bare"].append(time.process_time() - c0)
        for name, g in groups.items():
            m = g.train_step(batch)
            if i >= args.warmup:
                wall[name].append(m["tokens_per_s"])
                cpu[name].append(m["worker_cpu_s"])
    for g in groups.values():
        g.shutdown()
    if args.ray:
        ray.shutdown()
    for name in wall:
        pair = statistics.median(w / b for w, b in zip(wall[name], wall["bare"], strict=True))
        cpu_ratio = statistics.median(cpu["bare"]) / statistics.median(cpu[name])
        print(
            f"  {name:16s} median {statistics.median(wall[name]):8.1f} tokens/s wall "
            f"(min {min(wall[name]):.1f}, max {max(wall[name]):.1f}); ratio to bare: {pair:.3f} wall "
            f"(median of step pairs), {cpu_ratio:.3f} by CPU time per step"
        )


def swap(args: argparse.Namespace, model_dir: Path) -> None:
    from tracegym.procs import free_port, start_process
    from tracegym.trainer.weights.disk import DiskWeightSync

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        gateway = start_process(
            ["tracegym", "serve", "--engine", "embedded", "--model", str(model_dir), "--port", str(port),
             "--store", "none", "--weights-dir", str(Path(tmp) / "weights")],
            port=port,
            log_path=Path(tmp) / "gateway.log",
            health_path="/healthz",
        )
        group = WorkerGroup(model_dir, num_workers=1, train_cfg=TrainConfig(optim=OptimConfig(dtype="float32")), use_ray=False)
        try:
            sync = DiskWeightSync(gateway.base_url, Path(tmp) / "weights", keep=2)
            results = [sync.push(group, str(v)) for v in range(1, args.swaps + 1)]
            sync.close()
        finally:
            group.shutdown()
            gateway.stop()
    med = {k: statistics.median(getattr(r, k) for r in results) for k in ("save_s", "update_s", "total_s")}
    print(
        f"swap ({args.swaps}×, disk): save {med['save_s']:.3f} s + gateway swap "
        f"{med['update_s']:.3f} s = {med['total_s']:.3f} s (median)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--completion-len", type=int, default=24)
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the trainer's (4096 on a GPU, "
                    "1024 on a CPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ray", action="store_true", help="also time one Ray actor")
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--no-swap", action="store_true")
    args = ap.parse_args()
    model_dir = prepare_model(args.model)
    throughput(args, model_dir)
    if not args.no_swap:
        swap(args, model_dir)


if __name__ == "__main__":
    main()
