"""A keyed, loopback-style gateway in front of the SGLang fake, tried as an attacker would (docs/security.md):
each security header sent twice on every route family, malformed Host headers, a rollout token after its
rollout ended, control characters in hot-route ids, deep nesting, ``n`` × tokens past the cap, unused
sampling fields, a NUL in a weights path, and the OTLP byte budget."""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import ServerThread, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings
from tracegym.http_rules import LOOPBACK_HOSTS

MODEL = "tiny-random"
KEY = "hardening-admin-key-7Hq2"
ADMIN = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
CAP = 256


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("hardfake"), tokenizer=tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("hard")
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{tmp / 'tg.db'}",
                               admin_key=KEY, weights_dir=str(tmp), allowed_hosts=list(LOOPBACK_HOSTS),
                               max_tokens_cap=CAP)
    with ServerThread(create_app(settings)) as srv:
        yield srv


def _claim(srv: ServerThread, n: int, max_attempts: int = 3) -> dict[str, str]:
    r = httpx.post(srv.url + "/api/tasks", json={"tasks": [{"input": {"q": 1}}], "group_size": n,
                                                   "max_attempts": max_attempts}, headers=ADMIN)
    assert r.status_code == 201, r.text
    claimed = httpx.post(srv.url + "/api/rollouts/claim", json={"worker_id": "w", "limit": n}, headers=ADMIN)
    return {r["rollout_id"]: r["token"] for r in claimed.json()["rollouts"]}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def raw_request(port: int, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[int, str]:
    """One request over a plain socket, headers as given (HTTP clients refuse to send two ``Host``)."""
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}",
             "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest.decode(errors="replace")


def _span_count(srv: ServerThread, rollout_id: str) -> int:
    r = httpx.get(srv.url + f"/api/rollouts/{rollout_id}/spans", headers=ADMIN)
    return len(r.json()["spans"]) if r.status_code == 200 else 0


def test_a_repeated_security_header_is_400_on_every_route_family(gw) -> None:
    srv = gw
    (a, token_a), (b, token_b) = _claim(srv, 2).items()
    stored = httpx.post(srv.url + "/v1/responses", json=RESPONSES, headers=_bearer(token_b), timeout=30)
    assert stored.status_code == 200, stored.text
    response_b = stored.json()["id"]
    spans_b = _span_count(srv, b)
    routes = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
              ("POST", "/v1/responses", RESPONSES), ("GET", f"/v1/responses/{response_b}", None),
              ("POST", "/v1/messages", MESSAGES), ("POST", "/v1/messages/count_tokens", MESSAGES),
              ("POST", f"/rollouts/{a}/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
              ("GET", f"/api/rollouts/{a}", None), ("POST", f"/api/rollouts/{a}/rewards",
                                                        {"value": 1.0, "idempotency_key": "dup"}),
              ("GET", "/healthz", None)]
    port = srv.port
    repeats = {  # the second copy is the one the first reading used to miss
        "X-Rollout-Id": (b, a), "X-Tracegym-Key": (token_b, token_a), "Authorization": (f"Bearer {token_b}",
                                                                                     f"Bearer {token_a}"),
        "x-api-key": (token_b, token_a), "Host": ("evil.example", f"localhost:{port}"),
    }
    with httpx.Client(timeout=30) as client:
        for name, (first, second) in repeats.items():
            for method, path, body in routes:
                headers = [(name, first), (name, second)]
                if name not in ("X-Tracegym-Key", "Authorization", "x-api-key"):
                    headers.append(("X-Tracegym-Key", token_a))
                if name == "Host":
                    raw = json.dumps(body).encode() if body is not None else b""
                    status, text = raw_request(port, method, path, [*headers, ("Content-Type", "application/json")],
                                               raw)
                else:
                    r = client.request(method, srv.url + path, json=body, headers=headers)
                    status, text = r.status_code, r.text
                assert status == 400, (name, path, status, text)
                assert "repeated" in text, text
                if path.endswith(("/v1/messages", "/count_tokens")):
                    assert json.loads(text)["type"] == "error", text  # Anthropic's shape
    assert _span_count(srv, b) == spans_b  # nothing recorded into B
    # the same requests with each header once go through as the token allows
    ok = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={**_bearer(token_a), "X-Rollout-Id": a},
                    timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("host", "status"), [
    ("localhost:80:evil", 421), ("localhost:evil", 421), ("[::1]x", 421), (":80", 421), ("evil.example", 421),
    ("LOCALHOST", 200), ("127.0.0.1:1", 200), ("[::1]:8000", 200),
])
def test_the_host_allow_list_reads_a_name_and_a_numeric_port(gw, host: str, status: int) -> None:
    r = httpx.get(gw.url + "/healthz", headers={"Host": host})
    assert r.status_code == status, r.text


def test_an_ended_rollouts_token_stops_writing_but_still_reads(gw) -> None:
    srv = gw
    (done, token_done), (failed, token_failed) = _claim(srv, 2, max_attempts=1).items()
    for token in (token_done, token_failed):
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=_bearer(token), timeout=30)
        assert r.status_code == 200, r.text
    assert httpx.post(srv.url + f"/api/rollouts/{done}/complete", json={"worker_id": "w"},
                      headers=ADMIN).status_code == 200
    r = httpx.post(srv.url + f"/api/rollouts/{failed}/fail", json={"worker_id": "w", "error": "x"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text
    for rid, token in ((done, token_done), (failed, token_failed)):
        before = _span_count(srv, rid)
        for path, body in (("/v1/chat/completions", CHAT), (f"/rollouts/{rid}/v1/completions", COMPLETION),
                           ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES),
                           (f"/api/rollouts/{rid}/rewards", {"value": 1.0, "idempotency_key": "late"}),
                           (f"/api/rollouts/{rid}/events", {"name": "e", "idempotency_key": "late"})):
            r = httpx.post(srv.url + path, json=body, headers=_bearer(token), timeout=30)
            assert r.status_code == 409, (path, r.text)
            assert "has ended" in r.text
        assert _span_count(srv, rid) == before
        assert httpx.get(srv.url + f"/api/rollouts/{rid}", headers=_bearer(token)).status_code == 200
        assert httpx.get(srv.url + f"/api/rollouts/{rid}/spans", headers=_bearer(token)).status_code == 200
        assert httpx.post(srv.url + "/v1/messages/count_tokens", json=MESSAGES, headers=_bearer(token),
                          timeout=30).status_code == 200
    # the admin key still writes (a judge's reward after the rollout completed)
    r = httpx.post(srv.url + f"/api/rollouts/{done}/rewards", json={"value": 1.0, "idempotency_key": "judge"},
                   headers=ADMIN)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("path", ["/rollouts/ctl%03id/v1/chat/completions", "/rollouts/bad%FFid/v1/chat/completions",
                                  "/rollouts/x%7F/v1/messages", "/rollouts/" + "r" * 201 + "/v1/responses"])
def test_hot_routes_refuse_ids_the_api_cannot_read_back(gw, path: str) -> None:
    body = MESSAGES if "messages" in path else RESPONSES if "responses" in path else CHAT
    r = httpx.post(gw.url + path, json=body, headers=ADMIN, timeout=30)
    assert r.status_code == 400, r.text
    same = path.split("/")[2]
    assert httpx.get(gw.url + f"/api/rollouts/{same}", headers=ADMIN).status_code in (400, 404)


def test_a_nul_in_a_weights_path_is_400_and_the_connection_lives_on(gw) -> None:
    with httpx.Client(base_url=gw.url, headers=ADMIN, timeout=30) as client:
        for path, body in (("/api/weights/update", {"model_path": "w\x00x", "weight_version": "1"}),
                           ("/api/weights/lora", {"adapters": {"default": "w\x00x"}, "weight_version": "1"})):
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
        assert client.get("/healthz").status_code == 200


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("where", ["metadata", "tools", "chat_template_kwargs"])
def test_deep_nesting_is_400_before_any_generation(gw, fake, where: str) -> None:
    def body(depth: int) -> dict:
        if where == "tools":
            fn = {"name": "f", "parameters": {"type": "object", "properties": {"x": _nested(depth)}}}
            return {**CHAT, "tools": [{"type": "function", "function": fn}]}
        if where == "chat_template_kwargs":
            return {**CHAT, "chat_template_kwargs": {"x": _nested(depth)}}
        return {**CHAT, "metadata": {"x": _nested(depth)}}

    seen = len(httpx.get(fake.base_url + "/debug").json()["requests"])
    r = httpx.post(gw.url + "/v1/chat/completions", json=body(300), headers=ADMIN, timeout=30)
    assert r.status_code == 400 and "nested deeper" in r.text, r.text
    assert len(httpx.get(fake.base_url + "/debug").json()["requests"]) == seen  # nothing generated
    r = httpx.post(gw.url + "/v1/chat/completions", json=body(40), headers=ADMIN, timeout=30)
    assert r.status_code != 503, r.text  # what passes the parse is encodable


def test_the_token_cap_covers_every_choice_and_unused_fields_are_bounded(gw, fake) -> None:
    def chat(**kw: object) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, **kw}, headers=ADMIN, timeout=30)

    r = chat(n=128, max_tokens=CAP)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert chat(n=2, max_tokens=CAP // 2).status_code == 200
    assert chat(n=CAP + 1, max_tokens=None).status_code == 400
    r = chat(n=4, max_tokens=None)
    assert r.status_code == 200, r.text
    sent = httpx.get(fake.base_url + "/debug").json()["requests"][-1]
    assert sent["sampling_params"]["max_new_tokens"] * 4 <= CAP, sent
    for field, value in (("best_of", 2**70), ("best_of", 2), ("use_beam_search", True), ("top_k", 2**70),
                         ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {"1": 1000})):
        r = chat(**{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert chat(best_of=1).status_code == 200
    r = httpx.post(gw.url + "/v1/completions", json={**COMPLETION, "best_of": 2**70}, headers=ADMIN, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_otlp_past_its_byte_budget_is_429_and_the_budget_returns(gw) -> None:
    budget = gw.app.state.admission.otlp
    body = gzip.compress(b'{"resourceSpans": []}')
    headers = {**ADMIN, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    budget.used = budget.limit  # as if a burst held all of it
    try:
        r = httpx.post(gw.url + "/v1/traces", content=body, headers=headers)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    finally:
        budget.used = 0
    r = httpx.post(gw.url + "/v1/traces", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert budget.used == 0
