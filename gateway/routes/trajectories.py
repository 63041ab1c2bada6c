"""Trajectory routes: one rollout's trajectory, and trajectories in bulk as JSON lines for the trainer.

- ``GET /api/rollouts/{id}/trajectory``: the ``Trajectory`` JSON (404 for an unknown rollout).
- ``GET /api/trajectories``: one trajectory per line; filters ``status``, ``task_id``, ``group_id``,
  ``since``, ``until`` (ISO-8601 or epoch seconds), ``ids`` (comma-separated or repeated; all must
  exist), ``limit`` (total), ``page_size`` (rollouts read per store query, default 100, at most 1000).

Both take the assembly options as query parameters: ``mode`` (merge | per_call), ``agent_match`` (a
regex) or ``agents`` (comma-separated exact names), ``include_retokenized``, ``include_errors``,
``gamma``; and ``check`` (default true) to verify ``check_invariants`` before answering. Unknown
parameters and bad values are 400s in OpenAI's error shape; an empty value counts as absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from tracegym.gateway.assembly import AssemblyOptions, assemble_rollout, check_invariants
from tracegym.gateway.errors import OpenAIError, bad_request
from tracegym.gateway.routes.query import Query, query, unknown_params
from tracegym.gateway.store.rollouts import check_status
from tracegym.types import Sequence, Trajectory

router = APIRouter(tags=["trajectories"])

PAGE = 100
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_OPTION_PARAMS = ("mode", "agent_match", "agents", "include_retokenized", "include_errors", "gamma", "check")
_BULK_PARAMS = ("status", "task_id", "group_id", "since", "until", "limit", "ids", "page_size")


def _flag(q: Query, name: str, default: bool) -> bool:
    raw = q.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise bad_request(f"{name} must be true or false, got {raw!r}", param=name)


def parse_options(q: Query) -> tuple[AssemblyOptions, bool]:
    """``(AssemblyOptions, check)`` from query parameters; bad values are 400s."""
    if q.get("agent_match") is not None and q.get("agents") is not None:
        raise bad_request("pass either agent_match (a regex) or agents (names), not both", param="agents")
    match: str | tuple[str, ...] | None = q.get("agent_match")
    if q.get("agents") is not None:
        match = tuple(a for a in q["agents"].split(",") if a)
    try:
        gamma = float(q.get("gamma", "1"))
    except ValueError:
        raise bad_request(f"gamma must be a number, got {q.get('gamma')!r}", param="gamma") from None
    try:
        opts = AssemblyOptions(
            mode=q.get("mode", "merge"),
            agent_match=match,
            include_retokenized=_flag(q, "include_retokenized", False),
            include_errors=_flag(q, "include_errors", False),
            gamma=gamma,
        )
    except ValueError as e:
        raise bad_request(str(e)) from None
    return opts, _flag(q, "check", True)


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
        packed = dict(zip(Sequence.FIELDS[:3], obj.packed(), strict=True))  # token_ids, loss_mask, logprobs
        return {name: packed[name] if name in packed else getattr(obj, name) for name in Sequence.FIELDS}
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def trajectory_json(traj: Trajectory) -> bytes:
    """The trajectory as JSON. orjson writes the dataclasses and a sequence's packed numpy arrays directly
    (no Python list per token; a NaN logprob is written as null, as None would be)."""
    return orjson.dumps(traj, default=_sequence_fields, option=orjson.OPT_SERIALIZE_NUMPY)


@router.get("/api/rollouts/{rollout_id}/trajectory")
async def get_trajectory(rollout_id: str, request: Request) -> Response:
    q = query(request)
    unknown_params(q, _OPTION_PARAMS)
    opts, check = parse_options(q)
    store = request.app.state.store

    def work() -> bytes:
        rollout = store.get_rollout(rollout_id)
        if rollout is None:
            raise OpenAIError(404, f"unknown rollout {rollout_id!r}", param="rollout_id")
        [(_, calls)] = store.iter_token_calls([rollout_id])
        return trajectory_json(_assemble(store, rollout, calls, opts, check))

    return Response(await run_in_threadpool(work), media_type="application/json")


def _positive(q: Query, name: str, default: int | None, most: int | None = None) -> int | None:
    raw = q.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= (most or int(raw)):
        bound = f" at most {most}" if most else ""
        raise bad_request(f"{name} must be a positive integer{bound}, got {raw!r}", param=name)
    return int(raw)


def _rows_by_ids(store: Any, ids: list[str], q: Query) -> list[dict]:
    """The named rollouts (all must exist), in the given order, kept when they pass the filters."""
    for name in ("since", "until"):
        if q.get(name) is not None:
            raise bad_request(f"{name} cannot be combined with ids", param=name)
    try:
        check_status(q.get("status"))
    except ValueError as e:
        raise bad_request(str(e), param="status") from None
    found = store.get_rollouts(ids)
    missing = [rid for rid in ids if rid not in found]
    if missing:
        raise OpenAIError(404, f"unknown rollout id(s): {', '.join(missing[:20])}", param="ids")
    keep = {k: q[k] for k in ("status", "task_id", "group_id") if q.get(k) is not None}
    rows = [found[rid] for rid in ids]
    return [r for r in rows if all(r[k] == v for k, v in keep.items())]


def _pages(store: Any, q: Query, limit: int | None, page: int) -> Iterator[list[dict]]:
    """Rollout rows page by page (newest first), stopping after ``limit`` rows."""
    filters = {
        "status": q.get("status"),
        "task_id": q.get("task_id"),
        "group_id": q.get("group_id"),
        "since": q.get("since"),  # epoch seconds or ISO-8601: the store parses both
        "until": q.get("until"),
    }
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
        # One rollout's calls alive at a time (see ``Store.iter_token_calls``).
        calls = store.iter_token_calls(ids)
        for row, (rid, cs) in zip(page, calls, strict=True):
            traj = _assemble(store, row, cs, opts, check, events.get(rid, []))
            yield trajectory_json(traj) + b"\n"
        page = next(rest, None)


@router.get("/api/trajectories")
async def list_trajectories(request: Request) -> StreamingResponse:
    """JSON lines, one trajectory per rollout: the rollouts named by ``ids`` (comma-separated, in that
    order), else those matching ``status``/``task_id``/``group_id``/``since``/``until`` newest first, at
    most ``limit``. Filters and ids combine. Read ``page_size`` rollouts (default 100) at a time while
    streaming."""
    q = query(request)
    unknown_params(q, _OPTION_PARAMS + _BULK_PARAMS)
    opts, check = parse_options(q)
    limit = _positive(q, "limit", None)
    page = _positive(q, "page_size", PAGE, most=1000) or PAGE
    store = request.app.state.store

    def start() -> tuple[list[dict], Iterator[list[dict]]]:
        # The first page is read before answering, so bad filters and unknown ids are 4xx, not a cut stream.
        if q.get("ids") is not None:
            ids = [i for i in q["ids"].split(",") if i]
            rows = _rows_by_ids(store, ids, q)[:limit]
            chunks = [rows[i : i + page] for i in range(0, len(rows), page)] or [[]]
            return chunks[0], iter(chunks[1:])
        try:
            pages = _pages(store, q, limit, page)
            return next(pages), pages
        except ValueError as e:
            raise bad_request(str(e)) from None

    first, rest = await run_in_threadpool(start)
    return StreamingResponse(_lines(store, first, rest, opts, check), media_type="application/x-ndjson")
