"""Nothing acknowledged is lost: ``kill -9`` of ``tracegym serve`` under load (calls, streams and rewards
from concurrent clients against the SGLang fake), then a restart on the same store, which must hold the
span of every call answered 200 (a stream: ``[DONE]``) and every reward answered 201. One kill per store
in CI; ``TRACEGYM_DURABILITY_KILLS=5`` repeats it (the figures in docs/security.md)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import orjson

from tests.procs import ManagedProcess, free_port, start_process
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.store import Store

REPO = Path(__file__).resolve().parents[2]
CLIENTS = 12
KILL_AFTER = 150
"""Acknowledged calls before the kill (the load keeps going until the gateway is gone)."""


def _serve(tmp: Path, upstream: str, model: Path, store_url: str, *extra: str) -> ManagedProcess:
    for attempt in range(3):  # a port drawn free may be taken before the gateway binds it: draw another
        port = free_port()
        argv = ["tracegym", "serve", "--port", str(port), "--upstream", upstream, "--model", str(model),
                "--store", store_url, "--log-level", "warning", *extra]
        try:
            return start_process(argv, port=port, log_path=tmp / f"gateway-{port}.log", health_path="/healthz",
                                 timeout=120)
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


class Load:
    """``CLIENTS`` threads, each in a loop: a call in a fresh rollout (every third one streamed), then a
    reward for it; what was acknowledged is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.calls: dict[str, str] = {}  # call_id -> rollout_id, answered as a success
        self.rewards: dict[str, str] = {}  # idempotency key -> rollout_id, answered 201
        self.enough = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _call(self, http: httpx.Client, rid: str, stream: bool) -> str | None:
        body = {"model": "m", "messages": [{"role": "user", "content": f"hi {rid}"}], "max_tokens": 8}
        url = f"{self.url}/rollouts/{rid}/v1/chat/completions"
        if not stream:
            r = http.post(url, json={**body, "model": self.model})
            return r.json()["id"] if r.status_code == 200 else None
        with http.stream("POST", url, json={**body, "model": self.model, "stream": True}) as r:
            lines = [x for x in r.iter_lines() if x] if r.status_code == 200 else []
        if not lines or lines[-1] != "data: [DONE]" or '"error"' in lines[-2]:
            return None
        return orjson.loads(lines[0][6:])["id"]

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=30) as http:
            while True:
                rid = f"ro-{i}-{n}"
                try:
                    call_id = self._call(http, rid, stream=n % 3 == 2)
                    if call_id is None:
                        return
                    with self.lock:
                        self.calls[call_id] = rid
                        if len(self.calls) >= KILL_AFTER:
                            self.enough.set()
                    key = f"rw-{rid}"
                    r = http.post(f"{self.url}/api/rollouts/{rid}/rewards",
                                  json={"value": 1.0, "idempotency_key": key})
                    if r.status_code != 201:
                        return
                    with self.lock:
                        self.rewards[key] = rid
                except httpx.HTTPError:  # the gateway is gone
                    return
                n += 1

    def start(self, model: str) -> None:
        self.model = model
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(60)


def _lost(store: Store, load: Load) -> tuple[list[str], list[str]]:
    stored: dict[str, set[str]] = {}
    for rid in set(load.calls.values()):
        stored[rid] = {s["call_id"] for s in list_spans(store, rid)}
    calls = [c for c, rid in load.calls.items() if c not in stored[rid]]
    rewards = [k for k, rid in load.rewards.items()
               if k not in {e["idempotency_key"] for e in store.list_events(rid, "reward")}]
    return calls, rewards


def test_kill_9_loses_no_acknowledged_call_or_reward(store_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    fake = start_process([sys.executable, "-m", "benchmarks.fake_sglang", "--port", str(port), "--tokenizer",
                          str(tiny_model_dir)], port=port, log_path=tmp_path / "fake.log", timeout=30,
                         env={"PYTHONPATH": str(REPO)})
    kills = int(os.environ.get("TRACEGYM_DURABILITY_KILLS", "1"))
    with fake:
        for run in range(kills):
            gw = _serve(tmp_path, fake.base_url, tiny_model_dir, store_url)
            try:
                load = Load(gw.base_url)
                load.start(str(tiny_model_dir))
                assert load.enough.wait(120), "the load never got going: " + gw.log()
                os.kill(gw.proc.pid, signal.SIGKILL)  # mid-load: clients are still sending
                gw.proc.wait(10)
                load.join()
            finally:
                gw.stop()
            # Restarted on the same store (with --durability async: the option is accepted and serves).
            with _serve(tmp_path, fake.base_url, tiny_model_dir, store_url, "--durability", "async") as again:
                rid = next(iter(load.calls.values()))
                assert httpx.get(f"{again.base_url}/api/rollouts/{rid}/spans", timeout=30).status_code == 200
                r = httpx.post(f"{again.base_url}/v1/chat/completions", timeout=30,
                               json={"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 200
            store = Store.open(store_url)
            try:
                lost_calls, lost_rewards = _lost(store, load)
            finally:
                store.close()
            print(f"kill {run + 1}/{kills}: {len(load.calls)} calls and {len(load.rewards)} rewards acknowledged, "
                  f"lost {len(lost_calls)} calls, {len(lost_rewards)} rewards")
            assert len(load.calls) >= KILL_AFTER
            assert lost_calls == [] and lost_rewards == []

