"""The trainer's group judge (``tracegym.trainer.run.judge.GroupJudge``, the recipe's ``reward.judge``)
against a real ``tracegym serve --engine embedded --model tiny-random`` whose rollouts were run by the real
runner: once with a scripted judge process outside the gateway (its calls recorded as OTLP spans), once
with the gateway itself judging (tiny-random writes garbage, so every rollout must end with a clear judge
error, never a score). Either way the judge's calls are spans of a rollout of their own, in no group, and
never in the trajectories a step trains on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import serve_tiny
from tests.gateway.app_support import spans_of
from tests.procs import ManagedProcess
from tests.sdk.scripted_judge import read_log, scripted_judge
from tracegym.judge import JUDGE_AGENT
from tracegym.runner import run_agent
from tracegym.trainer.run.gateway_client import ControlClient, Group
from tracegym.trainer.run.judge import GroupJudge
from tracegym.trainer.settings import JudgeConfig, RewardConfig
from tracegym.types import Trajectory

RUBRIC = "The reply is an even number of characters long."


@pytest.fixture(scope="module")
def judged_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with serve_tiny(tmp_path_factory.mktemp("judge-gateway")) as gw:
        yield gw


def _run_group(gateway: str, ctl: ControlClient, n: int = 3) -> tuple[Group, list[Trajectory]]:
    (group,) = ctl.enqueue([{"input": {"question": "Say something."}}], group_size=n, split="train")
    stats = asyncio.run(run_agent("tests.e2e.agents.length_agent:agent", gateway, concurrency=n,
                                  exit_when_idle=True, progress=False))
    assert stats.done == n and stats.failed == 0, stats
    assert ctl.wait([group], timeout=30)
    trajs = ctl.trajectories(group.rollout_ids)
    assert sorted(t.rollout_id for t in trajs) == sorted(group.rollout_ids)
    return group, sorted(trajs, key=lambda t: group.rollout_ids.index(t.rollout_id))


def _events(ctl: ControlClient, rid: str, name: str) -> list[dict]:
    return [e for e in ctl.client.get_rollout(rid)["events"] if e["name"] == name]


def _not_trained(gateway: str, group: Group, judge_rollout: str, judge_call_ids: set[str]) -> None:
    """The judge rollout is in no group and no completed trajectory holds a judge call."""
    listed = httpx.get(f"{gateway}/api/rollouts", params={"group_id": group.group_id}, timeout=30).json()
    assert {r["rollout_id"] for r in listed["rollouts"]} == set(group.rollout_ids)
    r = httpx.get(f"{gateway}/api/trajectories", params={"status": "completed"}, timeout=60)
    trained = [json.loads(line) for line in r.text.splitlines()]
    assert judge_rollout not in {t["rollout_id"] for t in trained}
    assert not judge_call_ids & {c for t in trained for s in t["sequences"] for c in s["call_ids"]}


def test_scripted_judge_scores_a_group(judged_gateway: ManagedProcess, tmp_path: Path) -> None:
    gw = judged_gateway.base_url
    ctl = ControlClient(gw)
    group, trajs = _run_group(gw, ctl)
    agent_rewards = {t.rollout_id: t.reward for t in trajs}
    assert all(v in (0.0, 1.0) for v in agent_rewards.values())
    # first answer: a score out of range; then one that never scores r2
    bad = {"scores": [{"id": "r1", "score": 0.5}, {"id": "r2", "score": 4}, {"id": "r3", "score": 0.5}]}
    partial = {"scores": [{"id": "r1", "score": 0.25, "explanation": "ok"}, {"id": "r3", "score": 0.0}]}
    answers = [{"content": json.dumps(bad)}, {"content": "```json\n" + json.dumps(partial) + "\n```"}]
    with scripted_judge(tmp_path, answers) as (url, log):
        reward = RewardConfig(agent_weight=0.5, judge=JudgeConfig(rubric=RUBRIC, base_url=url, model="judge-m",
                                                                   weight=2.0, retries=1))
        judge = GroupJudge(ctl, reward, gateway_url=gw, model="tiny-random")
        try:
            kept, metrics = judge.apply([(group.group_id, trajs)])
        finally:
            judge.close()
        requests = read_log(log)
    r1, r2, r3 = group.rollout_ids
    assert len(requests) == 2 and requests[0]["model"] == "judge-m"
    assert RUBRIC in requests[0]["messages"][1]["content"]
    assert metrics["judge_calls"] == 2 and metrics["judge_failed"] == 1 and metrics["judge_score_mean"] == 0.125
    # trained rewards: 0.5 * the agent's + 2.0 * the judge's; r2 (never scored) is left out, not given 0
    assert set(kept) == {r1, r3}
    assert kept[r1].reward == 0.5 * agent_rewards[r1] + 0.5 and kept[r3].reward == 0.5 * agent_rewards[r3]
    assert all(s.reward == kept[r1].reward for s in kept[r1].sequences)

    # the store keeps both: the agent's reward on the rollout, the judge's score and the result as an event
    (ev,) = _events(ctl, r1, "tracegym.judge")
    assert ctl.client.get_rollout(r1)["reward"] == agent_rewards[r1]
    assert ev["value"] == 0.25 and ev["attributes"]["agent_reward"] == agent_rewards[r1]
    assert ev["attributes"]["reward"] == kept[r1].reward and ev["attributes"]["explanation"] == "ok"
    (err,) = _events(ctl, r2, "tracegym.judge_error")
    assert err["value"] == "judge failed after 2 attempt(s): missing from the answer"
    assert _events(ctl, r2, "tracegym.judge") == []

    # the judge's two requests are OTLP spans of the judge rollout, named in its event
    judge_rollout = ev["attributes"]["judge_rollout_id"]
    assert judge_rollout.startswith(f"judge-{group.group_id}-")
    (grp,) = _events(ctl, judge_rollout, "tracegym.judge_group")
    assert grp["attributes"]["ids"] == {"r1": r1, "r2": r2, "r3": r3} and grp["attributes"]["failed"] == [r2]
    spans = spans_of(gw, judge_rollout, 2)
    assert [(s["source"], s["attributes"]["tracegym.judge.attempt"], s["status"]) for s in spans] == [
        ("otlp", 1, "error"), ("otlp", 2, "error")]  # both answers had a problem
    assert spans[0]["attributes"]["tracegym.agent_name"] == JUDGE_AGENT
    assert json.loads(spans[1]["attributes"]["tracegym.judge.problems"]) == {"r2": "missing from the answer"}
    _not_trained(gw, group, judge_rollout, set())
    ctl.close()


def test_gateway_as_judge_records_llm_spans_and_fails_clearly(judged_gateway: ManagedProcess) -> None:
    gw = judged_gateway.base_url
    ctl = ControlClient(gw)
    group, trajs = _run_group(gw, ctl, n=2)
    reward = RewardConfig(judge=JudgeConfig(rubric=RUBRIC, retries=1, max_tokens=12))
    judge = GroupJudge(ctl, reward, gateway_url=gw, model="tiny-random")
    try:
        kept, metrics = judge.apply([(group.group_id, trajs)])
    finally:
        judge.close()
    assert kept == {} and metrics["judge_failed"] == 2 and metrics["judge_calls"] == 2
    errors = [_events(ctl, rid, "tracegym.judge_error") for rid in group.rollout_ids]
    assert all(len(e) == 1 and e[0]["value"].startswith("judge failed after 2 attempt(s): ") for e in errors)
    judge_rollout = errors[0][0]["attributes"]["judge_rollout_id"]
    spans = [s for s in spans_of(gw, judge_rollout, 2) if s.get("choices")]  # recording is asynchronous
    assert len(spans) == 2 and all(s["attributes"]["tracegym.agent_name"] == JUDGE_AGENT for s in spans)
    assert spans[0]["prompt_ids"] and RUBRIC in spans[0]["attributes"]["tracegym.request"]["messages"][1]["content"]
    assert ctl.client.get_rollout(judge_rollout)["status"] == "adhoc"
    _not_trained(gw, group, judge_rollout, {s["call_id"] for s in spans})
    ctl.close()
