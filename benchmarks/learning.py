"""The product against the bare GRPO loop on the quickstart task, side by side in one invocation.

    python -m benchmarks.learning [--steps 24] [--eval-every 6] [--target 0.6] [--lora]
                                  [--only bare|product] [--out results.json]

Both sides use SmolLM2-135M-Instruct (``tracegym models prepare smollm2-135m``), examples/quickstart's
train and held-out tasks with the same task order (``data.shuffle_seed``, reshuffled per epoch as the
trainer does), 8 prompts × 4 samples per step at T=1.0 (top_p 1, no top_k), up to 24 new tokens, the
"last number" reward, GRPO advantages ``(r − mean) / (std + 1e-4)`` per group with all-equal groups
dropped, the token-mean ``−A·log p`` loss (the product's PPO-clip with one update per batch has ratio 1:
the same gradient), AdamW (lr 1e-5; with ``--lora`` rank 16, alpha 32, lr 1e-4 as
examples/quickstart/recipe-lora.yaml), grad clip 1.0, and the compute dtype the trainer picks on this
CPU (bf16 autocast only where it is faster, ``modelfiles.load.cpu_compute_dtype``). Held-out reward:
64 tasks × 2 samples at T=1.0 before the first step and every ``--eval-every`` steps.

(a) bare: one process — transformers ``generate`` (left padding, KV cache), the loss, backward, AdamW;
    no HTTP, no store, no runner, no swap.
(b) product: ``tracegym train`` on a copy of the quickstart recipe with the same steps and evaluation
    interval (embedded engine, SQLite store, runner, one trainer worker, a weight swap per step); its
    per-step times come from the run's metrics.jsonl (``gen_s``, ``train_s``, ``swap_s``, ``step_s``).

Time to the target: the sum of step times up to the first evaluation at or above ``--target`` (evaluations and
start-up left out on both sides, and reported apart); and, which a short run always has, the time to the bare
loop's best held-out reward (its highest once training began, against the product's first evaluation at or
above it). Ratio = product / bare; the target is ≤ 1.1, per 1,000 trained tokens too. The sides run one after
the other (a side alone on the two cores); noise on a shared machine hits whichever runs then, so compare
per-step medians as well as totals. Training time is also given per 1,000 tokens of the sequences trained: a
step trains only the groups whose rewards differ, so the two sides' steps train different amounts; per 1,000
padded tokens (rows × the longest row: what the forward and backward ran), the same work whatever the lengths
of the rows; after each side's first training step (a process's first step pays its warm-up: the product's
trainer is a process of its own that has run nothing before it, where the bare loop's process has run its
generation and evaluation); and in CPU seconds of the training process per 1,000 tokens (the bare loop's
``process_time``, the product's ``worker_cpu_s``: the ``tracegym train`` process with its in-process worker),
steadier than wall time on a shared machine. Also per step after the first: the page faults and system seconds
of the training process (memory faulted in again, ``modelfiles.cpu_memory``). Each side's trained batch shape
(rows, micro-batches, padded against real tokens) and the 1-minute load as it began and ended are recorded
with it."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart"
NUMBER = re.compile(r"-?\d+")
PROMPTS, GROUP, MAX_NEW, EVAL_SAMPLES = 8, 4, 24, 2


def last_number_reward(text: str, answer: int) -> float:
    numbers = NUMBER.findall(text or "")
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["input"] for line in path.read_text().splitlines() if line.strip()]


class TaskOrder:
    """The trainer's draw order (``trainer/run/loop.py``): shuffled with ``shuffle_seed``, reshuffled with the
    same generator at each new epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.order = list(range(n))
        self.rng.shuffle(self.order)
        self.pos = 0

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.pos >= len(self.order):
                self.pos = 0
                self.rng.shuffle(self.order)
            out.append(self.order[self.pos])
            self.pos += 1
        return out


# ------------------------------------------------------------------------------------------ bare loop


class Bare:
    def __init__(self, model_dir: Path, lora: bool, seed: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tracegym.modelfiles.load import cpu_compute_dtype

        torch.manual_seed(seed)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora:
            from peft import LoraConfig, get_peft_model

            from tracegym.trainer.workers.lora import default_targets

            targets = list(default_targets(str(model.config.model_type)))  # the trainer's own default
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4 if lora else 1e-5, weight_decay=0.0)
        self.params = params
        self.bf16 = cpu_compute_dtype(torch.bfloat16) is torch.bfloat16
        self.eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                       else [model.generation_config.eos_token_id])
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 2

    def _autocast(self) -> Any:
        return self.torch.autocast("cpu", dtype=self.torch.bfloat16) if self.bf16 else nullcontext()

    def prompt_ids(self, question: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def sample(self, prompts: list[list[int]]) -> list[list[int]]:
        """One sampled completion per prompt (its ids up to and including the first EOS)."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.model.eval()
        with torch.no_grad(), self._autocast():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                      top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, pad_token_id=self.pad)
        completions = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            completions.append(row[:cut])
        return completions

    def rewards(self, completions: list[list[int]], answers: list[int]) -> list[float]:
        return [last_number_reward(self.tok.decode(c, skip_special_tokens=True), a)
                for c, a in zip(completions, answers, strict=True)]

    def train(self, prompts: list[list[int]], completions: list[list[int]], adv: list[float]) -> dict[str, float]:
        """One update on the sequences with a non-zero advantage: their tokens, loss tokens, rows and padded
        tokens (rows x the longest row: one forward, so one micro-batch)."""
        torch = self.torch
        keep = [i for i, a in enumerate(adv) if a != 0.0 and completions[i]]
        if not keep:
            return dict.fromkeys(("tokens", "loss_tokens", "sequences", "padded_tokens", "micro_batches"), 0.0)
        seqs = [prompts[i] + completions[i] for i in keep]
        width = max(len(s) for s in seqs)
        k = max(len(completions[i]) for i in keep) + 1
        ids = torch.tensor([[self.pad] * (width - len(s)) + s for s in seqs])
        attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        target = ids[:, width - k + 1:]
        cmask = torch.zeros_like(target, dtype=torch.float32)
        for row, i in enumerate(keep):
            cmask[row, k - 1 - len(completions[i]):] = 1.0
        a = torch.tensor([adv[i] for i in keep]).unsqueeze(1)
        self.model.train()
        with self._autocast():
            logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=k).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        loss = -(a * logp * cmask).sum() / cmask.sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return {"tokens": sum(len(q) for q in seqs), "loss_tokens": int(cmask.sum().item()), "sequences": len(seqs),
                "padded_tokens": len(seqs) * width, "micro_batches": 1.0}

    def evaluate(self, tasks: list[dict[str, Any]]) -> float:
        prompts = [self.prompt_ids(t["question"]) for t in tasks for _ in range(EVAL_SAMPLES)]
        answers = [t["answer"] for t in tasks for _ in range(EVAL_SAMPLES)]
        rewards: list[float] = []
        for i in range(0, len(prompts), 64):
            rewards += self.rewards(self.sample(prompts[i:i + 64]), answers[i:i + 64])
        return statistics.fmean(rewards)


def grpo(rewards: list[float]) -> list[float]:
    """Per group of GROUP: (r − mean) / (std + 1e-4); an all-equal group gets 0 (dropped)."""
    out = []
    for g in range(0, len(rewards), GROUP):
        r = rewards[g:g + GROUP]
        if len(set(r)) == 1:
            out += [0.0] * len(r)
            continue
        m, s = statistics.fmean(r), statistics.stdev(r)
        out += [(x - m) / (s + 1e-4) for x in r]
    return out


def run_bare(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    train = read_jsonl(QUICKSTART / "train.jsonl")
    held = read_jsonl(QUICKSTART / "eval.jsonl")
    bare = Bare(model_dir, args.lora, args.seed)
    startup = time.monotonic() - t0
    order = TaskOrder(len(train), args.seed)
    steps: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []

    def evaluate(step: int) -> None:
        te = time.monotonic()
        evals.append({"step": step, "reward": bare.evaluate(held), "eval_s": time.monotonic() - te})
        print(f"  bare eval @ {step}: {evals[-1]['reward']:.3f} ({evals[-1]['eval_s']:.0f} s)", flush=True)

    evaluate(0)
    for step in range(1, args.steps + 1):
        tasks = [train[i] for i in order.take(PROMPTS)]
        prompts = [bare.prompt_ids(t["question"]) for t in tasks for _ in range(GROUP)]
        answers = [t["answer"] for t in tasks for _ in range(GROUP)]
        tg = time.monotonic()
        completions = bare.sample(prompts)
        rewards = bare.rewards(completions, answers)
        gen_s = time.monotonic() - tg
        tt, ct, ru0 = time.monotonic(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        shape = bare.train(prompts, completions, grpo(rewards))
        train_s, cpu_s, ru = time.monotonic() - tt, time.process_time() - ct, resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"step": step, "gen_s": gen_s, "train_s": train_s, "swap_s": 0.0,
                      "step_s": gen_s + train_s, "reward": statistics.fmean(rewards), "cpu_s": cpu_s,
                      "sys_s": ru.ru_stime - ru0.ru_stime, "page_faults": float(ru.ru_minflt - ru0.ru_minflt), **shape})
        print(f"  bare step {step}: gen {gen_s:.1f} s, train {train_s:.1f} s, {cpu_s:.1f} CPU s "
              f"({shape['tokens']:.0f} tokens, {shape['sequences']:.0f} x {shape['padded_tokens'] / max(shape['sequences'], 1):.0f}"
              f" padded), reward {steps[-1]['reward']:.2f}", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    return {"startup_s": startup, "steps": steps, "evals": evals, "bf16": bare.bf16}


# ------------------------------------------------------------------------------------------ product


def run_product(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tracegym-learning-"))
    try:
        for name in ("agent.py", "train.jsonl", "eval.jsonl"):
            shutil.copy(QUICKSTART / name, work / name)
        recipe = (QUICKSTART / ("recipe-lora.yaml" if args.lora else "recipe.yaml")).read_text()
        recipe = re.sub(r"(?m)^steps: .*$", f"steps: {args.steps}", recipe)
        recipe = re.sub(r"(?m)^eval_interval: .*$", f"eval_interval: {args.eval_every}", recipe)
        recipe += f"seed: {args.seed}\n" if not re.search(r"(?m)^seed:", recipe) else ""
        (work / "recipe.yaml").write_text(recipe)
        t0, wall0 = time.monotonic(), time.time()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (work / "train.log").open("w") as log:
            exe = Path(sys.executable).parent / "tracegym"  # this interpreter's, else the one on PATH
            cli = str(exe) if exe.exists() else shutil.which("tracegym") or "tracegym"
            proc = subprocess.run([cli, "train", "recipe.yaml"], cwd=work, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, check=False)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"tracegym train failed ({proc.returncode}):\n" + (work / "train.log").read_text()[-4000:])
        [metrics] = {m.resolve() for m in work.glob("runs/*/*/metrics.jsonl")}  # runs/<name>/latest links too
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        keys = ("gen_s", "train_s", "swap_s", "swap_save_s", "swap_update_s", "step_s", "tokens", "loss_tokens",
                "sequences", "padded_tokens", "micro_batches")
        # cpu_s: the trainer process's CPU time in its step (an in-process worker: the whole `tracegym train`
        # process, so it counts as the bare loop's process_time does)
        steps = [{"step": r["step"], **{k: float(r.get(k, 0.0)) for k in keys},
                  "cpu_s": float(r.get("worker_cpu_s", 0.0)), "sys_s": float(r.get("worker_sys_s", 0.0)),
                  "page_faults": float(r.get("worker_page_faults", 0.0)), "reward": float(r.get("reward_mean", 0.0))}
                 for r in rows if r["kind"] == "train"]
        evals = [{"step": r["step"], "reward": float(r["reward_mean"]), "eval_s": float(r["eval_s"])}
                 for r in rows if r["kind"] == "eval"]
        first = min(rows, key=lambda r: r["time"])  # the evaluation before step 1
        startup = first["time"] - float(first.get("eval_s", 0.0)) - wall0
        return {"startup_s": startup, "steps": steps, "evals": evals, "wall_s": wall}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"  product run kept in {work}")


# ------------------------------------------------------------------------------------------ report


def time_to(side: dict[str, Any], target: float, from_step: int = 0) -> float | None:
    """Step seconds up to the first evaluation at or above ``target`` (None: never reached), counting the
    evaluations from step ``from_step`` on."""
    for ev in side["evals"]:
        if ev["step"] >= from_step and ev["reward"] >= target:
            return sum(s["step_s"] for s in side["steps"] if s["step"] <= ev["step"])
    return None


def best_eval(side: dict[str, Any]) -> dict[str, Any] | None:
    """The side's highest held-out reward after training began (the earliest evaluation of it), or None."""
    trained = [e for e in side["evals"] if e["step"] > 0]
    return max(trained, key=lambda e: (e["reward"], -e["step"])) if trained else None


def time_to_best(bare: dict[str, Any], product: dict[str, Any]) -> tuple[float, float | None, dict[str, Any]] | None:
    """Step seconds to the bare loop's best held-out reward, the bare loop's and the product's (None: the
    product never reached it), and that evaluation; None when the bare loop was never evaluated after a step.
    Evaluations before the first step (the same weights on both sides) do not count. Unlike a fixed
    ``--target``, a short run reaches it on one side at least."""
    best = best_eval(bare)
    if best is None:
        return None
    bare_s = time_to(bare, best["reward"], from_step=1)
    assert bare_s is not None, "the best is one of the bare loop's evaluations"
    return bare_s, time_to(product, best["reward"], from_step=1), best


def train_s_per_1k_tokens(steps: list[dict[str, Any]], key: str = "train_s",
                          tokens_key: str = "tokens") -> float | None:
    """Training seconds (``key``: wall ``train_s``, or the training process's CPU ``cpu_s``) per 1,000 tokens
    of the sequences trained (``tokens_key``: their real ``tokens``, or the ``padded_tokens`` the forward and
    backward ran: rows × the longest row), over all steps that trained. The sides train different numbers
    of sequences per step (only groups whose rewards differ carry a signal, and that depends on what each
    side sampled), so their median training step times alone do not compare; nor do their rows' lengths,
    so that the same work per padded token is more per real token on the side whose rows differ more in
    length. CPU seconds are steadier than wall seconds when other work shares the machine."""
    tokens = sum(s.get(tokens_key, 0.0) for s in steps)
    return 1000 * sum(s.get(key, 0.0) for s in steps if s.get("tokens", 0.0) > 0) / tokens if tokens else None


def _median_after_first(trained: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the training steps after the first (None: one step or none)."""
    return statistics.median(s.get(key, 0.0) for s in trained[1:]) if len(trained) > 1 else None


def summary(name: str, side: dict[str, Any], target: float) -> dict[str, Any]:
    steps = side["steps"]
    trained = [s for s in steps if s.get("tokens", 0.0) > 0]
    med = {k: statistics.median(s[k] for s in steps) for k in ("gen_s", "train_s", "swap_s", "step_s")}
    return {"side": name, **{f"median_{k}": v for k, v in med.items()}, "steps": len(steps),
            "train_s_per_1k_tokens": train_s_per_1k_tokens(steps),
            "cpu_s_per_1k_tokens": train_s_per_1k_tokens(steps, "cpu_s"),
            "train_s_per_1k_padded": train_s_per_1k_tokens(steps, tokens_key="padded_tokens"),
            "cpu_s_per_1k_padded": train_s_per_1k_tokens(steps, "cpu_s", "padded_tokens"),
            # the first training step of a process pays its warm-up (memory first touched, kernels first built)
            "first_train": (trained[0]["train_s"], trained[0].get("padded_tokens", 0.0)) if trained else None,
            "train_s_per_1k_tokens_after_first": train_s_per_1k_tokens(trained[1:]),
            "train_s_per_1k_padded_after_first": train_s_per_1k_tokens(trained[1:], tokens_key="padded_tokens"),
            # the kernel's part of a training step after the first: memory faulted in again (modelfiles.cpu_memory)
            "page_faults_after_first": _median_after_first(trained, "page_faults"),
            "sys_s_after_first": _median_after_first(trained, "sys_s"),
            # a weight swap: the trainer writing the weights, then the gateway's swap (pause, load, continue)
            "median_swap_save_s": statistics.median(s.get("swap_save_s", 0.0) for s in steps),
            "median_swap_update_s": statistics.median(s.get("swap_update_s", 0.0) for s in steps),
            "tokens_per_step": statistics.fmean(s.get("tokens", 0.0) for s in steps),
            "padding": (sum(s.get("padded_tokens", 0.0) for s in steps) / max(sum(s.get("tokens", 0.0) for s in steps), 1)),
            "rows_per_step": statistics.fmean(s.get("sequences", 0.0) for s in trained) if trained else 0.0,
            "micro_batches_per_step": statistics.fmean(s.get("micro_batches", 0.0) for s in trained) if trained else 0.0,
            "load": side.get("load"),
            "startup_s": side["startup_s"], "eval_s": sum(e["eval_s"] for e in side["evals"]),
            "held_out": [(e["step"], round(e["reward"], 3)) for e in side["evals"]],
            "time_to_target_s": time_to(side, target)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=6)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="LoRA on both sides (recipe-lora.yaml's settings)")
    p.add_argument("--only", choices=("bare", "product"), default=None)
    p.add_argument("--keep", action="store_true", help="keep the product's run directory")
    p.add_argument("--out", type=Path, default=None, help="write both sides' rows as JSON")
    args = p.parse_args(argv)

    from benchmarks.machine import describe
    from tracegym.modelfiles.load import CPU_BF16_ENV, decide_cpu_bf16
    from tracegym.modelfiles.prepare import prepare_model

    print(describe(), flush=True)
    decide_cpu_bf16()  # both sides (and the product's engine and trainer) compute in one dtype
    print(f"compute dtype on this CPU: {'bf16' if os.environ.get(CPU_BF16_ENV) == 'fast' else 'fp32'}", flush=True)
    model_dir = prepare_model("smollm2-135m")
    sides: dict[str, dict[str, Any]] = {}
    for name in ("bare", "product"):
        if args.only in (None, name):
            print(f"== {name}{' (LoRA)' if args.lora else ''}: {args.steps} steps, held-out every "
                  f"{args.eval_every}", flush=True)
            load0 = os.getloadavg()[0]
            sides[name] = run_bare(model_dir, args) if name == "bare" else run_product(args)
            sides[name]["load"] = (round(load0, 1), round(os.getloadavg()[0], 1))  # 1-min load as it began, ended
            if args.out:  # each side as it ends: a failure in the next one keeps this one's rows
                args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "sides": sides},
                                               indent=1, default=str))
    rows = [summary(n, s, args.target) for n, s in sides.items()]
    print(f"\n{'side':8} {'gen s':>6} {'train s':>8} {'s/1k tok':>8} {'tok/step':>8} {'swap s':>7} {'step s':>7} "
          f"{'start s':>8} {'eval s':>7} {'to ' + str(args.target):>9}  held-out (step, reward)")
    for r in rows:
        reach = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "never"
        per_1k = f"{r['train_s_per_1k_tokens']:.3f}" if r["train_s_per_1k_tokens"] is not None else "-"
        print(f"{r['side']:8} {r['median_gen_s']:6.2f} {r['median_train_s']:8.2f} {per_1k:>8} "
              f"{r['tokens_per_step']:8.0f} {r['median_swap_s']:7.2f} {r['median_step_s']:7.2f} "
              f"{r['startup_s']:8.0f} {r['eval_s']:7.0f} {reach:>9}  {r['held_out']}")
    for r in rows:
        if r["median_swap_s"]:
            print(f"{r['side']}: a weight swap {r['median_swap_s']:.2f} s (medians): writing the weights "
                  f"{r['median_swap_save_s']:.2f} s, the gateway's swap {r['median_swap_update_s']:.2f} s")
    if len(rows) == 2:
        b, q = rows
        print(f"product / bare, median step time: {q['median_step_s'] / b['median_step_s']:.2f}x "
              f"(generation {q['median_gen_s'] / b['median_gen_s']:.2f}x, "
              f"training {q['median_train_s'] / b['median_train_s']:.2f}x)")
        if b["train_s_per_1k_tokens"] and q["train_s_per_1k_tokens"]:
            print(f"product / bare, training seconds per 1,000 tokens trained: "
                  f"{q['train_s_per_1k_tokens'] / b['train_s_per_1k_tokens']:.2f}x "
                  f"({q['tokens_per_step']:.0f} vs {b['tokens_per_step']:.0f} tokens per step)")
        if b["cpu_s_per_1k_tokens"] and q["cpu_s_per_1k_tokens"]:
            print(f"product / bare, training CPU seconds per 1,000 tokens trained: "
                  f"{q['cpu_s_per_1k_tokens'] / b['cpu_s_per_1k_tokens']:.2f}x "
                  f"({q['cpu_s_per_1k_tokens']:.2f} vs {b['cpu_s_per_1k_tokens']:.2f})")

        def ratio(key: str) -> str:
            return f"{q[key] / b[key]:.2f}x" if q[key] and b[key] else "-"

        print(f"product / bare, per 1,000 padded tokens (rows x the longest row, what the forward ran): "
              f"training seconds {ratio('train_s_per_1k_padded')}, CPU seconds {ratio('cpu_s_per_1k_padded')}")
        if b["first_train"] and q["first_train"]:
            print(f"first training step, product vs bare: {q['first_train'][0]:.2f} s for {q['first_train'][1]:.0f} "
                  f"padded tokens vs {b['first_train'][0]:.2f} s for {b['first_train'][1]:.0f}; after it, per 1,000 "
                  f"tokens trained {ratio('train_s_per_1k_tokens_after_first')}, "
                  f"per 1,000 padded {ratio('train_s_per_1k_padded_after_first')}")
        if q["page_faults_after_first"] is not None and b["page_faults_after_first"] is not None:
            print(f"a training step after the first, product vs bare (medians): {q['page_faults_after_first']:,.0f} vs "
                  f"{b['page_faults_after_first']:,.0f} page faults, {q['sys_s_after_first']:.2f} vs "
                  f"{b['sys_s_after_first']:.2f} s of system time")
        print(f"trained batch shape, product vs bare: {q['rows_per_step']:.1f} vs {b['rows_per_step']:.1f} rows, "
              f"{q['micro_batches_per_step']:.1f} vs {b['micro_batches_per_step']:.1f} micro-batches per step; "
              f"padded / real tokens {q['padding']:.2f} vs {b['padding']:.2f}; load {q['load']} vs {b['load']}")
        if b["time_to_target_s"] and q["time_to_target_s"]:
            print(f"product / bare, time to held-out {args.target}: "
                  f"{q['time_to_target_s'] / b['time_to_target_s']:.2f}x (target <= 1.1)")
        to_best = time_to_best(sides["bare"], sides["product"])
        if to_best is not None:
            tb, tq, best = to_best
            head = f"time to the bare loop's best held-out reward ({best['reward']:.3f}, its step {best['step']})"
            if tq is None:
                print(f"product / bare, {head}: the product never reached it ({tb:.0f} s for the bare loop)")
            elif tb:
                print(f"product / bare, {head}: {tq / tb:.2f}x ({tq:.0f} s vs {tb:.0f} s; target <= 1.1)")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "sides": sides,
                                        "summary": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
