"""Trajectories → the trainer's batch: samples (``TrainSample``/``TrainBatch``), their split across
ranks by token count, micro-batches by token budget, padding aligned with the targets (``collate``), and
the way back from per-micro-batch metrics to one step's metrics. All pure (numpy arrays in, tensors out),
so all of it is tested without a model."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tracegym.arrays import as_logprobs, as_loss_mask, as_token_ids

if TYPE_CHECKING:
    import torch

    from tracegym.types import Sequence


@dataclass(slots=True)
class TrainSample:
    """One training sequence, its arrays in ``tracegym.arrays``' types (lists or other arrays given are
    converted). ``engine_logprobs[i]`` is the sampling engine's logprob of token ``i`` where
    ``loss_mask[i] == 1`` (ignored elsewhere)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    engine_logprobs: np.ndarray
    advantage: float
    adapter: str | None = None
    """The LoRA adapter this sample trains (one adapter per agent); None = the model or its one adapter."""
    pair: int = -1
    """DPO: the index of this sample's chosen/rejected pair in its batch (-1: not a pair member)."""
    chosen: bool = False
    """DPO: this sample is its pair's chosen sequence (else the rejected one)."""

    def __post_init__(self) -> None:
        self.token_ids = as_token_ids(self.token_ids)
        self.loss_mask = as_loss_mask(self.loss_mask)
        self.engine_logprobs = as_logprobs(self.engine_logprobs)
        n = len(self.token_ids)
        if n < 2:
            raise ValueError(f"a training sample needs at least 2 tokens, got {n}")
        if len(self.loss_mask) != n or len(self.engine_logprobs) != n:
            raise ValueError(
                f"token_ids, loss_mask and engine_logprobs must have the same length, got "
                f"{n}, {len(self.loss_mask)}, {len(self.engine_logprobs)}"
            )
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be 0: the first token has no context to be predicted from")

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


@dataclass(slots=True)
class TrainBatch:
    """The samples of one optimizer step."""

    samples: list[TrainSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.samples)

    @classmethod
    def from_sequences(
        cls, sequences: Seq[Sequence], advantages: Seq[float], adapters: Seq[str | None] | None = None,
        *, need_logprobs: bool = True,
    ) -> TrainBatch:
        """Build from assembled ``tracegym.types.Sequence``s and one advantage per sequence.

        A sequence whose loss mask covers a token without an engine logprob is rejected (it could not be
        used for TIS nor for the mismatch metric, and it means assembly went wrong), unless
        ``need_logprobs`` is False (SFT and DPO on imported demonstrations, which were never sampled)."""
        if len(sequences) != len(advantages):
            raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantages")
        samples = []
        for k, (seq, adv) in enumerate(zip(sequences, advantages, strict=True)):
            try:
                ids, mask, lps = seq.arrays()
            except ValueError as e:
                raise ValueError(f"sequence {k}: {e}") from None
            missing = np.isnan(lps)
            if missing.any():
                bad = np.flatnonzero(missing & (mask != 0))
                if len(bad) and need_logprobs:
                    raise ValueError(f"sequence {k}: token {bad[0]} is in the loss mask but has no engine "
                                     "logprob")
                lps = np.where(missing, 0.0, lps)  # ignored there; 0 keeps NaN out of the batch's tensors
            adapter = None if adapters is None else adapters[k]
            samples.append(TrainSample(ids, mask, lps, float(adv), adapter))
        return cls(samples)

    @classmethod
    def from_pairs(cls, pairs: Seq[tuple[Sequence, Sequence]], adapters: Seq[str | None] | None = None) -> TrainBatch:
        """DPO: ``[(chosen, rejected)]`` as samples ``c0, r0, c1, r1, ...`` marked with their pair."""
        flat = [s for pair in pairs for s in pair]
        batch = cls.from_sequences(flat, [0.0] * len(flat), need_logprobs=False)
        for k, s in enumerate(batch.samples):
            s.pair, s.chosen = k // 2, k % 2 == 0
            if adapters is not None:
                s.adapter = adapters[k // 2]
        return batch


def pair_units(samples: Seq[TrainSample]) -> list[list[int]]:
    """The sample indices of each DPO pair (chosen first), in pair order; every pair must be whole."""
    units: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.pair < 0:
            raise ValueError(f"sample {i} is no DPO pair member")
        units.setdefault(s.pair, []).append(i)
    for p, ix in units.items():
        if len(ix) != 2 or samples[ix[0]].chosen == samples[ix[1]].chosen:
            raise ValueError(f"DPO pair {p} needs one chosen and one rejected sample, got {len(ix)} sample(s)")
        ix.sort(key=lambda i: not samples[i].chosen)
    return [units[p] for p in sorted(units)]


def plan_pairs(samples: Seq[TrainSample], world_size: int, token_budget: int) -> tuple[list[list[list[int]]], int]:
    """``plan_step`` for DPO: a pair is never split across ranks or micro-batches (its loss needs both
    sequences), so the plan is made over pairs (as rows of twice the longer length) and expanded."""
    units = pair_units(samples)
    lengths = [max(len(samples[i].token_ids) for i in u) for u in units]
    plan, n_micro = plan_step(lengths, world_size, max(token_budget // 2, 1))
    return [[[i for u in mb for i in units[u]] for mb in rank] for rank in plan], n_micro


def split_across_ranks(lengths: Seq[int], world_size: int) -> list[list[int]]:
    """Indices of the samples for each rank, balancing the token count (longest first, to the lightest
    rank). Every rank gets at least one sample when there are enough samples."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], len(out[r]), r))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(ix) for ix in out]


def micro_batches(lengths: Seq[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that ``rows × longest row <= token_budget`` per group (a single sample
    longer than the budget gets a group of its own). Samples are taken longest first."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        groups.append(cur)
    return groups


def plan_step(lengths: Seq[int], world_size: int, token_budget: int) -> tuple[list[list[list[int]]], int]:
    """Per rank, its micro-batches (lists of global sample indices); and the count all ranks run (FSDP2's
    collectives need the same count on every rank). A rank left without samples (fewer samples than
    ranks) runs only empty micro-batches."""
    if not lengths:
        raise ValueError("an empty batch has nothing to train on")
    plan = []
    for ix in split_across_ranks(lengths, world_size):
        groups = micro_batches([lengths[i] for i in ix], token_budget)
        plan.append([[ix[j] for j in g] for g in groups])
    return plan, max(len(p) for p in plan)


@dataclass(slots=True)
class MicroBatch:
    """Padded tensors of one micro-batch. ``input_ids``/``attention_mask`` are ``[B, L]``; the
    target-aligned tensors are ``[B, K]`` and hold tokens ``L-K..L-1``, predicted by positions
    ``L-K-1..L-2``: run the model with ``logits_to_keep=K + 1`` and drop its last logit."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    targets: torch.Tensor  # [B, K] long: the token predicted at each kept position
    loss_mask: torch.Tensor  # [B, K] float
    engine_logprobs: torch.Tensor  # [B, K] float
    advantages: torch.Tensor  # [B] float
    logits_to_keep: int
    num_tokens: int  # real (non-pad) tokens
    pairs: torch.Tensor | None = None  # [B] long: DPO pair index (-1: none)
    chosen: torch.Tensor | None = None  # [B] bool: DPO chosen member

    def to(self, device: torch.device | str) -> MicroBatch:
        t = {k: getattr(self, k).to(device) for k in ("input_ids", "attention_mask", "targets", "loss_mask")}
        return MicroBatch(
            **t,
            engine_logprobs=self.engine_logprobs.to(device),
            advantages=self.advantages.to(device),
            logits_to_keep=self.logits_to_keep,
            num_tokens=self.num_tokens,
            pairs=None if self.pairs is None else self.pairs.to(device),
            chosen=None if self.chosen is None else self.chosen.to(device),
        )


def collate(samples: Seq[TrainSample], pad_id: int = 0) -> MicroBatch:
    """Right-pad ``samples`` into a ``MicroBatch``. An empty list gives a 1-token dummy with no loss
    tokens (what a rank with fewer micro-batches runs so the collectives stay matched)."""
    import torch

    if not samples:
        samples = [TrainSample([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0)]
        dummy = True
    else:
        dummy = False
    length = max(len(s.token_ids) for s in samples)
    # Padded in numpy, then one tensor each (torch.from_numpy shares the memory): a sample's arrays may be
    # read-only (Ray hands them to a worker as views of its object store), which torch would warn about.
    ids = np.full((len(samples), length), pad_id, dtype=np.int64)
    attn = np.zeros((len(samples), length), dtype=np.int64)
    mask = np.zeros((len(samples), length), dtype=np.float32)
    elp = np.zeros((len(samples), length), dtype=np.float32)
    for r, s in enumerate(samples):
        n = len(s.token_ids)
        ids[r, :n] = s.token_ids
        attn[r, :n] = 1
        mask[r, :n] = s.loss_mask
        elp[r, :n] = s.engine_logprobs
    keep = _logits_to_keep([s.loss_mask for s in samples], length)
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        targets=torch.from_numpy(ids[:, length - keep :].copy()),
        loss_mask=torch.from_numpy(mask[:, length - keep :].copy()),
        engine_logprobs=torch.from_numpy(elp[:, length - keep :].copy()),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        logits_to_keep=keep,
        num_tokens=0 if dummy else int(attn.sum()),
        pairs=torch.tensor([-1 if dummy else s.pair for s in samples], dtype=torch.long),
        chosen=torch.tensor([s.chosen for s in samples], dtype=torch.bool),
    )


def _logits_to_keep(masks: Seq[np.ndarray], length: int) -> int:
    """How many trailing predicted positions cover every loss token: the logit at position ``t - 1``
    predicts token ``t``, so keeping the last ``K`` of the ``L - 1`` logits covers tokens ``L-K..L-1``."""
    starts = [int(mk.argmax()) for mk in masks if mk.any()]  # argmax: the first 1
    if not starts:
        return 1
    return length - min(starts)


LOSS_SCALED = ("pg_loss", "kl_loss", "sft_loss", "dpo_loss")
"""Loss metrics already scaled by the step's global normalisers: summed over micro-batches, not averaged."""

MAX_METRICS = ("ratio_max",)
"""``policy_loss`` metrics that are maxima over tokens: combined by max (``max:<name>``), not averaged."""


def add_loss_metrics(sums: dict[str, float], metrics: dict[str, float]) -> None:
    """Accumulate ``policy_loss`` metrics: loss-scaled ones summed, maxima maxed, per-token means weighted
    by tokens."""
    sums["loss_tokens"] += metrics["tokens"]
    for k, v in metrics.items():
        if k in ("tokens", "seqs", "pairs"):
            continue
        if k in MAX_METRICS:
            if metrics["tokens"] > 0:  # an empty (padding) micro-batch has no tokens to take a max over
                sums[f"max:{k}"] = max(sums.get(f"max:{k}", v), v)
            continue
        w = 1.0 if k in LOSS_SCALED else metrics["tokens"]
        sums[f"m:{k}"] = sums.get(f"m:{k}", 0.0) + v * w


def combine_metrics(per_rank: list[dict[str, float]], wall_s: float, world_size: int) -> dict[str, float]:
    """Global step metrics from the ranks' sums (losses are already globally normalised per rank)."""
    total = {k: sum(r.get(k, 0.0) for r in per_rank) for k in per_rank[0] if not k.startswith("max:")}
    n = max(total["loss_tokens"], 1.0)
    out = {
        "loss": total["loss"] / world_size,
        "mismatch": total["mismatch"] / n,
        "entropy": total["entropy"] / max(total.get("entropy_tokens", 0.0), 1.0),
        "nll": total["nll"] / n,
        "grad_norm": per_rank[0]["grad_norm"],
        "lr": per_rank[0]["lr"],
        "tokens": total["tokens"],
        "loss_tokens": total["loss_tokens"],
        "padded_tokens": total.get("padded_tokens", 0.0),
        "micro_batches": total.get("micro_batches", 0.0),
        "tokens_per_s": total["tokens"] / wall_s if wall_s > 0 else 0.0,
        "step_time": wall_s,
        "worker_cpu_s": max(r["cpu_s"] for r in per_rank),
        "worker_sys_s": max(r.get("sys_s", 0.0) for r in per_rank),
        "worker_page_faults": max(r.get("page_faults", 0.0) for r in per_rank),
        "skipped": per_rank[0]["skipped"],
    }
    for k, v in total.items():
        if k.startswith("m:"):
            name = k[2:]
            out[name] = v / world_size if name in LOSS_SCALED else v / n
    for k in {k for r in per_rank for k in r if k.startswith("max:")}:
        out[k[4:]] = max(r[k] for r in per_rank if k in r)
    out.setdefault("kl", 0.0)
    return out
