"""What a run prints and leaves behind, as pure functions: the live line's labels, the ETA, a line every
10 s when the output is not a terminal, and the summary read from the run's own rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

from tracegym.trainer.run.eta import eta_seconds, eval_estimate, evals_left, step_estimate
from tracegym.trainer.run.report import (
    StepProgress,
    fmt_duration,
    live_label,
    read_metrics,
    skipped_reason,
    summary_table,
    tool_parse_warning,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_live_label_names_the_evaluation_not_a_step_past_the_end() -> None:
    # the final evaluation of a 2-step run used to read "step 3/2 | generating 79/128"
    assert live_label(step=2, total=2, evaluating=True, done=79, n=128, elapsed_s=12) == (
        "eval @ step 2 | generating 79/128 | 12s"
    )
    assert live_label(step=0, total=36, evaluating=True, done=0, n=128, elapsed_s=0).startswith("eval @ step 0")
    assert live_label(step=2, total=36, evaluating=False, done=5, n=32, elapsed_s=75) == (
        "step 3/36 | generating 5/32 | 1m15s"
    )


def test_eta_leaves_out_the_first_steps_and_evaluations_warm_up() -> None:
    # the first ETA of the quickstart read 216m31s, later 3.6x the run: the first step's and first evaluation's
    # one-time costs were counted as if every step and evaluation would pay them
    out = io.StringIO()
    p = StepProgress(36, out=out, eval_interval=18, step_rollouts=32, eval_rollouts=128, clock=Clock())
    p.evaluated("eval @ step 0: ...", 60.0)
    p.step(1, {"reward_mean": 0.1, "step_s": 18.0, "gen_s": 13.0})
    assert out.getvalue().splitlines()[-1].endswith("| eta ?")  # only the warm-up step: no estimate yet
    p.step(2, {"reward_mean": 0.1, "step_s": 7.0, "gen_s": 2.0})
    # a step: generation 2 s (step 2's) + the rest 5 s (both steps'); an evaluation: 4 steps' rollouts at 2 s
    assert p.eta_s(2) == 7.0 * 34 + 2 * (2.0 * 128 / 32)
    assert out.getvalue().splitlines()[-1].endswith(f"| eta {fmt_duration(7.0 * 34 + 16)}")
    p.evaluated("eval @ step 18: ...", 6.0)  # an evaluation after the first: evaluations are timed by it
    assert p.eta_s(2) == 7.0 * 34 + 2 * 6.0
    assert evals_left(1, 36, 18) == 2  # after step 18, and the final one
    assert fmt_duration(195) == "3m15s" and fmt_duration(7500) == "2h05m" and fmt_duration(9.6) == "10s"


def test_eta_is_a_moving_average_of_the_last_steps() -> None:
    assert eta_seconds([], 10) is None and eta_seconds([100.0], 10) is None
    assert eta_seconds([100.0, 1, 1, 1, 1, 1], 10, window=5) == 10.0  # the slow first step has dropped out
    assert eta_seconds([100.0, 9, 1, 1, 1, 1, 1], 10, window=5) == 10.0  # and the older ones
    assert eta_seconds([5.0], 0, eval_s=[30.0], evals=1) == 30.0  # the last step: the final evaluation left
    # offline steps (no generation part) are averaged whole; generation's warm-up is in the first step only
    assert step_estimate([9.0, 3.0, 5.0]) == 4.0
    assert step_estimate([9.0, 3.0, 5.0], [6.0, 1.0, 1.0]) == 1.0 + (3.0 + 2.0 + 4.0) / 3
    assert eval_estimate([40.0], [], eval_rollouts=128, step_rollouts=32) == 40.0
    assert evals_left(18, 36, 18) == 2  # step 18's own evaluation is still to come once its line is printed
    assert evals_left(36, 36, 18) == 1 and evals_left(5, 36, 0) == 1 and evals_left(5, 36, 0, evaluates=False) == 0
    assert evals_left(1, 12, 0, also=[4]) == 2 and evals_left(5, 12, 4, also=[4, 6]) == 3  # phase ends: 6, 8, final


def test_without_a_terminal_the_live_line_is_printed_every_10s() -> None:
    clock, out = Clock(), io.StringIO()  # StringIO: not a TTY, like output redirected to a file
    p = StepProgress(2, out=out, clock=clock)
    printed = []
    for i in range(121):  # two minutes of polls every 0.25 s... every second here
        p.status(live_label(step=0, total=2, evaluating=True, done=i, n=128, elapsed_s=i))
        printed += out.getvalue().splitlines()[len(printed):]
        clock.t += 1.0
    assert len(printed) == 12, printed  # at 10 s, 20 s, ... 120 s: never silent for longer than 10 s
    assert printed[0] == "eval @ step 0 | generating 10/128 | 10s"
    assert all("\r" not in line and "\x1b" not in line for line in printed)
    # a permanent line counts: the next live line comes 10 s after it
    p.evaluated("eval @ step 0: reward 0.1", 120.0)
    clock.t += 5
    p.status("step 1/2 | generating 3/8 | 5s")
    assert out.getvalue().splitlines()[-1] == "eval @ step 0: reward 0.1"
    clock.t += 5
    p.status("step 1/2 | generating 4/8 | 10s")
    assert out.getvalue().splitlines()[-1] == "step 1/2 | generating 4/8 | 10s"


def test_summary_reads_only_its_own_run_once_per_step(tmp_path: Path) -> None:
    rows = [
        {"run": "a", "kind": "eval", "step": 0, "reward_mean": 0.141},
        {"run": "a", "kind": "train", "step": 1, "reward_mean": 0.2, "gen_s": 1.0},
        {"run": "a", "kind": "train", "step": 2, "reward_mean": 0.3, "gen_s": 9.0},  # redone after resume
        {"run": "b", "kind": "eval", "step": 0, "reward_mean": 0.117},
        {"run": "b", "kind": "train", "step": 1, "reward_mean": 0.2, "gen_s": 100.0},
        {"run": "a", "kind": "train", "step": 2, "reward_mean": 0.4, "gen_s": 3.0},
        {"run": "a", "kind": "eval", "step": 2, "reward_mean": 0.5},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = read_metrics(path, run="a")
    assert [(r["kind"], r["step"]) for r in own] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert own[2]["reward_mean"] == 0.4
    table = summary_table(own, wall_s=10)
    assert "| eval reward before (step 0) | 0.141 |" in table and "| mean gen_s per step | 2.00 |" in table


def test_a_step_that_did_not_train_says_so() -> None:
    out = io.StringIO()
    p = StepProgress(36, out=out, clock=Clock())
    equal = {"reward_mean": 0.0, "pass_rate": 0.0, "rollouts": 32.0, "groups_used": 0.0, "gen_s": 3.0,
             "step_s": 3.0}
    p.step(4, equal)
    assert out.getvalue().splitlines()[-1].startswith(
        "step 4/36 | skipped: no reward variance: every group's rollouts got equal rewards (32 rollouts) | "
        "reward_mean 0 | pass_rate 0 | eta")
    p.step(5, {"reward_mean": 0.5, "rollouts": 32.0, "groups_used": 3.0, "loss": 0.1, "train_s": 2.0, "step_s": 6.0})
    assert "skipped" not in out.getvalue().splitlines()[-1]
    assert skipped_reason({"rollouts": 0.0, "groups_used": 0.0}) == "no completed rollouts"
    assert skipped_reason({"rollouts": 8.0, "pairs": 0.0}).startswith("no preference pair")
    assert skipped_reason({"rollouts": 8.0, "sft_rollouts": 0.0, "sequences": 0.0}).startswith("no example")
    assert skipped_reason({"rollouts": 8.0, "groups_used": 2.0, "sequences": 0.0}).startswith("no sampled tokens")


def test_a_step_whose_tool_calls_often_fail_to_parse_prints_a_warning() -> None:
    out = io.StringIO()
    p = StepProgress(10, out=out, clock=Clock())
    p.step(3, {"reward_mean": 0.9, "tool_parse_failed": 0.75, "tool_parse_attempts": 8.0, "step_s": 2.0})
    step_line, warning = out.getvalue().splitlines()[-2:]
    assert "tool_parse_failed 0.75" in step_line
    assert warning.startswith("warning: step 3: 6 of 8 replies that wrote a tool call did not parse "
                              "(tool_parse_failed 0.75 >= 0.2)")
    p.step(4, {"reward_mean": 0.9, "tool_parse_failed": 0.1, "tool_parse_attempts": 40.0, "step_s": 2.0})
    assert out.getvalue().splitlines()[-1].startswith("step 4/10")
    assert tool_parse_warning({"tool_parse_failed": 1.0, "tool_parse_attempts": 4.0}, "step 1") is None  # too few
    assert tool_parse_warning({"reward_mean": 1.0}, "step 1") is None  # no tools parsed
    assert tool_parse_warning({"tool_parse_failed": 0.2, "tool_parse_attempts": 5.0}, "eval @ step 2").startswith(
        "warning: eval @ step 2: 1 of 5")
    rows = [{"kind": "train", "step": 1, "tool_parse_failed": 0.5, "tool_parse_attempts": 4.0},
            {"kind": "train", "step": 2, "tool_parse_failed": 0.0, "tool_parse_attempts": 4.0},
            {"kind": "train", "step": 3, "tool_parse_failed": 0.0, "tool_parse_attempts": 0.0}]
    assert "| tool calls that did not parse (tool_parse_failed) | 0.250 (2 of 8) |" in summary_table(rows, wall_s=1)
