"""Prompt logprobs of the embedded engine, as SGLang's ``/generate`` gives them (``return_logprob`` with
``logprob_start_len``, ``top_logprobs_num``): they equal a direct forward pass's log-softmax of the same
model, whatever the request shares its prefill or batch with; ``max_new_tokens`` 0 only scores; bad values
are 400s; requests that do not ask answer as before."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tracegym.engine.runtime import EngineConfig
from tracegym.engine.server import create_app
from tracegym.modelfiles.load import load_model

PROMPT = [1, 9690, 314, 253, 1743, 30, 2, 4000, 17, 808]
OTHER = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    config = EngineConfig(model_path=tiny_model_dir, served_model_name="tiny-random", device="cpu", dtype="float32")
    with TestClient(create_app(config)) as c:
        yield c


@pytest.fixture(scope="module")
def direct(tiny_model_dir: Path):
    """Log-softmax of one forward pass of the whole prompt: row ``i`` is the distribution of token ``i + 1``."""
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return run


def gen(client: TestClient, ids: list[int], **body: Any) -> dict[str, Any]:
    body.setdefault("sampling_params", {"max_new_tokens": 2})
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check(meta: dict[str, Any], ids: list[int], start: int, lsm: torch.Tensor, top: int = 0) -> None:
    """``meta``'s input logprobs are ``lsm``'s (``direct``) from ``start`` on, in SGLang's shape."""
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == ids[start:] and triples[0][0] is None
    got = torch.tensor([t[0] for t in triples[1:]])
    expected = lsm[torch.arange(start, len(ids) - 1), torch.tensor(ids[start + 1 :], dtype=torch.long)]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    if not top:
        assert meta.get("input_top_logprobs", []) == []
        return
    rows = meta["input_top_logprobs"]
    assert len(rows) == len(ids) - start and rows[0] is None
    for pos, row in zip(range(start, len(ids) - 1), rows[1:], strict=True):
        values, token_ids = torch.topk(lsm[pos], top)
        assert [t[1] for t in row] == token_ids.tolist()  # most likely first
        torch.testing.assert_close(torch.tensor([t[0] for t in row]), values, atol=ATOL, rtol=0)


def test_prompt_logprobs_equal_a_direct_forward(client: TestClient, direct) -> None:
    lsm = direct(PROMPT)
    for start in (0, 1, 6, len(PROMPT) - 1):
        out = gen(client, PROMPT, logprob_start_len=start)
        check(out["meta_info"], PROMPT, start, lsm)
    out = gen(client, PROMPT, logprob_start_len=0, top_logprobs_num=4, return_text_in_logprobs=True)
    check(out["meta_info"], PROMPT, 0, lsm, top=4)
    assert all(isinstance(t[2], str) for t in out["meta_info"]["input_token_logprobs"])
    # the output side is unchanged: its first token's logprob is the prompt's last position's
    first = out["meta_info"]["output_token_logprobs"][0]
    assert first[0] == pytest.approx(float(lsm[-1, first[1]]), abs=ATOL)
    assert len(out["meta_info"]["output_top_logprobs"]) == 2


def test_max_new_tokens_zero_only_scores(client: TestClient, direct) -> None:
    out = gen(client, PROMPT, logprob_start_len=0, top_logprobs_num=2, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    check(meta, PROMPT, 0, direct(PROMPT), top=2)
    plain = gen(client, PROMPT, sampling_params={"max_new_tokens": 0})
    assert plain["meta_info"]["input_token_logprobs"] == []


def test_batches_samples_and_a_second_ask_give_the_same_logprobs(client: TestClient, direct) -> None:
    """Left-padded prompts of different lengths in one prefill, ``n`` samples of one prompt (scored once,
    copied), and the same prompt asked again (SGLang would serve it from its prefix cache; this engine
    keeps none and prefills it whole again)."""
    lsm_a, lsm_b = direct(PROMPT), direct(OTHER)
    both = gen(client, [PROMPT, OTHER], logprob_start_len=[2, 0], top_logprobs_num=3,
               sampling_params={"max_new_tokens": 3, "n": 2})
    assert len(both) == 4
    for item, ids, start, lsm in zip(both, [PROMPT, PROMPT, OTHER, OTHER], [2, 2, 0, 0],
                                     [lsm_a, lsm_a, lsm_b, lsm_b], strict=True):
        check(item["meta_info"], ids, start, lsm, top=3)
    again = gen(client, PROMPT, logprob_start_len=2, top_logprobs_num=3)
    check(again["meta_info"], PROMPT, 2, lsm_a, top=3)
    assert both[0]["meta_info"]["input_token_logprobs"] == both[1]["meta_info"]["input_token_logprobs"]


def test_a_request_joining_a_running_batch_is_scored_alone(client: TestClient, direct) -> None:
    """A scoring request admitted while another decodes: its prefill merges into the running batch; its
    logprobs, and the running request's, are what a direct forward of each gives."""
    sp = {"max_new_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(gen, client, OTHER, sampling_params=sp)
        deadline = time.monotonic() + 30
        while client.get("/server_info").json()["internal_states"][0]["running_requests"] == 0:
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.01)
        joined = gen(client, PROMPT, logprob_start_len=0, sampling_params={"max_new_tokens": 3})
        out = running.result(60)
    check(joined["meta_info"], PROMPT, 0, direct(PROMPT))
    ids = OTHER + out["output_ids"]
    lsm = direct(ids)
    expected = lsm[torch.arange(len(OTHER) - 1, len(ids) - 1), torch.tensor(out["output_ids"])]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_stream_chunks_carry_the_prompt_logprobs(client: TestClient) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2,
            "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as s:
        chunks = [json.loads(line.removeprefix("data: ")) for line in s.iter_lines() if line.startswith("data: {")]
    whole = gen(client, PROMPT, logprob_start_len=3, top_logprobs_num=2,
                sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert len(chunks) == 4
    for c in chunks:
        assert c["meta_info"]["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        assert c["meta_info"]["input_top_logprobs"] == whole["meta_info"]["input_top_logprobs"]


def test_requests_that_do_not_ask_answer_as_before(client: TestClient) -> None:
    out = gen(client, PROMPT, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2
    # without return_logprob, logprob_start_len is not read (as SGLang)
    r = client.post("/generate", json={"input_ids": PROMPT, "logprob_start_len": 99,
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and "input_token_logprobs" not in r.json()["meta_info"]


@pytest.mark.parametrize(("start", "message"), [
    (len(PROMPT), f"`logprob_start_len` ({len(PROMPT)}) must be less than the prompt's {len(PROMPT)} tokens"),
    (-2, "`logprob_start_len` must be an integer >= 0, or -1 for output logprobs only; got -2"),
    ("0", "`logprob_start_len` must be an integer >= 0, or -1 for output logprobs only; got '0'"),
    (True, "`logprob_start_len` must be an integer >= 0"),
    ([0, 1], "`logprob_start_len` has 2 items for 1 prompts"),
])
def test_bad_logprob_start_len_is_a_400(client: TestClient, start: Any, message: str) -> None:
    r = client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
