"""Two gateway apps on one store (real uvicorn servers, the SGLang fake as the engine): a rollout's calls
alternate between them and each still continues the exact ids of the call before it, which the other app
served (``proxy/prefix_lookup.py``); so does a call to a third app started afterwards (a restart). The e2e test
with real PostgreSQL and a real engine is ``tests/e2e/test_replicas_pg.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import ServerThread, check_one_merged_sequence, sse_payloads, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("fake"), tokenizer=tiny_model_dir) as p:
        yield p


def _app(fake: ManagedProcess, store_url: str, **kw: object) -> ServerThread:
    return ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=store_url,
                                                   **kw)))


def _call(srv: ServerThread, rid: str, msgs: list[dict], stream: bool = False) -> tuple[str, dict, dict]:
    """``(call id, reply message, tracegym field)`` of one chat call of rollout ``rid``."""
    url = f"{srv.url}/rollouts/{rid}/v1/chat/completions"
    r = httpx.post(url, json={"model": MODEL, "messages": msgs, "max_tokens": 16, "stream": stream}, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        return body["id"], body["choices"][0]["message"], body["tracegym"]
    chunks = [p for p in sse_payloads(r.text.splitlines()) if p != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks[0]["id"], {"role": "assistant", "content": text}, chunks[-1].get("tracegym") or {}


def _lookups(srv: ServerThread, result: str) -> float:
    value = srv.app.state.metrics_registry.get_sample_value("tracegym_gateway_prefix_lookups_total",
                                                            {"result": result})
    return value or 0.0


@pytest.mark.parametrize("lookup", [True, False])
def test_calls_alternating_between_two_gateways_continue_each_other(fake, sqlite_url: str, lookup: bool) -> None:
    kw = {} if lookup else {"prefix_lookup_timeout_s": 0}
    rid, msgs, ids, prefixes = f"r-replicas-{lookup}", [{"role": "user", "content": "What is 2+3?"}], [], []
    with ExitStack() as stack:
        a, b = (stack.enter_context(_app(fake, sqlite_url, **kw)) for _ in range(2))
        for turn in range(4):
            call_id, reply, _ = _call((a, b)[turn % 2], rid, msgs, stream=turn == 2)
            ids.append(call_id)
            msgs = [*msgs, reply, {"role": "user", "content": f"And {turn}+1?"}]
        with _app(fake, sqlite_url, **kw) as c:  # a third gateway, or one restarted: its memory is empty
            ids.append(_call(c, rid, msgs)[0])
            spans = httpx.get(f"{c.url}/api/rollouts/{rid}/spans", timeout=30).json()["spans"]
            prefixes = [s["attributes"]["tracegym.prefix_len"] for s in spans]
            drifts = [s["attributes"]["tracegym.drift"] for s in spans]
            if lookup:
                check_one_merged_sequence(c.url, rid, ids)
                assert _lookups(c, "found") == 1
        if lookup:
            assert drifts == ["none"] + ["clean"] * 4
            assert prefixes[1:] == [len(s["prompt_ids"]) + len(s["choices"][0]["output_ids"]) for s in spans[:-1]]
            assert (_lookups(a, "found"), _lookups(b, "found")) == (1, 2)
        else:  # the fake's replies re-tokenize to the sampled ids, so only the reuse shows what was missed:
            # each gateway continues its own older call at best
            ends = [len(s["prompt_ids"]) + len(s["choices"][0]["output_ids"]) for s in spans]
            assert drifts == ["none", "none", "clean", "clean", "none"]
            assert prefixes == [0, 0, ends[0], ends[1], 0]
            assert _lookups(a, "found") == _lookups(b, "found") == 0
