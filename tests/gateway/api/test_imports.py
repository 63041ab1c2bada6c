"""``POST /api/import`` over a real store with tiny-random's chat template (SmolLM2's): chat demonstrations
(tool calls included) rendered token-exactly into trajectories, preference pairs, token sequences back
token for token, and the refusals that name their line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tracegym.gateway.api import imports, trajectories
from tracegym.gateway.openai_errors import install_error_handlers
from tracegym.gateway.proxy.prompt.templating import ChatTokenizer
from tracegym.gateway.traces.store import Store
from tracegym.types import Trajectory

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a colour's code",
                                            "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}}}}]
TOOL_CONV = [
    {"role": "user", "content": "What is the secret code of red?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"colour\": \"red\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "R-17"},
    {"role": "assistant", "content": "The code is R-17."},
]


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[TestClient, Store, ChatTokenizer]]:
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(imports.router)
    app.include_router(trajectories.router)
    app.state.store = store
    app.state.services = SimpleNamespace(tokenizer=tok, served_model="tiny-random")
    with TestClient(app) as client:
        yield client, store, tok
    store.close()


def _post(client: TestClient, fmt: str, records: list[Any], name: str = "demos") -> Any:
    return client.post("/api/import", json={"name": name, "format": fmt, "records": records})


def _trajs(client: TestClient) -> list[Trajectory]:
    # imported calls carry no logprobs: the assembly counts them as re-tokenized, left out unless asked
    r = client.get("/api/trajectories", params={"status": "completed", "include_retokenized": "true"})
    assert r.status_code == 200, r.text
    return [Trajectory.from_dict(json.loads(x)) for x in r.text.splitlines()]


def test_a_tool_conversation_becomes_one_sequence_of_the_templates_tokens(env: Any) -> None:
    client, store, tok = env
    r = _post(client, "chat", [{"messages": TOOL_CONV, "tools": TOOLS, "reward": 1.0}])
    assert r.status_code == 201, r.text
    assert r.json() == {"groups": 1, "skipped": 0, "rollouts": 1, "calls": 2}
    (t,) = _trajs(client)
    assert t.group_id == "demos-import-1" and t.reward == 1.0
    (seq,) = t.sequences  # the second call extends the first: merged
    # the whole conversation as the gateway renders it, up to the last end of turn
    full = tok.apply(TOOL_CONV, tools=TOOLS, add_generation_prompt=False)
    assert seq.token_ids == full[: len(seq.token_ids)] and len(full) - len(seq.token_ids) <= 1
    sampled = tok.decode([i for i, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m])
    assert '<tool_call>' in sampled and '"lookup"' in sampled and "The code is R-17." in sampled
    assert "R-17\n</tool_response>" not in sampled  # the tool's answer is context, not trained
    assert all(lp is None for lp in seq.logprobs)
    rollout = store.get_rollout(t.rollout_id)
    assert rollout["status"] == "completed"


def test_reimport_adds_nothing_and_pairs_share_their_prompt(env: Any) -> None:
    client, _, _ = env
    pair = {"prompt": [{"role": "user", "content": "Say hi"}], "chosen": {"role": "assistant", "content": "hi"},
            "rejected": [{"role": "assistant", "content": "no"}]}
    assert _post(client, "dpo", [pair], name="prefs").json()["rollouts"] == 2
    assert _post(client, "dpo", [pair], name="prefs").json() == {"groups": 0, "skipped": 1, "rollouts": 0, "calls": 0}
    ts = sorted(_trajs(client), key=lambda t: -(t.reward or 0))
    assert [t.reward for t in ts] == [1.0, 0.0] and ts[0].group_id == ts[1].group_id == "prefs-import-1"
    from tracegym.trainer.run.objective_batches import prompt_ids

    assert prompt_ids(ts[0].sequences[0]) == prompt_ids(ts[1].sequences[0])


def test_tokens_come_back_token_for_token(env: Any) -> None:
    client, _, _ = env
    recs = [{"token_ids": [5, 6, 7, 8, 9, 10, 11], "loss_mask": [0, 0, 1, 1, 0, 1, 1],
             "logprobs": [None, None, -0.5, -0.25, None, -1.0, -2.0], "reward": 0.5, "group_id": "g1"},
            {"token_ids": [5, 6, 12], "loss_mask": [0, 0, 1], "reward": 0.0, "group_id": "g1"}]
    assert _post(client, "tokens", recs, name="old").json()["groups"] == 1
    ts = sorted(_trajs(client), key=lambda t: -(t.reward or 0))
    assert {t.group_id for t in ts} == {"old-import-g1"}
    assert ts[0].sequences[0].token_ids == recs[0]["token_ids"]
    assert ts[0].sequences[0].loss_mask == recs[0]["loss_mask"]
    assert ts[0].sequences[0].logprobs == recs[0]["logprobs"]
    assert ts[1].sequences[0].token_ids == [5, 6, 12]


@pytest.mark.parametrize(("records", "message"), [
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
      {"messages": TOOL_CONV}], "line 2: messages[1] calls tool 'lookup', but the record offers no tools"),
    ([{"messages": TOOL_CONV, "tools": [{"type": "function", "function": {"name": "other"}}]}],
     "line 1: messages[1] calls tool 'lookup', but the record offers tools ['other']"),
    ([{"messages": [{"role": "user", "content": "only a question"}]}], "line 1: no assistant message"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "reward": "high"}],
     "line 1: reward must be a number"),
    ([{"messages": [{"content": "no role"}, {"role": "assistant", "content": "y"}]}],
     "line 1: the chat template refuses"),
])
def test_refused_records_name_their_line_and_nothing_is_stored(env: Any, records: list, message: str) -> None:
    client, _, _ = env
    r = _post(client, "chat", records)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert _trajs(client) == []


def test_imported_calls_are_left_out_of_rl_by_default(env: Any) -> None:
    client, _, _ = env
    _post(client, "chat", [{"messages": TOOL_CONV, "tools": TOOLS}])
    (line,) = client.get("/api/trajectories", params={"status": "completed"}).text.splitlines()
    t = json.loads(line)
    assert t["sequences"] == [] and {e["reason"] for e in t["excluded"]} == {"retokenized"}


def test_bad_names_and_formats_are_400(env: Any) -> None:
    client, _, _ = env
    assert client.post("/api/import", json={"name": "a b", "format": "chat", "records": []}).status_code == 400
    assert client.post("/api/import", json={"name": "a", "format": "csv", "records": []}).status_code == 400
