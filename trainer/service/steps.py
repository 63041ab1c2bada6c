"""The training service's operations on one ``TrainWorker``: ``forward_backward`` (gradients accumulate
across calls until ``optim_step``), ``forward`` (no gradient), ``optim_step`` (AdamW with the caller's
hyperparameters), ``reset_optimizer``. Each is a plain function ``fn(worker, ...)``, run through
``WorkerGroup.run_on_ranks``.

A datum is the API's: ``tokens`` (the model input), ``targets`` (``targets[t]`` is predicted from
``tokens[: t + 1]``) and per-token inputs of the same length. The batch the worker runs is built the way
``batches.collate`` builds the trainer's own: the input is ``tokens`` plus the last target (so a row of
shifted targets is exactly a trainer sample) and the model is run with ``logits_to_keep`` = the row
length through ``TrainWorker._forward``. Losses come from ``algorithms.datum_losses`` (the API's names:
sums over tokens) or from the trainer's own objectives (``tracegym/sft``, ``tracegym/grpo``: the
recipe's ``algorithm`` section with the call's ``loss_fn_config`` over it, aggregated over the call's
tokens as one trainer step aggregates over its batch).

All-or-nothing: a ``forward_backward`` that fails part-way leaves the gradients it found; the ones it
made are dropped (its own gradients are summed into the earlier ones only when every micro-batch ran).

Several ranks (FSDP2, Ray actors): every rank is given the whole call and runs its share of the datums
(``rank_plan``: balanced by tokens, as the trainer splits a batch), padded with empty micro-batches to the
count every rank runs, since each forward and backward is a collective. FSDP2 averages the ranks'
gradients, so each rank's backward is of its partial sum times the world size: the step sees the
gradient of the whole call's loss, as on one rank. ``merge_ranks`` puts the ranks' answers together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tracegym.trainer.algorithms.datum_losses import DATUM_LOSSES
from tracegym.trainer.algorithms.losses import loss_scales, masked_sum, policy_loss
from tracegym.trainer.algorithms.objectives import sft_loss
from tracegym.trainer.algorithms.optim import build_optimizer
from tracegym.trainer.algorithms.registry import UnknownNameError, lookup
from tracegym.trainer.settings import AlgorithmConfig
from tracegym.trainer.workers.batches import MicroBatch, split_across_ranks
from tracegym.trainer.workers.fsdp import full_tensor
from tracegym.trainer.workers.worker import TrainWorker, token_logprobs

OBJECTIVE_PREFIX = "tracegym/"
OBJECTIVE_LOSSES = ("grpo", "sft")
"""The trainer's objectives the service offers (``tracegym/<name>``): those that need neither a reference
model nor a teacher."""
OBJECTIVE_CONFIG = ("loss", "agg", "clip_low", "clip_high", "cispo_clip_low", "cispo_clip_high", "tis_cap")
"""``loss_fn_config`` keys a ``tracegym/`` loss takes: fields of the recipe's ``algorithm`` section."""


NOT_OFFERED = {
    "stable_reinforce": "it needs samples recorded with record_stability_info, which tracegym's sampler does "
                        "not record",
    "custom": "server-side custom losses are not offered; forward_backward_custom runs the loss on the client",
    OBJECTIVE_PREFIX + "dpo": "it needs a frozen reference model, which a run does not hold: run DPO as a "
                              "forward_backward_custom loss with the reference logprobs from a second run's forward",
    OBJECTIVE_PREFIX + "distill": "it needs a teacher model, which a run does not hold: score the samples with the "
                                  "teacher and train importance_sampling on advantages log p_teacher - log q",
}
"""Loss names of the Tinker API the service refuses, and why."""


def loss_names() -> list[str]:
    """Every loss a ``forward_backward`` may name."""
    return sorted(DATUM_LOSSES) + [OBJECTIVE_PREFIX + o for o in OBJECTIVE_LOSSES]


def check_loss(name: str, config: dict[str, float | str]) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` (besides ``target_tokens``) loss ``name`` requires; ``UnknownNameError``
    listing the valid names, or ``ValueError`` for a config key it does not read."""
    if name.startswith(OBJECTIVE_PREFIX) and name[len(OBJECTIVE_PREFIX):] in OBJECTIVE_LOSSES:
        known: tuple[str, ...] = OBJECTIVE_CONFIG
        required: tuple[str, ...] = ("weights",) if name.endswith("/sft") else ("weights", "advantages")
        objective_config(config)  # its values are checked as the recipe checks them
    else:
        try:
            loss = DATUM_LOSSES[name]
        except KeyError:
            why = f" ({NOT_OFFERED[name]})" if name in NOT_OFFERED else ""
            raise UnknownNameError(f"unknown loss_fn {name!r}{why}; valid: {', '.join(loss_names())}") from None
        known, required = loss.config, loss.required
        missing = [k for k in loss.config_required if not isinstance(config.get(k), int | float)]
        if missing:
            raise ValueError(f"loss_fn {name!r} needs loss_fn_config {', '.join(map(repr, missing))} (a number; "
                             "tracegym gives it no default)")
    extra = sorted(set(config) - set(known))
    if extra:
        raise ValueError(f"loss_fn {name!r} takes no config key {extra[0]!r}; it takes: {', '.join(known) or 'none'}")
    return required


def objective_config(config: dict[str, float | str]) -> AlgorithmConfig:
    """The recipe's ``algorithm`` defaults with ``config`` over them, validated like a recipe."""
    return AlgorithmConfig.model_validate({k: v for k, v in config.items() if k in OBJECTIVE_CONFIG})


@dataclass(slots=True)
class Datum:
    tokens: np.ndarray
    """int64 ``[n]``: the model input."""
    targets: np.ndarray
    """int64 ``[n]``: ``targets[t]`` is the token predicted after ``tokens[: t + 1]``."""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """float32 ``[n]`` each: ``weights``, ``advantages``, ``logprobs`` (the sampler's), ..."""


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions in ``lengths``, consecutive, at most ``budget`` tokens a group (a longer one alone)."""
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, n in enumerate(lengths):
        if groups[-1] and tokens + n > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups


def rank_plan(lengths: list[int], rank: int, world_size: int, budget: int) -> tuple[list[list[int]], int]:
    """Rank ``rank``'s micro-batches (datum indices, in the call's order; ``lengths`` are the rows' token
    counts) and the count every rank runs. One rank: the call's datums in order, in consecutive groups."""
    shares = split_across_ranks(lengths, world_size)
    plans = [[[share[j] for j in g] for g in _micro_batches([lengths[i] for i in share], budget)] if share else []
             for share in shares]
    return plans[rank], max(len(p) for p in plans)


def _collate(rows: list[Datum], names: tuple[str, ...], defaults: dict[str, float],
             pad_id: int) -> tuple[MicroBatch, dict[str, torch.Tensor], torch.Tensor]:
    """The worker's micro-batch of ``rows`` (see the module docstring), the inputs ``[B, T]`` and the
    0/1 mask of real positions ``[B, T]``."""
    length = max(len(d.tokens) for d in rows)
    ids = np.full((len(rows), length + 1), pad_id, dtype=np.int64)
    attn = np.zeros((len(rows), length + 1), dtype=np.int64)
    targets = np.full((len(rows), length), pad_id, dtype=np.int64)
    valid = np.zeros((len(rows), length), dtype=np.float32)
    inputs = {k: np.zeros((len(rows), length), dtype=np.float32) for k in names}
    for r, d in enumerate(rows):
        n = len(d.tokens)
        ids[r, :n], ids[r, n] = d.tokens, d.targets[-1]
        attn[r, : n + 1] = 1
        targets[r, :n] = d.targets
        valid[r, :n] = 1
        for k in names:
            inputs[k][r, :n] = d.inputs[k] if k in d.inputs else defaults[k]
    t_inputs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    zeros = torch.zeros(len(rows), length)
    mb = MicroBatch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn), targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(valid), engine_logprobs=t_inputs.get("logprobs", zeros),
        advantages=t_inputs.get("advantages", zeros), logits_to_keep=length, num_tokens=int(attn.sum()),
    )
    return mb, t_inputs, torch.from_numpy(valid)


def _loss_inputs(loss: str) -> tuple[tuple[str, ...], dict[str, float]]:
    if loss.startswith(OBJECTIVE_PREFIX):
        return ("weights", "advantages", "logprobs"), {"weights": 0.0, "advantages": 0.0, "logprobs": 0.0}
    spec = lookup(DATUM_LOSSES, loss, "loss_fn")
    return spec.required + tuple(spec.defaults), dict(spec.defaults)


def _run(worker: TrainWorker, data: list[Datum], loss: str, config: dict[str, float | str],
         backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """This rank's share of the call: ``{}`` for the other ranks' datums, and its partial sums."""
    names, defaults = _loss_inputs(loss)
    objective = loss[len(OBJECTIVE_PREFIX):] if loss.startswith(OBJECTIVE_PREFIX) else None
    algo = objective_config(config) if objective else None
    scales: dict[str, float] = {}
    if objective:
        masks = [torch.from_numpy((np.asarray(d.inputs.get("weights", 0.0)) > 0).astype(np.float32))[None]
                 for d in data]
        scales = loss_scales(*masks)
    plan, n_micro = rank_plan([len(d.tokens) + 1 for d in data], worker.rank, worker.world_size,
                              worker.cfg.optim.micro_batch_budget(worker.device.type))
    outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
    total, tokens = 0.0, 0.0
    for group in plan + [[] for _ in range(n_micro - len(plan))]:
        if not group:
            _empty_micro_batch(worker, backward)
            continue
        mb, inputs, valid = _collate([data[i] for i in group], names, defaults, worker.pad_id)
        mb = mb.to(worker.device)
        inputs = {k: v.to(worker.device) for k, v in inputs.items()}
        valid = valid.to(worker.device)
        logprobs = token_logprobs(worker._forward(worker.model, mb), mb.targets)
        if objective == "sft":
            mask = (inputs["weights"] > 0).float()
            value, _ = sft_loss(algo, logprobs, mask, **scales)
            per_token = -logprobs * mask
        elif objective == "grpo":
            mask = (inputs["weights"] > 0).float()
            value, _ = policy_loss(algo, logprobs, logprobs.detach(), inputs["advantages"], mask,
                                   engine_logprobs=inputs["logprobs"], **scales)
            per_token = -logprobs * inputs["advantages"] * mask
        else:
            per_token = DATUM_LOSSES[loss].fn(logprobs, inputs, config) * valid
            value = masked_sum(per_token, valid)
        if backward:
            (value if worker.world_size == 1 else value * worker.world_size).backward()
        total += float(value.detach())
        tokens += float(valid.sum())
        lp, el = logprobs.detach().float().cpu().numpy(), per_token.detach().float().cpu().numpy()
        for row, i in enumerate(group):
            n = len(data[i].tokens)
            outputs[i] = {"logprobs": lp[row, :n].copy(), "elementwise_loss": el[row, :n].copy()}
    return outputs, {"loss:sum": total, "tokens:sum": tokens}


def _empty_micro_batch(worker: TrainWorker, backward: bool) -> None:
    """A rank with fewer micro-batches than the others: a one-token forward (and a zero backward) so
    that its collectives match theirs."""
    pad = np.array([worker.pad_id], dtype=np.int64)
    mb, _, _ = _collate([Datum(pad, pad)], (), {}, worker.pad_id)
    mb = mb.to(worker.device)
    logprobs = token_logprobs(worker._forward(worker.model, mb), mb.targets)
    if backward:
        (logprobs.sum() * 0.0).backward()


def merge_ranks(per_rank: list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]
                ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """The call's answer from every rank's ``forward`` / ``forward_backward``: each datum's outputs from
    the rank that ran it, the metrics summed over ranks."""
    outputs = [next((o for o in column if o), {}) for column in zip(*(out for out, _ in per_rank), strict=True)]
    metrics = {k: sum(m[k] for _, m in per_rank) for k in per_rank[0][1]}
    return outputs, metrics


def _trainable(worker: TrainWorker) -> list[torch.nn.Parameter]:
    return [p for p in worker.model.parameters() if p.requires_grad]


def forward_backward(worker: TrainWorker, data: list[Datum], loss: str,
                     config: dict[str, float | str]) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """Per-datum ``logprobs`` and ``elementwise_loss``, metrics ``loss:sum`` and ``tokens:sum``; the
    gradients are added to those of earlier calls since the last ``optim_step``, or not at all if it
    fails."""
    params = _trainable(worker)
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        out = _run(worker, data, loss, config, backward=True)
    except BaseException:
        for p, g in zip(params, earlier, strict=True):
            p.grad = g
        raise
    for p, g in zip(params, earlier, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else g.add_(p.grad)
    return out


def forward(worker: TrainWorker, data: list[Datum], loss: str,
            config: dict[str, float | str]) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """``forward_backward`` without the backward: the gradients are not touched."""
    with torch.no_grad():
        return _run(worker, data, loss, config, backward=False)


class NoGradientsError(ValueError):
    """``optim_step`` with no gradient since the last step."""


def optim_step(worker: TrainWorker, adam: dict[str, float]) -> dict[str, float]:
    """One AdamW step with ``adam`` (``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``,
    ``grad_clip_norm``: 0 = no clipping) on the accumulated gradients, then clear them. A non-finite
    gradient norm skips the update (as ``TrainWorker.train_step`` does) and says so in the metrics."""
    params = _trainable(worker)
    if all(p.grad is None for p in params):
        raise NoGradientsError("optim_step without gradients: run forward_backward (not forward) first; "
                               "each optim_step uses the gradients accumulated since the last one")
    for g in worker.optimizer.param_groups:
        g["lr"] = adam["learning_rate"]
        g["betas"] = (adam["beta1"], adam["beta2"])
        g["eps"] = adam["eps"]
        g["weight_decay"] = adam["weight_decay"]
    clip = adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else float("inf")
    grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, clip)))
    finite = bool(np.isfinite(grad_norm))
    if finite:
        worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    worker.step += 1
    return {"grad_norm": grad_norm, "learning_rate": adam["learning_rate"], "skipped": float(not finite),
            "step": float(worker.step)}


def has_gradients(worker: TrainWorker) -> bool:
    return any(p.grad is not None for p in _trainable(worker))


def reset_optimizer(worker: TrainWorker) -> None:
    """A fresh AdamW (no moments): what loading weights without the optimizer state leaves."""
    worker.optimizer = build_optimizer(worker.model.parameters(), worker.cfg.optim)


def model_facts(worker: TrainWorker) -> dict[str, Any]:
    cfg = worker.model.config
    return {"vocab_size": int(cfg.vocab_size), "max_length": int(getattr(cfg, "max_position_embeddings", 0) or 0)}
