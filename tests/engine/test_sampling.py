"""Pure sampling functions of the embedded engine."""

from __future__ import annotations

import pytest
import torch

from tracegym.engine.request import GenRequest
from tracegym.engine.sampling import (
    filtered_probs,
    find_stop_string,
    make_generator,
    parse_sampling_params,
    prompt_logprobs,
    sample_from,
    sample_rows,
)
from tracegym.engine.scoring import kept_columns, scoring_plan


def test_defaults_and_sglang_spellings() -> None:
    p = parse_sampling_params({})
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n) == (128, 1.0, 1.0, -1, 1)
    p = parse_sampling_params(
        {"top_k": 1 << 30, "stop": "x", "stop_token_ids": [7], "repetition_penalty": 1.0}
    )
    assert p.top_k == -1 and p.stop == ("x",) and p.stop_token_ids == (7,)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"max_tokens": 5}, "unknown sampling_params keys"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"max_new_tokens": "5"}, "max_new_tokens"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"frequency_penalty": 0.5}, "not supported"),
        ({"stop_regex": "("}, "stop_regex"),
    ],
)
def test_bad_params_are_rejected(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sampling_params(raw)


def test_logprobs_are_raw_log_softmax_whatever_the_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    params = [
        parse_sampling_params({"temperature": 0}),
        parse_sampling_params({"temperature": 0.3, "top_k": 5}),
        parse_sampling_params({"temperature": 1.7, "top_p": 0.5, "min_p": 0.01}),
    ]
    gens = [make_generator(i, "cpu") for i in range(3)]
    tokens, lps, _ = sample_rows(logits, params, gens, [(), (), ()])
    expected = torch.log_softmax(logits, -1)
    for i in range(3):
        assert lps[i] == pytest.approx(float(expected[i, tokens[i]]), abs=1e-6)
    assert tokens[0] == int(logits[0].argmax())


def test_seeded_sampling_is_reproducible_and_banned_ids_are_never_sampled() -> None:
    logits = torch.zeros(1, 20)
    logits[0, 3] = 10.0  # nearly always sampled unless banned
    p = [parse_sampling_params({"temperature": 1.0})]
    a = [sample_rows(logits, p, [make_generator(5, "cpu")], [()])[0][0] for _ in range(3)]
    assert len(set(a)) == 1
    g = make_generator(1, "cpu")
    banned = [sample_rows(logits, p, [g], [(3,)])[0][0] for _ in range(50)]
    assert 3 not in banned


def test_filters() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = filtered_probs(logits, parse_sampling_params({"top_k": 2}))
    assert (top2[2:] == 0).all() and top2.sum() == pytest.approx(1.0)
    nucleus = filtered_probs(logits, parse_sampling_params({"top_p": 0.5}))
    assert nucleus[0] > 0 and (nucleus[1:] == 0).all()  # p(top token) ≈ 0.64 > 0.5
    minp = filtered_probs(logits, parse_sampling_params({"min_p": 0.3}))
    assert (minp > 0).tolist() == [True, True, False, False, False]


def test_find_stop_string_earliest_match() -> None:
    p = parse_sampling_params({"stop": ["END", "b"], "stop_regex": [r"\d+"]})
    assert find_stop_string("aa b END 12", p) == (3, "b")
    assert find_stop_string("x 42 END", p) == (2, "42")
    assert find_stop_string("nothing", p) is None


def test_inverse_cdf_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2])
    g = make_generator(0, "cpu")
    draws = torch.tensor([sample_from(probs, g) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=5).float() / 4000
    assert counts[0] == 0 and counts[2] == 0
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_prompt_logprobs_in_chunks_equal_a_loop_over_positions() -> None:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (9,), generator=gen).tolist()
    start = 2
    logits = torch.randn(len(ids) - start, 50, generator=gen) * 3
    lps, tops = prompt_logprobs(logits, ids, start, 4, chunk_rows=3)
    whole_lps, whole_tops = prompt_logprobs(logits, ids, start, 4, chunk_rows=1000)
    assert lps[0] is None and tops is not None and tops[0] is None and len(lps) == len(tops) == len(ids) - start
    assert lps == whole_lps and tops == whole_tops
    for j in range(1, len(ids) - start):
        row = torch.log_softmax(logits[j - 1], -1)  # position start + j - 1 predicts token start + j
        assert lps[j] == pytest.approx(float(row[ids[start + j]]), abs=1e-6)
        assert [t for _, t in tops[j]] == torch.topk(row, 4).indices.tolist()
    assert prompt_logprobs(logits, ids, start, 0)[1] is None
    assert prompt_logprobs(logits[-1:], ids, len(ids) - 1, 2) == ([None], [None])
    with pytest.raises(ValueError, match=r"7 logit rows for prompt positions 1\.\.8"):
        prompt_logprobs(logits, ids, 1, 0)


def _req(ids: list[int], start: int = -1, top: int = 0, adapter: object = None) -> GenRequest:
    return GenRequest("r", ids, parse_sampling_params({}), torch.Generator(), frozenset(), return_logprob=True,
                      top_logprobs_num=top, logprob_start_len=start, adapter=adapter)


def test_scoring_plan_scores_each_distinct_prompt_once() -> None:
    lora = object()
    a, a2, a_lora = _req([1, 2, 3], 0), _req([1, 2, 3], 0), _req([1, 2, 3], 0, adapter=lora)
    a_top, b, plain = _req([1, 2, 3], 0, top=2), _req([4, 5, 6, 7], 1), _req([1, 2, 3])
    plain_part, scored, copies = scoring_plan([plain, a, a2, a_lora, a_top, b])
    assert scored == [a, a_lora, a_top, b]
    assert copies == [(a2, a)]
    assert plain_part == [plain, a2]
    assert kept_columns(scored) == 3  # b asks for positions 1..3 of 4
