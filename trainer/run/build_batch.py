"""Finished groups of trajectories → one step's ``TrainBatch`` plus reward statistics.

A rollout's reward is the advantage signal of every sequence it produced (multi-sequence rollouts share
it); groups whose rewards are all equal carry no signal and are dropped when asked (DAPO dynamic
sampling). A completed rollout without a reward counts as 0 and is reported in ``reward_missing``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tracegym.trainer.settings import LoraConfig
from tracegym.trainer.workers.batches import TrainBatch
from tracegym.types import Trajectory

log = logging.getLogger(__name__)


def reward_stats(rewards: Sequence[float]) -> dict[str, float]:
    if not rewards:
        return {"reward_mean": 0.0, "reward_std": 0.0, "pass_rate": 0.0}
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "pass_rate": sum(1 for r in rewards if r > 0) / len(rewards),
    }


def emitted_means(rollouts: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Per event name, the mean of the numeric values the agent emitted (``tg.emit(name, 1.0)``; booleans
    count as 0/1) over the rollouts that emitted it (a rollout emitting a name twice counts its last
    value): ``{"emitted/<name>": mean}``. What an agent reports about its behaviour (a tool-call rate),
    averaged per evaluation. Events whose value is not a number, and the product's own ``tracegym.*``
    events, are left out."""
    per: dict[str, list[float]] = {}
    for r in rollouts:
        last: dict[str, float] = {}
        for ev in r.get("events") or []:
            name, value = ev.get("name"), ev.get("value")
            if not name or name.startswith("tracegym.") or not isinstance(value, int | float):
                continue
            last[name] = float(value)
        for name, value in last.items():
            per.setdefault(name, []).append(value)
    return {f"emitted/{k}": statistics.fmean(v) for k, v in sorted(per.items())}


def tool_parse_stats(counts: Iterable[Mapping[str, int]]) -> dict[str, float]:
    """The step's tool-call parsing, from its rollouts' ``tool_parse`` counts (``GET /api/rollouts``):
    ``tool_parse_attempts``, the replies that wrote the model's tool-call syntax (parsed or not), and
    ``tool_parse_failed``, the fraction of those whose call did not parse (0 without attempts). ``{}`` when no
    reply was parsed for tool calls at all (no tools offered)."""
    ok = failed = none = 0
    for c in counts:
        ok, failed, none = ok + c.get("ok", 0), failed + c.get("failed", 0), none + c.get("none", 0)
    if not ok + failed + none:
        return {}
    attempts = ok + failed
    return {"tool_parse_failed": failed / attempts if attempts else 0.0, "tool_parse_attempts": float(attempts)}


def sampled_segments(loss_mask: Sequence[int]) -> int:
    """How many runs of sampled (mask-1) tokens a sequence holds."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def build_train_batch(
    groups: Sequence[tuple[str, Sequence[Trajectory]]],
    *,
    advantage: str,
    drop_zero_signal: bool,
    lora: LoraConfig | None = None,
) -> tuple[TrainBatch | None, dict[str, float]]:
    """``groups`` = ``[(group_id, its completed trajectories)]``. Returns None for the batch when no
    sequence carries signal (e.g. every group got equal rewards).

    ``lora`` with one adapter per agent: each sequence trains its agent's adapter; sequences of agents
    without one are left out (``unrouted_sequences``), and adapters whose agent sent no sequence are
    warned about (one warning per call, naming the agents seen)."""
    import torch

    from tracegym.trainer.algorithms.advantages import compute_advantages, filter_zero_signal_groups

    trajs = [t for _, ts in groups for t in ts]
    gids = [gid for gid, ts in groups for _ in ts]
    rewards = [float(t.reward) if t.reward is not None else 0.0 for t in trajs]
    stats = reward_stats(rewards)
    stats["reward_missing"] = float(sum(1 for t in trajs if t.reward is None))
    stats["rollouts"] = float(len(trajs))
    if not trajs:
        stats["groups_used"] = 0.0
        return None, stats
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = compute_advantages(advantage, r, gids)
    keep = (
        filter_zero_signal_groups(r, gids) if drop_zero_signal else torch.ones(len(trajs), dtype=torch.bool)
    )
    seqs, advs = [], []
    for t, a, k in zip(trajs, adv.tolist(), keep.tolist(), strict=True):
        if not k:
            continue
        for s in t.sequences:
            if any(s.loss_mask):
                seqs.append(s)
                advs.append(a)
    adapters: list[str | None] | None = None
    if lora is not None and lora.per_agent:
        seqs, advs, adapters = _route(seqs, advs, lora, stats)
    stats["groups_used"] = float(len({g for g, k in zip(gids, keep.tolist(), strict=True) if k}))
    stats["sequences"] = float(len(seqs))
    if seqs:  # a merged multi-turn sequence holds one sampled segment per LLM call it merged
        stats["sampled_segments"] = statistics.fmean(sampled_segments(s.loss_mask) for s in seqs)
    if not seqs:
        return None, stats
    return TrainBatch.from_sequences(seqs, advs, adapters), stats


def _route(seqs: list, advs: list[float], lora: LoraConfig,
           stats: dict[str, float]) -> tuple[list, list[float], list[str | None]]:
    kept, kept_advs, names = [], [], []
    seen: set[str | None] = set()
    unrouted: set[str | None] = set()
    for s, a in zip(seqs, advs, strict=True):
        seen.add(s.agent_name)
        name = lora.adapter_for(s.agent_name)
        if name is None:
            unrouted.add(s.agent_name)
            continue
        kept.append(s)
        kept_advs.append(a)
        names.append(name)
    stats["unrouted_sequences"] = float(len(seqs) - len(kept))
    absent = [n for n in lora.names if n not in seen]
    if (unrouted or absent) and seqs:
        parts = []
        if unrouted:
            parts.append(f"{len(seqs) - len(kept)} sequence(s) of agent(s) {sorted(map(str, unrouted))} have "
                         "no adapter and are not trained")
        if absent:
            parts.append(f"lora.adapters names agent(s) {absent} that sent no trainable sequence")
        log.warning("LoRA: %s; agents seen this step: %s", "; ".join(parts), sorted(map(str, seen)))
    return kept, kept_advs, names
