"""The ETA against real runs: ``StepProgress`` is fed the step and evaluation times of recorded runs, in the
order the run printed them, and each ETA it shows is compared with the time the run really had left.

The recordings (``data/eta_tiny_quickstart_*.jsonl``: one row per evaluation and step with its wall time
since the run's start, and the run's end) are ``tracegym train`` runs of the quickstart's shape on
tiny-random (36 steps of 8 groups of 4, evaluations of 128 rollouts at steps 0, 18 and 36, a weight swap
every step; ``drop_zero_signal_groups: false`` so that every step trains although tiny-random earns no
reward), on a 2-vCPU AMD EPYC shared with other work: the first at a load average falling from 14 to 5
during the run, the second at 4.5–5, the third at 2.8–3.2. Their end is the run's wall time as its summary
printed it (whole seconds), or the last evaluation's end where that is later."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tracegym.trainer.run.report import StepProgress

DATA = Path(__file__).parent / "data"
RECORDINGS = sorted(DATA.glob("eta_tiny_quickstart_*.jsonl"))


def replay(path: Path) -> list[tuple[int, float | None, float, float]]:
    """``(step, ETA shown at its line, seconds the run really had left then, seconds since the start)``."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    end = rows[-1]["at"]
    assert rows[-1]["kind"] == "end"
    p = StepProgress(36, out=io.StringIO(), eval_interval=18, step_rollouts=8 * 4, eval_rollouts=64 * 2)
    shown = []
    for r in rows[:-1]:
        if r["kind"] == "eval":
            p.evaluated("eval", r["eval_s"])
        else:
            p.step(r["step"], {"step_s": r["step_s"], "gen_s": r["gen_s"]})
            shown.append((r["step"], p.eta_s(r["step"]), end - r["at"], r["at"]))
    return shown


def test_there_are_recordings() -> None:
    assert len(RECORDINGS) >= 3


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_the_first_eta_promises_the_runs_real_length(path: Path) -> None:
    """The run's length the first ETA promises (the time so far plus the ETA) is within 1.5× of the real
    one, and so is the ETA itself from the second step on, while at least a minute is left (a few seconds of noise weigh more below), except on a run
    whose machine's load fell by 3× during it: there from the fifth step."""
    shown = replay(path)
    first = next((step, eta, left, at) for step, eta, left, at in shown if eta is not None)
    step, eta, left, at = first
    assert step == 2, "the first step alone gives no ETA; the second does"
    assert 1 / 1.5 <= (at + eta) / (at + left) <= 1.5, first
    from_step = 5 if path.stem.endswith("_1") else 2
    for step, eta, left, _ in shown:
        if step >= from_step and left >= 60:
            assert eta is not None and 1 / 1.5 <= eta / left <= 1.5, (step, eta, left)


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_counting_the_warm_up_overstated_the_run(path: Path) -> None:
    """What the ETA of the first step used to be (that step's time × the steps left, plus the first
    evaluation's × the evaluations left) against the time left: outside 1.5× on every recording (3.58×,
    2.31×, 1.76×), so the warm-up costs the estimate leaves out are real."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    eval0, step1 = rows[0], rows[1]
    left = rows[-1]["at"] - step1["at"]
    assert (step1["step_s"] * 35 + eval0["eval_s"] * 2) / left > 1.5
