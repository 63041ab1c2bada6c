"""Control and query API under ``/api/`` (docs/api.md): tasks and the rollout queue, rewards and events,
rollout and span queries, weight versions, and per-run training metrics.

Handlers are plain ``def``s (FastAPI runs them in its threadpool) because the store is synchronous; the
two that may hold their answer until the queue changes (``waits.py``) are ``async`` and call the store in
the threadpool.
Store errors map to OpenAI-shaped errors: ValueError -> 400, NotFound -> 404, Conflict -> 409.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Path, Query, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from tracegym.gateway.api.params import Names, QueryModel, Status, Time, integer
from tracegym.gateway.api.waits import MAX_WAIT_S, ChangesDep, held
from tracegym.gateway.deps import RecorderDep, StoreDep
from tracegym.gateway.openai_errors import OpenAIError, bad_request, error_responses
from tracegym.gateway.proxy.ids import ID_CHARS
from tracegym.gateway.proxy.validation import JSON_MAX_DEPTH
from tracegym.gateway.traces.reads import list_spans as read_spans
from tracegym.gateway.traces.store.schema import (
    ID_MAX_LENGTH,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    max_length,
)
from tracegym.gateway.traces.store.schema import events as E
from tracegym.gateway.traces.store.schema import tasks as TASKS
from tracegym.gateway.traces.store.store_errors import Conflict, NotFound

router = APIRouter(prefix="/api", tags=["control"])
T = TypeVar("T")

# Lengths and ranges of the columns the values are stored in (PostgreSQL refuses longer strings).
_ID = ID_MAX_LENGTH
_SPLIT = max_length(TASKS.c.split)
_EVENT_NAME = max_length(E.c.name)
# Ids are path segments: the one rule of ``proxy/ids.py`` (the hot routes check the same).
RolloutId = Annotated[str, Path(max_length=_ID, pattern=ID_CHARS)]
RunName = Annotated[str, Path(max_length=_ID, pattern=ID_CHARS)]
MAX_LEASE_SECONDS = 7 * 24 * 3600.0
"""A lease longer than a week is a mistake (a hung worker would hold its rollout that long)."""


def _json_value(value: Any) -> Any:
    """A JSON value the store can keep on every dialect: integers within 64 bits, nesting at most
    ``JSON_MAX_DEPTH`` deep (checked without recursion, so a hostile nesting cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > JSON_MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {JSON_MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"integer {v} does not fit in 64 bits")
    return value


JsonValue = Annotated[Any, AfterValidator(_json_value)]
RealNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A JSON number: not a string of one, not a boolean, not NaN or infinity."""
Int32 = integer(INT32_MIN, INT32_MAX)
"""A value kept in a 32-bit column."""
Lease = Annotated[float, Field(gt=0, le=MAX_LEASE_SECONDS, allow_inf_nan=False)]
WaitSeconds = Annotated[float, Field(ge=0, le=MAX_WAIT_S, strict=True, allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskIn(_Body):
    task_id: str | None = Field(None, max_length=_ID)
    group_id: str | None = Field(None, min_length=1, max_length=_ID)
    """The group's id (default: a new one). An existing group id is not enqueued again: its rollouts are
    returned, so a retried enqueue (or a resumed trainer's) never runs a group twice."""
    input: JsonValue
    split: str | None = Field(None, max_length=_SPLIT)
    metadata: Annotated[dict[str, Any] | None, AfterValidator(_json_value)] = None


class EnqueueIn(_Body):
    tasks: list[TaskIn] = Field(min_length=1)
    group_size: integer(1, 10_000) = 1  # type: ignore[valid-type]
    max_attempts: integer(1, 1_000) = 3  # type: ignore[valid-type]


class ClaimIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)
    limit: integer(1, 1000) = 1  # type: ignore[valid-type]
    lease_seconds: Lease = 60.0
    wait_s: WaitSeconds = 0.0
    """With nothing queued, hold the answer up to this many seconds until something is (long polling)."""


class HeartbeatIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)
    lease_seconds: Lease | None = None


class CompleteIn(_Body):
    worker_id: str | None = Field(None, max_length=_ID)
    reward: RealNumber | None = None


class FailIn(_Body):
    worker_id: str | None = Field(None, max_length=_ID)
    error: str
    traceback: str | None = None


class ReleaseIn(_Body):
    worker_id: str = Field(min_length=1, max_length=_ID)


class RewardIn(_Body):
    value: RealNumber
    name: str | None = Field(None, max_length=_EVENT_NAME)
    idempotency_key: str = Field(min_length=1, max_length=_ID)
    call_index: Int32 | None = None


class EventIn(_Body):
    name: str = Field(min_length=1, max_length=_EVENT_NAME)
    value: JsonValue = None
    attributes: Annotated[dict[str, Any] | None, AfterValidator(_json_value)] = None
    idempotency_key: str = Field(min_length=1, max_length=_ID)


class WeightVersionIn(_Body):
    version: str = Field(min_length=1, max_length=_ID)
    path: str | None = None
    step: Int32 | None = None
    swap_seconds: RealNumber | None = None


class MetricsIn(_Body):
    step: Int32
    metrics: Annotated[dict[str, Any], AfterValidator(_json_value)]


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


# -- tasks and the rollout queue -----------------------------------------------------------------------------
@router.post("/tasks", status_code=201, responses=error_responses(400, 409))
def enqueue(body: EnqueueIn, store: StoreDep, changes: ChangesDep) -> Response:
    tasks = [t.model_dump(exclude_none=True) | {"input": t.input} for t in body.tasks]
    out = _call(store.enqueue_tasks, tasks, group_size=body.group_size,
                max_attempts=body.max_attempts)
    changes.bump()
    return _json({"tasks": out}, 201)


@router.post("/rollouts/claim", responses=error_responses(400))
async def claim(body: ClaimIn, store: StoreDep, request: Request, changes: ChangesDep) -> Response:
    """Each claimed rollout comes with its ``token`` (on a gateway with an admin key): the key its agent
    calls, rewards and emits with, valid for that rollout only (docs/security.md)."""

    def fetch() -> Any:
        return run_in_threadpool(_call, store.claim, body.worker_id, limit=body.limit,
                                 lease_seconds=body.lease_seconds)

    rollouts = await held(fetch, bool, changes, body.wait_s)
    guard = request.app.state.guard
    if guard.keyed:
        rollouts = [r | {"token": guard.token_for(r["rollout_id"])} for r in rollouts]
    return _json({"rollouts": rollouts})


@router.post("/rollouts/{rollout_id}/heartbeat", responses=error_responses(400, 404, 409))
def heartbeat(rollout_id: RolloutId, body: HeartbeatIn, store: StoreDep) -> Response:
    from tracegym.gateway.traces.store.db import iso

    expires = _call(store.heartbeat, rollout_id, body.worker_id, lease_seconds=body.lease_seconds)
    return _json({"lease_expires_at": iso(expires)})


def _flush_spans(recorder: Any) -> None:
    """Write every recorded call before a rollout is marked finished, so whoever sees it finished (the
    trainer fetching its trajectory) also sees all of its calls (spans are otherwise written in batches)."""
    if recorder is not None:
        recorder.force_flush()


def _ended(request: Request, row: dict) -> dict:
    """Tell the app's admission state (``proxy/admission.py``) what became of a rollout, so that its token
    stops writing at once once it has ended."""
    admission = getattr(request.app.state, "admission", None)
    if admission is not None:
        admission.rollouts.ended(row["rollout_id"], row["status"])
    return row


@router.post("/rollouts/{rollout_id}/complete", responses=error_responses(400, 404, 409))
def complete(rollout_id: RolloutId, body: CompleteIn, store: StoreDep,
             recorder: RecorderDep, request: Request, changes: ChangesDep) -> Response:
    _flush_spans(recorder)
    row = _call(store.complete, rollout_id, worker_id=body.worker_id, reward=body.reward)
    changes.bump()
    return _json(_ended(request, row))


@router.post("/rollouts/{rollout_id}/fail", responses=error_responses(400, 404, 409))
def fail(rollout_id: RolloutId, body: FailIn, store: StoreDep,
         recorder: RecorderDep, request: Request, changes: ChangesDep) -> Response:
    _flush_spans(recorder)
    row = _call(store.fail, rollout_id, error=body.error, worker_id=body.worker_id, traceback=body.traceback)
    changes.bump()  # ended, or queued again for another attempt
    return _json(_ended(request, row))


@router.post("/rollouts/{rollout_id}/release", responses=error_responses(400, 404, 409))
def release(rollout_id: RolloutId, body: ReleaseIn, store: StoreDep, changes: ChangesDep) -> Response:
    row = _call(store.release, rollout_id, worker_id=body.worker_id)
    changes.bump()
    return _json(row)


# -- rewards and events ------------------------------------------------------------------------------------
@router.post("/rollouts/{rollout_id}/rewards", status_code=201, responses=error_responses(400, 404, 409))
def add_reward(rollout_id: RolloutId, body: RewardIn, store: StoreDep) -> Response:
    event_id, dup = _call(store.add_event, rollout_id, kind="reward", name=body.name,
                          value=body.value, idempotency_key=body.idempotency_key, call_index=body.call_index)
    return _json({"event_id": event_id, "duplicate": dup}, 201)


@router.post("/rollouts/{rollout_id}/events", status_code=201, responses=error_responses(400, 404, 409))
def add_event(rollout_id: RolloutId, body: EventIn, store: StoreDep) -> Response:
    event_id, dup = _call(store.add_event, rollout_id, kind="event", name=body.name,
                          value=body.value, attributes=body.attributes, idempotency_key=body.idempotency_key)
    return _json({"event_id": event_id, "duplicate": dup}, 201)


# -- queries -----------------------------------------------------------------------------------------------
class RolloutFilters(QueryModel):
    status: Status = None
    task_id: str | None = None
    group_id: str | None = None
    group_ids: Names = None
    """The rollouts of any of these groups (up to 500)."""
    since: Time = None
    """ISO-8601 or epoch seconds."""
    until: Time = None
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None
    """The ``next_cursor`` of the previous page."""
    with_events: bool = False
    """Each rollout with its ``rewards`` and ``events``, as ``GET /api/rollouts/{id}`` shows them (one query
    for the page instead of a request per rollout)."""
    with_tool_parse: bool = True
    """Each rollout with ``tool_parse``: its calls by how their tool-call parse went (one query for the
    page; a poller that only follows statuses turns it off)."""
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    """While a rollout of the page is queued or running, hold the answer up to this many seconds until
    none is (long polling: a trainer waiting for its groups asks once instead of polling)."""


def _settled(page: tuple[list[dict], str | None]) -> bool:
    return all(r["status"] not in ("queued", "running") for r in page[0])


@router.get("/rollouts", responses=error_responses(400))
async def list_rollouts(filters: Annotated[RolloutFilters, Query()], store: StoreDep,
                        changes: ChangesDep) -> Response:
    def fetch() -> Any:
        return run_in_threadpool(_page, filters, store)

    rollouts, cursor = await held(fetch, _settled, changes, filters.wait_s)
    return _json({"rollouts": rollouts, "next_cursor": cursor})


def _page(filters: RolloutFilters, store: Any) -> tuple[list[dict], str | None]:
    """One page of rollouts with what ``filters`` asks to attach (one threadpool hop per look)."""
    query = filters.model_dump(exclude={"with_events", "with_tool_parse", "wait_s"})
    rollouts, cursor = _call(store.list_rollouts, **query)
    if filters.with_events:
        events = store.list_events_many([r["rollout_id"] for r in rollouts])
        for r in rollouts:
            _attach_events(r, events.get(r["rollout_id"], []))
    if filters.with_tool_parse:
        counts = store.tool_parse_counts([r["rollout_id"] for r in rollouts])
        for r in rollouts:
            r["tool_parse"] = counts[r["rollout_id"]]
    return rollouts, cursor


def _attach_events(rollout: dict, events: list[dict]) -> None:
    rollout["rewards"] = [e for e in events if e["kind"] == "reward"]
    rollout["events"] = [e for e in events if e["kind"] == "event"]


def _rollout_or_404(store: Any, rollout_id: str) -> dict:
    rollout = store.get_rollout(rollout_id)
    if rollout is None:
        raise OpenAIError(404, f"unknown rollout {rollout_id!r}", code="not_found")
    return rollout


@router.get("/rollouts/{rollout_id}", responses=error_responses(400, 404))
def get_rollout(rollout_id: RolloutId, store: StoreDep) -> Response:
    rollout = _rollout_or_404(store, rollout_id)
    _attach_events(rollout, store.list_events(rollout_id))
    rollout["tool_parse"] = store.tool_parse_counts([rollout_id])[rollout_id]
    return _json(rollout)


@router.get("/rollouts/{rollout_id}/spans", responses=error_responses(400, 404))
def list_spans(rollout_id: RolloutId, store: StoreDep) -> Response:
    _rollout_or_404(store, rollout_id)
    return _json({"spans": read_spans(store, rollout_id)})


# -- weight versions and training metrics -------------------------------------------------------------------
@router.get("/weight_versions")
def list_weight_versions(store: StoreDep) -> Response:
    return _json({"weight_versions": store.list_weight_versions()})


@router.post("/weight_versions", status_code=201, responses=error_responses(400, 409))
def add_weight_version(body: WeightVersionIn, store: StoreDep) -> Response:
    return _json(_call(store.add_weight_version, body.version, path=body.path, step=body.step,
                       swap_seconds=body.swap_seconds), 201)


@router.post("/runs/{run}/metrics", status_code=201, responses=error_responses(400))
def add_metrics(run: RunName, body: MetricsIn, store: StoreDep) -> Response:
    _call(store.add_metrics, run, body.step, body.metrics)
    return _json({"run": run, "step": body.step}, 201)


@router.get("/runs/{run}/metrics", responses=error_responses(400))
def list_metrics(run: RunName, store: StoreDep) -> Response:
    return _json({"run": run, "metrics": store.list_metrics(run)})
