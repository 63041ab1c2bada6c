"""Upstream failures (down → 502, silent → 504), client disconnects mid-stream, and the gateway process
never importing torch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import REPO, MemoryRecorder, ServerThread, sse_payloads, start_fake
from tests.procs import free_port
from tracegym.gateway.app import create_app
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _gateway(upstream: str, **kw: object) -> tuple[ServerThread, MemoryRecorder]:
    rec = MemoryRecorder()
    settings = GatewaySettings(upstream_url=upstream, model=MODEL, store_url=None, **kw)
    return ServerThread(create_app(settings, recorder=rec)), rec


def test_upstream_down_is_502(tiny_model_dir: Path) -> None:
    srv, rec = _gateway(f"http://127.0.0.1:{free_port()}")
    with srv:
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "upstream_unavailable" and "unreachable" in err["message"]
        health = httpx.get(srv.url + "/healthz").json()
        assert health["status"] == "ok" and health["upstream"]["reachable"] is False
        calls = rec.wait_for(2)
        assert [c.status for c in calls] == ["error", "error"] and calls[0].prompt_ids
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'tracegym_gateway_upstream_errors_total{kind="sglang",status="502"} 2.0' in metrics


def test_upstream_timeout_is_504(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, "--delay", "2", tokenizer=tiny_model_dir) as fake:
        srv, rec = _gateway(fake.base_url, upstream_timeout=0.5)
        with srv:
            for stream in (False, True):
                t0 = time.monotonic()
                r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
                assert r.status_code == 504, r.text
                assert r.json()["error"]["code"] == "upstream_timeout"
                assert time.monotonic() - t0 < 3
            assert [c.status for c in rec.wait_for(2)] == ["error", "error"]


def test_client_disconnect_aborts_and_records_partial(tiny_model_dir: Path, tmp_path: Path) -> None:
    reply = " ".join(f"word{i}" for i in range(150))
    with start_fake(tmp_path, "--stream-delay", "0.02", tokenizer=tiny_model_dir, reply=reply) as fake:
        srv, rec = _gateway(fake.base_url)
        with srv:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              timeout=30) as r:
                seen = []
                for line in r.iter_lines():
                    seen += sse_payloads([line])
                    if len(seen) >= 5:
                        break  # leave with the stream still running
            (call,) = rec.wait_for(1, timeout=10)
            assert call.status == "error" and call.error == "client disconnected"
            total = len(ChatTokenizer.from_dir(tiny_model_dir).encode(reply)) + 1
            assert 0 < len(call.choices[0].output_ids) < total
            assert len(call.choices[0].output_logprobs) == len(call.choices[0].output_ids)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                aborted = httpx.get(fake.base_url + "/debug").json()["aborted"]
                if call.call_id in aborted:
                    break
                time.sleep(0.05)
            assert call.call_id in aborted


_TORCH_CHECK = """
import asyncio, sys
import httpx
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings

async def main():
    app = create_app(GatewaySettings(upstream_url=sys.argv[1], model="tiny-random", store_url=sys.argv[2]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions",
                             json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
    print("TORCH" if "torch" in sys.modules else "NO-TORCH", "transformers" in sys.modules)

asyncio.run(main())
"""


def test_gateway_never_imports_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, tokenizer=tiny_model_dir) as fake:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_CHECK, fake.base_url, f"sqlite:///{tmp_path / 'tg.db'}"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["NO-TORCH", "False"]


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_missing_upstream_url_fails_clearly(kind: str) -> None:
    from tracegym.gateway.app import build_upstream

    with pytest.raises(ValueError, match="needs an upstream URL"):
        build_upstream(GatewaySettings(upstream_kind=kind, store_url=None), session=None)  # type: ignore[arg-type]


def test_model_and_tokenizer_default_to_the_upstreams_model_info(tiny_model_dir: Path, tmp_path: Path) -> None:
    with start_fake(tmp_path, "--model-name", "served-by-upstream", tokenizer=tiny_model_dir) as fake:
        rec = MemoryRecorder()
        with ServerThread(create_app(GatewaySettings(upstream_url=fake.base_url, store_url=None),
                                     recorder=rec)) as srv:
            assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["served-by-upstream"]
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                           json={**CHAT, "model": "served-by-upstream"})
            assert r.status_code == 200 and r.json()["model"] == "served-by-upstream"
            assert rec.wait_for(1)[0].prompt_ids  # templated with the tokenizer model_info pointed at


async def test_unresolvable_tokenizer_fails_at_startup(tmp_path: Path) -> None:
    with start_fake(tmp_path) as fake:  # its model_info reports no tokenizer_path
        app = create_app(GatewaySettings(upstream_url=fake.base_url, store_url=None), recorder=MemoryRecorder())
        with pytest.raises(FileNotFoundError, match="no tokenizer found for model 'fake-model'"):
            async with app.router.lifespan_context(app):
                pass
