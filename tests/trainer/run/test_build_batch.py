"""``emitted_means``: what agents report with ``tg.emit``, averaged per evaluation; and its summary rows.
``tool_parse_stats``: how a step's tool calls parsed."""

from __future__ import annotations

import pytest

from tracegym.trainer.run.build_batch import emitted_means, sampled_segments, tool_parse_stats
from tracegym.trainer.run.report import summary_table


def ev(name: str, value: object) -> dict:
    return {"kind": "event", "name": name, "value": value}


def test_means_per_name_over_the_rollouts_that_emitted_it() -> None:
    rollouts = [
        {"events": [ev("tool_call", 1.0), ev("valid_call", True)]},
        {"events": [ev("tool_call", 0.0), ev("valid_call", False)]},
        {"events": [ev("tool_call", 1)]},  # no valid_call: not counted as 0 for it
        {"events": []},
        {},
    ]
    assert emitted_means(rollouts) == {"emitted/tool_call": pytest.approx(2 / 3),
                                       "emitted/valid_call": pytest.approx(0.5)}


def test_last_value_of_a_rollout_counts_and_non_numbers_and_own_events_are_left_out() -> None:
    rollouts = [{"events": [ev("turns", 1), ev("turns", 3), ev("note", "hello"), ev("attrs", None),
                            ev("tracegym.judge", 0.9), ev("", 1.0)]}]
    assert emitted_means(rollouts) == {"emitted/turns": 3.0}


def test_summary_shows_each_emitted_mean_before_and_after() -> None:
    rows = [
        {"kind": "eval", "step": 0, "reward_mean": 0.1, "emitted/tool_call": 0.125},
        {"kind": "train", "step": 1, "reward_mean": 0.2},
        {"kind": "eval", "step": 1, "reward_mean": 0.6, "emitted/tool_call": 0.75, "emitted/valid_call": 0.5},
    ]
    table = summary_table(rows, wall_s=5)
    assert "| eval tool_call (tg.emit mean) | 0.125 (step 0) -> 0.750 (step 1) |" in table
    assert "| eval valid_call (tg.emit mean) | 0.500 (step 1) -> 0.500 (step 1) |" in table
    assert "tool_call" not in summary_table(rows[1:2], wall_s=5)


def test_sampled_segments_counts_runs_of_sampled_tokens() -> None:
    assert sampled_segments([]) == 0
    assert sampled_segments([0, 0, 1, 1, 0, 0, 1, 0, 1]) == 3
    assert sampled_segments([1, 1, 1]) == 1


def test_tool_parse_failed_is_the_share_of_written_calls_that_did_not_parse() -> None:
    counts = [{"ok": 3, "failed": 1, "none": 4}, {"ok": 0, "failed": 2, "none": 0}, {"ok": 0, "failed": 0, "none": 0}]
    assert tool_parse_stats(counts) == {"tool_parse_failed": pytest.approx(3 / 6), "tool_parse_attempts": 6.0}
    assert tool_parse_stats([{"ok": 0, "failed": 0, "none": 5}]) == {"tool_parse_failed": 0.0,
                                                                    "tool_parse_attempts": 0.0}
    assert tool_parse_stats([{"ok": 0, "failed": 0, "none": 0}]) == {}  # no reply was parsed for tools
    assert tool_parse_stats([]) == {}
