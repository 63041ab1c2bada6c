"""An idle engine gathers a burst before its first prefill (``engine/scheduler.py``): requests submitted one by
one, each within the quiet gap of the last, are prefilled in one forward; a lone request waits one quiet gap;
a steady stream is cut at the longest gather; a running batch takes arrivals at its next step as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tracegym.engine.request import GenRequest
from tracegym.engine.sampling import SamplingParams
from tracegym.engine.scheduler import Scheduler
from tracegym.modelfiles.load import load_model


@pytest.fixture(scope="module")
def parts(tiny_model_dir: Path) -> tuple[torch.nn.Module, Tokenizer]:
    return (load_model(tiny_model_dir, device="cpu", dtype="float32"),
            Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))


@contextmanager
def running(parts: tuple[torch.nn.Module, Tokenizer], **kw: float) -> Iterator[Scheduler]:
    model, tokenizer = parts
    s = Scheduler(model, tokenizer, device=torch.device("cpu"), max_batch_size=int(kw.pop("max_batch_size", 16)),
                  weight_version="v0", **kw)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _request(i: int, tokens: int = 4) -> tuple[GenRequest, Future]:
    done: Future = Future()

    def on_update(r: GenRequest, final: bool) -> None:
        if final:
            done.set_result(time.monotonic())

    req = GenRequest(rid=f"r{i}", input_ids=[5 + i, 6, 7, 8], generator=torch.Generator().manual_seed(i),
                     params=SamplingParams(max_new_tokens=tokens, ignore_eos=True), stop_ids=frozenset(),
                     on_update=on_update)
    return req, done


def _submit_spaced(s: Scheduler, n: int, gap_s: float, tokens: int = 4) -> list[Future]:
    futures = []
    for i in range(n):
        req, done = _request(i, tokens)
        s.submit([req])
        futures.append(done)
        time.sleep(gap_s)
    return futures


def test_a_burst_arriving_one_by_one_is_prefilled_in_one_forward(parts: tuple) -> None:
    with running(parts, gather_quiet_s=1.0, gather_max_s=10.0) as s:
        for f in _submit_spaced(s, 6, 0.01):
            f.result(timeout=60)
        assert s.stats.prefill_batches == 1 and s.stats.requests_served == 6


def test_without_gathering_the_first_arrival_is_prefilled_alone(parts: tuple) -> None:
    """The control of the test above: with gathering off, arrivals 0.1 s apart take more than one prefill."""
    with running(parts, gather_quiet_s=0.0) as s:
        for f in _submit_spaced(s, 4, 0.1):
            f.result(timeout=60)
        assert s.stats.prefill_batches >= 2 and s.stats.requests_served == 4


def test_a_lone_request_waits_one_quiet_gap_and_a_stream_is_cut_at_the_longest_gather(parts: tuple) -> None:
    with running(parts, gather_quiet_s=0.3, gather_max_s=0.6) as s:
        req, done = _request(0)
        t0 = time.monotonic()
        s.submit([req])
        waited = done.result(timeout=60) - t0
        assert 0.25 <= waited < 5.0, waited
        assert s.stats.prefill_batches == 1

        # one request every 0.1 s for 1.5 s, each within the quiet gap of the last: the gather ends at 0.6 s,
        # and the requests after it are prefilled apart (the running batch takes them at its steps)
        for f in _submit_spaced(s, 15, 0.1, tokens=200):
            f.result(timeout=60)
        assert s.stats.prefill_batches >= 1 + 2


def test_a_full_batch_ends_the_gather_at_once(parts: tuple) -> None:
    with running(parts, gather_quiet_s=5.0, gather_max_s=10.0, max_batch_size=4) as s:
        reqs = [_request(i) for i in range(4)]
        t0 = time.monotonic()
        s.submit([r for r, _ in reqs])
        finished = max(f.result(timeout=60) for _, f in reqs)
        assert finished - t0 < 4.0 and s.stats.prefill_batches == 1


def test_a_command_ends_the_gather(parts: tuple) -> None:
    with running(parts, gather_quiet_s=5.0, gather_max_s=10.0) as s:
        req, done = _request(0)
        s.submit([req])
        time.sleep(0.05)
        t0 = time.monotonic()
        assert s.call(lambda: "ran").result(timeout=3) == "ran"
        assert time.monotonic() - t0 < 3
        done.result(timeout=60)
