"""The inspector's rollout, group and system views over a real store (SQLite and PostgreSQL), and its
pages and static files."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from tests.gateway.api.inspector_data import FakeServices, Scenario, inspector_app, make_scenario
from tracegym.gateway.api.ui.calls_view import tool_parse_status
from tracegym.gateway.api.ui.inspector_routes import advantages
from tracegym.gateway.api.ui.tokens import TokenTexts


class WordTokenizer:
    """``decode([id])`` of a tokenizer: "<id>" for every id, counted (to check the cache)."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert not skip_special_tokens  # the view shows special tokens too
        self.calls += 1
        return f"<{ids[0]}>"


class WordServices(FakeServices):
    def __init__(self) -> None:
        super().__init__(tokenizer=type("ChatTokenizer", (), {"tokenizer": WordTokenizer()})())


@pytest.fixture
def scene(store_url: str) -> Iterator[tuple[TestClient, Scenario]]:
    s = make_scenario(store_url)
    with TestClient(inspector_app(s.store, WordServices())) as client:
        yield client, s
    s.store.close()


def _view(client: TestClient, rid: str, **params: Any) -> dict[str, Any]:
    resp = client.get(f"/api/inspect/rollouts/{rid}", params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_clean_rollout_is_one_sequence_with_its_calls_ranges(scene) -> None:
    client, s = scene
    v = _view(client, s.clean)
    (seq,) = v["trajectory"]["sequences"]
    assert seq["token_ids"] == [1, 2, 3, 10, 11, 50, 51, 12, 13, 14, 60, 15]
    assert seq["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1] and seq["n_sampled"] == 6
    assert seq["logprobs"][3:5] == [-0.25, -0.5] and seq["logprobs"][0] is None
    assert seq["text"] == [f"<{i}>" for i in seq["token_ids"]]
    kinds = [(g["start"], g["end"], g["kind"], g["call_index"]) for g in seq["segments"]]
    assert kinds == [(0, 3, "prompt", 0), (3, 5, "sampled", 0), (5, 7, "tool", 1), (7, 10, "sampled", 1),
                     (10, 11, "user", 2), (11, 12, "sampled", 2)]
    assert [(m["pos"], m["drift"]) for m in seq["markers"]] == [(0, "none"), (5, "clean"), (10, "clean")]
    assert seq["versions"] == [{"start": 3, "end": 5, "version": "v1", "call_index": 0},
                               {"start": 7, "end": 10, "version": "v1", "call_index": 1},
                               {"start": 11, "end": 12, "version": "v1", "call_index": 2}]
    assert seq["trainer_logprobs"] is None
    assert v["export"]["command"] == (f"tracegym export --gateway http://testserver --ids {s.clean} "
                                      f"--out {s.clean}.jsonl")


def test_calls_show_api_drift_tool_parse_and_only_new_messages(scene) -> None:
    client, s = scene
    calls = _view(client, s.clean)["calls"]
    assert [c["api"] for c in calls] == ["chat.completions"] * 3
    assert [c["drift"] for c in calls] == ["none", "clean", "clean"]
    assert [c["tool_parse"] for c in calls] == ["parsed", "failed", "no_tools"]
    assert [c["messages_from"] for c in calls] == [0, 3, 5]  # repeated: earlier messages + the reply
    assert [m["role"] for m in calls[1]["messages"]] == ["tool"]
    assert calls[2]["messages"] == [{"role": "user", "content": "Anything else?"}]
    assert calls[0]["tools"] == ["add"] and calls[0]["latency_s"] == 0.25
    assert calls[0]["replies"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"


def test_forked_rollout_has_two_sequences_and_an_excluded_errored_call(scene) -> None:
    client, s = scene
    v = _view(client, s.forked)
    seqs = v["trajectory"]["sequences"]
    assert [q["token_ids"] for q in seqs] == [[1, 2, 20], [1, 2, 99, 21]]
    assert seqs[1]["markers"] == [{"pos": 0, "call_index": 1, "call_id": f"{s.forked}-c1", "drift": "forked"}]
    assert v["trajectory"]["excluded"] == [{"call_id": f"{s.forked}-c2", "choice_index": 0, "reason": "error",
                                            "call_index": 2}]
    errored = v["calls"][2]
    assert errored["status"] == "error" and errored["error"] == "upstream reset"
    assert errored["excluded"][0]["reason"] == "error" and "error" in errored["excluded"][0]["explanation"]
    per_call = _view(client, s.forked, mode="per_call")["trajectory"]
    assert per_call["mode"] == "per_call" and len(per_call["sequences"]) == 2
    assert client.get(f"/api/inspect/rollouts/{s.forked}", params={"mode": "tree"}).status_code == 400


def test_weight_versions_per_token_range_and_trainer_logprobs(scene) -> None:
    client, s = scene
    (seq,) = _view(client, s.realigned)["trajectory"]["sequences"]
    assert [(r["start"], r["end"], r["version"]) for r in seq["versions"]] == [(1, 2, "v1"), (2, 3, "v2"),
                                                                               (4, 5, "v2")]
    assert seq["markers"][1]["drift"] == "realigned"
    # the trainer reports logprobs of the sampled tokens, in order: aligned on the mask
    s.store.add_event(s.realigned, kind="event", name="tracegym.trainer_logprobs", idempotency_key="t1",
                      value={"sequence": 0, "logprobs": [-0.3, -0.6, -0.2]})
    (seq,) = _view(client, s.realigned)["trajectory"]["sequences"]
    assert seq["trainer_logprobs"] == [None, -0.3, -0.6, None, -0.2]
    # a later report as long as the sequence replaces it
    s.store.add_event(s.realigned, kind="event", name="tracegym.trainer_logprobs", idempotency_key="t2",
                      value={"sequence": 0, "logprobs": [None, -1.0, -1.0, None, -1.0]})
    (seq,) = _view(client, s.realigned)["trajectory"]["sequences"]
    assert seq["trainer_logprobs"] == [None, -1.0, -1.0, None, -1.0]


def test_failed_rollout_shows_its_traceback_and_split(scene) -> None:
    client, s = scene
    r = _view(client, s.failed)["rollout"]
    assert (r["status"], r["error"], r["traceback"], r["split"]) == ("failed", "ValueError: bad tool",
                                                                    "Traceback ...\nValueError", "eval")
    assert client.get("/api/inspect/rollouts/nope").status_code == 404


def test_group_view_has_grpo_advantages_and_last_replies(scene) -> None:
    client, s = scene
    g = client.get(f"/api/inspect/groups/{s.groups[0]['group_id']}").json()
    by_id = {r["rollout_id"]: r for r in g["rollouts"]}
    assert by_id[s.clean]["advantage"] == pytest.approx(0.7071, abs=1e-3)  # (1 - .5) / std([1, 0])
    assert by_id[s.forked]["advantage"] == pytest.approx(-0.7071, abs=1e-3)
    assert by_id[s.clean]["last_reply"]["message"]["content"] == "No, 5."
    g2 = client.get(f"/api/inspect/groups/{s.groups[1]['group_id']}").json()
    adv = {r["rollout_id"]: r["advantage"] for r in g2["rollouts"]}
    assert adv == {s.realigned: 0.0, s.failed: None}  # a failed rollout is not trained
    assert client.get("/api/inspect/groups/nope").status_code == 404


def test_advantages_match_the_trainers_grpo() -> None:
    assert advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)
    assert advantages([1.0, 1.0]) == [0.0, 0.0]
    assert advantages([None, 2.0]) == [None, 0.0]


def test_system_view_counts_the_queue_and_reads_the_recorders_counters(scene) -> None:
    client, s = scene
    registry = CollectorRegistry()
    dropped = Counter("tracegym_spans_dropped", "d", ["reason"], registry=registry)
    dropped.labels("queue_full").inc(3)
    Counter("tracegym_spans_recorded", "r", registry=registry).inc(7)
    client.app.state.metrics_registry = registry
    body = client.get("/api/inspect/system").json()
    assert body["queue"]["rollouts"] == {"completed": 3, "failed": 1}
    assert body["queue"]["tasks"] == {"train": 1, "eval": 1}
    assert body["failed"][0]["rollout_id"] == s.failed and body["failed"][0]["traceback"].startswith("Traceback")
    assert body["spans"]["dropped"] == {"queue_full": 3.0} and body["spans"]["recorded"] == 7.0
    assert body["upstream"]["health"] == {"reachable": True} and body["upstream"]["kind"] == "sglang"
    assert body["leases"] == []


def test_system_view_lists_each_engine_of_a_fleet(store_url: str) -> None:
    from tracegym.gateway.proxy.upstream.fleet import UpstreamFleet
    from tracegym.gateway.proxy.upstream.sglang import SGLangUpstream

    urls = ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    services = FakeServices()
    services.upstream = UpstreamFleet([(u, SGLangUpstream(u, None)) for u in urls])  # type: ignore[arg-type]
    a, b = services.upstream.engines
    a.healthy, a.calls, a.weight_version = True, 5, "3"
    b.healthy, b.error = False, "ConnectError: refused"
    s = make_scenario(store_url)
    with TestClient(inspector_app(s.store, services)) as client:
        up = client.get("/api/inspect/system").json()["upstream"]
    s.store.close()
    assert up["health"] == {"reachable": True, "engines": 2, "healthy": [urls[0]]}
    assert [(e["url"], e["healthy"], e["calls"], e["weight_version"], e["error"]) for e in up["engines"]] == [
        (urls[0], True, 5, "3", None), (urls[1], False, 0, None, "ConnectError: refused")]


def test_pages_and_static_files_are_served(scene) -> None:
    client, _ = scene
    for path in ("/ui", "/ui/", "/ui/rollouts", "/ui/rollouts/some-id", "/ui/runs/a%2Fb", "/ui/system"):
        resp = client.get(path)
        assert resp.status_code == 200 and "<main id=\"app\">" in resp.text, path
        assert resp.headers["content-type"].startswith("text/html")
    for name, kind in (("app.js", "javascript"), ("app.css", "text/css"), ("vendor/uPlot.iife.min.js", "javascript")):
        resp = client.get(f"/ui/static/{name}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"], name
    assert "MIT License" in client.get("/ui/static/vendor/LICENSE-uPlot.txt").text
    assert client.get("/ui/static/nope.js").status_code == 404


def test_tool_parse_status() -> None:
    tools = {"tools": [{"type": "function"}]}
    assert tool_parse_status(tools, [{"message": {"tool_calls": [{}]}}]) == "parsed"
    assert tool_parse_status(tools, [{"message": {"content": "<tool_call>{bad"}}]) == "failed"
    assert tool_parse_status(tools, [{"message": {"content": "hi"}}]) == "none"
    assert tool_parse_status({}, [{"message": None}]) == "no_tools"


def test_token_texts_are_decoded_once_per_id() -> None:
    tok, texts = WordTokenizer(), TokenTexts()
    assert texts.texts(tok, [5, 6, 5]) == ["<5>", "<6>", "<5>"]
    assert texts.texts(tok, [6, 5]) == ["<6>", "<5>"] and tok.calls == 2
    assert texts.texts(None, [1]) is None
