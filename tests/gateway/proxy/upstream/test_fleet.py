"""Several engines behind one gateway (``proxy/upstream/fleet.py``), against SGLang fakes run as real
processes: a rollout's calls stay on one engine (``tracegym.upstream`` on its records), unattributed
calls spread by load, ``GET /api/upstreams``, an engine that never answers at start, a killed engine
whose rollouts move and whose in-flight stream is continued on another engine with its partial output,
503 when every engine is down, refusal to start on engines serving different models; and rendezvous
hashing moving few rollouts when an engine is added."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.app_support import SWAP_REPLY, sse_payloads, start_fake
from tests.gateway.proxy.upstream.fleet_support import (
    MODEL,
    chat,
    debug,
    engine,
    fleet_gateway,
    kill,
    upstreams,
    wait_until,
)
from tests.procs import ManagedProcess, free_port
from tracegym.gateway.proxy.upstream.fleet import FleetMismatch, UpstreamFleet, rendezvous_score
from tracegym.gateway.proxy.upstream.sglang import SGLangUpstream


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedProcess]]:
    tmp = tmp_path_factory.mktemp("fleetfakes")
    with start_fake(tmp, tokenizer=tiny_model_dir) as a, start_fake(tmp, tokenizer=tiny_model_dir) as b:
        yield [a, b]


def test_a_rollouts_calls_stay_on_one_engine_and_rollouts_spread(pair, tmp_path: Path) -> None:
    urls = [f.base_url for f in pair]
    with fleet_gateway(urls, tmp_path) as (srv, rec):
        for i in range(16):
            for turn in range(2):
                r = chat(srv, f"ro-{i}", f"turn {turn}")
                assert r.status_code == 200, r.text
        records = rec.wait_for(32)
        by_rollout: dict[str, set[str]] = {}
        for c in records:
            by_rollout.setdefault(c.rollout_id, set()).add(c.upstream)
        assert all(len(v) == 1 for v in by_rollout.values()), by_rollout
        per_engine = Counter(next(iter(v)) for v in by_rollout.values())
        assert set(per_engine) == set(urls), per_engine  # 16 rollouts on one engine: p = 2^-15
        fleet = srv.services.upstream
        assert all(next(iter(by_rollout[f"ro-{i}"])) == fleet.pick(f"ro-{i}").url for i in range(16))
        # the fakes saw exactly the calls the records say they served
        served = Counter(c.upstream for c in records)
        assert {f.base_url: len(debug(f)["requests"]) for f in pair} == {u: served[u] for u in urls}
        report = upstreams(srv)
        assert report["model"] == "fake-model" and report["weight_version"] == "v0"
        assert [(e["url"], e["healthy"], e["inflight"], e["calls"], e["weight_version"]) for e in report["engines"]] \
            == [(u, True, 0, served[u], "v0") for u in urls]


def test_unattributed_calls_go_to_the_least_loaded_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    slow = ("--token-delay", "0.4")  # 3.2 s per call: all four overlap
    with start_fake(tmp_path, *slow, tokenizer=tiny_model_dir) as a, \
            start_fake(tmp_path, *slow, tokenizer=tiny_model_dir) as b, \
            fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, rec):
        threads = [threading.Thread(target=chat, args=(srv, None)) for _ in range(4)]
        for t in threads:
            t.start()
            wait_until(lambda n=threads.index(t) + 1: sum(e.calls for e in srv.services.upstream.engines) >= n,
                       what="the call's engine picked")
        for t in threads:
            t.join(timeout=30)
        assert Counter(c.upstream for c in rec.wait_for(4)) == {a.base_url: 2, b.base_url: 2}


def test_an_engine_that_never_answers_starts_unhealthy_and_joins_when_it_does(
        pair, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    urls = [pair[0].base_url, late]

    def top(rid: str) -> str:
        return max(urls, key=lambda u: rendezvous_score(rid.encode(), u.encode()))

    ids = [r for r in (f"late-{i}" for i in range(200)) if top(r) == late][:3] + \
        [r for r in (f"late-{i}" for i in range(200)) if top(r) != late][:3]
    with fleet_gateway(urls, tmp_path) as (srv, rec):
        down = engine(srv, late)
        assert down["healthy"] is False and down["error"] and down["weight_version"] is None
        for rid in ids:
            assert chat(srv, rid).status_code == 200
        assert {c.upstream for c in rec.wait_for(6)} == {pair[0].base_url}
        with start_fake(tmp_path, tokenizer=tiny_model_dir, port=port):
            wait_until(lambda: engine(srv, late)["healthy"], what="the late engine's return")
            assert engine(srv, late)["weight_version"] == "v0"
            for rid in ids:  # the rollouts whose top engine it is go there now, the others stay
                assert chat(srv, rid).status_code == 200
            assert [c.upstream for c in rec.wait_for(12)[6:]] == [late] * 3 + [pair[0].base_url] * 3


def test_every_engine_down_is_a_503_in_openai_shape_and_no_good_call(tmp_path: Path) -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with fleet_gateway(urls, tmp_path) as (srv, rec):
        assert [e["healthy"] for e in upstreams(srv)["engines"]] == [False, False]
        r = chat(srv, "ro-down")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_healthy_upstream" and all(u in err["message"] for u in urls)
        assert err["type"]
        stream = chat(srv, "ro-down", stream=True)
        assert stream.status_code == 503 and stream.json()["error"]["code"] == "no_healthy_upstream"
        calls = rec.wait_for(2)
        assert [c.status for c in calls] == ["error", "error"] and all(not c.choices for c in calls)
        assert httpx.get(srv.url + "/healthz").json()["upstream"]["reachable"] is False


def _stream(srv: Any, rollout: str, out: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 30, "stream": True,
            "temperature": 0.7}
    with httpx.stream("POST", f"{srv.url}/rollouts/{rollout}/v1/chat/completions", json=body, timeout=60) as r:
        out["status"] = r.status_code
        out["events"] = sse_payloads(list(r.iter_lines()))


def test_a_killed_engines_stream_continues_on_another_and_its_rollouts_move(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    slow = ("--token-delay", "0.03")
    with start_fake(tmp_path, *slow, tokenizer=tiny_model_dir, reply=SWAP_REPLY) as a, \
            start_fake(tmp_path, *slow, tokenizer=tiny_model_dir, reply=SWAP_REPLY) as b, \
            fleet_gateway([a.base_url, b.base_url], tmp_path) as (srv, rec):
        fakes = {a.base_url: a, b.base_url: b}
        fleet = srv.services.upstream
        first = fleet.pick("ro-kill").url
        other = next(u for u in fakes if u != first)
        out: dict[str, Any] = {}
        t = threading.Thread(target=_stream, args=(srv, "ro-kill", out))
        t.start()
        # the gateway counts the call in flight before the engine has read it: wait for both
        wait_until(lambda: engine(srv, first)["inflight"] == 1 and debug(fakes[first])["requests"],
                   what="the stream on its engine")
        original = debug(fakes[first])["requests"][-1]
        time.sleep(0.3)  # ~10 of 30 tokens generated
        kill(fakes[first])
        t.join(timeout=60)
        assert out["status"] == 200
        chunks = [e for e in out["events"][:-1] if e.get("choices")]
        assert out["events"][-1] == "[DONE]" and not any("error" in e for e in out["events"][:-1])
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        call = rec.wait_for(1)[0]
        assert call.status == "ok" and call.upstream == other
        ch = call.choices[0]
        assert len(ch.output_ids) == 30 and len(ch.output_logprobs) == 30 and ch.finish_reason == "length"
        [cont] = debug(fakes[other])["requests"]
        k = len(cont["input_ids"]) - len(original["input_ids"])
        assert 0 < k < 30 and cont["input_ids"][: len(original["input_ids"])] == original["input_ids"]
        assert cont["input_ids"][len(original["input_ids"]):] == ch.output_ids[:k]
        assert cont["sampling_params"]["max_new_tokens"] == 30 - k and cont["rid"] == original["rid"] + "-c1"
        report = engine(srv, first)
        assert report["healthy"] is False and report["failovers"] == 1
        r = chat(srv, "ro-kill", "again")  # the rollout's next call goes to the live engine
        assert r.status_code == 200 and rec.wait_for(2)[1].upstream == other


def test_engines_serving_different_models_refuse_to_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tracegym.gateway.app import create_app
    from tracegym.gateway.settings import GatewaySettings

    with start_fake(tmp_path, "--model-name", "model-a", tokenizer=tiny_model_dir) as a, \
            start_fake(tmp_path, "--model-name", "model-b", tokenizer=tiny_model_dir) as b:
        app = create_app(GatewaySettings(upstream_url=a.base_url, upstream_urls=[b.base_url], model=MODEL,
                                         store_url=None))

        async def start() -> None:
            async with app.router.lifespan_context(app):
                pass

        with pytest.raises(FleetMismatch) as err:
            asyncio.run(start())
        msg = str(err.value)
        assert "different models" in msg and f"{a.base_url} serves 'model-a'" in msg and "'model-b'" in msg


def test_rendezvous_hashing_moves_only_the_new_engines_rollouts() -> None:
    def fleet(n: int) -> UpstreamFleet:
        return UpstreamFleet([(f"http://10.0.0.{i}:30000", SGLangUpstream(f"http://10.0.0.{i}:30000", None))  # type: ignore[arg-type]
                              for i in range(n)])

    two, three = fleet(2), fleet(3)
    keys = [f"rollout-{i}" for i in range(3000)]
    before = {k: two.pick(k).url for k in keys}
    after = {k: three.pick(k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://10.0.0.2:30000" for k in moved)  # only to the new engine
    assert 800 < len(moved) < 1200  # ~1/3 of the rollouts
    assert 1300 < Counter(before.values())["http://10.0.0.0:30000"] < 1700
    three.engines[2].healthy = False  # the new engine gone: every rollout back where it was
    assert {k: three.pick(k).url for k in keys} == before


def test_a_call_to_a_dead_engine_moves_before_any_health_check_notices(tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """The call path itself: no health check runs during the test (1 h apart), so the non-stream call
    that finds its engine gone is re-sent to the other one and the engine leaves the rotation."""
    with start_fake(tmp_path, tokenizer=tiny_model_dir) as a, start_fake(tmp_path, tokenizer=tiny_model_dir) as b, \
            fleet_gateway([a.base_url, b.base_url], tmp_path, upstream_health_interval_s=3600) as (srv, rec):
        fakes = {a.base_url: a, b.base_url: b}
        fleet = srv.services.upstream
        rid = next(f"ro-{i}" for i in range(100) if fleet.pick(f"ro-{i}").url == a.base_url)
        assert chat(srv, rid).status_code == 200
        kill(fakes[a.base_url])
        r = chat(srv, rid, "again")
        assert r.status_code == 200, r.text
        assert [c.upstream for c in rec.wait_for(2)] == [a.base_url, b.base_url]
        assert [c.status for c in rec.records] == ["ok", "ok"]
        gone = engine(srv, a.base_url)
        assert gone["healthy"] is False and gone["failovers"] == 1 and "failed a call" in gone["error"]
