"""Trainer workers: one ``TrainWorker`` per rank holding an FSDP2 shard, and ``WorkerGroup`` driving them.

Where this departs from PPO as written: one optimizer update per batch. The trainer does recompute the
old policy's logprobs, but in the same forward that carries the gradient (``old = logprobs.detach()``,
exact because the weights have not moved yet) rather than in a second, gradient-free pass; it is what
TIS is weighted against and what the ``mismatch`` metric (mean |Δlogprob| between the engine and the
trainer on sampled tokens) measures. A consequence: the importance ratio new/old is exactly 1 on every
token, so ``ppo_clip``, ``gspo`` and ``cispo`` all reduce to the policy gradient ``-A ∇log p`` (they
differ only through their aggregation), the clip settings have no effect and ``clip_frac`` is always 0.
Clipping starts to matter only once a batch gets several updates (PPO epochs / mini-batches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tracegym.trainer.batch import (
    TrainBatch,
    TrainSample,
    add_loss_metrics,
    collate,
    combine_metrics,
    plan_step,
)
from tracegym.trainer.fsdp import (
    full_tensor,
    init_distributed,
    is_distributed,
    iter_full_params,
    load_rng,
    load_sharded,
    save_rng,
    save_sharded,
    shard_model,
)
from tracegym.trainer.lora import activate, apply_lora, check_checkpoint_base, model_fingerprint
from tracegym.trainer.losses import entropy_from_logits, loss_scales, policy_loss
from tracegym.trainer.models import cpu_compute_dtype, recover_dir, replace_dir
from tracegym.trainer.optim import build_optimizer, set_lr
from tracegym.trainer.ray_cluster import RaySettings, check_fits, connect
from tracegym.trainer.train_config import TrainConfig
from tracegym.trainer.weight_sync import write_weights_dir

log = logging.getLogger(__name__)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per position, in fp32: ``[B, K, V]``, ``[B, K]`` → ``[B, K]``."""
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


class TrainWorker:
    """One rank. Create with the rank's coordinates, then ``setup(master_addr, master_port)``."""

    def __init__(self, model_path: str, cfg: TrainConfig, rank: int, world_size: int) -> None:
        self.model_path, self.cfg, self.rank, self.world_size = Path(model_path), cfg, rank, world_size
        self.step = 0
        self.weight_group: Any = None
        """Rank 0's process group with the inference engine, for distributed weight pushes
        (``weight_sync.init_distributed``)."""

    def address(self) -> tuple[str, int]:
        """This host's address and a free port, for the rank-0 rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> None:
        cfg = self.cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        init_distributed(self.rank, self.world_size, master_addr, master_port, backend)
        torch.manual_seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        self.bf16_compute = self.device.type != "cpu" or cpu_compute_dtype(torch.bfloat16) is torch.bfloat16  # fast?
        self.model = self._load(trainable=True)
        # the adapters' parameters, found once: a walk over the model's modules costs a swap ~5 ms (SmolLM2)
        self.adapter_params = [(n, p) for n, p in self.model.named_parameters() if "lora_" in n] if cfg.lora else []
        # with LoRA the reference is the same model with its adapters disabled (``_reference``)
        self.ref_model = self._load(trainable=False) if cfg.loss.kl_coef > 0 and cfg.lora is None else None
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.pad_id = int(self.model.config.pad_token_id or 0)

    def _load(self, *, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=torch.float32)
        model.to(self.device)
        if trainable and self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train(trainable)
        model.requires_grad_(trainable)
        mp = torch.bfloat16 if self.cfg.dtype == "bfloat16" and self.device.type == "cuda" else None
        if trainable and self.cfg.lora is not None:
            model.requires_grad_(False)
            with torch.random.fork_rng(devices=[]):  # every rank initialises the same adapters
                torch.manual_seed(self.cfg.seed)
                peft_model = apply_lora(model, self.cfg.lora)  # adapters trainable, base frozen
            shard_model(peft_model.get_base_model(), param_dtype=mp)  # frozen and adapter params alike
            return peft_model
        return shard_model(model, param_dtype=mp)

    def _reference(self, mb: Any) -> torch.Tensor | None:
        """The KL reference's logprobs: the frozen copy, or with LoRA this model with adapters disabled."""
        if self.ref_model is not None:
            with torch.no_grad():
                return token_logprobs(self._forward(self.ref_model, mb), mb.targets)
        if self.cfg.lora is not None and self.cfg.loss.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                return token_logprobs(self._forward(self.model, mb), mb.targets)
        return None

    def _autocast(self) -> AbstractContextManager[Any]:
        sharded_mp = self.device.type == "cuda" and is_distributed()
        if self.cfg.dtype == "bfloat16" and not sharded_mp and self.bf16_compute:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _forward(self, model: torch.nn.Module, mb: Any) -> torch.Tensor:
        with self._autocast():
            out = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                logits_to_keep=mb.logits_to_keep + 1,
                use_cache=False,
            )
        return out.logits[:, :-1]

    def train_step(
        self,
        micro: list[list[TrainSample]],
        n_micro: int,
        scales: dict[str, float],
        adapter: str | None = None,
        advance: bool = True,
    ) -> dict:
        """Run this rank's micro-batches (padded to ``n_micro``) and one optimizer step. Returns sums.
        ``adapter``: the LoRA adapter these samples train (only its parameters get gradients, so the
        step moves only it); ``advance=False`` keeps the step count (the other adapters of the same
        training step follow)."""
        t0, c0 = time.perf_counter(), time.process_time()
        if adapter is not None:
            activate(self.model, adapter)
        lr = set_lr(self.optimizer, self.step, self.cfg.optim)
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(
            ("loss", "tokens", "loss_tokens", "mismatch", "entropy", "entropy_tokens", "nll"), 0.0
        )
        batches = micro + [[] for _ in range(n_micro - len(micro))]
        for i, samples in enumerate(batches):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            mb = collate(samples, self.pad_id).to(self.device)
            logits = self._forward(self.model, mb)
            logprobs = token_logprobs(logits, mb.targets)
            ref = self._reference(mb)
            loss, metrics = policy_loss(
                self.cfg.loss,
                logprobs,
                logprobs.detach(),
                mb.advantages,
                mb.loss_mask,
                ref_logprobs=ref,
                engine_logprobs=mb.engine_logprobs,
                **scales,
            )
            loss.backward()
            m = mb.loss_mask.bool()
            with torch.no_grad():
                sums["mismatch"] += float((logprobs.detach() - mb.engine_logprobs)[m].abs().sum())
                sums["nll"] -= float(logprobs.detach()[m].sum())
                self._entropy_into(sums, logits, m)
            sums["loss"] += float(loss.detach())
            sums["tokens"] += mb.num_tokens
            add_loss_metrics(sums, metrics)
        grad_norm = float(
            full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip))
        )
        finite = bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += int(advance)
        return sums | {
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped": float(not finite),
            "time": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
        }

    def _entropy_into(self, sums: dict[str, float], logits: torch.Tensor, mask: torch.Tensor) -> None:
        where = mask.nonzero()
        n = min(self.cfg.entropy_tokens, where.shape[0])
        if n > 0:
            pick = where[torch.linspace(0, where.shape[0] - 1, n).round().long()]
            sums["entropy"] += float(entropy_from_logits(logits.detach()[pick[:, 0], pick[:, 1]]).sum())
            sums["entropy_tokens"] += n

    # ---------------------------------------------------------------- weights, checksums, checkpoints

    def save_weights(self, out_dir: str, dtype: str | None) -> str | None:
        """Gather the full weights (collective) and, on rank 0, write a loadable model directory."""
        params = self.rank0_full_params()
        if params is None:
            return None
        to = getattr(torch, dtype) if dtype else None
        tensors = {k: (v.to(to) if to is not None else v) for k, v in params}
        return str(write_weights_dir(tensors, self.model_path, Path(out_dir)))

    def save_adapters(self, out_root: str, dtype: str | None) -> dict[str, str] | None:
        """LoRA: every adapter as a PEFT directory under ``out_root`` (collective; ``lora.save_adapters``)."""
        from tracegym.trainer.lora import save_adapters

        return save_adapters(self, out_root, dtype)

    def rank0_full_params(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """On rank 0, the gathered full weights (lazily, one collective per parameter as it is consumed);
        on the other ranks None, after taking part in every gather (their copies are discarded)."""
        params = iter_full_params(self.model)
        if self.rank == 0:
            return params
        for _ in params:
            pass
        return None

    def param_specs(self) -> list[tuple[str, list[int]]]:
        """Every parameter's name and full (unsharded) shape, in ``rank0_full_params`` order, without a
        gather: what a distributed push announces before it broadcasts."""
        return [(name, list(p.shape)) for name, p in self.model.named_parameters()]

    def checksum(self) -> str:
        """sha256 over this rank's gathered full weights (names, shapes, fp32 bytes)."""
        h = hashlib.sha256()
        for name, t in iter_full_params(self.model):
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.float().contiguous().numpy().tobytes())
        return h.hexdigest()

    def save_checkpoint(self, d: str) -> None:
        save_sharded(self.model, self.optimizer, Path(d) / "dcp", frozen=self.cfg.lora is None)
        save_rng(Path(d) / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, d: str) -> int:
        load_sharded(self.model, self.optimizer, Path(d) / "dcp", frozen=self.cfg.lora is None)
        load_rng(Path(d) / f"rng_rank{self.rank}.pt")
        self.step = int(json.loads((Path(d) / "trainer_state.json").read_text())["step"])
        return self.step

    def get_step(self) -> int:
        return self.step

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(self, *args)`` on this rank (e.g. the distributed weight push, see ``weight_sync``)."""
        return fn(self, *args)

    def close(self) -> None:
        if is_distributed():
            import torch.distributed as dist

            dist.destroy_process_group()


class WorkerGroup:
    """``num_workers`` ranks as Ray actors, or one ``TrainWorker`` in this process (``use_ray=False``).

    ``TrainWorker`` is a plain class: with Ray it runs as one actor per rank (gloo on CPU, NCCL on GPU);
    without (only with ``num_workers=1``) the very same class runs in the calling process, so one worker
    needs no Ray at all (no cluster, no ``local_mode``). With one rank there is no process group and no
    sharding (``fsdp.shard_model``); everything else (batching, loss, clipping, AdamW, checkpoints,
    weight export) is the same code. ``ray_settings``: the cluster to start or join, and the CPUs and GPUs
    each actor reserves (``ray_cluster``)."""

    def __init__(
        self,
        model_path: Path,
        *,
        num_workers: int,
        train_cfg: TrainConfig,
        use_ray: bool = True,
        ray_settings: RaySettings | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not use_ray and num_workers != 1:
            raise ValueError(f"num_workers={num_workers} needs use_ray=True (in-process runs one worker)")
        self.cfg, self.world_size, self.use_ray, self._owns_ray = train_cfg, num_workers, use_ray, False
        self.model_path = Path(model_path)
        self._workers: list[Any] = []
        try:
            if use_ray:
                import ray

                rs = ray_settings or RaySettings()
                if not rs.gpus_per_worker and (train_cfg.device or "").startswith("cuda"):
                    rs = replace(rs, gpus_per_worker=1.0)  # a CUDA rank needs a GPU of its own
                self._owns_ray = connect(rs)
                check_fits(num_workers, rs, started_here=self._owns_ray)
                actor = ray.remote(num_cpus=rs.cpus_per_worker, num_gpus=rs.gpus_per_worker)(TrainWorker)
                for r in range(num_workers):  # appended one by one: a failure kills the ones made
                    self._workers.append(actor.remote(str(model_path), train_cfg, r, num_workers))
                addr, port = ray.get(self._workers[0].address.remote())
            else:
                self._workers = [TrainWorker(str(model_path), train_cfg, 0, 1)]
                addr, port = "127.0.0.1", 0
            self._call_all("setup", [(addr, port)] * num_workers)
        except BaseException:
            self.shutdown()  # the actors (and a Ray this group started) must not outlive a failed setup
            raise

    def _call_all(self, method: str, args: list[tuple[Any, ...]]) -> list[Any]:
        if not self.use_ray:
            return [getattr(w, method)(*a) for w, a in zip(self._workers, args, strict=True)]
        import ray

        return ray.get([getattr(w, method).remote(*a) for w, a in zip(self._workers, args, strict=True)])

    def _same(self, method: str, *args: Any) -> list[Any]:
        return self._call_all(method, [args] * self.world_size)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; metrics: loss, kl, clip_frac, entropy, mismatch, grad_norm, lr,
        tokens, tokens_per_s (plus the other ``policy_loss`` metrics).

        The batch is split across ranks by tokens and into micro-batches by token budget; every rank runs
        the same number of micro-batches (empty ones if it has fewer), each a forward with
        ``logits_to_keep`` covering only the loss tokens, ``policy_loss`` with global normalisers, and a
        backward; then gradient clipping and AdamW with the scheduled LR."""
        if not batch.samples:
            raise ValueError("empty batch")
        t0 = time.perf_counter()
        lora = self.cfg.lora
        if lora is None or not lora.per_agent:
            per_rank = self._rank_steps(batch.samples, None, advance=True)
            return combine_metrics(per_rank, time.perf_counter() - t0, self.world_size)
        # one adapter per agent: each adapter's own samples, loss normalisers and optimizer step
        by_adapter = {name: [s for s in batch.samples if s.adapter == name] for name in lora.names}
        todo = [(name, ss) for name, ss in by_adapter.items() if ss]
        if not todo:
            raise ValueError("no sample of the batch is routed to an adapter")
        every: list[dict[str, float]] = []
        extra: dict[str, float] = {}
        for i, (name, ss) in enumerate(todo):
            ts = time.perf_counter()
            per_rank = self._rank_steps(ss, name, advance=i == len(todo) - 1)
            m = combine_metrics(per_rank, time.perf_counter() - ts, self.world_size)
            extra |= {f"{k}/{name}": m[k] for k in ("loss", "grad_norm", "loss_tokens")}
            every += per_rank
        out = combine_metrics(every, time.perf_counter() - t0, self.world_size)
        out["grad_norm"] = max(extra[f"grad_norm/{n}"] for n, _ in todo)
        return out | extra

    def _rank_steps(self, samples: list[TrainSample], adapter: str | None, *, advance: bool) -> list[dict]:
        """One optimizer step on ``samples`` over every rank; the ranks' sums."""
        plan, n_micro = plan_step(
            [len(s.token_ids) for s in samples], self.world_size, self.cfg.micro_batch_tokens
        )
        scales = loss_scales(*(torch.tensor(s.loss_mask)[None] for s in samples), world_size=self.world_size)
        args = [([[samples[i] for i in g] for g in rank_plan], n_micro, scales, adapter, advance)
                for rank_plan in plan]
        return self._call_all("train_step", args)

    def save_weights(self, out_dir: Path, dtype: str | None = None) -> Path:
        """Gathered full weights → ``out_dir`` (safetensors + config + tokenizer files), written atomically."""
        paths = self._same("save_weights", str(out_dir), dtype)
        return Path(paths[0])

    def save_adapters(self, out_root: Path, dtype: str | None = None) -> dict[str, Path]:
        """LoRA runs: every adapter as a PEFT directory under ``out_root`` (``{name: path}``)."""
        paths = self._same("save_adapters", str(out_root), dtype)[0]
        return {name: Path(p) for name, p in paths.items()}

    def state_dict_checksum(self) -> list[str]:
        return self._same("checksum")

    def save_checkpoint(self, d: Path, extra: dict[str, Any] | None = None) -> Path:
        """Model, optimizer, step and RNG of every rank, plus ``extra`` (e.g. the data position), into
        ``d`` (written to a sibling temp dir, then swapped in with ``replace_dir``, so an interrupted save
        never loses the previous checkpoint)."""
        d = Path(d)
        tmp = d.parent / f".{d.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._same("save_checkpoint", str(tmp))
        state = {"step": self.step, "world_size": self.world_size, "extra": extra or {}}
        if self.cfg.lora is not None:  # checked on resume: adapters fit only the base they were trained on
            state["lora_base"] = model_fingerprint(self.model_path)
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        return replace_dir(tmp, d)

    def load_checkpoint(self, d: Path) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` directory; returns its ``extra`` (``step``, the optimizer steps, only
        where ``extra`` has none: the loop's step counts steps that had nothing to train on too). If a save
        was interrupted between its renames, the previous checkpoint is moved back first."""
        d = recover_dir(Path(d))
        if not (d / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{d} is not a trainer checkpoint (no trainer_state.json)")
        state = json.loads((d / "trainer_state.json").read_text())
        if self.cfg.lora is not None:
            check_checkpoint_base(state, d, self.model_path)
        self._same("load_checkpoint", str(d))
        return {"step": state["step"], **state["extra"]}

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by ``load_checkpoint``)."""
        return self._same("get_step")[0]

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every rank at once (for collectives such as the distributed weight
        push)."""
        return self._same("run", fn, *args)

    def shutdown(self) -> None:
        """Close every rank, kill the actors and stop a Ray this group started (a joined cluster is only
        disconnected from: ``ray_cluster.connect``); best effort (a dead or half-set-up actor does not
        keep the others, or Ray, alive). Safe to call twice."""
        workers, self._workers = self._workers, []
        try:
            if not self.use_ray:
                for w in workers:
                    _best_effort("closing the worker", w.close)
            elif workers:
                import ray

                refs = [_best_effort(f"closing rank {r}", w.close.remote) for r, w in enumerate(workers)]
                for r, (w, ref) in enumerate(zip(workers, refs, strict=True)):
                    if ref is not None:
                        _best_effort(f"closing rank {r}", ray.get, ref, timeout=60)
                    _best_effort(f"killing rank {r}", ray.kill, w)
        finally:
            if self._owns_ray:
                import ray

                self._owns_ray = False
                ray.shutdown()


def _best_effort(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or None (logged) if it raises: for cleanup that must go on."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        log.warning("%s failed: %s", what, e)
        return None
