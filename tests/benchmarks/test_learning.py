"""The learning benchmark's report: time to the target, and training time per 1,000 tokens trained (real and
padded)."""

from __future__ import annotations

import pytest

from benchmarks.learning import grpo, summary, time_to, time_to_best, train_s_per_1k_tokens


def _step(step: int, train_s: float, tokens: float, step_s: float = 10.0) -> dict[str, float]:
    return {"step": step, "gen_s": step_s - train_s, "train_s": train_s, "swap_s": 0.0, "step_s": step_s,
            "tokens": tokens, "loss_tokens": tokens / 3}


def test_training_time_is_compared_per_token_trained() -> None:
    # a side that trained twice the tokens in twice the time trains exactly as fast
    few = [_step(1, 2.0, 1000), _step(2, 4.0, 2000)]
    many = [_step(1, 4.0, 2000), _step(2, 8.0, 4000)]
    assert train_s_per_1k_tokens(few) == pytest.approx(2.0)
    assert train_s_per_1k_tokens(many) == pytest.approx(2.0)
    # a step that trained nothing (every group's rewards equal) adds neither time nor tokens
    assert train_s_per_1k_tokens([*few, _step(3, 0.01, 0)]) == pytest.approx(2.0)
    assert train_s_per_1k_tokens([_step(1, 0.01, 0)]) is None


def test_training_time_per_padded_token_counts_the_padding_the_forward_ran() -> None:
    # the same seconds for the same real tokens, but one side's rows differ in length: twice the padding
    even = [{**_step(1, 2.0, 1000), "padded_tokens": 1000.0}]
    ragged = [{**_step(1, 2.0, 1000), "padded_tokens": 2000.0}]
    assert train_s_per_1k_tokens(even) == train_s_per_1k_tokens(ragged) == pytest.approx(2.0)
    assert train_s_per_1k_tokens(even, tokens_key="padded_tokens") == pytest.approx(2.0)
    assert train_s_per_1k_tokens(ragged, tokens_key="padded_tokens") == pytest.approx(1.0)
    row = summary("product", {"steps": ragged, "startup_s": 0.0, "evals": []}, 0.6)
    assert row["train_s_per_1k_padded"] == pytest.approx(1.0) and row["padding"] == pytest.approx(2.0)


def test_the_first_training_step_is_reported_apart() -> None:
    # a cold first step (4 s for 500 padded tokens), then 1 s per 1,000; a step that trained nothing is skipped
    steps = [{**_step(1, 0.01, 0), "padded_tokens": 0.0}, {**_step(2, 4.0, 400), "padded_tokens": 500.0},
             {**_step(3, 1.0, 800), "padded_tokens": 1000.0}, {**_step(4, 2.0, 1600), "padded_tokens": 2000.0}]
    row = summary("product", {"steps": steps, "startup_s": 0.0, "evals": []}, 0.6)
    assert row["first_train"] == (4.0, 500.0)
    assert row["train_s_per_1k_padded_after_first"] == pytest.approx(1.0)
    assert row["train_s_per_1k_tokens_after_first"] == pytest.approx(1.25)
    assert row["train_s_per_1k_padded"] == pytest.approx(7000 / 3500)
    assert row["page_faults_after_first"] == 0.0  # these steps did not say


def test_page_faults_and_system_time_after_the_first_step() -> None:
    # the first step faults its memory in; after it, the median of the steps that trained
    steps = [{**_step(1, 4.0, 400), "page_faults": 900000.0, "sys_s": 3.0},
             {**_step(2, 0.01, 0), "page_faults": 50.0, "sys_s": 0.0},
             *({**_step(i, 1.0, 800), "page_faults": f, "sys_s": f / 500000} for i, f in
               ((3, 200000.0), (4, 100.0), (5, 150000.0)))]
    row = summary("product", {"steps": steps, "startup_s": 0.0, "evals": []}, 0.6)
    assert row["page_faults_after_first"] == 150000.0 and row["sys_s_after_first"] == pytest.approx(0.3)
    one = summary("bare", {"steps": steps[:1], "startup_s": 0.0, "evals": []}, 0.6)
    assert one["page_faults_after_first"] is None and one["sys_s_after_first"] is None


def test_summary_and_time_to_target() -> None:
    side = {"steps": [_step(1, 2.0, 1000), _step(2, 4.0, 3000), _step(3, 3.0, 2000)], "startup_s": 5.0,
            "evals": [{"step": 0, "reward": 0.1, "eval_s": 3.0}, {"step": 2, "reward": 0.7, "eval_s": 3.0}]}
    row = summary("bare", side, 0.6)
    assert row["median_train_s"] == 3.0 and row["tokens_per_step"] == pytest.approx(2000)
    assert row["train_s_per_1k_tokens"] == pytest.approx(1.5)
    assert row["time_to_target_s"] == time_to(side, 0.6) == 20.0
    assert time_to(side, 0.8) is None


def test_time_to_the_bare_loops_best_reward() -> None:
    # the bare loop's best is its earliest evaluation of the highest reward after training began
    bare = {"steps": [_step(i, 2.0, 1000) for i in (1, 2, 3, 4)],
            "evals": [{"step": 0, "reward": 0.5}, {"step": 2, "reward": 0.3}, {"step": 4, "reward": 0.3}]}
    fast = {"steps": [_step(i, 2.0, 1000, step_s=5.0) for i in (1, 2, 3, 4)],
            "evals": [{"step": 0, "reward": 0.1}, {"step": 2, "reward": 0.35}, {"step": 4, "reward": 0.2}]}
    tb, tq, best = time_to_best(bare, fast)
    assert best == {"step": 2, "reward": 0.3} and (tb, tq) == (20.0, 10.0)
    slow = {**fast, "evals": [{"step": 0, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 4, "reward": 0.3}]}
    assert time_to_best(bare, slow)[:2] == (20.0, 20.0)
    never = {**fast, "evals": [{"step": 0, "reward": 0.6}, {"step": 4, "reward": 0.29}]}
    assert time_to_best(bare, never)[1] is None
    assert time_to_best({**bare, "evals": bare["evals"][:1]}, fast) is None  # evaluated only before training


def test_a_swap_is_split_into_writing_the_weights_and_the_gateways_swap() -> None:
    swaps = [(2.6, 0.4, 2.2), (0.9, 0.4, 0.5), (0.6, 0.2, 0.4)]
    steps = [{**_step(i, 2.0, 1000), "swap_s": t, "swap_save_s": w, "swap_update_s": u}
             for i, (t, w, u) in enumerate(swaps, 1)]
    row = summary("product", {"steps": steps, "startup_s": 0.0, "evals": []}, 0.6)
    assert (row["median_swap_s"], row["median_swap_save_s"], row["median_swap_update_s"]) == (0.9, 0.4, 0.5)
    # the bare loop samples from the model it trains: no swap, and its rows have no split
    bare = summary("bare", {"steps": [_step(1, 2.0, 1000)], "startup_s": 0.0, "evals": []}, 0.6)
    assert bare["median_swap_s"] == bare["median_swap_save_s"] == bare["median_swap_update_s"] == 0.0


def test_grpo_drops_groups_whose_rewards_are_all_equal() -> None:
    adv = grpo([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert adv[:4] == [0.0] * 4
    assert adv[4] > 0 > adv[5] and sum(adv[4:]) == pytest.approx(0.0)
