"""Finished groups of trajectories → the batch of an ``sft``, ``dpo`` or ``distill`` step, and the
offline examples of ``sft``/``dpo`` read from runs in the store (``SourceConfig.runs``).

- ``sft``: every sequence of the rollouts whose reward passes ``min_reward`` (rejection sampling), or
  of imported demonstrations; no engine logprobs needed.
- ``dpo``: per group, the highest- against the lowest-reward rollout, when their rewards differ by more
  than ``min_margin``, each has one trainable sequence, and both have the same prompt tokens (the tokens
  before the first sampled one). Imported pairs are groups of two (chosen rewarded 1, rejected 0).
- ``distill``: as GRPO's batch, but no group is dropped for equal rewards (the teacher's signal is
  per token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tracegym.trainer.recipe import RecipeError
from tracegym.trainer.run.build_batch import build_train_batch, reward_stats
from tracegym.trainer.settings import DpoConfig, LoraConfig, SftConfig, dataset_name
from tracegym.trainer.workers.batches import TrainBatch
from tracegym.types import Sequence as TokenSequence
from tracegym.types import Trajectory

Groups = Sequence[tuple[str, Sequence[Trajectory]]]


class EmptySourceError(RecipeError):
    """An offline objective found nothing to train on; the message says how many rollouts it looked at."""


def _stats(groups: Groups) -> dict[str, float]:
    trajs = [t for _, ts in groups for t in ts]
    out = reward_stats([float(t.reward) if t.reward is not None else 0.0 for t in trajs])
    out["rollouts"] = float(len(trajs))
    return out


def passes(t: Trajectory, min_reward: float | None) -> bool:
    """Whether ``t`` is an SFT example: reward >= ``min_reward`` (unset: any reward, or none at all)."""
    if min_reward is None:
        return True
    return t.reward is not None and float(t.reward) >= min_reward


def sft_batch(groups: Groups, cfg: SftConfig) -> tuple[TrainBatch | None, dict[str, float]]:
    stats = _stats(groups)
    kept = [t for _, ts in groups for t in ts if passes(t, cfg.min_reward)]
    seqs = [s for t in kept for s in t.sequences if any(s.loss_mask)]
    stats |= {"sft_rollouts": float(len(kept)), "sequences": float(len(seqs))}
    if not seqs:
        return None, stats
    return TrainBatch.from_sequences(seqs, [1.0] * len(seqs), need_logprobs=False), stats


def prompt_ids(seq: TokenSequence) -> list[int]:
    """The tokens before the first sampled (mask-1) one."""
    mask = seq.loss_mask
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    return seq.token_ids[:first]


def group_pair(ts: Sequence[Trajectory], min_margin: float) -> tuple[tuple[TokenSequence, TokenSequence] | None, str]:
    """The group's (chosen, rejected) sequences, or None and why not."""
    rated = [t for t in ts if t.reward is not None]
    if len(rated) < 2:
        return None, "unrated"
    best = max(rated, key=lambda t: float(t.reward))  # type: ignore[arg-type]
    worst = min(rated, key=lambda t: float(t.reward))  # type: ignore[arg-type]
    if float(best.reward) - float(worst.reward) <= min_margin:  # type: ignore[arg-type]
        return None, "equal_rewards"
    seqs = [[s for s in t.sequences if any(s.loss_mask)] for t in (best, worst)]
    if any(len(s) != 1 for s in seqs):
        return None, "multi_sequence"
    chosen, rejected = seqs[0][0], seqs[1][0]
    if prompt_ids(chosen) != prompt_ids(rejected):
        return None, "prompt_differs"
    return (chosen, rejected), "ok"


def dpo_batch(groups: Groups, cfg: DpoConfig) -> tuple[TrainBatch | None, dict[str, float]]:
    stats = _stats(groups)
    pairs, why = [], {"unrated": 0, "equal_rewards": 0, "multi_sequence": 0, "prompt_differs": 0}
    for _, ts in groups:
        pair, reason = group_pair(ts, cfg.min_margin)
        if pair is None:
            why[reason] += 1
        else:
            pairs.append(pair)
    stats["pairs"] = float(len(pairs))
    stats |= {f"pairs_skipped/{k}": float(v) for k, v in why.items() if v}
    if not pairs:
        return None, stats
    return TrainBatch.from_pairs(pairs), stats


def objective_batch(
    objective: str, groups: Groups, *, advantage: str, drop_zero_signal: bool, sft: SftConfig, dpo: DpoConfig,
    lora: LoraConfig | None = None,
) -> tuple[TrainBatch | None, dict[str, float]]:
    """The batch of one step of ``objective`` from ``groups`` (``[(group_id, trajectories)]``)."""
    if objective == "sft":
        return sft_batch(groups, sft)
    if objective == "dpo":
        return dpo_batch(groups, dpo)
    return build_train_batch(groups, advantage=advantage, lora=lora,
                             drop_zero_signal=drop_zero_signal and objective == "grpo")


# ---------------------------------------------------------------- offline sources


def in_runs(group_id: str | None, runs: Iterable[str]) -> bool:
    """Whether a group belongs to one of ``runs``: a training group of a run of that name
    (``NAME-<id>-train-<n>``) or a group of a dataset imported under that name (``NAME-import-<n>``)."""
    if not group_id:
        return False
    for run in runs:
        rest = group_id[len(run) + 1:] if group_id.startswith(run + "-") else None
        if rest is not None and (rest.startswith("import-") or "-train-" in rest):
            return True
    return False


def read_source(lines: Iterable[str], runs: Sequence[str]) -> list[tuple[str, list[Trajectory]]]:
    """``[(group_id, trajectories)]`` of the completed rollouts of ``runs`` among ``lines`` (the
    ``GET /api/trajectories`` lines), in the order their groups first appear."""
    out: dict[str, list[Trajectory]] = {}
    for line in lines:
        d: dict[str, Any] = json.loads(line)
        if in_runs(d.get("group_id"), runs):
            out.setdefault(d["group_id"], []).append(Trajectory.from_dict(d))
    return list(out.items())


def check_source(objective: str, groups: Groups, runs: Sequence[str], sft: SftConfig,
                 dpo: DpoConfig) -> list[tuple[str, list[Trajectory]]]:
    """The groups of the source that give an example, or ``EmptySourceError`` saying how many matched."""
    n = sum(len(ts) for _, ts in groups)
    if objective == "sft":
        kept = [(g, [t for t in ts if passes(t, sft.min_reward)]) for g, ts in groups]
        kept = [(g, ts) for g, ts in kept if ts]
        if not kept:
            what = "" if sft.min_reward is None else f" with reward >= {sft.min_reward}"
            raise EmptySourceError(f"sft: 0 of the {n} completed rollouts of runs {list(runs)} in the store are"
                                   f" examples{what}; nothing to train on")
        return kept
    kept = [(g, list(ts)) for g, ts in groups if group_pair(ts, dpo.min_margin)[0] is not None]
    if not kept:
        raise EmptySourceError(f"dpo: 0 of the {len(groups)} groups ({n} completed rollouts) of runs {list(runs)}"
                               f" in the store give a pair (two rewards differing by more than {dpo.min_margin},"
                               " one sequence each, the same prompt tokens); nothing to train on")
    return kept


def load_source(client: Any, objective: str, recipe: Any) -> list[tuple[str, list[Trajectory]]]:
    """The example groups of ``objective``'s source runs (``recipe.sft.runs`` / ``recipe.dpo.runs``) in the
    store behind ``client`` (a ``GatewayClient``), checked by ``check_source``; its dataset ``files`` are
    imported first (``import_files``)."""
    src = getattr(recipe, objective)
    import_files(client, objective, src.files)
    runs = src.sources()
    # imported examples carry no logprobs (the assembly calls them re-tokenized): asked for explicitly
    lines = client.iter_lines("/api/trajectories", "read the source runs",
                              {"status": "completed", "include_retokenized": "true"})
    return check_source(objective, read_source(lines, runs), runs, recipe.sft, recipe.dpo)


def import_files(client: Any, objective: str, files: Sequence[Path]) -> None:
    """Import each of ``files`` into the store behind ``client`` as ``tracegym import FILE --name STEM``
    does (sft: chat records, dpo: preference pairs); groups already there are skipped. A missing file or
    a refused record is a ``RecipeError`` naming it."""
    from tracegym.client import GatewayError
    from tracegym.imports import import_file

    for path in files:
        if not path.is_file():
            raise RecipeError(f"{objective}.files: no such file: {path}")
        try:
            import_file(client, path, name=dataset_name(path), fmt="chat" if objective == "sft" else "dpo")
        except GatewayError as e:
            raise RecipeError(f"{objective}.files: {path}: {e}") from None


def take_groups(src: Sequence[tuple[str, list[Trajectory]]], pos: int, objective: str, *, batch_size: int,
                group_size: int) -> tuple[list[tuple[str, list[Trajectory]]], int]:
    """The next step's groups of an offline source from position ``pos`` (cycling) and the new position:
    ``batch_size`` groups (dpo: one pair each), or for sft groups until ``batch_size × group_size``
    rollouts."""
    out: list[tuple[str, list[Trajectory]]] = []
    if objective == "sft":
        while sum(len(ts) for _, ts in out) < batch_size * group_size:
            out.append(src[pos % len(src)])
            pos += 1
        return out, pos
    out = [src[(pos + k) % len(src)] for k in range(batch_size)]
    return out, pos + batch_size
