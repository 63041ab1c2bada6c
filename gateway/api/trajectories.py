"""Trajectory routes: one rollout's trajectory, and trajectories in bulk as JSON lines for the trainer.

- ``GET /api/rollouts/{id}/trajectory``: the ``Trajectory`` JSON (404 for an unknown rollout).
- ``GET /api/trajectories``: one trajectory per line; filters ``status``, ``task_id``, ``group_id``,
  ``since``, ``until`` (ISO-8601 or epoch seconds), ``ids`` (comma-separated or repeated; all must
  exist), ``limit`` (total), ``page_size`` (rollouts read per store query, default 100, at most 1000).

Both take the assembly options as query parameters: ``mode`` (merge | per_call), ``agent_match`` (a
regex) or ``agents`` (comma-separated exact names), ``include_retokenized``, ``include_errors``,
``gamma``; and ``check`` (default true) to verify ``check_invariants`` before answering (typed in
``AssemblyParams``/``BulkParams``). Unknown parameters and bad values are 400s in OpenAI's error shape;
an empty value counts as absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from tracegym.gateway.api.params import Mode, Names, QueryModel, Status, Time
from tracegym.gateway.deps import StoreDep
from tracegym.gateway.openai_errors import NDJSONResponse, OpenAIError, bad_request, error_responses
from tracegym.gateway.traces.assembly import AssemblyOptions, assemble_rollout, check_invariants
from tracegym.gateway.traces.reads import iter_token_calls
from tracegym.gateway.traces.store.rollouts import check_status
from tracegym.types import Sequence, Trajectory

router = APIRouter(tags=["trajectories"])

PAGE = 100


class AssemblyParams(QueryModel):
    """The assembly options, and ``check`` (verify ``check_invariants`` before answering)."""

    mode: Mode = "merge"
    agent_match: str | None = None
    """A regex over agent names."""
    agents: Names = None
    """Exact agent names (comma-separated or repeated)."""
    include_retokenized: bool = False
    include_errors: bool = False
    gamma: float = Field(1.0, gt=0, le=1)
    check: bool = True

    def options(self) -> AssemblyOptions:
        """``AssemblyOptions`` from these parameters; bad values are 400s."""
        if self.agent_match is not None and self.agents is not None:
            raise bad_request("pass either agent_match (a regex) or agents (names), not both", param="agents")
        try:
            return AssemblyOptions(
                mode=self.mode,  # type: ignore[arg-type]
                agent_match=tuple(self.agents) if self.agents is not None else self.agent_match,
                include_retokenized=self.include_retokenized,
                include_errors=self.include_errors,
                gamma=self.gamma,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None


class BulkParams(AssemblyParams):
    status: Status = None
    task_id: str | None = None
    group_id: str | None = None
    since: Time = None
    """ISO-8601 or epoch seconds."""
    until: Time = None
    ids: Names = None
    """Rollout ids (comma-separated or repeated); all must exist."""
    limit: int | None = Field(None, ge=1)
    """At most this many trajectories in all."""
    page_size: int = Field(PAGE, ge=1, le=1000)
    """Rollouts read per store query while streaming."""

    def filters(self) -> dict[str, str | None]:
        return {"status": self.status, "task_id": self.task_id, "group_id": self.group_id,
                "since": self.since, "until": self.until}


def _assemble(store: Any, rollout: dict, calls: list, opts: AssemblyOptions, check: bool,
              events: list[dict] | None = None) -> Trajectory:
    if events is None:
        events = store.list_events(rollout["rollout_id"], kind="reward")
    traj = assemble_rollout(rollout, calls, events, opts)
    if check:
        check_invariants(calls, traj)
    return traj


def _sequence_fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Sequence):
        arrays = obj.arrays()._asdict()  # token_ids, loss_mask, logprobs
        return {name: arrays[name] if name in arrays else getattr(obj, name) for name in Sequence.FIELDS}
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def trajectory_json(traj: Trajectory) -> bytes:
    """The trajectory as JSON. orjson writes the dataclasses and a sequence's numpy arrays directly
    (no Python list per token; a NaN logprob is written as null, as None would be)."""
    return orjson.dumps(traj, default=_sequence_fields, option=orjson.OPT_SERIALIZE_NUMPY)


@router.get("/api/rollouts/{rollout_id}/trajectory", responses=error_responses(400, 404))
async def get_trajectory(rollout_id: str, params: Annotated[AssemblyParams, Query()], store: StoreDep) -> Response:
    opts, check = params.options(), params.check

    def work() -> bytes:
        rollout = store.get_rollout(rollout_id)
        if rollout is None:
            raise OpenAIError(404, f"unknown rollout {rollout_id!r}", param="rollout_id")
        [(_, calls)] = iter_token_calls(store, [rollout_id])
        return trajectory_json(_assemble(store, rollout, calls, opts, check))

    return Response(await run_in_threadpool(work), media_type="application/json")


def _rows_by_ids(store: Any, ids: list[str], q: BulkParams) -> list[dict]:
    """The named rollouts (all must exist), in the given order, kept when they pass the filters."""
    for name in ("since", "until"):
        if getattr(q, name) is not None:
            raise bad_request(f"{name} cannot be combined with ids", param=name)
    try:
        check_status(q.status)
    except ValueError as e:
        raise bad_request(str(e), param="status") from None
    found = store.get_rollouts(ids)
    missing = [rid for rid in ids if rid not in found]
    if missing:
        raise OpenAIError(404, f"unknown rollout id(s): {', '.join(missing[:20])}", param="ids")
    keep = {k: v for k in ("status", "task_id", "group_id") if (v := getattr(q, k)) is not None}
    rows = [found[rid] for rid in ids]
    return [r for r in rows if all(r[k] == v for k, v in keep.items())]


def _pages(store: Any, filters: dict[str, str | None], limit: int | None, page: int) -> Iterator[list[dict]]:
    """Rollout rows page by page (newest first), stopping after ``limit`` rows."""
    cursor, left = None, limit
    rows, cursor = store.list_rollouts(**filters, limit=min(page, left or page))  # validates the filters
    while True:
        if left is not None:
            rows = rows[:left]
            left -= len(rows)
        yield rows
        if cursor is None or left == 0:
            return
        rows, cursor = store.list_rollouts(**filters, limit=min(page, left or page), cursor=cursor)


def _lines(store: Any, first: list[dict], rest: Iterator[list[dict]], opts: AssemblyOptions, check: bool):
    page: list[dict] | None = first
    while page is not None:
        ids = [r["rollout_id"] for r in page]
        events = store.list_events_many(ids, kind="reward") if page else {}
        # One rollout's calls alive at a time (see ``iter_token_calls``).
        calls = iter_token_calls(store, ids)
        for row, (rid, cs) in zip(page, calls, strict=True):
            traj = _assemble(store, row, cs, opts, check, events.get(rid, []))
            yield trajectory_json(traj) + b"\n"
        page = next(rest, None)


@router.get("/api/trajectories", response_class=NDJSONResponse, responses=error_responses(400, 404))
async def list_trajectories(q: Annotated[BulkParams, Query()], store: StoreDep) -> StreamingResponse:
    """JSON lines, one trajectory per rollout: the rollouts named by ``ids`` (comma-separated, in that
    order), else those matching ``status``/``task_id``/``group_id``/``since``/``until`` newest first, at
    most ``limit``. Filters and ids combine. Read ``page_size`` rollouts (default 100) at a time while
    streaming."""
    opts, check, limit, page = q.options(), q.check, q.limit, q.page_size

    def start() -> tuple[list[dict], Iterator[list[dict]]]:
        # The first page is read before answering, so bad filters and unknown ids are 4xx, not a cut stream.
        if q.ids is not None:
            rows = _rows_by_ids(store, q.ids, q)[:limit]
            chunks = [rows[i : i + page] for i in range(0, len(rows), page)] or [[]]
            return chunks[0], iter(chunks[1:])
        try:
            pages = _pages(store, q.filters(), limit, page)
            return next(pages), pages
        except ValueError as e:
            raise bad_request(str(e)) from None

    first, rest = await run_in_threadpool(start)
    return StreamingResponse(_lines(store, first, rest, opts, check), media_type="application/x-ndjson")
