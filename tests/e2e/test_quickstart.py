"""The quickstart, shortened: SmolLM2-135M through the whole product (engine, gateway, store, runner,
trainer, swaps) must raise the held-out reward within a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import train_example_shortened

ROOT = Path(__file__).resolve().parents[2]
QS = ROOT / "examples" / "quickstart"
# 8 steps were too few to be sure: over runs the held-out rise was +0.16 to +0.63, and one CI run saw none at all
# (0.148 -> 0.148). 14 steps give the answer format time to lock in (~60 s more).
STEPS = 18


@pytest.mark.slow
def test_quickstart_reward_rises(tmp_path: Path) -> None:
    # 3x the recipe's learning rate: the answer format locks in within a few steps (LEARNING_PROBE: lr 3e-5
    # learns fastest early, then plateaus). At 1e-5, 8 steps rose the held-out reward by +0.03 to +0.25
    # over runs (flaky); at 3e-5 by +0.16 to +0.63 over 5 runs (and 0 once, in CI). At 14 steps: +0.55 and +0.59
    # (2 runs, 147 s alone, bf16), but +0.21 on a CPU where bf16 is slower and it computes in fp32: 18 steps.
    _, rows = train_example_shortened(QS, tmp_path, STEPS, timeout=1500, lr=3.0e-5)
    evals = [r for r in rows if r["kind"] == "eval"]
    before, after = evals[0]["reward_mean"], evals[-1]["reward_mean"]
    print(f"quickstart ({STEPS} steps): eval reward {before:.3f} -> {after:.3f}")
    # 64 held-out tasks × 2 samples: the standard error of the difference is ~0.05 at these rates, so a rise
    # of 0.15 is 3 of them, and well under the smallest rise seen at this learning rate.
    assert after >= before + 0.15, f"held-out reward did not rise: {before:.3f} -> {after:.3f}"
    assert len([r for r in rows if r["kind"] == "train"]) == STEPS
