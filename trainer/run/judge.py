"""Group judge rewards in the training loop: the recipe's ``reward: {judge: {...}}``.

After a step's groups complete, each group's completed rollouts are scored relative to each other by an LLM
judge (``tracegym.judge``: rubric, retries, per-rollout errors) and the reward the trainer uses becomes

    reward = agent_weight * agent_reward + judge.weight * judge_score        (a missing agent reward = 0)

What the store keeps, per judged rollout: its own reward stays the agent's (the rollout's ``reward``), and an
event ``tracegym.judge`` holds the judge's score as its value with ``{"explanation", "agent_reward",
"reward", "agent_weight", "judge_weight", "judge_rollout_id", "model"}``; a rollout the judge could not score
gets an event ``tracegym.judge_error`` (the reason) instead and is left out of the step (counted in the
step's ``judge_failed``), never trained with a made-up 0.

The judge's own calls are recorded as spans of their own under a rollout ``judge-{group_id}-{hex}`` that
belongs to no group, so no step ever trains on them: through the run's gateway (``base_url`` unset) they
are ordinary LLM spans sent to ``/rollouts/{judge rollout}/v1``; to another endpoint, each request is
posted to the gateway as an OTLP span (``POST /v1/traces``) with the messages, the answer and the
problems found. The judge rollout carries an event ``tracegym.judge_group`` naming the group and its
rollouts by the ids the judge saw (``r1``...). Held-out evaluations report the agent's own reward.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tracegym.judge import (
    JUDGE_AGENT,
    Candidate,
    GroupJudgement,
    JudgeAttempt,
    JudgeSettings,
    combine,
    judge_group,
    labels,
)
from tracegym.trainer.settings import RewardConfig
from tracegym.types import Trajectory


def conversation(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rollout's conversation as the judge sees it: the last successful LLM call's messages and reply."""
    calls = [s for s in spans if s.get("choices") and s.get("status") != "error"]
    if not calls:
        return []
    last = calls[-1]
    request = (last.get("attributes") or {}).get("tracegym.request") or {}
    messages = list(request.get("messages") or [])
    if isinstance(request.get("prompt"), str):  # a Completions call
        messages = [{"role": "user", "content": request["prompt"]}]
    reply = last["choices"][0].get("message") or {}
    return [*messages, {"role": "assistant", **{k: v for k, v in reply.items() if k != "role"}}]


def _attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": value if isinstance(value, str) else json.dumps(value)}}


def otlp_span(judge_rollout: str, group_id: str, model: str, index: int, a: JudgeAttempt) -> dict[str, Any]:
    """One judge request as an OTLP/JSON export request (for a judge outside the gateway)."""
    attrs = {"tracegym.rollout_id": judge_rollout, "tracegym.agent_name": JUDGE_AGENT,
             "gen_ai.operation.name": "chat", "gen_ai.request.model": model, "tracegym.judge.group_id": group_id,
             "tracegym.judge.attempt": index, "tracegym.judge.messages": a.messages,
             "tracegym.judge.answer": a.text if a.text is not None else "", "tracegym.judge.problems": a.problems}
    failed = a.call_error is not None or bool(a.problems)
    span = {"traceId": secrets.token_hex(16), "spanId": secrets.token_hex(8), "name": f"judge {model}",
            "kind": 3, "startTimeUnixNano": str(a.start_ns), "endTimeUnixNano": str(a.end_ns),
            "attributes": [_attr(k, v) for k, v in attrs.items()],
            "status": {"code": 2 if failed else 1, "message": (a.call_error or json.dumps(a.problems)) if failed else ""}}
    return {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "tracegym-judge")]},
                               "scopeSpans": [{"scope": {"name": "tracegym.judge"}, "spans": [span]}]}]}


class GroupJudge:
    """Judges groups for one run: ``apply`` is the loop's hook."""

    def __init__(self, ctl: Any, reward: RewardConfig, *, gateway_url: str, model: str) -> None:
        assert reward.judge is not None
        self.ctl, self.reward, self.cfg = ctl, reward, reward.judge
        self.gateway_url = gateway_url.rstrip("/")
        self.model = self.cfg.model or model
        key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
        if self.cfg.api_key_env and not key:
            raise ValueError(f"reward.judge.api_key_env: ${self.cfg.api_key_env} is not set")
        self.api_key = key if self.cfg.base_url or key else ctl.client.config.api_key
        self.http = httpx.Client()

    def close(self) -> None:
        self.http.close()

    def settings(self, judge_rollout: str) -> JudgeSettings:
        c = self.cfg
        base = c.base_url or f"{self.gateway_url}/rollouts/{judge_rollout}/v1"
        return JudgeSettings(base_url=base, model=self.model, rubric=c.rubric, api_key=self.api_key,
                             retries=c.retries, temperature=c.temperature, max_tokens=c.max_tokens,
                             timeout_s=c.timeout_s, max_chars=c.max_chars, headers={"X-Agent-Name": JUDGE_AGENT})

    def judge(self, group_id: str, trajs: Sequence[Trajectory]) -> tuple[str, GroupJudgement, list[dict]]:
        """Judge one group's completed trajectories; returns the judge rollout, the judgement and the rollouts
        as read from the gateway (for their task input and the agent's reward)."""
        client = self.ctl.client
        rollouts = [client.get_rollout(t.rollout_id) for t in trajs]
        cands = [Candidate(t.rollout_id, conversation(client.rollout_spans(t.rollout_id))) for t in trajs]
        judge_rollout = f"judge-{group_id}-{secrets.token_hex(4)}"
        n = 0

        def record(a: JudgeAttempt) -> None:  # a judge outside the gateway: its calls as OTLP spans
            nonlocal n
            n += 1
            if self.cfg.base_url:
                client.post("/v1/traces", otlp_span(judge_rollout, group_id, self.model, n, a), "record a judge span")

        task = rollouts[0].get("input") if rollouts else None
        judgement = judge_group(self.settings(judge_rollout), task, cands, http=self.http, on_attempt=record)
        client.add_event(judge_rollout, "events", {
            "name": "tracegym.judge_group", "idempotency_key": "tracegym.judge_group",
            "attributes": {"group_id": group_id, "model": self.model, "attempts": len(judgement.attempts),
                           "ids": dict(zip(labels(len(cands)), [c.rollout_id for c in cands], strict=True)),
                           "failed": [s.rollout_id for s in judgement.failed]}})
        return judge_rollout, judgement, rollouts

    def apply(self, groups: Sequence[tuple[str, Sequence[Trajectory]]]) -> tuple[dict[str, Trajectory], dict[str, float]]:
        """Judge every group (``[(group_id, completed trajectories)]``, several at once); returns the
        trajectories to train on with their combined rewards (rollouts the judge failed left out) and the
        step's judge metrics."""
        t0 = time.monotonic()
        todo = [(gid, list(ts)) for gid, ts in groups if ts]
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            results = list(pool.map(lambda g: self.judge(*g), todo))
        kept: dict[str, Trajectory] = {}
        scores: list[float] = []
        agent: list[float] = []
        failed = calls = missing = 0
        for (_, trajs), (judge_rollout, judgement, rollouts) in zip(todo, results, strict=True):
            calls += len(judgement.attempts)
            for t, s, row in zip(trajs, judgement.scores, rollouts, strict=True):
                missing += t.reward is None
                agent.append(t.reward if t.reward is not None else 0.0)
                key = f"tracegym.judge:{judge_rollout}"
                if s.score is None:
                    failed += 1
                    self.ctl.client.add_event(t.rollout_id, "events", {
                        "name": "tracegym.judge_error", "value": s.error, "idempotency_key": key,
                        "attributes": {"judge_rollout_id": judge_rollout, "model": self.model}})
                    continue
                final = combine(t.reward, s.score, agent_weight=self.reward.agent_weight, judge_weight=self.cfg.weight)
                self.ctl.client.add_event(t.rollout_id, "events", {
                    "name": "tracegym.judge", "value": s.score, "idempotency_key": key,
                    "attributes": {"explanation": s.explanation, "agent_reward": row.get("reward"), "reward": final,
                                   "agent_weight": self.reward.agent_weight, "judge_weight": self.cfg.weight,
                                   "judge_rollout_id": judge_rollout, "model": self.model}})
                t.reward = final
                for seq in t.sequences:
                    seq.reward = final
                scores.append(s.score)
                kept[t.rollout_id] = t
        metrics = {
            "judge_s": time.monotonic() - t0, "judge_calls": float(calls), "judge_failed": float(failed),
            "judge_score_mean": statistics.fmean(scores) if scores else 0.0,
            "agent_reward_mean": statistics.fmean(agent) if agent else 0.0,
        }
        if self.reward.agent_weight:
            metrics["reward_missing"] = float(missing)
        return kept, metrics
