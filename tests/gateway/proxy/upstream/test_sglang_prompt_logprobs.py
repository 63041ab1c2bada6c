"""vLLM's ``prompt_logprobs``, ``return_tokens_as_token_ids`` and ``top_k`` on the gateway's completions route
over the SGLang-native upstream: the request fields parsed, the ``/generate`` payload that carries them
(``logprob_start_len``, ``top_logprobs_num``, ``sampling_params.top_k``), SGLang's input logprobs read back,
a swap continuation's re-post, and the reply's ``choices[i].prompt_logprobs``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tracegym.gateway.openai_errors import OpenAIError
from tracegym.gateway.proxy.openai_replies import completion_logprobs, prompt_logprob_entries
from tracegym.gateway.proxy.upstream.base import GenChoice, GenerateRequest, SamplingParams
from tracegym.gateway.proxy.upstream.continuation import JoinedChoice, continuation_request
from tracegym.gateway.proxy.upstream.sglang import generate_payload, parse_generate_response
from tracegym.gateway.proxy.validation import parse_chat, parse_completion

NO_TOKENIZER: Any = SimpleNamespace(tokenizer=None)


def _completion(**body: Any) -> Any:
    return parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, **body})


def test_the_fields_are_parsed() -> None:
    parsed = _completion(prompt_logprobs=3, return_tokens_as_token_ids=True, top_k=5)
    assert (parsed.prompt_logprobs, parsed.tokens_as_ids, parsed.sampling.top_k) == (3, True, 5)
    plain = _completion()
    assert (plain.prompt_logprobs, plain.tokens_as_ids, plain.sampling.top_k) == (None, False, None)
    assert _completion(top_k=-1).sampling.top_k is None and _completion(top_k=0).sampling.top_k is None
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 2,
                       "return_tokens_as_token_ids": True})
    assert (chat.sampling.top_k, chat.tokens_as_ids) == (2, True)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt_logprobs": 2, "stream": True}, "'prompt_logprobs' is not supported with 'stream': true"),
    ({"prompt_logprobs": 21}, "'prompt_logprobs' must be between 0 and 20, got 21"),
    ({"prompt_logprobs": True}, "'prompt_logprobs' must be an integer, got a boolean"),
    ({"top_k": -2}, "'top_k' must be between -1 and 1048576, got -2"),
])
def test_bad_fields_are_400s(body: dict[str, Any], message: str) -> None:
    with pytest.raises(OpenAIError) as e:
        _completion(**body)
    assert e.value.status == 400 and e.value.message == message


def _request(prompt_logprobs: int | None, top: int = 0, top_k: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid="r", operation="text_completion", input_ids=[1, 2, 3], logprobs=True,
                           top_logprobs=top, prompt_logprobs=prompt_logprobs,
                           sampling=SamplingParams(max_tokens=4, top_k=top_k))


def test_the_generate_payload_asks_sglang_for_them() -> None:
    payload = generate_payload(_request(2, top=1, top_k=7), stream=False)
    assert (payload["logprob_start_len"], payload["top_logprobs_num"]) == (0, 2)
    assert payload["sampling_params"]["top_k"] == 7 and payload["return_logprob"] is True
    assert generate_payload(_request(0), stream=False)["logprob_start_len"] == 0
    assert "top_logprobs_num" not in generate_payload(_request(0), stream=False)
    plain = generate_payload(_request(None, top=3), stream=False)
    assert "logprob_start_len" not in plain and plain["top_logprobs_num"] == 3
    assert "top_k" not in plain["sampling_params"]
    with pytest.raises(ValueError, match="without streaming only"):
        generate_payload(_request(2), stream=True)


def _item(input_lps: list | None, output_tops: list | None = None, reason: str = "length") -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": {"type": reason}, "prompt_tokens": 3, "weight_version": "v1",
                            "output_token_logprobs": [[-0.5, 9, None]],
                            "input_token_logprobs": [] if input_lps is None else [
                                [None, 1, None], [-1.0, 2, None], [-2.0, 3, None]]}
    if output_tops is not None:
        meta["output_top_logprobs"] = output_tops
        meta["input_top_logprobs"] = [] if input_lps is None else input_lps
    return {"text": "x", "output_ids": [9], "meta_info": meta}


def test_sglangs_input_logprobs_are_read_back() -> None:
    tops = [None, [[-1.0, 2, None], [-1.5, 8, None]], [[-0.5, 7, None], [-2.0, 3, None]]]
    out_tops = [[[-0.5, 9, None], [-0.7, 4, None]]]
    aborted_in_queue = _item(None, out_tops, reason="abort") | {"output_ids": []}
    result = parse_generate_response([aborted_in_queue, _item(tops, out_tops)], _request(2, top=1))
    pl = result.prompt_logprobs
    assert pl is not None and (pl.token_ids, pl.logprobs) == ([1, 2, 3], [None, -1.0, -2.0])
    assert pl.top is not None and pl.top[0] is None and [t.token_id for t in pl.top[2]] == [7, 3]
    # the output side keeps the one top logprob the request asked for, not the prompt's two
    assert [[t.token_id for t in row] for row in result.choices[1].top_logprobs] == [[9]]
    assert parse_generate_response(_item(tops, out_tops), _request(2, top=0)).choices[0].top_logprobs is None
    assert parse_generate_response(_item(tops, out_tops), _request(None)).prompt_logprobs is None


def test_a_continuation_asks_again_only_before_any_output() -> None:
    req = _request(2)
    fresh = JoinedChoice(0)
    again = continuation_request(req, fresh)
    assert again is not None and again.prompt_logprobs == 2 and again.input_ids == [1, 2, 3]
    started = JoinedChoice(0)
    started.add(GenChoice(index=0, output_ids=[9], logprobs=[-0.5]), "v1")
    later = continuation_request(req, started)
    assert later is not None and later.prompt_logprobs is None and later.input_ids == [1, 2, 3, 9]


def test_the_reply_has_vllms_prompt_logprobs() -> None:
    tops = [None, [[-1.0, 2, None], [-1.5, 8, None]], [[-0.5, 7, None], [-2.0, 3, None]]]
    pl = parse_generate_response(_item(tops, []), _request(2)).prompt_logprobs
    assert pl is not None
    entries = prompt_logprob_entries(NO_TOKENIZER, pl)
    assert entries[0] is None
    assert entries[1] == {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "2"},
                          "8": {"logprob": -1.5, "rank": 2, "decoded_token": "8"}}
    assert entries[2] == {"3": {"logprob": -2.0, "rank": 2, "decoded_token": "3"},
                          "7": {"logprob": -0.5, "rank": 1, "decoded_token": "7"}}
    no_tops = parse_generate_response(_item([]), _request(0)).prompt_logprobs
    assert no_tops is not None
    as_ids = prompt_logprob_entries(NO_TOKENIZER, no_tops, as_ids=True)
    assert as_ids[2] == {"3": {"logprob": -2.0, "rank": None, "decoded_token": "token_id:3"}}


def test_tokens_as_token_ids_name_every_logprob_entry() -> None:
    ch = parse_generate_response(_item(None, [[[-0.5, 9, None], [-0.7, 4, None]]]), _request(None, top=2)).choices[0]
    lp = completion_logprobs(NO_TOKENIZER, ch, as_ids=True)
    assert lp is not None
    assert lp["tokens"] == ["token_id:9"] and lp["top_logprobs"] == [{"token_id:9": -0.5, "token_id:4": -0.7}]
