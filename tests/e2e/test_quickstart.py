"""The quickstart, shortened: SmolLM2-135M through the whole product (engine, gateway, store, runner,
trainer, swaps) must raise the held-out reward within a few steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import QUICKSTART_STEPS
from tracegym.trainer.run.teacher import kept_weights


@pytest.mark.slow
def test_quickstart_reward_rises(quickstart_trained: tuple[Path, list[dict[str, Any]]]) -> None:
    run, rows = quickstart_trained
    evals = [r for r in rows if r["kind"] == "eval"]
    before, after = evals[0]["reward_mean"], evals[-1]["reward_mean"]
    print(f"quickstart ({QUICKSTART_STEPS} steps): eval reward {before:.3f} -> {after:.3f}")
    # 64 held-out tasks × 2 samples: the standard error of the difference is ~0.05 at these rates, so a rise
    # of 0.15 is 3 of them, and well under the smallest rise seen at this learning rate.
    assert after >= before + 0.15, f"held-out reward did not rise: {before:.3f} -> {after:.3f}"
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == QUICKSTART_STEPS
    # a step whose groups all had equal rewards trains nothing (drop_zero_signal_groups) and makes no version
    updates = [r for r in train if "train_s" in r]
    assert updates, "no step trained"
    kept = kept_weights(run)  # keep: weights kept the trained model, which the distillation test teaches with
    assert kept is not None and kept.name == f"v{len(updates)}"
