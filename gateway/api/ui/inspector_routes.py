"""The inspector's JSON routes (docs/api.md, "Trace inspector"): what the pages under ``/ui`` read, and
what scripts may read too.

- ``GET /api/runs``: the training runs in the store (``GET /api/runs/{run}/metrics`` has their curves).
- ``GET /api/inspect/rollouts``: rollouts filtered and paged on the server (``listing``).
- ``GET /api/inspect/rollouts/{id}``: one rollout, its calls and its trajectory's token view.
- ``GET /api/inspect/groups/{group_id}``: a GRPO group side by side, with rewards and advantages.
- ``GET /api/inspect/system``: queue, leases, failures, span counters, upstream.

Handlers are plain ``def``s where they only read the store (FastAPI runs them in its threadpool).
"""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Path, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from tracegym.gateway.api.params import Mode, QueryModel
from tracegym.gateway.api.ui.calls_view import call_rows
from tracegym.gateway.api.ui.flags import FlaggedRollouts
from tracegym.gateway.api.ui.listing import InspectRolloutParams, list_page
from tracegym.gateway.api.ui.system import queue_report, span_counters, upstream_report
from tracegym.gateway.api.ui.token_view import trainer_logprobs, trajectory_view
from tracegym.gateway.api.ui.tokens import TokenTexts
from tracegym.gateway.deps import ServicesDep, StoreDep
from tracegym.gateway.openai_errors import OpenAIError, bad_request, error_responses
from tracegym.gateway.traces.assembly import AssemblyOptions, assemble_rollout
from tracegym.gateway.traces.reads import iter_token_calls, list_spans
from tracegym.gateway.traces.store import ui_reads
from tracegym.gateway.traces.store.db import iso
from tracegym.gateway.traces.store.schema import ID_MAX_LENGTH

router = APIRouter(prefix="/api", tags=["inspector"])
RolloutId = Annotated[str, Path(max_length=ID_MAX_LENGTH)]
GroupId = Annotated[str, Path(max_length=ID_MAX_LENGTH)]
ADVANTAGE_EPS = 1e-6
"""As the trainer's GRPO (``trainer/algorithms/advantages.py``): (r - mean) / (unbiased std + eps)."""


class InspectorState:
    """What the inspector keeps between requests, owned by the app (``app.state.inspector``)."""

    def __init__(self) -> None:
        self.flags = FlaggedRollouts()
        self.token_texts = TokenTexts()


def get_inspector(request: Request) -> InspectorState:
    return request.app.state.inspector


InspectorDep = Annotated[InspectorState, Depends(get_inspector)]


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json")


@router.get("/runs")
def list_runs(store: StoreDep) -> Response:
    return _json({"runs": ui_reads.list_runs(store.db)})


@router.get("/inspect/rollouts", responses=error_responses(400))
def inspect_rollouts(params: Annotated[InspectRolloutParams, Query()], store: StoreDep,
                     state: InspectorDep) -> Response:
    return _json(list_page(store, params, state.flags))


class RolloutViewParams(QueryModel):
    mode: Mode = "merge"
    """Assembly mode of the token view: merge | per_call."""


def _rollout_view(store: Any, tokenizer: Any, state: InspectorState, rollout_id: str, mode: str,
                  base_url: str) -> dict[str, Any]:
    try:
        opts = AssemblyOptions(mode=mode)  # type: ignore[arg-type]
    except ValueError as e:
        raise bad_request(str(e), param="mode") from None
    rollout = store.get_rollout(rollout_id)
    if rollout is None:
        raise OpenAIError(404, f"unknown rollout {rollout_id!r}", code="not_found")
    rollout["traceback"] = ui_reads.rollout_traceback(store.db, rollout_id)
    rollout["split"] = ui_reads.task_split(store.db, rollout["task_id"])
    events = store.list_events(rollout_id)
    rewards = [e for e in events if e["kind"] == "reward"]
    rollout["rewards"], rollout["events"] = rewards, [e for e in events if e["kind"] == "event"]
    spans = list_spans(store, rollout_id)
    [(_, token_calls)] = iter_token_calls(store, [rollout_id])
    trajectory = assemble_rollout(rollout, token_calls, rewards, opts)
    calls, others = call_rows(spans, trajectory.excluded)
    view = trajectory_view(trajectory, token_calls, spans,
                           lambda ids: state.token_texts.texts(tokenizer, ids),
                           trainer_logprobs(rollout["events"]), mode)
    return {"rollout": rollout, "calls": calls, "other_spans": others, "trajectory": view,
            "export": {"command": f"tracegym export --gateway {base_url} --ids {rollout_id} "
                                  f"--out {rollout_id}.jsonl"}}


@router.get("/inspect/rollouts/{rollout_id}", responses=error_responses(400, 404))
async def inspect_rollout(rollout_id: RolloutId, params: Annotated[RolloutViewParams, Query()],
                          request: Request, store: StoreDep, svc: ServicesDep, state: InspectorDep) -> Response:
    tok = svc.tokenizer.tokenizer if svc.tokenizer is not None else None
    base = str(request.base_url).rstrip("/")
    body = await run_in_threadpool(_rollout_view, store, tok, state, rollout_id, params.mode, base)
    return _json(body)


def advantages(rewards: list[float | None]) -> list[float | None]:
    """GRPO advantages of a group's rewards (None for a rollout the trainer does not train on: not
    completed); 0 for a group of one."""
    known = [r for r in rewards if r is not None]
    if len(known) < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = sum(known) / len(known)
    std = math.sqrt(sum((r - mean) ** 2 for r in known) / (len(known) - 1))
    return [None if r is None else (r - mean) / (std + ADVANTAGE_EPS) for r in rewards]


@router.get("/inspect/groups/{group_id}", responses=error_responses(400, 404))
def inspect_group(group_id: GroupId, store: StoreDep) -> Response:
    rows = ui_reads.group_rollouts(store.db, group_id)
    if not rows:
        raise OpenAIError(404, f"unknown group {group_id!r}", code="not_found")
    ids = [r["rollout_id"] for r in rows]
    summaries = ui_reads.call_summaries(store.db, ids)
    replies = ui_reads.group_replies(store.db, ids)
    # As the trainer builds a group: its completed rollouts, a missing reward counted as 0 (trainer/run/build_batch.py).
    trained = [(r["reward"] or 0.0) if r["status"] == "completed" else None for r in rows]
    out = []
    for r, adv in zip(rows, advantages(trained), strict=True):
        s = summaries.get(r["rollout_id"], {})
        out.append({**r, "created_at": iso(r["created_at"]), "started_at": iso(r["started_at"]),
                    "finished_at": iso(r["finished_at"]), "advantage": adv, "calls": s.get("calls", 0),
                    "call_errors": s.get("errors", 0), "drifted_calls": s.get("drifted", 0),
                    "last_reply": replies.get(r["rollout_id"])})
    rewards = [r for r in trained if r is not None]
    return _json({"group_id": group_id, "task_id": rows[0]["task_id"], "rollouts": out,
                  "reward_mean": sum(rewards) / len(rewards) if rewards else None})


@router.get("/inspect/system")
async def inspect_system(request: Request, store: StoreDep, svc: ServicesDep) -> Response:
    # The store's counts and the upstream's answers, at once.
    report, upstream = await asyncio.gather(run_in_threadpool(queue_report, store),
                                            upstream_report(svc, getattr(request.app.state, "swap", None)))
    report["spans"] = span_counters(getattr(request.app.state, "metrics_registry", None))
    report["upstream"] = upstream
    return _json(report)
