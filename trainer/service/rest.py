"""The Tinker API's REST listings over what the service holds: training runs (``GET /api/v1/training_runs``,
``GET /api/v1/training_runs/{id}``), checkpoints (``GET /api/v1/checkpoints``, a run's ``GET .../checkpoints``,
``DELETE .../checkpoints/{weights/NAME | sampler_weights/VERSION}``) and ``POST /api/v1/weights_info``.

A training run is listed while its workers live, and after its session finished for as long as it has a
saved state on disk (``--state-dir/checkpoints``) or a kept weight version. Its checkpoints are its saved
states (``training``) and its kept weight versions (``sampler``). The admin key sees every run; a run's own
key sees that run only. Publishing, unpublishing and copying checkpoints are not offered (404): the service
has one owner, whose key already reads every checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tracegym.trainer.service.access import Access, HttpError, fail, read_json
from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.state import CHECKPOINTS, SAMPLER_WEIGHTS, ServiceState, parse_path, tinker_path

OWNER = "tracegym-admin"
"""``model_owner`` of every run: the service has one owner, the holder of its admin key."""
NOT_OFFERED = (
    "tracegym does not offer {what}: the service has one owner, whose key already reads every checkpoint"
)


@dataclass(slots=True)
class RunRecord:
    model_id: str
    base_model: str
    lora_rank: int | None
    last_request: float
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """``Checkpoint`` objects, oldest first."""


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _checkpoint(model_id: str, kind: str, name: str, d: Path) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{kind}/{name}",
        "checkpoint_type": "training" if kind == CHECKPOINTS else "sampler",
        "time": _when(d.stat().st_mtime),
        "tinker_path": tinker_path(model_id, kind, name),
        "size_bytes": _size(d),
        "public": False,
    }


def catalog(state: ServiceState) -> dict[str, RunRecord]:
    """Every training run the service can tell of, with its checkpoints."""
    records = {
        r.model_id: RunRecord(r.model_id, r.base_model, r.lora_rank, r.last_request)
        for r in state.runs.values()
    }
    for p in state.engines.published().values():
        records.setdefault(
            p.run.model_id, RunRecord(p.run.model_id, p.run.base_model, p.run.lora_rank, p.run.last_request)
        )
    root = state.cfg.state_dir / "checkpoints"
    for f in sorted(root.glob("*/*/trainer_state.json")) if root.is_dir() else []:
        if f.parent.name.startswith("."):
            continue  # a save still being written
        extra = json.loads(f.read_text()).get("extra") or {}
        model_id = str(extra.get("model_id", ""))
        if not model_id:
            continue
        rec = records.setdefault(
            model_id, RunRecord(model_id, str(extra.get("base_model")), extra.get("lora_rank"), 0.0)
        )
        rec.last_request = max(rec.last_request, f.parent.stat().st_mtime)
        rec.checkpoints.append(_checkpoint(model_id, CHECKPOINTS, f.parent.name, f.parent))
    for version, p in state.engines.published().items():
        if p.path.is_dir():
            records[p.run.model_id].checkpoints.append(
                _checkpoint(p.run.model_id, SAMPLER_WEIGHTS, version, p.path)
            )
    for rec in records.values():
        rec.checkpoints.sort(key=lambda c: c["time"])
    return records


def training_run(rec: RunRecord) -> dict[str, Any]:
    """The API's ``TrainingRun``."""

    def last(kind: str) -> dict[str, Any] | None:
        return next((c for c in reversed(rec.checkpoints) if c["checkpoint_type"] == kind), None)

    return {
        "training_run_id": rec.model_id,
        "base_model": rec.base_model,
        "model_owner": OWNER,
        "is_lora": rec.lora_rank is not None,
        "corrupted": False,
        "lora_rank": rec.lora_rank,
        "last_request_time": _when(rec.last_request),
        "last_checkpoint": last("training"),
        "last_sampler_checkpoint": last("sampler"),
        "user_metadata": None,
    }


def _visible(access: Access, model_id: str) -> bool:
    return access.admin or model_id in access.run_keys


def _record(state: ServiceState, access: Access, model_id: str) -> RunRecord:
    rec = catalog(state).get(model_id)
    if rec is None or not _visible(access, model_id):
        raise HttpError(404, f"unknown training run {model_id!r} (GET /api/v1/training_runs lists them)")
    return rec


def delete_checkpoint(state: ServiceState, model_id: str, checkpoint_id: str) -> None:
    """Remove a saved state (``weights/NAME``) or a kept weight version (``sampler_weights/VERSION``)."""
    kind, _, name = checkpoint_id.partition("/")
    if kind == CHECKPOINTS:
        try:
            d, _extra = state.checkpoint_dir(tinker_path(model_id, kind, name))
        except UserFault as e:
            raise LookupError(str(e)) from None
        shutil.rmtree(d)
    elif kind == SAMPLER_WEIGHTS:
        p = state.engines.published().get(name)
        if p is None or p.run.model_id != model_id:
            raise LookupError(f"no checkpoint {checkpoint_id!r} of run {model_id}")
        state.engines[p.run.base_model].delete(name)
    else:
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not weights/NAME or sampler_weights/VERSION")


def _page(name: str, items: list[Any], limit: int, offset: int) -> dict[str, Any]:
    """One page of a listing, newest first, with the SDK's cursor (``offset``, ``limit``, ``total_count``)."""
    if limit < 0 or offset < 0:
        raise HttpError(400, "limit and offset must be >= 0")
    return {name: items[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(items)}}  # fmt: skip


def add_rest_routes(app: FastAPI, svc: Callable[[Request], ServiceState]) -> None:
    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        state = svc(request)
        access = Access(state, request)
        runs = [training_run(r) for r in sorted(
            (r for r in catalog(state).values() if _visible(access, r.model_id)),
            key=lambda r: r.last_request, reverse=True)]  # fmt: skip
        return _page("training_runs", runs, limit, offset)

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        state = svc(request)
        access = Access(state, request)
        every = [c for r in catalog(state).values() if _visible(access, r.model_id) for c in r.checkpoints]
        every.sort(key=lambda c: c["time"], reverse=True)
        return _page("checkpoints", every, limit, offset)

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str, request: Request) -> dict[str, Any]:
        state = svc(request)
        return training_run(_record(state, Access(state, request), model_id))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request) -> dict[str, Any]:
        state = svc(request)
        checkpoints = _record(state, Access(state, request), model_id).checkpoints
        return {
            "checkpoints": checkpoints,
            "cursor": {"offset": 0, "limit": len(checkpoints), "total_count": len(checkpoints)},
        }

    @app.post("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish(model_id: str, checkpoint_id: str, request: Request) -> Response:
        Access(svc(request), request)
        return fail(404, NOT_OFFERED.format(what="publishing or unpublishing checkpoints"))

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def ttl(model_id: str, checkpoint_id: str, request: Request) -> Response:
        Access(svc(request), request)
        return fail(
            404, "tracegym does not offer checkpoint TTLs: files stay until deleted (delete_checkpoint)"
        )

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete(model_id: str, checkpoint_id: str, request: Request) -> Response:
        state = svc(request)
        _record(state, Access(state, request), model_id)
        try:
            delete_checkpoint(state, model_id, checkpoint_id)
        except LookupError as e:
            raise HttpError(404, str(e)) from None
        except (UserFault, ValueError) as e:
            raise HttpError(400, str(e)) from None
        return Response("null", media_type="application/json")

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        state, body = svc(request), await read_json(request)
        access = Access(state, request)
        path = str(body.get("tinker_path"))
        try:
            if f"/{SAMPLER_WEIGHTS}/" in path:
                owner, version = parse_path(path, SAMPLER_WEIGHTS)
                p = state.engines.published().get(version)
                if p is None or p.run.model_id != owner:
                    raise UserFault(f"no kept weight version at {path}")
                base, rank = p.run.base_model, p.run.lora_rank
            else:
                owner = parse_path(path, CHECKPOINTS)[0]
                _, extra = state.checkpoint_dir(path)
                base, rank = str(extra.get("base_model")), extra.get("lora_rank")
        except UserFault as e:
            raise HttpError(404, str(e)) from None
        if not _visible(access, owner):
            raise HttpError(404, f"unknown training run {owner!r}")
        return {"base_model": base, "is_lora": rank is not None, "lora_rank": rank}
