"""On-policy distillation, shortened: a fresh SmolLM2-135M (the student) samples the quickstart's tasks
through the gateway as in RL, the quickstart-trained SmolLM2 (the teacher: the shortened quickstart run, named
by its run directory) scores the same tokens, and the student learns from the per-token difference of their
logprobs, no reward used. The held-out reward must rise towards the teacher's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import QUICKSTART, train_example_shortened

STEPS = 6


@pytest.mark.slow
@pytest.mark.learns
def test_distillation_from_the_quickstart_trained_model_raises_a_fresh_students_reward(
    quickstart_trained: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    teacher_run, teacher_rows = quickstart_trained
    teacher = [r for r in teacher_rows if r["kind"] == "eval"][-1]["reward_mean"]
    _, rows = train_example_shortened(QUICKSTART, tmp_path, STEPS, timeout=1200, lr=3.0e-5, objective="distill",
                                      distill={"teacher": str(teacher_run)})
    before, after = (r["reward_mean"] for r in rows if r["kind"] == "eval")
    print(f"quickstart distilled ({STEPS} steps): held-out {before:.3f} -> {after:.3f} (teacher {teacher:.3f})")
    assert len([r for r in rows if r["kind"] == "train"]) == STEPS
    assert after >= before + 0.15, f"held-out reward did not rise: {before:.3f} -> {after:.3f}"
