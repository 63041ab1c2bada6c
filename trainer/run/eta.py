"""The time left in a training run, from the durations measured so far (``report.StepProgress`` shows it on
each step's line).

A run's first training step and its first evaluation carry one-time costs the later ones do not: the
engine's first batches and the agents' first imports and connections, so their generation is slow (several
times the later steps' and evaluations' on the recorded runs of ``tests/trainer/run/data/``). A moving
average that counts them promises several times the run's real length at its start. Hence:

- a training step is estimated as its generation part (``gen_s``), averaged over the steps after the first,
  plus the rest (update, weight swap, fetching), averaged over every step; with only the first step there
  is no estimate yet (the line shows ``eta ?``); steps without a generation part (offline objectives) are
  averaged whole, the first left out;
- an evaluation as the mean of the evaluations after the first; before one has run, as the generation time
  of the steps after the first scaled from a step's rollouts to an evaluation's; failing both, as the first
  evaluation.

The last ``WINDOW`` steps count, so the estimate follows a policy whose replies grow or shrink as it
learns. A machine whose load changes mid-run still moves the real time away from any estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 10
"""Steps (after the first) averaged for the per-step estimate: long enough to smooth a loaded machine's
noise, short enough to follow a policy whose replies grow or shrink as it learns."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def evals_left(step: int, total: int, interval: int, *, evaluates: bool = True, also: Sequence[int] = ()) -> int:
    """Held-out evaluations still to come once step ``step``'s line is printed: one after every
    ``interval``-th step and every step of ``also`` before the last (that step's own included), and the
    final one."""
    if not evaluates:
        return 0
    between = sum(1 for k in range(max(step, 1), total) if (interval and k % interval == 0) or k in also)
    return between + 1


def step_estimate(step_s: Sequence[float], gen_s: Sequence[float] = (), *, window: int = WINDOW) -> float | None:
    """Seconds per training step from the steps so far and their generation parts (both in order); None
    with only the first step."""
    if len(step_s) < 2:
        return None
    if len(gen_s) != len(step_s):  # not every step generated: averaged whole
        return _mean(step_s[1:][-window:])
    rest = [s - g for s, g in zip(step_s, gen_s, strict=True)]
    return _mean(gen_s[1:][-window:]) + _mean(rest[-window:])


def eval_estimate(eval_s: Sequence[float], gen_s: Sequence[float], *, eval_rollouts: int = 0,
                  step_rollouts: int = 0, window: int = WINDOW) -> float | None:
    """Seconds per evaluation from the evaluations so far and the steps' generation times (both in order);
    ``eval_rollouts`` and ``step_rollouts``: the rollouts an evaluation and a step sample."""
    if len(eval_s) > 1:
        return _mean(eval_s[1:])
    steady_gen = gen_s[1:]
    if steady_gen and eval_rollouts > 0 and step_rollouts > 0:
        return _mean(steady_gen[-window:]) * eval_rollouts / step_rollouts
    return eval_s[0] if eval_s else None


def eta_seconds(step_s: Sequence[float], steps_left: int, *, gen_s: Sequence[float] = (),
                eval_s: Sequence[float] = (), evals: int = 0, eval_rollouts: int = 0, step_rollouts: int = 0,
                window: int = WINDOW) -> float | None:
    """Time left: ``steps_left`` steps and ``evals`` evaluations at the estimates above. None while there is
    no estimate of a step that is still to come."""
    per_step = step_estimate(step_s, gen_s, window=window)
    if per_step is None and steps_left > 0:
        return None
    left = (per_step or 0.0) * steps_left
    if evals:
        per_eval = eval_estimate(eval_s, gen_s, eval_rollouts=eval_rollouts, step_rollouts=step_rollouts,
                                 window=window)
        left += (per_eval or 0.0) * evals
    return left
