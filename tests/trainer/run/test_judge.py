"""The recipe's ``reward`` section and the pure parts of ``tracegym.trainer.run.judge`` (the judge's
view of a rollout; the OTLP span of an outside judge's request). The judge against real processes is in
tests/e2e/test_judge_rewards.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tracegym.judge import JudgeAttempt
from tracegym.trainer.recipe import RecipeError, load_recipe
from tracegym.trainer.run.judge import conversation, otlp_span


def _recipe(tmp: Path, reward: object) -> Path:
    (tmp / "t.jsonl").write_text('{"input": {"q": 1}}\n')
    p = tmp / "r.yaml"
    p.write_text(yaml.safe_dump({"model": "tiny-random", "data": {"path": "t.jsonl"},
                                 "agent": {"target": "a:b"}, "reward": reward}))
    return p


def test_recipe_reward_section(tmp_path: Path) -> None:
    r = load_recipe(_recipe(tmp_path, {"agent_weight": 0.5, "judge": {"rubric": "short is good", "weight": 2}}))
    assert r.reward.agent_weight == 0.5 and r.reward.judge is not None
    j = r.reward.judge
    assert (j.rubric, j.weight, j.base_url, j.model, j.retries) == ("short is good", 2.0, None, None, 2)
    default = load_recipe(_recipe(tmp_path, {}))
    assert default.reward.judge is None and default.reward.agent_weight == 1.0


@pytest.mark.parametrize(("reward", "message"), [
    ({"judge": {"rubric": "x", "retires": 3}}, "reward.judge.retires: unknown field; did you mean 'retries'?"),
    ({"judge": {"weight": 1}}, "reward.judge.rubric: Field required"),
    ({"judge": {"rubric": "x", "retries": -1}}, "reward.judge.retries: Input should be greater than or equal to 0"),
])
def test_recipe_reward_errors(tmp_path: Path, reward: object, message: str) -> None:
    with pytest.raises(RecipeError, match="invalid recipe") as e:
        load_recipe(_recipe(tmp_path, reward))
    assert message in str(e.value)


def _span(messages: list, reply: dict, status: str = "ok") -> dict:
    return {"status": status, "attributes": {"tracegym.request": {"messages": messages}},
            "choices": [{"index": 0, "message": reply}]}


def test_conversation_is_the_last_good_call_and_its_reply() -> None:
    first = [{"role": "user", "content": "2+3?"}]
    second = [*first, {"role": "assistant", "content": "add"}, {"role": "tool", "content": "5"}]
    spans = [_span(first, {"role": "assistant", "content": "add"}),
             {"status": "ok", "attributes": {}, "choices": None},  # an OTLP span of the agent: not a call
             _span(second, {"role": "assistant", "content": "5"}),
             _span(second, {"role": "assistant", "content": None}, status="error")]
    assert conversation(spans) == [*second, {"role": "assistant", "content": "5"}]
    assert conversation([]) == []


def test_otlp_span_of_a_judge_request() -> None:
    a = JudgeAttempt(messages=[{"role": "user", "content": "judge"}], text="r1: 9", problems={"r1": "out of range"},
                     start_ns=10, end_ns=20)
    body = otlp_span("judge-g-1", "g", "m", 2, a)
    (span,) = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
    attrs = {kv["key"]: next(iter(kv["value"].values())) for kv in span["attributes"]}
    assert attrs["tracegym.rollout_id"] == "judge-g-1" and attrs["tracegym.judge.attempt"] == "2"
    assert json.loads(attrs["tracegym.judge.messages"]) == a.messages and attrs["tracegym.judge.answer"] == "r1: 9"
    assert span["status"] == {"code": 2, "message": '{"r1": "out of range"}'}
    assert (span["startTimeUnixNano"], span["endTimeUnixNano"]) == ("10", "20") and len(span["traceId"]) == 32
