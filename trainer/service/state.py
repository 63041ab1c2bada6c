"""What the training service holds while it runs (owned by the app's lifespan): sessions, training runs,
samplers, futures, checkpoints and each base model's inference; and the operations the routes submit as
futures."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tracegym.trainer.service import steps
from tracegym.trainer.service.futures import FutureStore, UserFault
from tracegym.trainer.service.inference import BASE
from tracegym.trainer.service.models import BaseModel, InferenceByModel
from tracegym.trainer.service.ray_workers import check_room, rank_error
from tracegym.trainer.service.runs import Run
from tracegym.trainer.service.sampling import SampleAsk
from tracegym.trainer.service.wire import ForwardBackwardCall, SampleResult
from tracegym.trainer.settings import OptimConfig, RayConfig

CHECKPOINTS = "weights"
"""``tinker://RUN/weights/NAME``: a training state (our checkpoint: model, optimizer, step)."""
SAMPLER_WEIGHTS = "sampler_weights"
"""``tinker://RUN/sampler_weights/VERSION``: a published weight version."""
T = TypeVar("T")


@dataclass(slots=True)
class ServiceConfig:
    models: list[BaseModel]
    """The base models this service trains and samples (``--model``), the default first."""
    state_dir: Path
    admin_key: str | None = None
    torch_threads: int | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The workers' settings as the recipe's ``optim`` section (its ``dtype`` and ``micro_batch_tokens``; the
    learning rate and Adam's betas come with each ``optim_step``): master weights and AdamW state are fp32,
    ``bfloat16`` autocasts where this machine runs bf16 fast (``modelfiles.load.cpu_compute_dtype``)."""
    gap_timeout: float = 300.0
    ray: RayConfig | None = None
    """Each run's ranks as Ray actors on this cluster (the service connected at start: ``ray_workers``),
    with each rank's CPUs and GPUs; None: each run is one worker in the service's process."""
    num_workers: int = 1
    """Ranks per run (FSDP2 data parallel; more than one needs ``ray``)."""


@dataclass(slots=True)
class Sampler:
    sampler_id: str
    base_model: str
    """The base model whose engine it samples."""
    version: str
    """The weight version it samples (``BASE``: the base model as its engine started)."""
    run: Run | None
    """The run that published ``version`` (None: the base model's sampler)."""
    model_path: str | None
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str, kind: str) -> tuple[str, str]:
    """``(run, name)`` of ``tinker://RUN/KIND/NAME``; ``UserFault`` for anything else."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != kind or not all(p.strip(".") for p in parts):
        raise UserFault(f"path {path!r} is not tinker://RUN/{kind}/NAME")
    return parts[0], parts[2]


class ServiceState:
    def __init__(self, cfg: ServiceConfig, engines: InferenceByModel) -> None:
        if [m.name for m in cfg.models] != list(engines.by_model):
            raise ValueError(f"engines for {list(engines.by_model)}, models {[m.name for m in cfg.models]}")
        self.cfg, self.engines = cfg, engines
        self.models = {m.name: m for m in cfg.models}
        self.futures = FutureStore()
        self.sessions: set[str] = set()
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self._sampler_ids = itertools.count(1)
        self._placing = asyncio.Lock()
        """Held while a run's workers start: a Ray's free resources are checked, then taken, one run at a time."""

    # ---------------------------------------------------------------- sessions, runs

    def new_session(self) -> str:
        sid = f"s-{secrets.token_hex(6)}"
        self.sessions.add(sid)
        return sid

    def base_model(self, name: Any) -> BaseModel:
        """The served base model ``name`` (None: the default, the first ``--model``; ``UserFault`` naming the
        served ones for any other)."""
        if name is None:
            return self.cfg.models[0]
        name = str(name)
        if name not in self.models:
            raise UserFault(f"unknown base model {name!r}; this service trains: {', '.join(self.models)}")
        return self.models[name]

    def run(self, model_id: str) -> Run:
        try:
            return self.runs[model_id]
        except KeyError:
            known = ", ".join(self.runs) or "none"
            raise LookupError(f"unknown model_id {model_id!r} (training runs: {known})") from None

    async def create_run(self, model_id: str, base_model: str, lora: dict[str, Any] | None) -> Run:
        if model_id in self.runs:
            raise UserFault(f"model_id {model_id!r} exists already")
        model = self.base_model(base_model)
        rank = None if lora is None else int(lora["rank"])
        async with self._placing:
            if self.cfg.ray is not None:
                await asyncio.to_thread(check_room, self.cfg.num_workers, self.cfg.ray)
            group = await asyncio.to_thread(self._worker_group, model.model_dir, rank, lora)
        try:
            facts = (await on_workers(group.run_on_ranks, steps.model_facts))[0]
        except BaseException:
            await asyncio.to_thread(group.shutdown)
            raise
        run = Run(model_id, model.name, rank, group, model.model_dir, facts)
        self.runs[model_id] = run
        return run

    def _worker_group(self, model_dir: Path, rank: int | None, lora: dict[str, Any] | None) -> Any:
        from tracegym.trainer.settings import LoraConfig
        from tracegym.trainer.workers.group import WorkerGroup
        from tracegym.trainer.workers.train_config import TrainConfig

        lora_cfg = None
        if rank is not None:
            assert lora is not None
            lora_cfg = LoraConfig(rank=rank, target_modules=lora_targets(model_dir, lora))
        seed = {} if lora is None or lora.get("seed") is None else {"seed": int(lora["seed"])}
        cfg = TrainConfig(optim=self.cfg.optim, lora=lora_cfg, torch_threads=self.cfg.torch_threads,
                          entropy_tokens=0, **seed)
        return WorkerGroup(model_dir, num_workers=self.cfg.num_workers, train_cfg=cfg,
                           use_ray=self.cfg.ray is not None, ray_settings=self.cfg.ray)

    def keyed_runs(self) -> list[Run]:
        """The runs whose keys work: those with live workers, and those whose session finished while a weight
        version of theirs is kept (their key still works for their samplers and listings)."""
        runs = {r.model_id: r for r in self.runs.values()}
        for p in self.engines.published().values():
            runs.setdefault(p.run.model_id, p.run)
        return list(runs.values())

    async def release_run(self, run: Run) -> None:
        """Free a run's workers (its session finished); its published versions stay sampleable."""
        self.runs.pop(run.model_id, None)
        await asyncio.to_thread(run.group.shutdown)

    # ---------------------------------------------------------------- training operations

    def check_call(self, run: Run, call: ForwardBackwardCall) -> None:
        """Everything about a forward_backward that can be checked before it runs (``ValueError``)."""
        required = steps.check_loss(call.loss_fn, call.loss_fn_config)
        if not call.data:
            raise ValueError("forward_backward needs at least one datum")
        vocab, max_len = run.facts["vocab_size"], run.facts["max_length"]
        for i, d in enumerate(call.data):
            if max_len and len(d.tokens) + 1 > max_len:
                raise ValueError(f"data[{i}] has {len(d.tokens)} tokens; {run.base_model} takes at most "
                                 f"{max_len - 1} input tokens: truncate or split it")
            for name, ids in (("model_input", d.tokens), ("target_tokens", d.targets)):
                if ids.min() < 0 or ids.max() >= vocab:
                    raise ValueError(f"data[{i}].{name} holds token id {int(ids.max() if ids.max() >= vocab else ids.min())}"
                                     f" outside the vocabulary [0, {vocab})")
            missing = [k for k in required if k not in d.inputs]
            if missing:
                raise ValueError(f"data[{i}].loss_fn_inputs lacks {missing} (loss_fn {call.loss_fn!r} needs "
                                 f"target_tokens, {', '.join(required)})")

    async def forward_backward(self, run: Run, call: ForwardBackwardCall) -> tuple[list, dict[str, float]]:
        fn = steps.forward if call.forward_only else steps.forward_backward
        out = await on_workers(run.group.run_on_ranks, fn, call.data, call.loss_fn, call.loss_fn_config)
        return steps.merge_ranks(out)

    async def optim_step(self, run: Run, adam: dict[str, float]) -> dict[str, float]:
        try:
            out = await on_workers(run.group.run_on_ranks, steps.optim_step, adam)
        except steps.NoGradientsError as e:
            raise UserFault(str(e)) from None
        return out[0]

    async def save_state(self, run: Run, name: str | None) -> str:
        name = name or f"step-{await on_workers(lambda: run.group.step):06d}"
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise UserFault(f"checkpoint name {name!r} must be letters, digits, '-', '_' and '.'")
        d = self.cfg.state_dir / "checkpoints" / run.safe_id / name
        extra = {"base_model": run.base_model, "lora_rank": run.lora_rank, "model_id": run.model_id}
        await on_workers(run.group.save_checkpoint, d, extra)
        return tinker_path(run.model_id, CHECKPOINTS, name)

    def checkpoint_dir(self, path: str) -> tuple[Path, dict[str, Any]]:
        owner, name = parse_path(path, CHECKPOINTS)
        d = self.cfg.state_dir / "checkpoints" / owner.replace(":", "_") / name
        state_file = d / "trainer_state.json"
        if not state_file.is_file():
            raise UserFault(f"no checkpoint at {path} (save one with save_state)")
        return d, json.loads(state_file.read_text())["extra"]

    async def load_state(self, run: Run, path: str, optimizer: bool) -> None:
        d, extra = self.checkpoint_dir(path)
        if extra.get("lora_rank") != run.lora_rank:
            raise UserFault(f"{path} was saved by a run with LoRA rank {extra.get('lora_rank')}, this run has "
                            f"{run.lora_rank}: create a training client from that state instead")
        await on_workers(run.group.load_checkpoint, d)
        if not optimizer:
            await on_workers(run.group.run_on_ranks, steps.reset_optimizer)

    # ---------------------------------------------------------------- sampling

    def new_sampler(self, base_model: str, version: str, run: Run | None, model_path: str | None) -> Sampler:
        """A sampler of ``version`` on ``base_model``'s engine (``UserFault`` when it cannot be sampled)."""
        self.engines[base_model].check_version(version)
        sid = f"sampler-{next(self._sampler_ids)}"
        self.samplers[sid] = Sampler(sid, base_model, version, run, model_path)
        return self.samplers[sid]

    async def publish(self, run: Run) -> str:
        """A new weight version of ``run``, swapped into its base model's engine; the version."""
        return await self.engines[run.base_model].publish(run)

    def published_at(self, model_path: str) -> tuple[str, Run]:
        """The weight version at ``tinker://RUN/sampler_weights/VERSION`` and the run that published it
        (``UserFault``: never published, pruned, or published by another run)."""
        owner, version = parse_path(model_path, SAMPLER_WEIGHTS)
        p = self.engines.holder(version).published[version]
        if p.run.model_id != owner:
            raise UserFault(f"{model_path}: version {version} was published by {p.run.model_id}, not {owner}")
        return version, p.run

    async def sample(self, sampler: Sampler, ask: SampleAsk) -> SampleResult:
        rollout = f"tinker-{sampler.sampler_id}-{next(sampler.seq)}"
        return await self.engines[sampler.base_model].sample(sampler.version, ask, rollout)

    async def close(self) -> None:
        await self.futures.close()
        for run in list(self.runs.values()):
            await asyncio.to_thread(run.group.shutdown)
        await self.engines.close()


async def on_workers(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a call of a run's ``WorkerGroup``) in a thread; what a rank raised is raised as the
    rank raised it, on Ray as in-process (``ray_workers.rank_error``)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as e:
        cause = rank_error(e)
        if cause is e:
            raise
        raise cause from e


def lora_targets(model_dir: Path, lora: dict[str, Any]) -> list[str] | None:
    """The LoRA ``target_modules`` for the API's ``train_attn`` / ``train_mlp`` (None: the family's
    default, both). ``train_unembed`` is not offered: the output layer is never adapted."""
    attn, mlp = lora.get("train_attn", True), lora.get("train_mlp", True)
    if not attn and not mlp:
        raise UserFault("train_attn and train_mlp are both false: LoRA would adapt nothing here (the output "
                        "layer, train_unembed, is not adapted by tracegym)")
    if attn and mlp:
        return None
    from tracegym.trainer.workers.lora import default_targets

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    want = {"q_proj", "k_proj", "v_proj", "o_proj"} if attn else {"gate_proj", "up_proj", "down_proj"}
    return [t for t in default_targets(model_type) if t in want]


__all__ = ["BASE", "ServiceConfig", "ServiceState"]
