"""Two `tracegym serve` replicas on one PostgreSQL store in front of one embedded engine (``tracegym engine
--model tiny-random``), all real processes, an admin key on both gateways.

- A rollout claimed from one gateway runs a six-call conversation (each call sends the previous messages,
  the reply and a new user turn) alternating between the two, with the rollout's token (derived from the
  admin key, so either gateway takes it). Its trajectory is one merged sequence whose mask-1 tokens are
  exactly the ids the engine sampled, as the gateways returned them: the gateway that did not serve the
  previous call finds it in the store and continues its ids (``proxy/prefix_lookup.py``). tiny-random samples
  random tokens, whose text rarely re-tokenizes into the same ids, so a gateway that rendered the
  conversation from text would split the sequence (TRACEGYM_PREFIX_LOOKUP_TIMEOUT_S=0 turns the lookup off
  and fails this test).
- Many queued rollouts claimed at once by threads on both gateways: no rollout is claimed twice, none is
  lost.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import sse_payloads
from tests.procs import ManagedProcess, free_port, fresh_pg_database, pg_available, start_process

pytestmark = pytest.mark.pg
MODEL = "tiny-random"
KEY = "replicas-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
TURNS = 6


@pytest.fixture(scope="module")
def pg_store() -> Iterator[str]:
    """A fresh PostgreSQL database for this module, dropped afterwards."""
    if not pg_available():
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    with fresh_pg_database("tg_replicas") as url:
        yield url


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, pg_store: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    tmp = tmp_path_factory.mktemp("e2e-replicas")
    port = free_port()
    with start_process(["tracegym", "engine", "--model", MODEL, "--port", str(port)], port=port,
                       log_path=tmp / "engine.log", timeout=240, env={"TRACEGYM_ENGINE_THREADS": "1"}) as engine:
        gateways = []
        for name in ("a", "b"):
            gw_port = free_port()
            argv = ["tracegym", "serve", "--upstream", engine.base_url, "--model", MODEL, "--port", str(gw_port),
                    "--store", pg_store]
            gateways.append(start_process(argv, port=gw_port, log_path=tmp / f"gateway-{name}.log",
                                          health_path="/healthz", timeout=240, env={"TRACEGYM_ADMIN_KEY": KEY}))
        with gateways[0] as a, gateways[1] as b:
            yield a, b


def _post(gw: ManagedProcess, path: str, body: dict, headers: dict = ADMIN) -> httpx.Response:
    r = httpx.post(gw.base_url + path, json=body, headers=headers, timeout=120)
    assert r.status_code in (200, 201), r.text
    return r


def _chat(gw: ManagedProcess, rid: str, token: str, msgs: list[dict], stream: bool) -> tuple[dict, list[int], str]:
    """One call of the rollout with its token: ``(reply message, sampled ids as returned, drift)``."""
    body = {"model": MODEL, "messages": msgs, "max_tokens": 12, "return_token_ids": True, "stream": stream}
    r = _post(gw, f"/rollouts/{rid}/v1/chat/completions", body, {"Authorization": f"Bearer {token}"})
    if not stream:
        out = r.json()
        return out["choices"][0]["message"], out["choices"][0]["token_ids"], out["tracegym"]["drift"]
    chunks = [p for p in sse_payloads(r.text.splitlines()) if p != "[DONE]"]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    ids = [i for d in deltas for i in d.get("token_ids") or []]
    return {"role": "assistant", "content": text}, ids, chunks[-1]["tracegym"]["drift"]


def test_a_conversation_alternating_between_replicas_is_one_token_exact_sequence(replicas) -> None:
    a, b = replicas
    enqueued = _post(a, "/api/tasks", {"tasks": [{"input": {"q": "chat"}}]}).json()["tasks"][0]["rollout_ids"]
    (claimed,) = _post(a, "/api/rollouts/claim", {"worker_id": "agent-1"}).json()["rollouts"]
    rid, token = claimed["rollout_id"], claimed["token"]
    assert [rid] == enqueued
    msgs: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    sampled, drifts = [], []
    for turn in range(TURNS):
        reply, ids, drift = _chat((a, b)[turn % 2], rid, token, msgs, stream=turn == 3)
        assert ids, "the gateway returned no token ids"
        sampled.append(ids)
        drifts.append(drift)
        msgs = [*msgs, reply, {"role": "user", "content": f"And then {turn}?"}]
    _post(b, f"/api/rollouts/{rid}/complete", {"worker_id": "agent-1", "reward": 1.0})

    spans = httpx.get(f"{b.base_url}/api/rollouts/{rid}/spans", headers=ADMIN, timeout=30).json()["spans"]
    assert [s["choices"][0]["output_ids"] for s in spans] == sampled
    r = httpx.get(f"{a.base_url}/api/rollouts/{rid}/trajectory", headers=ADMIN, timeout=30)
    traj = r.json()
    assert r.status_code == 200 and traj["excluded"] == [], traj
    assert len(traj["sequences"]) == 1, [s["call_ids"] for s in traj["sequences"]]
    seq = traj["sequences"][0]
    mask = seq["loss_mask"]
    assert [t for t, m in zip(seq["token_ids"], mask, strict=True) if m] == [t for ids in sampled for t in ids]
    assert ([lp for lp, m in zip(seq["logprobs"], mask, strict=True) if m]
            == [lp for s in spans for lp in s["choices"][0]["output_logprobs"]])
    assert seq["token_ids"] == spans[-1]["prompt_ids"] + sampled[-1]
    assert seq["call_ids"] == [s["call_id"] for s in spans] and traj["reward"] == 1.0
    for prev, span in pairwise(spans):  # each prompt continues the call before it
        head = prev["prompt_ids"] + prev["choices"][0]["output_ids"]
        assert span["prompt_ids"][: len(head)] == head
        assert span["attributes"]["tracegym.prefix_len"] == len(head)
    assert drifts[0] == "none" and set(drifts[1:]) <= {"clean", "realigned"}, drifts
    # the gateway that served the odd calls found the even calls' parents in the store, and the other way round
    found = [_lookups(gw, "found") for gw in (a, b)]
    assert found == [TURNS // 2 - 1, TURNS // 2], found


def _lookups(gw: ManagedProcess, result: str) -> float:
    text = httpx.get(gw.base_url + "/metrics", headers=ADMIN, timeout=30).text
    line = f'tracegym_gateway_prefix_lookups_total{{result="{result}"}} '
    return next((float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_concurrent_claims_on_both_replicas_never_share_a_rollout(replicas) -> None:
    a, b = replicas
    tasks = [{"input": {"i": i}} for i in range(60)]
    answer = _post(a, "/api/tasks", {"tasks": tasks, "group_size": 4}).json()["tasks"]
    enqueued = {rid for t in answer for rid in t["rollout_ids"]}
    assert len(enqueued) == 240
    threads, start = 8, threading.Barrier(8)
    claims: list[list[tuple[str, str, str]]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def worker(k: int) -> None:
        gw, rng = (a, b)[k % 2], random.Random(k)
        with httpx.Client(base_url=gw.base_url, headers=ADMIN, timeout=60) as client:
            start.wait()
            while True:
                body = {"worker_id": f"w{k}", "limit": rng.randint(1, 4), "lease_seconds": 600}
                r = client.post("/api/rollouts/claim", json=body)
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text}")
                    return
                got = r.json()["rollouts"]
                if not got:
                    return
                claims[k] += [(x["rollout_id"], x["worker_id"], x["status"]) for x in got]

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool) and not errors, errors
    ids = [rid for c in claims for rid, _, _ in c]
    assert len(ids) == len(set(ids)) == 240 and set(ids) == enqueued
    assert all(w == f"w{k}" and s == "running" for k, c in enumerate(claims) for _, w, s in c)
    assert all(sum(len(c) for c in claims[k::2]) for k in (0, 1)), [len(c) for c in claims]  # both replicas
    for rid, worker_id, _ in random.Random(0).sample([x for c in claims for x in c], 10):
        stored = httpx.get(f"{b.base_url}/api/rollouts/{rid}", headers=ADMIN, timeout=30).json()
        assert (stored["status"], stored["worker_id"]) == ("running", worker_id)
