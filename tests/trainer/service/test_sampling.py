"""A Tinker sample request checked, turned into the gateway's completions body, and the gateway's answer read
back (``trainer/service/sampling.py``), without a service."""

from __future__ import annotations

from typing import Any

import pytest

from tracegym.trainer.service.sampling import completion_body, parse_sample, read_completion
from tracegym.trainer.service.wire import BadInput, TopK

PROMPT = [5, 6, 7, 8]


def _body(**fields: Any) -> dict[str, Any]:
    return {"prompt": {"chunks": [{"tokens": PROMPT, "type": "encoded_text"}]}, "num_samples": 2,
            "sampling_params": {"max_tokens": 3}, **fields}


def _ask(**fields: Any) -> Any:
    return parse_sample(_body(**fields), max_length=64, model="m")


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not supported by tracegym's sampler"),
    ({"record_stability_info": True}, "record_stability_info is not supported by tracegym's sampler"),
    ({"target_prompt_logprobs": {"data": [1]}}, "target_prompt_logprobs is not supported by tracegym's sampler"),
    ({"topk_sample_logprobs": 21}, "topk_sample_logprobs must be an integer in 0..20, got 21"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4},
     "prompt_logprobs_last_n must be an integer in 1..3 (the prompt has 4 tokens), got 4"),
    ({"sampling_params": {"top_k": -5}}, "sampling_params.top_k must be -1 (every token) or an integer in 1.."),
    ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens must be an integer >= 1, got 0"),
])
def test_bad_requests_say_what_is_valid(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BadInput) as e:
        _ask(**fields)
    assert str(e.value).startswith(message)


def _sized(prompt: int, max_tokens: int | None) -> dict[str, Any]:
    return _body(prompt={"chunks": [{"tokens": [5] * prompt}]}, sampling_params={"max_tokens": max_tokens})


@pytest.mark.parametrize(("prompt", "max_tokens", "message"), [
    (64, None, "the prompt has 64 tokens; m's context is 64 tokens, which must hold the prompt and at least one "
               "sampled token: shorten the prompt to at most 63"),
    (60, 5, "the prompt's 60 tokens and max_tokens 5 make 65, more than m's context of 64 tokens: lower "
            "max_tokens to at most 4 or shorten the prompt"),
])
def test_a_sample_longer_than_the_context_names_the_lengths(prompt: int, max_tokens: int | None,
                                                            message: str) -> None:
    with pytest.raises(BadInput) as e:
        parse_sample(_sized(prompt, max_tokens), max_length=64, model="m")
    assert str(e.value) == message


def test_a_sample_that_just_fits_the_context_is_taken() -> None:
    for prompt, max_tokens in ((63, None), (60, 4), (63, 1)):
        assert len(parse_sample(_sized(prompt, max_tokens), max_length=64, model="m").prompt) == prompt


def test_the_completions_body_asks_for_what_the_request_asks() -> None:
    plain = completion_body(_ask(), "m")
    assert plain["logprobs"] == 0 and "prompt_logprobs" not in plain and "top_k" not in plain
    assert "return_tokens_as_token_ids" not in plain
    asked = completion_body(_ask(prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2,
                                 sampling_params={"top_k": 4, "max_tokens": 3}), "m")
    assert (asked["prompt_logprobs"], asked["logprobs"], asked["top_k"]) == (3, 2, 4)
    assert asked["return_tokens_as_token_ids"] is True
    assert completion_body(_ask(topk_prompt_logprobs=1), "m")["prompt_logprobs"] == 1
    assert completion_body(_ask(prompt_logprobs=True), "m")["prompt_logprobs"] == 0


def _entry(token: int, lp: float, *alternatives: tuple[int, float]) -> dict[str, Any]:
    ranks = {t: r for r, (t, _) in enumerate(alternatives, 1)}
    out = {str(token): {"logprob": lp, "rank": ranks.get(token)}}
    out |= {str(t): {"logprob": v, "rank": r} for r, (t, v) in enumerate(alternatives, 1)}
    return out


ANSWER = {"choices": [
    {"index": 1, "token_ids": [3], "finish_reason": "length",
     "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:3": -0.5, "token_id:1": -0.9}]}},
    {"index": 0, "token_ids": [9, 99, 4], "finish_reason": "length",
     "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0], "top_logprobs": [
         {"token_id:2": -0.1, "token_id:9": -1.0}, {"token_id:99": -2.0, "token_id:4": -2.5}, {"token_id:4": -3.0}]},
     "prompt_logprobs": [None, _entry(6, -4.0, (1, -0.5), (2, -0.6)), _entry(7, -0.2, (7, -0.2), (3, -1.0)),
                         _entry(8, -1.5, (2, -1.0), (8, -1.5))]},
]}


def test_the_answer_is_read_back_in_the_sdks_shapes() -> None:
    ask = _ask(prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=2,
               sampling_params={"max_tokens": 3, "stop": [99]})
    res = read_completion(ANSWER, ask)
    first, second = res.sequences
    # a Tinker stop token id ends its sequence after it; its top-k rows are cut with it
    assert (first.tokens, first.logprobs, first.stop_reason) == ([9, 99], [-1.0, -2.0], "stop")
    assert first.topk == TopK(2, [[(2, -0.1), (9, -1.0)], [(99, -2.0), (4, -2.5)]])
    assert (second.tokens, second.stop_reason) == ([3], "length")
    assert res.prompt_logprobs == [None, -4.0, -0.2, -1.5]
    assert res.topk_prompt == TopK(2, [None, [(1, -0.5), (2, -0.6)], [(7, -0.2), (3, -1.0)], [(2, -1.0), (8, -1.5)]])
    tail = read_completion(ANSWER, _ask(prompt_logprobs=True, prompt_logprobs_last_n=2, topk_prompt_logprobs=1))
    assert tail.prompt_logprobs == [None, None, -0.2, -1.5]
    assert tail.topk_prompt == TopK(1, [None, None, [(7, -0.2)], [(2, -1.0)]])
    only_top = read_completion(ANSWER, _ask(topk_prompt_logprobs=1))
    assert only_top.prompt_logprobs is None and only_top.topk_prompt is not None
    assert read_completion(ANSWER, _ask()).prompt_logprobs is None
