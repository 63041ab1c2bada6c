"""``WorkerGroup``: the trainer's ranks, as Ray actors placed on a cluster or one ``TrainWorker`` in this
process, driven together (step, checkpoint, weight export)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tracegym.modelfiles.folders import recover_dir, writing_folder
from tracegym.modelfiles.formats import model_fingerprint
from tracegym.trainer.algorithms.losses import loss_scales
from tracegym.trainer.settings import RayConfig
from tracegym.trainer.workers.batches import TrainBatch, TrainSample, combine_metrics, plan_pairs, plan_step
from tracegym.trainer.workers.lora import check_checkpoint_base
from tracegym.trainer.workers.ray_cluster import check_fits, connect, reserve, scheduling
from tracegym.trainer.workers.train_config import TrainConfig
from tracegym.trainer.workers.worker import TrainWorker

log = logging.getLogger(__name__)


class WorkerGroup:
    """``num_workers`` ranks as Ray actors, or one ``TrainWorker`` in this process (``use_ray=False``).

    ``TrainWorker`` is a plain class: with Ray it runs as one actor per rank (gloo on CPU, NCCL on GPU);
    without (only with ``num_workers=1``) the very same class runs in the calling process, so one worker
    needs no Ray at all (no cluster, no ``local_mode``). With one rank there is no process group and no
    sharding (``fsdp.shard_model``); everything else (batching, loss, clipping, AdamW, checkpoints,
    weight export) is the same code. ``ray_settings``: the cluster to start or join, the CPUs and GPUs
    each actor reserves, and whether the ranks are reserved together as a placement group (``ray_cluster``)."""

    def __init__(
        self,
        model_path: Path,
        *,
        num_workers: int,
        train_cfg: TrainConfig,
        use_ray: bool = True,
        ray_settings: RayConfig | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not use_ray and num_workers != 1:
            raise ValueError(f"num_workers={num_workers} needs use_ray=True (in-process runs one worker)")
        self.cfg, self.world_size, self.use_ray, self._owns_ray = train_cfg, num_workers, use_ray, False
        self.model_path = Path(model_path)
        self._workers: list[Any] = []
        self._placement: Any = None
        self.nodes: list[str] = []
        try:
            if use_ray:
                import ray

                rs = ray_settings or RayConfig()
                if not rs.gpus_per_worker and (train_cfg.device or "").startswith("cuda"):
                    rs = rs.model_copy(update={"gpus_per_worker": 1.0})  # a CUDA rank needs a GPU of its own
                self._owns_ray = connect(rs)
                check_fits(num_workers, rs, started_here=self._owns_ray)
                if rs.placement is not None:
                    self._placement = reserve(num_workers, rs)
                actor = ray.remote(num_cpus=rs.cpus_per_worker, num_gpus=rs.gpus_per_worker)(TrainWorker)
                for r in range(num_workers):  # appended one by one: a failure kills the ones made
                    opts = scheduling(self._placement, r)
                    self._workers.append(actor.options(**opts).remote(str(model_path), train_cfg, r, num_workers))
                addresses = ray.get([w.address.remote() for w in self._workers])
            else:
                self._workers = [TrainWorker(str(model_path), train_cfg, 0, 1)]
                addresses = [("127.0.0.1", 0)]
            self.nodes = [ip for ip, _ in addresses]
            """The address of each rank's node (Ray's node IP; 127.0.0.1 in-process), by rank."""
            addr, port = addresses[0]
            self.device_type: str = self._call_all("setup", [(addr, port)] * num_workers)[0]
            """What the ranks train on (``cpu``, ``cuda``): it sets the default micro-batch budget."""
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

    def train_step(self, batch: TrainBatch, objective: str = "grpo") -> dict[str, float]:
        """One optimizer step on ``batch``; metrics: loss, kl, clip_frac, entropy, mismatch, grad_norm, lr,
        tokens, tokens_per_s (plus the other ``policy_loss`` metrics).

        The batch is split across ranks by tokens and into micro-batches by token budget; every rank runs
        the same number of micro-batches (empty ones if it has fewer), each a forward with
        ``logits_to_keep`` covering only the loss tokens, ``policy_loss`` with global normalisers, and a
        backward; then gradient clipping and AdamW with the scheduled LR. ``objective``: the loss
        (``algorithms.objectives``); DPO keeps each pair in one micro-batch."""
        if not batch.samples:
            raise ValueError("empty batch")
        t0 = time.perf_counter()
        lora = self.cfg.lora
        if lora is None or not lora.per_agent:
            per_rank = self._rank_steps(batch.samples, None, advance=True, objective=objective)
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
            per_rank = self._rank_steps(ss, name, advance=i == len(todo) - 1, objective=objective)
            m = combine_metrics(per_rank, time.perf_counter() - ts, self.world_size)
            extra |= {f"{k}/{name}": m[k] for k in ("loss", "grad_norm", "loss_tokens")}
            every += per_rank
        out = combine_metrics(every, time.perf_counter() - t0, self.world_size)
        out["grad_norm"] = max(extra[f"grad_norm/{n}"] for n, _ in todo)
        return out | extra

    def _rank_steps(self, samples: list[TrainSample], adapter: str | None, *, advance: bool,
                    objective: str = "grpo") -> list[dict]:
        """One optimizer step on ``samples`` over every rank; the ranks' sums."""
        budget = self.cfg.optim.micro_batch_budget(self.device_type)
        if objective == "dpo":
            plan, n_micro = plan_pairs(samples, self.world_size, budget)
        else:
            plan, n_micro = plan_step([len(s.token_ids) for s in samples], self.world_size, budget)
        scales = loss_scales(*(torch.tensor(s.loss_mask)[None] for s in samples), world_size=self.world_size)
        if objective == "dpo":
            scales["num_pairs"] = max(len({s.pair for s in samples}), 1) / self.world_size
        args = [([[samples[i] for i in g] for g in rank_plan], n_micro, scales, adapter, advance, objective)
                for rank_plan in plan]
        return self._call_all("train_step", args)

    def save_weights(self, out_dir: Path, dtype: str | None = None, reuse: Path | None = None) -> Path:
        """Gathered full weights → ``out_dir`` (safetensors + config + tokenizer files), written atomically;
        ``reuse``: an older weights file to overwrite in place where it fits (``formats.write_safetensors``)."""
        paths = self._same("save_weights", str(out_dir), dtype, str(reuse) if reuse else None)
        return Path(paths[0])

    def save_adapters(self, out_root: Path, dtype: str | None = None) -> dict[str, Path]:
        """LoRA runs: every adapter as a PEFT directory under ``out_root`` (``{name: path}``)."""
        paths = self._same("save_adapters", str(out_root), dtype)[0]
        return {name: Path(p) for name, p in paths.items()}

    def state_dict_checksum(self) -> list[str]:
        return self._same("checksum")

    def save_checkpoint(self, d: Path, extra: dict[str, Any] | None = None) -> Path:
        """Model, optimizer, step and RNG of every rank, plus ``extra`` (e.g. the data position), into
        ``d`` (written to a sibling temp dir, then renamed into place (``writing_folder``), so an interrupted save
        never loses the previous checkpoint)."""
        with writing_folder(Path(d)) as tmp:
            self._same("save_checkpoint", str(tmp))
            state = {"step": self.step, "world_size": self.world_size, "extra": extra or {}}
            if self.cfg.lora is not None:  # checked on resume: adapters fit only the base they were trained on
                state["lora_base"] = model_fingerprint(self.model_path)
            (tmp / "trainer_state.json").write_text(json.dumps(state))
        return Path(d)

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
        """Close every rank, kill the actors, remove their placement group and stop a Ray this group
        started (a joined cluster is only disconnected from: ``ray_cluster.connect``); best effort (a dead
        or half-set-up actor does not keep the others, or Ray, alive). Safe to call twice."""
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
            if self._placement is not None:
                from ray.util.placement_group import remove_placement_group

                placement, self._placement = self._placement, None
                _best_effort("removing the placement group", remove_placement_group, placement)
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
