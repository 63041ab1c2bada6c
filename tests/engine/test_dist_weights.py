"""The engine's distributed weight update (SGLang's routes, gloo on CPU): this test process is rank 0 and
broadcasts; the engine joins as rank 1. Staged buckets change nothing until ``/end_weight_update``; a
refused bucket (unknown name, wrong shape) is still received, and the update it belongs to applies
nothing; a body that cannot be received is refused before any broadcast. Joining the group of the name it
is in again (a trainer that restarted) replaces it; a group of another name is refused meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.procs import free_port, start_process
from tracegym.modelfiles.load import load_model
from tracegym.trainer.weights.distributed import group_broadcast, weight_update_group

PROMPT = [1, 4093, 28, 2, 1, 1032, 34]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine-d") / "engine.log"
    argv = ["tracegym", "engine", "--model", str(tiny_model_dir), "--port", str(port), "--weight-version", "v0"]
    with start_process(argv, port=port, log_path=log) as p, httpx.Client(base_url=p.base_url, timeout=60) as c:
        addr, mport = "127.0.0.1", free_port()
        body = {"master_address": addr, "master_port": mport, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.post, "/init_weights_update_group", json=body)
            pg = weight_update_group(addr, mport, 2, "weight_update_group", "gloo", timeout_s=60)
            r = fut.result(timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text
        held = [c, pg]  # the client and this side's group (a test may replace the group)
        yield held
        r = c.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
        assert r.json()["success"], r.text
        torch.distributed.destroy_process_group(held[1])


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(0)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]


def logprobs(c: httpx.Client) -> tuple[list[float], str]:
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = c.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "sampling_params": sp})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]


def push(c: httpx.Client, pg: Any, names: list[str], tensors: list[torch.Tensor], **extra: Any) -> httpx.Response:
    """Post one bucket and broadcast it meanwhile (the engine answers once it has received it)."""
    body = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "group_name": "weight_update_group", **extra}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(c.post, "/update_weights_from_distributed", json=body)
        group_broadcast(pg, "cpu")(tensors)
        return fut.result(timeout=60)


def test_a_bad_bucket_is_received_refused_and_its_update_applies_nothing(engine, perturbed) -> None:
    c, pg = engine
    before = logprobs(c)
    assert c.post("/begin_weight_update", json={"selector": "all"}).json()["success"]
    (n0, t0), (n1, t1) = perturbed[0], perturbed[1]
    assert push(c, pg, [n0], [t0.to(torch.bfloat16)]).status_code == 200
    r = push(c, pg, [n1, "no.such.weight"], [t1, torch.zeros(3)])
    assert r.status_code == 400 and r.json()["success"] is False and "no.such.weight" in r.text, r.text
    r = c.post("/end_weight_update", json={"weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False and "nothing applied" in r.text, r.text
    assert logprobs(c) == before
    # a shape mismatch outside a session: refused, nothing applied, the group still in step
    r = push(c, pg, [n0], [torch.zeros(2, 2)], weight_version="bad2")
    assert r.status_code == 400 and "shape" in r.text, r.text
    assert logprobs(c) == before


def test_malformed_bodies_are_refused_before_any_broadcast(engine) -> None:
    c, _ = engine
    for body in [{"names": ["a"], "dtypes": ["int8"], "shapes": [[1]]},
                 {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]},
                 {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "other"}]:
        r = c.post("/update_weights_from_distributed", json=body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
    r = c.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                    "rank_offset": 1, "world_size": 2, "backend": "gloo",
                                                    "group_name": "other"})
    assert r.status_code == 400 and "already in weight-update group 'weight_update_group'" in r.text, r.text
    assert c.post("/end_weight_update", json={}).status_code == 400  # no session open


def test_staged_buckets_replace_the_weights_only_at_end(engine, perturbed, tiny_model_dir: Path) -> None:
    c, pg = engine
    before, version = logprobs(c)
    half = len(perturbed) // 2
    assert c.post("/begin_weight_update", json={}).json()["success"]
    for part, extra in ((perturbed[:half], {}), (perturbed[half:], {"weight_version": "v1"})):
        r = push(c, pg, [n for n, _ in part], [t for _, t in part], **extra)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert logprobs(c) == (before, version)  # staged, not served
    r = c.post("/end_weight_update", json={})
    assert r.status_code == 200 and r.json()["success"], r.text
    after, version = logprobs(c)
    assert version == "v1" and after != before
    assert c.get("/model_info").json()["weight_version"] == "v1"
    name, want = perturbed[-1]
    got = c.post("/get_weights_by_name", json={"name": name, "truncate_size": 5}).json()
    assert got == pytest.approx(want.flatten()[:5].tolist())


def test_a_discarded_session_applies_nothing(engine, perturbed) -> None:
    """What a gateway sends when a bucket failed on another engine of its fleet (model_info says the
    engine stages updates): every bucket was received well, and still nothing is applied."""
    c, pg = engine
    assert c.get("/model_info").json()["staged_weight_updates"] is True
    before = logprobs(c)
    assert c.post("/begin_weight_update", json={}).json()["success"]
    r = push(c, pg, [n for n, _ in perturbed], [t for _, t in perturbed], weight_version="v-discarded")
    assert r.status_code == 200 and r.json()["success"], r.text
    r = c.post("/end_weight_update", json={"discard": True})
    assert r.status_code == 200 and r.json()["success"] and f"{len(perturbed)} staged" in r.text, r.text
    assert logprobs(c) == before
    assert c.post("/end_weight_update", json={}).status_code == 400  # the session is closed


def test_joining_the_same_group_again_replaces_it(engine, perturbed) -> None:
    """What a trainer that restarted, or lost its side of the group, does: it sets the group up again
    under the same name; the engine leaves its old one to join. Last in this file: the fixture's group
    is replaced here."""
    c, old = engine
    torch.distributed.destroy_process_group(old)  # this side's old group goes first: its name is taken
    addr, mport = "127.0.0.1", free_port()
    body = {"master_address": addr, "master_port": mport, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(c.post, "/init_weights_update_group", json=body)
        engine[1] = weight_update_group(addr, mport, 2, "weight_update_group", "gloo", timeout_s=60)
        r = fut.result(timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    before, _ = logprobs(c)
    moved = [t * 0.9 for _, t in perturbed]  # unlike every update before
    r = push(c, engine[1], [n for n, _ in perturbed], moved, weight_version="v-rejoined")
    assert r.status_code == 200 and r.json()["success"], r.text
    after, version = logprobs(c)
    assert version == "v-rejoined" and after != before
