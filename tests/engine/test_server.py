"""The embedded engine as a real process: SGLang's /generate contract, batching, pause/abort."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.procs import ManagedProcess, free_port, start_process
from tracegym.modelfiles.load import load_model

PROMPT = [1, 9690, 314, 253, 1743, 30, 2]  # any ids in the vocabulary


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with start_process(
        ["tracegym", "engine", "--model", "tiny-random", "--port", str(port)], port=port, log_path=log
    ) as p:
        yield p


@pytest.fixture(scope="module")
def client(engine: ManagedProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        yield c


def gen(client: httpx.Client, **body) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_token_in_token_out_with_logprob_triples(client: httpx.Client) -> None:
    out = gen(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
    )
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and isinstance(out["text"], str)
    assert out["output_ids"] == [t[1] for t in meta["output_token_logprobs"]]
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(PROMPT), 6, 0)
    assert meta["weight_version"] == "default" and meta["id"]
    with_text = gen(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 2},
        return_logprob=True,
        return_text_in_logprobs=True,
        rid="r-text",
    )
    assert all(isinstance(t[2], str) for t in with_text["meta_info"]["output_token_logprobs"])
    assert with_text["meta_info"]["id"] == "r-text"


def test_logprobs_are_the_unmodified_model_distribution(client: httpx.Client, tiny_model_dir: Path) -> None:
    sp = {"max_new_tokens": 8, "temperature": 0.6, "top_k": 20, "sampling_seed": 3, "ignore_eos": True}
    out = gen(client, input_ids=PROMPT, sampling_params=sp, return_logprob=True)
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
    expected = logprobs[torch.arange(8), torch.tensor(out["output_ids"])]
    got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_text_input_and_bad_requests(client: httpx.Client) -> None:
    out = gen(client, text="Hello there", sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["prompt_tokens"] >= 2
    for body in (
        {"sampling_params": {"max_new_tokens": 2}},  # no input
        {"text": "a", "input_ids": [1]},  # both
        {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}},  # unknown sampling key
        {"input_ids": [1, 10**9]},  # out of vocabulary
        {"input_ids": [1], "sampling_params": {"temperature": -1}},
    ):
        r = client.post("/generate", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"]
    assert client.post("/generate", content=b"{not json",
                       headers={"Content-Type": "application/json"}).status_code == 400


def test_stop_token_ids_end_generation_and_are_kept(client: httpx.Client) -> None:
    sp = {"max_new_tokens": 8, "sampling_seed": 11}
    base = gen(client, input_ids=PROMPT, sampling_params={**sp, "ignore_eos": True})
    ids = base["output_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = gen(
        client, input_ids=PROMPT, return_logprob=True, sampling_params={**sp, "stop_token_ids": [ids[k]]}
    )
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert len(out["meta_info"]["output_token_logprobs"]) == k + 1


def test_stop_string_is_trimmed_from_text_only(client: httpx.Client) -> None:
    base = gen(
        client,
        input_ids=PROMPT,
        return_logprob=True,
        return_text_in_logprobs=True,
        sampling_params={"max_new_tokens": 16, "sampling_seed": 5, "ignore_eos": True},
    )
    pieces = [t[2].strip() for t in base["meta_info"]["output_token_logprobs"][2:]]
    piece = next(p for p in pieces if p.isascii() and p.isalnum())
    sp = {"max_new_tokens": 16, "sampling_seed": 5, "stop": [piece]}
    out = gen(client, input_ids=PROMPT, sampling_params=sp)
    fr = out["meta_info"]["finish_reason"]
    assert fr == {"type": "stop", "matched": piece}
    assert piece not in out["text"] and base["text"].startswith(out["text"])
    kept = gen(client, input_ids=PROMPT, sampling_params={**sp, "no_stop_trim": True})
    assert piece in kept["text"]


def test_n_samples_and_seeds(client: httpx.Client) -> None:
    sp = {"max_new_tokens": 8, "n": 2, "sampling_seed": 7, "ignore_eos": True}
    out = client.post("/generate", json={"input_ids": PROMPT, "rid": "pair", "sampling_params": sp}).json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["pair_0", "pair_1"]
    assert out[0]["output_ids"] != out[1]["output_ids"]
    again = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    other = gen(client, input_ids=PROMPT, sampling_params={**sp, "n": 1, "sampling_seed": 8})
    assert other["output_ids"] != out[0]["output_ids"]


def test_stream_sends_cumulative_chunks_then_done(client: httpx.Client) -> None:
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) == 5
    for prev, cur in itertools.pairwise(chunks):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(cur["meta_info"]["output_token_logprobs"]) == len(cur["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def _stats(client: httpx.Client) -> dict:
    return client.get("/server_info").json()["internal_states"][0]


def _wait_running(client: httpx.Client, n: int = 1, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _stats(client)["running_requests"] < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.02)


def test_concurrent_requests_are_batched(client: httpx.Client) -> None:
    sp = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(lambda i: gen(client, input_ids=[*PROMPT, 100 + i], sampling_params=sp), range(8))
        )
    assert all(len(o["output_ids"]) == 40 for o in outs)
    assert _stats(client)["max_batch_size_seen"] >= 4  # n=2 elsewhere only reaches 2
    # Batching does not change greedy results: the same prompt alone gives the same tokens.
    solo = gen(client, input_ids=[*PROMPT, 103], sampling_params=sp)
    assert solo["output_ids"] == outs[3]["output_ids"]


def test_abort_request_by_rid(client: httpx.Client) -> None:
    sp = {"max_new_tokens": 5000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(gen, client, input_ids=PROMPT, rid="to-abort", sampling_params=sp)
        _wait_running(client)
        assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        out = fut.result(timeout=30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 5000


def test_stream_disconnect_aborts_the_request(client: httpx.Client, engine: ManagedProcess) -> None:
    before = _stats(client)["requests_aborted"]
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
    }
    with (
        httpx.Client(base_url=engine.base_url, timeout=30) as c,
        c.stream("POST", "/generate", json=body) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 10
    while _stats(client)["requests_aborted"] == before or _stats(client)["running_requests"]:
        assert time.monotonic() < deadline, "the disconnected stream kept running"
        time.sleep(0.05)


def test_pause_aborts_in_flight_and_holds_new_requests(client: httpx.Client) -> None:
    sp = {"max_new_tokens": 5000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(gen, client, input_ids=PROMPT, sampling_params=sp)
        _wait_running(client)
        r = client.post("/pause_generation", json={"mode": "abort"})
        assert r.status_code == 200 and r.json()["status"] == "ok"
        out = long.result(timeout=5)  # returned at once, with its partial output
        assert out["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < len(out["output_ids"]) < 5000
        held = pool.submit(gen, client, input_ids=PROMPT, sampling_params={"max_new_tokens": 3})
        time.sleep(1.0)
        assert not held.done()
        assert client.post("/flush_cache").status_code == 200  # held requests do not block a flush
        assert client.post("/continue_generation", json={}).status_code == 200
        assert held.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"


def test_info_endpoints(client: httpx.Client, tiny_model_dir: Path) -> None:
    assert client.get("/health").status_code == 200
    info = client.get("/model_info").json()
    assert info["model_path"] == str(tiny_model_dir) and info["tokenizer_path"] == str(tiny_model_dir)
    assert info["served_model_name"] == "tiny-random" and info["is_generation"] is True
    assert info["weight_version"] == "default"
    stats = _stats(client)
    assert stats["requests_served"] > 0 and stats["tokens_generated"] > 0


def test_batched_prompts_and_multi_stream(client: httpx.Client) -> None:
    body = {"input_ids": [PROMPT, PROMPT[:3]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 3}}
    out = client.post("/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 3]
    zero = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=body) as r:
        chunks = [json.loads(x.removeprefix("data: ")) for x in r.iter_lines() if x and x != "data: [DONE]"]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and all(len(c["output_ids"]) == 3 for c in finals.values())


def test_the_gateways_host_and_content_type_rules() -> None:
    """``server.HttpRules`` before every route: a rebound DNS name (or two Host headers) is a 421, a
    ``text/plain`` body a 415; a loopback bind gets the loopback names as its allow-list."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from tracegym.engine.server import HttpRules, allowed_hosts

    async def generate(request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = HttpRules(Starlette(routes=[Route("/generate", generate, methods=["POST"])]),
                    allowed_hosts=allowed_hosts("127.0.0.1"))
    with TestClient(app, base_url="http://127.0.0.1:30000") as c:
        assert c.post("/generate", json={"input_ids": [1]}).status_code == 200
        assert c.post("/generate", json={"input_ids": [1]}, headers={"Host": "evil.example"}).status_code == 421
        assert c.post("/generate", json={}, headers={"Host": "localhost:80:evil"}).status_code == 421
        assert c.post("/generate", content=b'{"input_ids": [1]}',
                      headers={"Content-Type": "text/plain"}).status_code == 415
    assert allowed_hosts("0.0.0.0") is None
