"""The embedded engine in process, with faults injected: a failing prefill or weight swap answers the
callers with an error and the engine keeps serving; a dead model thread makes /health fail. Also the
streamed chunks (built off the model thread) and the tail-window stop-string check."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from tracegym.engine import kv_batch as kvb
from tracegym.engine import scheduler as scheduler_mod
from tracegym.engine.request import GenRequest
from tracegym.engine.runtime import EngineConfig
from tracegym.engine.sampling import find_stop_string, parse_sampling_params
from tracegym.engine.server import create_app

PROMPT = [1, 9690, 314, 253, 1743, 30, 2]
TIMEOUT = 60


def _client(model_dir: Path) -> TestClient:
    config = EngineConfig(model_path=model_dir, served_model_name="tiny-random", device="cpu")
    return TestClient(create_app(config))


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with _client(tiny_model_dir) as c:
        yield c


def _stats(client: TestClient) -> dict:
    return client.get("/server_info").json()["internal_states"][0]


def _wait_running(client: TestClient, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _stats(client)["running_requests"] == 0:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.02)


def _post(client: TestClient, body: dict):
    return client.post("/generate", json=body)


def _boom(*args, **kwargs):
    raise RuntimeError("injected failure")


def test_failing_prefill_answers_with_an_error(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    sp = {"max_new_tokens": 4, "ignore_eos": True}
    with monkeypatch.context() as m:
        m.setattr(kvb, "prefill_keep", _boom)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            r = pool.submit(_post, client, {"input_ids": PROMPT, "sampling_params": sp}).result(TIMEOUT)
        assert r.status_code == 500
        assert "injected failure" in r.json()["error"]["message"]
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": sp}
        with client.stream("POST", "/generate", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "injected failure" in json.loads(lines[0].removeprefix("data: "))["error"]["message"]
        assert _stats(client)["running_requests"] == 0 and _stats(client)["waiting_requests"] == 0
    # The engine still serves.
    r = _post(client, {"input_ids": PROMPT, "sampling_params": sp})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    assert client.get("/health").status_code == 200


def _long(rid: str) -> dict:
    """A request that generates until it is aborted (by ``rid``)."""
    return {"input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}


def test_failing_merge_fails_only_the_joining_request(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, client, _long("long"))
        _wait_running(client)
        with monkeypatch.context() as m:
            m.setattr(kvb, "merge", _boom)
            joining = pool.submit(
                _post, client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
            )
            r = joining.result(TIMEOUT)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        assert not running.done()
        assert client.post("/abort_request", json={"rid": "long"}).status_code == 200
        out = running.result(TIMEOUT)
    assert out.status_code == 200
    assert out.json()["meta_info"]["finish_reason"]["message"] == "Aborted"  # not an engine error


def test_failing_row_drop_fails_the_rest_and_delivers_the_finished(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, client, _long("drop-long"))
        _wait_running(client)
        with monkeypatch.context() as m:
            m.setattr(kvb, "select", _boom)
            short = pool.submit(_post, client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            short, long = short.result(TIMEOUT), running.result(TIMEOUT)
    assert short.status_code == 200 and len(short.json()["output_ids"]) == 2
    assert long.status_code == 500 and "injected failure" in long.json()["error"]["message"]
    assert _stats(client)["running_requests"] == 0
    r = _post(client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_a_delivered_request_no_longer_counts_as_running(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model thread may lose the CPU right after handing a final response over: the client that holds
    it must not still see its request running, nor the engine busy (the request leaves the running batch
    before its response is sent)."""
    deliver = scheduler_mod.Scheduler._deliver

    def deliver_then_stall(self: scheduler_mod.Scheduler, r: GenRequest) -> None:
        deliver(self, r)
        time.sleep(0.5)

    with monkeypatch.context() as m:
        m.setattr(scheduler_mod.Scheduler, "_deliver", deliver_then_stall)
        r = _post(client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        assert _stats(client)["running_requests"] == 0
        assert client.post("/flush_cache").status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_post, client, _long("stall"))
            _wait_running(client)
            assert client.post("/abort_request", json={"rid": "stall"}).status_code == 200
            assert running.result(TIMEOUT).json()["meta_info"]["finish_reason"]["message"] == "Aborted"
            assert _stats(client)["running_requests"] == 0


def _update(client: TestClient, path: Path, version: str):
    body = {"model_path": str(path), "weight_version": version}
    return client.post("/update_weights_from_disk", json=body)


def test_failing_weight_swap_keeps_serving_with_old_weights(
    client: TestClient, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = _post(client, {"input_ids": PROMPT, "sampling_params": sp}).json()
    version = before["meta_info"]["weight_version"]
    with monkeypatch.context() as m:
        m.setattr(scheduler_mod, "apply_state", _boom)
        # Applied at once (nothing in flight).
        r = _update(client, tiny_model_dir, "v-bad")
        assert r.status_code == 400 and r.json()["success"] is False
        assert "injected failure" in r.json()["message"]
        # Applied by the model loop once the in-flight request is done.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(_post, client, _long("w-long"))
            _wait_running(client)
            swap = pool.submit(_update, client, tiny_model_dir, "v-bad2")
            time.sleep(0.3)
            assert not swap.done()  # waits for the in-flight request
            assert client.post("/abort_request", json={"rid": "w-long"}).status_code == 200
            r = swap.result(TIMEOUT)
            assert running.result(TIMEOUT).status_code == 200
        assert r.status_code == 400 and r.json()["success"] is False
    assert client.get("/health").status_code == 200
    after = _post(client, {"input_ids": PROMPT, "sampling_params": sp}).json()
    assert after["meta_info"]["weight_version"] == version
    assert after["output_ids"] == before["output_ids"]
    # The weight lock was released: a good update goes through.
    r = _update(client, tiny_model_dir, "v-good")
    assert r.status_code == 200 and r.json()["success"] is True
    assert _post(client, {"input_ids": PROMPT, "sampling_params": sp}).json()["meta_info"][
        "weight_version"
    ] == ("v-good")


def test_stream_chunks_match_the_final_response(client: TestClient) -> None:
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    opts = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    whole = _post(client, {"input_ids": PROMPT, "sampling_params": sp, **opts}).json()
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {**sp, "stream_interval": 3}, **opts}
    with client.stream("POST", "/generate", json=body) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [3, 6, 9, 12]
    tok = Tokenizer.from_file(
        str(Path(client.get("/model_info").json()["tokenizer_path"]) / "tokenizer.json")
    )
    for c in chunks:
        n = len(c["output_ids"])
        meta, full = c["meta_info"], whole["meta_info"]
        assert c["output_ids"] == whole["output_ids"][:n]
        assert c["text"] == tok.decode(c["output_ids"], skip_special_tokens=True)
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"] == n
        assert meta["output_token_logprobs"] == full["output_token_logprobs"][:n]
        assert meta["output_top_logprobs"] == full["output_top_logprobs"][:n]
    for key in ("e2e_latency", "id"):
        chunks[-1]["meta_info"].pop(key)
        whole["meta_info"].pop(key)
    assert chunks[-1] == whole
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def _reference_finish(
    tok: Tokenizer, ids: list[int], stop: list[str], min_new: int
) -> tuple[int, tuple] | None:
    """The step and match at which the old check (full decode after every token) stops."""
    p = parse_sampling_params({"stop": stop, "min_new_tokens": min_new})
    for n in range(max(1, min_new), len(ids) + 1):
        hit = find_stop_string(tok.decode(ids[:n], skip_special_tokens=True), p)
        if hit is not None:
            return n, hit
    return None


def test_tail_window_stop_check_matches_full_decoding(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    checked = 0
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(120)]
        text = tok.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, 6)
            start = rng.randrange(max(1, len(text) - length))
            if text[start : start + length]:
                stops.append(text[start : start + length])
        stops = stops or ["\x00never"]
        min_new = rng.choice([0, 0, 5, 70])
        expected = _reference_finish(tok, ids, stops, min_new)
        p = parse_sampling_params({"stop": stops, "min_new_tokens": min_new, "max_new_tokens": 10_000})
        r = GenRequest(rid="t", input_ids=[1], params=p, generator=torch.Generator(), stop_ids=frozenset())
        got = None
        for t in ids:
            r.append(t, 0.0, None)
            r.check_finish(tok, 1 << 30)
            if r.finished:
                got = (len(r.output_ids), r.stop_text)
                assert r.finish_reason == {"type": "stop", "matched": r.stop_text[1]}
                break
        assert got == expected, (stops, min_new)
        checked += expected is not None and expected[0] > 60
    assert checked >= 5  # some matches came late enough for the tail window to matter


def test_dead_model_thread_fails_health_and_requests(tiny_model_dir: Path) -> None:
    with _client(tiny_model_dir) as c:
        assert c.get("/health").status_code == 200
        sched = c.app.state.engine.scheduler

        def broken() -> bool:
            raise RuntimeError("injected crash")

        sched._has_work = broken
        fut = sched.resume()  # wakes the thread, which dies on ``_has_work``
        with pytest.raises(RuntimeError):
            fut.result(timeout=TIMEOUT)
        sched._thread.join(TIMEOUT)
        assert not sched.alive()
        assert c.get("/health").status_code == 503
        assert c.get("/health_generate").status_code == 503
        r = _post(c, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 500 and "not running" in r.json()["error"]["message"]
