"""A gateway with an admin key, in front of the SGLang fake, route family by route family: 401 without a key
(or with a wrong one), 403 with another rollout's token (or a token on an admin route), 200 with the
rollout's own token or the admin key; the weights jail; the open inspector page; a keyless gateway's
content-type rule; and no key in the logs."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.app_support import MemoryRecorder, ServerThread, start_fake
from tests.procs import ManagedProcess
from tracegym.gateway.app import create_app
from tracegym.gateway.settings import GatewaySettings

MODEL = "tiny-random"
KEY = "test-admin-key-Zq81"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fake(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with start_fake(tmp_path_factory.mktemp("authfake"), tokenizer=tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def gw(fake: ManagedProcess, weights_root: Path, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("authdb") / "tg.db"
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=f"sqlite:///{db}",
                               admin_key=KEY, weights_dir=str(weights_root))
    with ServerThread(create_app(settings)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokens(gw: ServerThread) -> dict[str, str]:
    """Two claimed rollouts' ``{rollout_id: token}``, from the claim answer."""
    srv = gw
    r = httpx.post(srv.url + "/api/tasks", json={"tasks": [{"input": {"q": 1}}], "group_size": 2}, headers=ADMIN)
    assert r.status_code == 201, r.text
    claimed = httpx.post(srv.url + "/api/rollouts/claim", json={"worker_id": "w", "limit": 2}, headers=ADMIN).json()
    out = {r["rollout_id"]: r["token"] for r in claimed["rollouts"]}
    assert len(out) == 2 and all(t.startswith("tgr.") for t in out.values())
    return out


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _code(r: httpx.Response) -> str | None:
    return r.json()["error"].get("code")


def test_admin_routes_need_the_admin_key(gw, tokens) -> None:
    srv = gw
    token = next(iter(tokens.values()))
    for method, path, body in [
        ("GET", "/api/rollouts", None), ("POST", "/api/tasks", {"tasks": [{"input": 1}]}),
        ("GET", "/metrics", None), ("GET", "/api/weights", None),
        ("POST", "/api/weights/update", {"model_path": "/tmp", "weight_version": "1"}),
        ("POST", "/v1/traces", {"resourceSpans": []}), ("GET", "/api/inspect/rollouts", None),
        ("GET", "/api/trajectories", None), ("POST", "/api/rollouts/claim", {"worker_id": "x"}),
    ]:
        none = httpx.request(method, srv.url + path, json=body)
        assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Bearer"), (path, none.text)
        assert _code(httpx.request(method, srv.url + path, json=body, headers=_bearer("nope"))) == "invalid_api_key"
        as_token = httpx.request(method, srv.url + path, json=body, headers=_bearer(token))
        assert as_token.status_code == 403 and _code(as_token) == "admin_key_required", path
    assert httpx.get(srv.url + "/metrics", headers=ADMIN).status_code == 200
    assert httpx.get(srv.url + "/api/rollouts", headers=ADMIN).status_code == 200
    assert httpx.get(srv.url + "/api/inspect/rollouts", headers=ADMIN).status_code == 200
    otlp = httpx.post(srv.url + "/v1/traces", json={"resourceSpans": []}, headers=ADMIN)
    assert otlp.status_code == 200, otlp.text


def test_open_routes(gw) -> None:
    srv = gw
    health = httpx.get(srv.url + "/healthz")
    assert health.status_code == 200 and health.json()["upstream"]["reachable"] is True
    assert "url" not in health.json()["upstream"] and "127.0.0.1" not in health.text
    page = httpx.get(srv.url + "/ui/rollouts")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(srv.url + "/ui/static/core.js").status_code == 200


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_agent_calls_take_their_rollouts_token_only(gw, tokens, api: str) -> None:
    srv = gw
    (a, token_a), (b, token_b) = tokens.items()
    route, body = {"chat": ("chat/completions", CHAT), "messages": ("messages", MESSAGES),
                   "responses": ("responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4})}[api]
    auth = (lambda t: {"x-api-key": t}) if api == "messages" else _bearer
    anthropic = api == "messages"

    def post(path: str, headers: dict[str, str]) -> httpx.Response:
        return httpx.post(srv.url + path, json=body, headers=headers, timeout=30)

    for path in (f"/v1/{route}", f"/rollouts/{a}/v1/{route}"):
        r = post(path, {})
        assert r.status_code == 401, r.text
        assert (r.json()["type"] == "error") if anthropic else (_code(r) == "missing_api_key")
        assert post(path, auth("sk-wrong")).status_code == 401
    assert post(f"/rollouts/{a}/v1/{route}", auth(token_b)).status_code == 403
    r = post(f"/v1/{route}", auth(token_b) | {"X-Rollout-Id": a})
    assert r.status_code == 403 and (anthropic or _code(r) == "wrong_rollout")
    before = {r: _span_count(srv, r) for r in (a, b)}
    assert post(f"/rollouts/{a}/v1/{route}", auth(token_a)).status_code == 200
    assert post(f"/v1/{route}", auth(token_a) | {"X-Rollout-Id": a}).status_code == 200
    assert post(f"/v1/{route}", auth(token_a)).status_code == 200  # named no rollout: the token's
    # an agent whose client was built with api_key="unused": the SDK's X-Tracegym-Key carries the token
    assert post(f"/v1/{route}", auth("unused") | {"X-Tracegym-Key": token_a}).status_code == 200
    assert post(f"/v1/{route}", ADMIN | {"X-Rollout-Id": b}).status_code == 200  # the admin key: any rollout
    assert {r: _span_count(srv, r) - before[r] for r in (a, b)} == {a: 4, b: 1}


def _span_count(srv: ServerThread, rollout_id: str) -> int:
    """The rollout's stored spans, after the recorder wrote every call answered so far."""
    assert srv.app.state.recorder.force_flush()
    r = httpx.get(f"{srv.url}/api/rollouts/{rollout_id}/spans", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()["spans"])


def test_models_route(gw, tokens) -> None:
    srv = gw
    a, token_a = next(iter(tokens.items()))
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/v1/models", headers=_bearer(token_a)).status_code == 200
    assert httpx.get(srv.url + f"/rollouts/{a}/v1/models", headers=_bearer(token_a)).status_code == 200


def test_stored_responses_are_read_by_their_own_rollout_only(gw, tokens) -> None:
    srv = gw
    (a, token_a), (_, token_b) = tokens.items()
    made = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4},
                      headers=_bearer(token_a), timeout=30)
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert httpx.get(srv.url + f"/v1/responses/{rid}").status_code == 401
    assert httpx.get(srv.url + f"/v1/responses/{rid}", headers=_bearer(token_a), timeout=30).status_code == 200
    assert httpx.get(srv.url + f"/v1/responses/{rid}", headers=_bearer(token_b), timeout=30).status_code == 404
    assert httpx.get(srv.url + f"/rollouts/{a}/v1/responses/{rid}", headers=_bearer(token_b)).status_code == 403
    assert httpx.get(srv.url + f"/v1/responses/{rid}", headers=ADMIN, timeout=30).status_code == 200
    chained = httpx.post(srv.url + "/v1/responses", headers=_bearer(token_b), timeout=30,
                         json={"model": MODEL, "input": "more", "previous_response_id": rid, "max_output_tokens": 4})
    assert chained.status_code == 400 and _code(chained) == "previous_response_not_found"


def test_rewards_and_events_of_a_rollout(gw, tokens) -> None:
    srv = gw
    (a, token_a), (_, token_b) = tokens.items()
    for kind, body in (("rewards", {"value": 1.0, "idempotency_key": "k1"}),
                       ("events", {"name": "e", "value": 1, "idempotency_key": "k2"})):
        url = srv.url + f"/api/rollouts/{a}/{kind}"
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers=_bearer(token_b)).status_code == 403
        assert httpx.post(url, json=body, headers=_bearer(token_a)).status_code == 201
    assert httpx.get(srv.url + f"/api/rollouts/{a}", headers=_bearer(token_a)).json()["rollout_id"] == a
    assert httpx.get(srv.url + f"/api/rollouts/{a}/spans", headers=_bearer(token_b)).status_code == 403
    assert httpx.get(srv.url + f"/api/rollouts/{a}/spans", headers=_bearer(token_a)).status_code == 200
    done = httpx.post(srv.url + f"/api/rollouts/{a}/complete", json={"worker_id": "w"}, headers=_bearer(token_a))
    assert done.status_code == 403  # finishing a rollout is the runner's (admin) business


def test_weights_jail(gw, weights_root: Path, tmp_path: Path) -> None:
    srv = gw
    inside = weights_root / "v1"
    inside.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (weights_root / "escape").symlink_to(outside, target_is_directory=True)
    refused = set()
    for path in [str(outside), str(tmp_path / "missing"), str(weights_root / "escape"),
                 f"{weights_root}/v1/../../{outside.parent.name}/{outside.name}", "/etc", "/", str(weights_root),
                 "../" * 8 + "etc", str(outside / "x" / "..")]:
        r = httpx.post(srv.url + "/api/weights/update", json={"model_path": path, "weight_version": "9"}, headers=ADMIN)
        assert r.status_code == 403, (path, r.text)
        refused.add(r.text)
    assert len(refused) == 1 and str(tmp_path) not in refused.pop()  # one answer, naming nothing
    ok = httpx.post(srv.url + "/api/weights/update", json={"model_path": str(inside), "weight_version": "1"},
                    headers=ADMIN, timeout=60)
    assert ok.status_code == 200 and ok.json()["success"] is True, ok.text
    absent = httpx.post(srv.url + "/api/weights/update", headers=ADMIN, timeout=60,
                        json={"model_path": str(weights_root / "absent"), "weight_version": "3"})
    assert absent.status_code == 400 and absent.json()["success"] is False  # under the root: the engine's to refuse
    rel = httpx.post(srv.url + "/api/weights/update", json={"model_path": "v1", "weight_version": "2"},
                     headers=ADMIN, timeout=60)
    assert rel.status_code == 200, rel.text  # relative: under the root


def test_weight_updates_are_refused_without_a_weights_root(fake: ManagedProcess, tmp_path: Path) -> None:
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None)
    with ServerThread(create_app(settings, recorder=MemoryRecorder())) as srv:
        r = httpx.post(srv.url + "/api/weights/update", json={"model_path": str(tmp_path), "weight_version": "1"})
        assert r.status_code == 403 and _code(r) == "weights_dir_unset"
        # no key: the content-type rule still holds (a browser's blind cross-site POST is text/plain)
        plain = httpx.post(srv.url + "/v1/chat/completions", content=b'{"model": "x"}',
                           headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415 and _code(plain) == "unsupported_media_type"
        form = httpx.post(srv.url + "/api/weights/update", data={"model_path": str(tmp_path)})
        assert form.status_code == 415


def test_host_allow_list(fake: ManagedProcess) -> None:
    settings = GatewaySettings(upstream_url=fake.base_url, model=MODEL, store_url=None,
                               allowed_hosts=["localhost", "127.0.0.1", "[::1]"])
    with ServerThread(create_app(settings, recorder=MemoryRecorder())) as srv:
        assert httpx.get(srv.url + "/healthz").status_code == 200  # Host: 127.0.0.1:port
        rebound = httpx.get(srv.url + "/healthz", headers={"Host": "attacker.example:8000"})
        assert rebound.status_code == 421 and _code(rebound) == "host_not_allowed"
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Host": "attacker.example"})
        assert r.status_code == 421  # the inference route too


def test_no_key_or_token_in_the_logs(gw, tokens, caplog: pytest.LogCaptureFixture) -> None:
    srv = gw
    a, token_a = next(iter(tokens.items()))
    with caplog.at_level(logging.DEBUG):
        httpx.post(srv.url + f"/rollouts/{a}/v1/chat/completions", json=CHAT, headers=_bearer(token_a), timeout=30)
        httpx.get(srv.url + "/api/rollouts", headers=_bearer(token_a))
        httpx.get(srv.url + "/api/rollouts", headers=_bearer(KEY + "x"))
        httpx.post(srv.url + "/api/weights/update", json={"model_path": "/", "weight_version": "1"}, headers=ADMIN)
    assert caplog.records  # the gateway did log (so the check below looked at something)
    assert KEY not in caplog.text and token_a not in caplog.text
    assert os.environ.get("TRACEGYM_ADMIN_KEY") is None


def test_a_rollout_tokens_call_while_the_store_is_away_is_a_503_in_its_shape(gw, monkeypatch) -> None:
    """A token's call is checked against its rollout's state in the store (an ended rollout takes no more
    calls); with the store's database away, that check is a 503 to retry, not a 500 or a reset."""
    import sqlalchemy as sa

    srv = gw
    httpx.post(srv.url + "/api/tasks", json={"tasks": [{"input": {"q": 2}}]}, headers=ADMIN).raise_for_status()
    (claimed,) = httpx.post(srv.url + "/api/rollouts/claim", json={"worker_id": "w"}, headers=ADMIN).json()["rollouts"]

    def away(*a: object, **k: object) -> None:
        raise sa.exc.OperationalError("SELECT", {}, Exception("the database system is shutting down"))

    monkeypatch.setattr(srv.app.state.services.store, "get_rollout", away)
    with httpx.Client(headers=_bearer(claimed["token"]), timeout=30) as http:
        r = http.post(srv.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and _code(r) == "store_unavailable", r.text
        r = http.post(srv.url + "/v1/messages", json=MESSAGES)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
        monkeypatch.undo()
        assert http.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200  # the same connection
