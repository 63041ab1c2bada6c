"""Weight swaps on two engines behind one gateway (``proxy/upstream/fleet_swap.py``), against SGLang
fakes run as real processes: a checkpoint under the gateway's weights root that one of them cannot read
(``--cannot-read``: an engine on a host without that volume) is one engine that cannot load.
All or none: a refused load rolls back the engine that loaded, to the engine's own model before any swap
and to the fleet's last weights after one; ``GET /api/weights`` shows one version; a distributed swap
reaches both (ranks split over the engines) and a second swap meanwhile is a 409, and one that fails
on either engine changes neither (staged: discarded; loaded on receipt: rolled back); an engine that was
away during a swap catches up before it rejoins; calls in flight on both engines are continued."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.app_support import SWAP_REPLY, start_fake
from tests.gateway.proxy.upstream.fleet_support import (
    chat,
    debug,
    engine,
    fleet_gateway,
    kill,
    upstreams,
    wait_until,
)
from tests.procs import ManagedProcess


@pytest.fixture()
def two(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[ManagedProcess, ManagedProcess, Path]]:
    """Engines A (it reads ``ckpt/``) and B (it cannot), and a weights directory both can read."""
    (tmp_path / "ckpt").mkdir()
    shared = tmp_path / "weights-v1"
    shared.mkdir()
    with start_fake(tmp_path, tokenizer=tiny_model_dir) as a, \
            start_fake(tmp_path, "--cannot-read", str(tmp_path / "ckpt"), tokenizer=tiny_model_dir) as b:
        yield a, b, shared


def _update(srv: Any, model_path: str, version: str) -> httpx.Response:
    return httpx.post(srv.url + "/api/weights/update", json={"model_path": model_path, "weight_version": version},
                      timeout=60)


def _loads(fake: ManagedProcess) -> list[dict]:
    return [c["body"] for c in debug(fake)["controls"] if c["path"] == "/update_weights_from_disk"]


def _paths(fake: ManagedProcess) -> list[str]:
    return [c["path"] for c in debug(fake)["controls"]]


def _served_version(fake: ManagedProcess) -> str:
    return httpx.get(fake.base_url + "/model_info", timeout=10).json()["weight_version"]


def test_a_swap_reaches_every_engine_or_none(two, tiny_model_dir: Path, tmp_path: Path) -> None:
    a, b, shared = two
    with fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, rec):
        # 1. before any swap: B cannot read ckpt, A loaded it and goes back to its own model at v0
        r = _update(srv, str(tmp_path / "ckpt"), "v-bad")
        assert r.status_code == 400, r.text
        out = r.json()
        assert out["success"] is False and b.base_url in out["message"] and "not loaded on 1 of 2" in out["message"]
        assert _loads(a) == [{"model_path": str(tmp_path / "ckpt"), "weight_version": "v-bad"},
                             {"model_path": str(tiny_model_dir), "weight_version": "v0"}]
        assert _loads(b) == [{"model_path": str(tmp_path / "ckpt"), "weight_version": "v-bad"}]
        load = "/update_weights_from_disk"
        assert _paths(a) == ["/pause_generation", load, load, "/continue_generation"]  # rolled back while paused
        assert _paths(b) == ["/pause_generation", load, "/continue_generation"]
        assert [_served_version(f) for f in (a, b)] == ["v0", "v0"]
        assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == "v0"

        # 2. a directory both read: both move to v1, one version for the fleet
        r = _update(srv, str(shared), "v1")
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert [_served_version(f) for f in (a, b)] == ["v1", "v1"]
        weights = httpx.get(srv.url + "/api/weights").json()
        assert weights["weight_version"] == "v1" and weights["last_swap"]["success"] is True
        assert [e["weight_version"] for e in upstreams(srv)["engines"]] == ["v1", "v1"]

        # 3. refused again: A goes back to the fleet's last weights (v1), not to its own model
        r = _update(srv, str(tmp_path / "ckpt"), "v-bad2")
        assert r.status_code == 400 and "rolled back to version v1" in r.json()["message"], r.text
        assert _loads(a)[-1] == {"model_path": str(shared), "weight_version": "v1"}
        assert [_served_version(f) for f in (a, b)] == ["v1", "v1"]
        assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == "v1"
        assert upstreams(srv)["weights_path"] == str(shared)
        # calls go on, on v1 everywhere (24 rollouts hashed over two engines: all on one has p = 2^-23;
        # 6 left it at 3 %, and once in CI they all went to one)
        for i in range(24):
            assert chat(srv, f"after-{i}").status_code == 200
        assert {c.weight_version for c in rec.wait_for(24)} == {"v1"}
        assert {c.upstream for c in rec.records} == {a.base_url, b.base_url}


def test_an_engine_away_during_a_swap_catches_up_before_it_rejoins(two, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    a, b, shared = two
    with fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, _rec):
        kill(b)
        wait_until(lambda: not engine(srv, b.base_url)["healthy"], what="B out of the rotation")
        r = _update(srv, str(shared), "v1")  # reaches the engines in the rotation
        assert r.status_code == 200 and r.json()["success"], r.text
        port = int(b.base_url.rsplit(":", 1)[1])
        with start_fake(tmp_path, tokenizer=tiny_model_dir, port=port) as b2:
            wait_until(lambda: engine(srv, b.base_url)["healthy"], what="B back in the rotation")
            assert _loads(b2) == [{"model_path": str(shared), "weight_version": "v1"}]
            assert _served_version(b2) == "v1" and engine(srv, b.base_url)["weight_version"] == "v1"


def _distributed(srv: Any, out: dict[str, Any]) -> None:
    body = {"weight_version": "v-dist", "buckets": [{"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]]}]}
    with httpx.stream("POST", srv.url + "/api/weights/distributed/update", json=body, timeout=60) as r:
        out["status"] = r.status_code
        out["events"] = [json.loads(line) for line in r.iter_lines() if line]


def test_distributed_swap_reaches_both_and_a_second_swap_meanwhile_is_409(two, tmp_path: Path) -> None:
    a, b, shared = two
    with fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, _rec):
        bad = httpx.post(srv.url + "/api/weights/distributed/init", timeout=30, json={
            "master_address": "127.0.0.1", "master_port": 29500, "world_size": 4, "backend": "gloo"})
        assert bad.status_code == 400 and "split evenly over 2 engines" in bad.json()["message"]
        r = httpx.post(srv.url + "/api/weights/distributed/init", timeout=30, json={
            "master_address": "127.0.0.1", "master_port": 29500, "world_size": 5, "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        inits = [[c["body"]["rank_offset"] for c in debug(f)["controls"]
                  if c["path"] == "/init_weights_update_group"] for f in (a, b)]
        assert inits == [[1], [3]]  # 2 ranks each after the trainer's rank 0

        out: dict[str, Any] = {}
        t = threading.Thread(target=_distributed, args=(srv, out))
        t.start()
        wait_until(lambda: all("/update_weights_from_distributed" in _paths(f) for f in (a, b)),
                   what="both engines waiting for the broadcast")
        busy = _update(srv, str(shared), "v1")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "swap_in_progress"
        for f in (a, b):  # the trainer's one broadcast reaches both
            httpx.post(f.base_url + "/debug/broadcast", json={"names": ["w"]}, timeout=10)
        t.join(timeout=60)
        assert out["status"] == 200 and out["events"][-1]["success"] is True, out
        assert [_served_version(f) for f in (a, b)] == ["v-dist", "v-dist"]
        assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == "v-dist"
        for f in (a, b):
            assert _paths(f)[-6:] == ["/pause_generation", "/flush_cache", "/begin_weight_update",
                                      "/update_weights_from_distributed", "/end_weight_update",
                                      "/continue_generation"]
        assert upstreams(srv)["weights_path"] is None  # no directory holds v-dist


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "sglang"])
def test_a_distributed_swap_that_fails_on_one_engine_changes_no_engine(staged: bool, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """B refuses the bucket that A loaded: engines that stage the session (the embedded engine) are told
    to discard it; engines that loaded it on receipt (SGLang) load their previous weights from disk. Either
    way both serve v0 afterwards, in the rotation, and the swap reports failure naming B."""
    extra = ("--staged",) if staged else ()
    with start_fake(tmp_path, *extra, tokenizer=tiny_model_dir) as a, \
            start_fake(tmp_path, *extra, tokenizer=tiny_model_dir) as b, \
            fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, _rec):
        r = httpx.post(srv.url + "/api/weights/distributed/init", timeout=30, json={
            "master_address": "127.0.0.1", "master_port": 29500, "world_size": 3, "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        out: dict[str, Any] = {}
        t = threading.Thread(target=_distributed, args=(srv, out))
        t.start()
        wait_until(lambda: all("/update_weights_from_distributed" in _paths(f) for f in (a, b)),
                   what="both engines waiting for the broadcast")
        httpx.post(a.base_url + "/debug/broadcast", json={"names": ["w"]}, timeout=10)
        httpx.post(b.base_url + "/debug/broadcast", json={"names": ["not-w"]}, timeout=10)  # B fails it
        t.join(timeout=60)
        done = out["events"][-1]
        assert out["status"] == 200 and done["success"] is False and b.base_url in done["message"], out
        ends = [[c["body"] for c in debug(f)["controls"] if c["path"] == "/end_weight_update"] for f in (a, b)]
        if staged:
            assert ends == [[{"discard": True}], [{"discard": True}]]
            assert "nothing applied" in done["message"]
            assert _loads(a) == _loads(b) == []
            tail = ["/update_weights_from_distributed", "/end_weight_update", "/continue_generation"]
        else:  # A loaded v-dist on receipt; both load the model they started with, at v0, while paused
            assert ends == [[{}], [{}]]
            assert "rolled back to version v0" in done["message"]
            assert _loads(a) == _loads(b) == [{"model_path": str(tiny_model_dir), "weight_version": "v0"}]
            tail = ["/update_weights_from_distributed", "/end_weight_update", "/update_weights_from_disk",
                    "/continue_generation"]
        for f in (a, b):
            assert _paths(f)[-len(tail):] == tail
        assert [_served_version(f) for f in (a, b)] == ["v0", "v0"]
        assert httpx.get(srv.url + "/api/weights").json()["weight_version"] == "v0"
        assert all(engine(srv, f.base_url)["healthy"] for f in (a, b))


def test_calls_in_flight_on_both_engines_are_continued_across_a_fleet_swap(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """Both engines paused at once: each one's cut call is re-sent to its own engine with its output so
    far once every engine has loaded, so each span's tokens are part v0, part v1."""
    slow = ("--token-delay", "0.03")
    shared = tmp_path / "weights-v1"
    shared.mkdir()
    with start_fake(tmp_path, *slow, tokenizer=tiny_model_dir, reply=SWAP_REPLY) as a, \
            start_fake(tmp_path, *slow, tokenizer=tiny_model_dir, reply=SWAP_REPLY) as b, \
            fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, rec):
        fleet = srv.services.upstream
        rids = [next(f"ro-{i}" for i in range(100) if fleet.pick(f"ro-{i}").url == f.base_url) for f in (a, b)]
        results: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda r=r: results.setdefault(r, chat(srv, r, "count", max_tokens=30)))
                   for r in rids]
        for t in threads:
            t.start()
        wait_until(lambda: all(e.inflight == 1 for e in fleet.engines), what="a call in flight on each engine")
        time.sleep(0.25)  # ~8 of 30 tokens generated
        swap = _update(srv, str(shared), "v1")
        assert swap.status_code == 200 and swap.json()["success"], swap.text
        for t in threads:
            t.join(timeout=60)
        assert all(results[r].status_code == 200 for r in rids), {r: results[r].text for r in rids}
        calls = {c.rollout_id: c for c in rec.wait_for(2)}
        for rid, fake in zip(rids, (a, b), strict=True):
            call = calls[rid]
            assert call.upstream == fake.base_url and call.weight_version == "v1"
            spans = [(w.version, w.start, w.end) for w in call.choices[0].weight_versions]
            assert [v for v, _, _ in spans] == ["v0", "v1"] and spans[-1][2] == 30, spans
            assert [r["rid"] for r in debug(fake)["requests"]] == [call.call_id, call.call_id + "-c1"]
