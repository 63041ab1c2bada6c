"""The Tinker API's sampling routes: ``create_sampling_session`` (a sampler of a published weight version, or
of a served base model, each model on its own engine), ``GET /api/v1/samplers/{id}`` and ``asample`` (answered as a future, drawn through the
gateway by ``ServiceState.sample``).

A sampler of a published version belongs to the run that published it: that run's key and the admin key
use it; the base model's sampler is the admin's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from tracegym.trainer.service.access import Access, HttpError, read_json
from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.sampling import parse_sample
from tracegym.trainer.service.state import BASE, Sampler, ServiceState
from tracegym.trainer.service.wire import BadInput, SampleResult


def path_sampler(state: ServiceState, access: Access, model_path: str) -> Sampler:
    """A new sampler of the weight version at ``model_path`` (404 when there is none; 403 for another run's
    key)."""
    try:
        version, run = state.published_at(model_path)
    except UserFault as e:
        raise HttpError(404, str(e)) from None
    access.need_run(run)
    return state.new_sampler(run.base_model, version, run, model_path)


def base_sampler(state: ServiceState, access: Access, base_model: Any) -> Sampler:
    """A new sampler of a served base model (admin; None: the default model; 400 naming the served models
    for any other name, 404 after the first publish on that model's engine)."""
    access.need_admin()
    try:
        name = state.base_model(base_model).name
    except UserFault as e:
        raise HttpError(400, str(e)) from None
    try:
        return state.new_sampler(name, BASE, None, None)
    except UserFault as e:
        raise HttpError(404, str(e)) from None


def known_sampler(state: ServiceState, access: Access, sid: Any) -> Sampler:
    """The sampler ``sid`` (404 when there is none), which this key must be allowed to use (403)."""
    sampler = state.samplers.get(str(sid))
    if sampler is None:
        raise HttpError(404, f"unknown sampling_session_id {sid!r}: create a sampling client first")
    if sampler.run is None:
        access.need_admin()
    else:
        access.need_run(sampler.run)
    return sampler


def add_sampling_routes(app: FastAPI, svc: Callable[[Request], ServiceState]) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        state, body = svc(request), await read_json(request)
        access = Access(state, request)
        if body.get("model_path"):
            sampler = path_sampler(state, access, str(body["model_path"]))
        else:
            sampler = base_sampler(state, access, body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        state = svc(request)
        sampler = known_sampler(state, Access(state, request), sampler_id)
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        state, body = svc(request), await read_json(request)
        access = Access(state, request)
        if body.get("sampling_session_id") is not None:
            sampler = known_sampler(state, access, body["sampling_session_id"])
        elif body.get("model_path"):
            sampler = path_sampler(state, access, str(body["model_path"]))
        else:
            raise HttpError(400, "asample needs a sampling_session_id (or a model_path)")
        model = state.models[sampler.base_model]
        try:
            ask = parse_sample(body, max_length=model.max_length, model=model.name)
        except BadInput as e:
            raise HttpError(400, str(e)) from None

        async def work() -> SampleResult:
            return await state.sample(sampler, ask)
        rid = state.futures.submit(work(), "sample", None if sampler.run is None else sampler.run.model_id)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}-{i}" for i in range(ask.n)]}
