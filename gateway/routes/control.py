"""Control and query API under ``/api/`` (docs/api.md): tasks and the rollout queue, rewards and events,
rollout and span queries, weight versions, and per-run training metrics.

Handlers are plain ``def``s (FastAPI runs them in its threadpool) because the store is synchronous.
Store errors map to OpenAI-shaped errors: ValueError -> 400, NotFound -> 404, Conflict -> 409.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError
from starlette.responses import Response

from tracegym.gateway.errors import OpenAIError, bad_request
from tracegym.gateway.routes.query import query, unknown_params
from tracegym.gateway.store.errors import Conflict, NotFound
from tracegym.gateway.store.schema import ID_MAX_LENGTH, INT32_MAX, INT32_MIN, max_length
from tracegym.gateway.store.schema import events as E
from tracegym.gateway.store.schema import tasks as TASKS

router = APIRouter(prefix="/api", tags=["control"])
T = TypeVar("T")

# Lengths and ranges of the columns the values are stored in (PostgreSQL refuses longer strings).
_ID = ID_MAX_LENGTH
_SPLIT = max_length(TASKS.c.split)
_EVENT_NAME = max_length(E.c.name)
RolloutId = Annotated[str, Path(max_length=_ID)]
RunName = Annotated[str, Path(max_length=_ID)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskIn(_Body):
    task_id: str | None = Field(None, max_length=_ID)
    input: Any
    split: str | None = Field(None, max_length=_SPLIT)
    metadata: dict[str, Any] | None = None


class EnqueueIn(_Body):
    tasks: list[TaskIn] = Field(min_length=1)
    group_size: int = Field(1, ge=1, le=10_000)
    max_attempts: int = Field(3, ge=1, le=1_000)


class ClaimIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)
    limit: int = Field(1, ge=1, le=1000)
    lease_seconds: float = Field(60.0, gt=0)


class HeartbeatIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)
    lease_seconds: float | None = Field(None, gt=0)


class CompleteIn(_Body):
    worker_id: str | None = Field(None, max_length=_ID)
    reward: float | None = Field(None, allow_inf_nan=False)


class FailIn(_Body):
    worker_id: str | None = Field(None, max_length=_ID)
    error: str
    traceback: str | None = None


class ReleaseIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)


class RewardIn(_Body):
    value: float = Field(allow_inf_nan=False)
    name: str | None = Field(None, max_length=_EVENT_NAME)
    idempotency_key: str = Field(min_length=1, max_length=_ID)
    call_index: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)


class EventIn(_Body):
    name: str = Field(min_length=1, max_length=_EVENT_NAME)
    value: Any = None
    attributes: dict[str, Any] | None = None
    idempotency_key: str = Field(min_length=1, max_length=_ID)


class WeightVersionIn(_Body):
    version: str = Field(min_length=1, max_length=_ID)
    path: str | None = None
    step: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    swap_seconds: float | None = None


class MetricsIn(_Body):
    step: int = Field(ge=INT32_MIN, le=INT32_MAX)
    metrics: dict[str, Any]


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS), status_code=status,
                    media_type="application/json")


def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except NotFound as e:
        raise OpenAIError(404, str(e), code="not_found") from e
    except Conflict as e:
        raise OpenAIError(409, str(e), code="conflict") from e
    except ValueError as e:
        raise bad_request(str(e)) from e
    except DataError as e:  # a value PostgreSQL refuses that the checks missed: still the client's
        raise bad_request(f"the store refused a value: {str(e.orig).splitlines()[0]}") from e


def _store(request: Request) -> Any:
    # The store routers are mounted only on a gateway with a store (app.py), so app.state.store is set.
    return request.app.state.store


# -- tasks and the rollout queue -----------------------------------------------------------------------------
@router.post("/tasks")
def enqueue(body: EnqueueIn, request: Request) -> Response:
    tasks = [t.model_dump(exclude_none=True) | {"input": t.input} for t in body.tasks]
    out = _call(_store(request).enqueue_tasks, tasks, group_size=body.group_size,
                max_attempts=body.max_attempts)
    return _json({"tasks": out}, 201)


@router.post("/rollouts/claim")
def claim(body: ClaimIn, request: Request) -> Response:
    rollouts = _call(_store(request).claim, body.worker_id, limit=body.limit, lease_seconds=body.lease_seconds)
    return _json({"rollouts": rollouts})


@router.post("/rollouts/{rollout_id}/heartbeat")
def heartbeat(rollout_id: RolloutId, body: HeartbeatIn, request: Request) -> Response:
    from tracegym.gateway.store.db import iso

    expires = _call(_store(request).heartbeat, rollout_id, body.worker_id, lease_seconds=body.lease_seconds)
    return _json({"lease_expires_at": iso(expires)})


def _flush_spans(request: Request) -> None:
    """Write every recorded call before a rollout is marked finished, so whoever sees it finished (the
    trainer fetching its trajectory) also sees all of its calls. Spans are otherwise written ~0.1 s late."""
    recorder = getattr(request.app.state, "recorder", None)
    if recorder is not None:
        recorder.force_flush()


@router.post("/rollouts/{rollout_id}/complete")
def complete(rollout_id: RolloutId, body: CompleteIn, request: Request) -> Response:
    _flush_spans(request)
    return _json(_call(_store(request).complete, rollout_id, worker_id=body.worker_id, reward=body.reward))


@router.post("/rollouts/{rollout_id}/fail")
def fail(rollout_id: RolloutId, body: FailIn, request: Request) -> Response:
    _flush_spans(request)
    return _json(_call(_store(request).fail, rollout_id, error=body.error, worker_id=body.worker_id,
                       traceback=body.traceback))


@router.post("/rollouts/{rollout_id}/release")
def release(rollout_id: RolloutId, body: ReleaseIn, request: Request) -> Response:
    return _json(_call(_store(request).release, rollout_id, worker_id=body.worker_id))


# -- rewards and events ------------------------------------------------------------------------------------
@router.post("/rollouts/{rollout_id}/rewards")
def add_reward(rollout_id: RolloutId, body: RewardIn, request: Request) -> Response:
    event_id, dup = _call(_store(request).add_event, rollout_id, kind="reward", name=body.name,
                          value=body.value, idempotency_key=body.idempotency_key, call_index=body.call_index)
    return _json({"event_id": event_id, "duplicate": dup}, 201)


@router.post("/rollouts/{rollout_id}/events")
def add_event(rollout_id: RolloutId, body: EventIn, request: Request) -> Response:
    event_id, dup = _call(_store(request).add_event, rollout_id, kind="event", name=body.name,
                          value=body.value, attributes=body.attributes, idempotency_key=body.idempotency_key)
    return _json({"event_id": event_id, "duplicate": dup}, 201)


# -- queries -----------------------------------------------------------------------------------------------
_LIST_PARAMS = ("status", "task_id", "group_id", "since", "until", "limit", "cursor")


@router.get("/rollouts")
def list_rollouts(request: Request) -> Response:
    q = query(request)
    unknown_params(q, _LIST_PARAMS)
    try:
        limit = int(q.get("limit", "100"))
    except ValueError:
        raise bad_request(f"limit must be an integer, got {q.get('limit')!r}", param="limit") from None
    filters = {k: q.get(k) for k in ("status", "task_id", "group_id", "since", "until", "cursor")}
    rollouts, cursor = _call(_store(request).list_rollouts, **filters, limit=limit)
    return _json({"rollouts": rollouts, "next_cursor": cursor})


def _rollout_or_404(store: Any, rollout_id: str) -> dict:
    rollout = store.get_rollout(rollout_id)
    if rollout is None:
        raise OpenAIError(404, f"unknown rollout {rollout_id!r}", code="not_found")
    return rollout


@router.get("/rollouts/{rollout_id}")
def get_rollout(rollout_id: RolloutId, request: Request) -> Response:
    store = _store(request)
    rollout = _rollout_or_404(store, rollout_id)
    events = store.list_events(rollout_id)
    rollout["rewards"] = [e for e in events if e["kind"] == "reward"]
    rollout["events"] = [e for e in events if e["kind"] == "event"]
    return _json(rollout)


@router.get("/rollouts/{rollout_id}/spans")
def list_spans(rollout_id: RolloutId, request: Request) -> Response:
    store = _store(request)
    _rollout_or_404(store, rollout_id)
    return _json({"spans": store.list_spans(rollout_id)})


# -- weight versions and training metrics -------------------------------------------------------------------
@router.get("/weight_versions")
def list_weight_versions(request: Request) -> Response:
    return _json({"weight_versions": _store(request).list_weight_versions()})


@router.post("/weight_versions")
def add_weight_version(body: WeightVersionIn, request: Request) -> Response:
    return _json(_call(_store(request).add_weight_version, body.version, path=body.path, step=body.step,
                       swap_seconds=body.swap_seconds), 201)


@router.post("/runs/{run}/metrics")
def add_metrics(run: RunName, body: MetricsIn, request: Request) -> Response:
    _call(_store(request).add_metrics, run, body.step, body.metrics)
    return _json({"run": run, "step": body.step}, 201)


@router.get("/runs/{run}/metrics")
def list_metrics(run: RunName, request: Request) -> Response:
    return _json({"run": run, "metrics": _store(request).list_metrics(run)})
