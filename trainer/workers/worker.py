"""One trainer rank: ``TrainWorker`` holds an FSDP2 shard (or the whole model on one rank) and runs the
forward, backward and optimizer step on its part of the batch (``group.WorkerGroup`` drives the ranks).

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
import resource
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from tracegym.modelfiles.cpu_memory import keep_freed_memory
from tracegym.modelfiles.formats import write_weights_dir
from tracegym.modelfiles.load import cpu_compute_dtype, own_weights
from tracegym.trainer.algorithms.losses import entropy_from_logits, policy_loss
from tracegym.trainer.algorithms.objectives import distill_advantages, dpo_loss, sequence_logprobs, sft_loss
from tracegym.trainer.algorithms.optim import build_optimizer, set_lr
from tracegym.trainer.workers.batches import (
    TrainSample,
    add_loss_metrics,
    collate,
)
from tracegym.trainer.workers.fsdp import (
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
from tracegym.trainer.workers.lora import activate, apply_lora
from tracegym.trainer.workers.train_config import TrainConfig

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
        (``weights.distributed.init_distributed``)."""

    def address(self) -> tuple[str, int]:
        """This host's address and a free port, for the rank-0 rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> str:
        """Join the ranks' process group and load the model, the reference and the optimizer; the device type
        this rank trains on (``cpu``, ``cuda``)."""
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
        if self.device.type == "cpu":
            keep_freed_memory()  # each step reuses the last one's pages (modelfiles.cpu_memory)
        self.bf16_compute = self.device.type != "cpu" or cpu_compute_dtype(torch.bfloat16) is torch.bfloat16  # fast?
        self.model = self._load(trainable=True)
        # the adapters' parameters, found once: not a walk over the model's modules at every swap
        self.adapter_params = [(n, p) for n, p in self.model.named_parameters() if "lora_" in n] if cfg.lora else []
        # with LoRA the reference is the same model with its adapters disabled (``_reference``)
        self.ref_model = self._load(trainable=False) if cfg.needs_reference() and cfg.lora is None else None
        self.teacher = None
        if "distill" in cfg.objectives:
            if cfg.teacher_path is None:
                raise ValueError("objective distill needs TrainConfig.teacher_path")
            self.teacher = self._load(trainable=False, path=Path(cfg.teacher_path))
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        return self.device.type

    def _load(self, *, trainable: bool, path: Path | None = None) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path or self.model_path), dtype=torch.float32)
        model.to(self.device)
        if trainable and self.cfg.lora is None:  # weights the optimizer writes; a frozen model stays mapped
            own_weights(model)
        if trainable and self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train(trainable)
        model.requires_grad_(trainable)
        mp = torch.bfloat16 if self.cfg.optim.dtype == "bfloat16" and self.device.type == "cuda" else None
        if trainable and self.cfg.lora is not None:
            model.requires_grad_(False)
            with torch.random.fork_rng(devices=[]):  # every rank initialises the same adapters
                torch.manual_seed(self.cfg.seed)
                peft_model = apply_lora(model, self.cfg.lora)  # adapters trainable, base frozen
            shard_model(peft_model.get_base_model(), param_dtype=mp)  # frozen and adapter params alike
            return peft_model
        return shard_model(model, param_dtype=mp)

    def _reference(self, mb: Any, *, need: bool = False) -> torch.Tensor | None:
        """The reference's logprobs (for the KL penalty, or when ``need``: DPO): the frozen copy, or with
        LoRA this model with adapters disabled."""
        if self.ref_model is not None and (need or self.cfg.algorithm.kl_coef > 0):
            with torch.no_grad():
                return token_logprobs(self._forward(self.ref_model, mb), mb.targets)
        if self.cfg.lora is not None and (need or self.cfg.algorithm.kl_coef > 0):
            with torch.no_grad(), self.model.disable_adapter():
                return token_logprobs(self._forward(self.model, mb), mb.targets)
        return None

    def _autocast(self) -> AbstractContextManager[Any]:
        sharded_mp = self.device.type == "cuda" and is_distributed()
        if self.cfg.optim.dtype == "bfloat16" and not sharded_mp and self.bf16_compute:
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
        objective: str = "grpo",
    ) -> dict:
        """Run this rank's micro-batches (padded to ``n_micro``) and one optimizer step. Returns sums.
        ``adapter``: the LoRA adapter these samples train (only its parameters get gradients, so the
        step moves only it); ``advance=False`` keeps the step count (the other adapters of the same
        training step follow). ``objective``: the loss (``algorithms.objectives``)."""
        t0, c0, ru0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if adapter is not None:
            activate(self.model, adapter)
        lr = set_lr(self.optimizer, self.step, self.cfg.optim, self.cfg.total_steps)
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(
            ("loss", "tokens", "padded_tokens", "micro_batches", "loss_tokens", "mismatch", "entropy",
             "entropy_tokens", "nll"), 0.0
        )
        batches = micro + [[] for _ in range(n_micro - len(micro))]
        for i, samples in enumerate(batches):
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            mb = collate(samples, self.pad_id).to(self.device)
            logits = self._forward(self.model, mb)
            logprobs = token_logprobs(logits, mb.targets)
            loss, metrics = self._loss(objective, mb, logprobs, scales)
            loss.backward()
            m = mb.loss_mask.bool()
            with torch.no_grad():
                sums["mismatch"] += float((logprobs.detach() - mb.engine_logprobs)[m].abs().sum())
                sums["nll"] -= float(logprobs.detach()[m].sum())
                self._entropy_into(sums, logits, m)
            sums["loss"] += float(loss.detach())
            sums["tokens"] += mb.num_tokens
            if mb.num_tokens:  # not the dummy of a rank with fewer micro-batches
                sums["padded_tokens"] += mb.input_ids.numel()  # rows x the longest row: what the forward ran
                sums["micro_batches"] += 1
            add_loss_metrics(sums, metrics)
        grad_norm = float(
            full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip))
        )
        finite = bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += int(advance)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return sums | {
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped": float(not finite),
            "time": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
            # memory faulted in (freed and allocated again: modelfiles.cpu_memory) and the kernel's time
            "sys_s": ru.ru_stime - ru0.ru_stime,
            "page_faults": float(ru.ru_minflt - ru0.ru_minflt),
        }

    def _loss(self, objective: str, mb: Any, logprobs: torch.Tensor,
              scales: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective's loss of one micro-batch and its metrics (``algorithms.objectives``)."""
        token_scales = {k: v for k, v in scales.items() if k.startswith("loss_scale_")}
        if objective == "sft":
            return sft_loss(self.cfg.algorithm, logprobs, mb.loss_mask, **token_scales)
        if objective == "dpo":
            return self._dpo_loss(mb, logprobs, scales.get("num_pairs"))
        advantages = mb.advantages
        if objective == "distill":
            assert self.teacher is not None and self.cfg.distill is not None
            with torch.no_grad():
                teacher = token_logprobs(self._forward(self.teacher, mb), mb.targets)
            advantages = distill_advantages(teacher, mb.engine_logprobs, mb.loss_mask,
                                            reward_advantages=mb.advantages,
                                            reward_weight=self.cfg.distill.reward_weight)
        elif objective != "grpo":
            raise ValueError(f"unknown objective {objective!r}")
        return policy_loss(self.cfg.algorithm, logprobs, logprobs.detach(), advantages, mb.loss_mask,
                           ref_logprobs=self._reference(mb), engine_logprobs=mb.engine_logprobs, **token_scales)

    def _dpo_loss(self, mb: Any, logprobs: torch.Tensor, num_pairs: float | None) -> tuple[torch.Tensor, dict]:
        m = mb.loss_mask
        tokens = {"tokens": float(m.bool().sum()), "seqs": float(m.bool().any(-1).sum())}
        real = mb.pairs >= 0
        if not bool(real.any()):  # a padding micro-batch: a zero loss that still touches the graph
            return logprobs.sum() * 0.0, {"dpo_loss": 0.0, **tokens}
        ref = self._reference(mb, need=True)
        assert ref is not None
        seq, ref_seq = sequence_logprobs(logprobs, m), sequence_logprobs(ref, m)
        order = torch.argsort(mb.pairs * 2 + (~mb.chosen).long())  # c0, r0, c1, r1, ...
        order = order[real[order]]
        c, r = order[0::2], order[1::2]
        loss, metrics = dpo_loss(seq[c], seq[r], ref_seq[c], ref_seq[r], beta=self.cfg.dpo.beta,
                                 num_pairs=num_pairs)
        return loss, metrics | tokens

    def _entropy_into(self, sums: dict[str, float], logits: torch.Tensor, mask: torch.Tensor) -> None:
        where = mask.nonzero()
        n = min(self.cfg.entropy_tokens, where.shape[0])
        if n > 0:
            pick = where[torch.linspace(0, where.shape[0] - 1, n).round().long()]
            sums["entropy"] += float(entropy_from_logits(logits.detach()[pick[:, 0], pick[:, 1]]).sum())
            sums["entropy_tokens"] += n

    # ---------------------------------------------------------------- weights, checksums, checkpoints

    def save_weights(self, out_dir: str, dtype: str | None, reuse: str | None = None) -> str | None:
        """Gather the full weights (collective) and, on rank 0, write a loadable model directory (``reuse``:
        an older weights file to overwrite in place where it fits, ``formats.write_safetensors``)."""
        params = self.rank0_full_params()
        if params is None:
            return None
        to = getattr(torch, dtype) if dtype else None
        tensors = {k: (v.to(to) if to is not None else v) for k, v in params}
        return str(write_weights_dir(tensors, self.model_path, Path(out_dir), Path(reuse) if reuse else None))

    def save_adapters(self, out_root: str, dtype: str | None) -> dict[str, str] | None:
        """LoRA: every adapter as a PEFT directory under ``out_root`` (collective; ``lora.save_adapters``)."""
        from tracegym.trainer.workers.lora import save_adapters

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
        """Run ``fn(self, *args)`` on this rank (e.g. the distributed weight push, see ``weights.distributed``)."""
        return fn(self, *args)

    def close(self) -> None:
        if is_distributed():
            import torch.distributed as dist

            dist.destroy_process_group()
