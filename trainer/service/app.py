"""The training service's HTTP API: the Tinker API's routes (``/api/v1/...``, what the ``tinker`` SDK
calls) over ``ServiceState``. Training and sampling requests answer a future at once
(``{"request_id": ...}``) and run as tasks; ``/api/v1/retrieve_future`` answers their result.

Keys: with an admin key set, every route but the health checks needs it (``X-API-Key``, the SDK's
header, or ``Authorization: Bearer``), given as it is or with the ``tml-`` prefix the SDK insists on;
a run's own key (``GET /api/v1/training_runs/{model_id}/key``) works for that run's requests, its
samplers and its own saved states only; a future's result is read by the admin key or its own run's key
(another run's key is told the request id is unknown). Status codes: 400 bad input, 401/403 keys, 404
unknown run, sampler, version, request id or an operation tracegym does not offer
(``not_offered``), 409 a second client stepping a run (``runs`` says the ordering rule)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tracegym.trainer.algorithms.registry import UnknownNameError
from tracegym.trainer.service.access import Access, HttpError, fail, get_run, read_json
from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.not_offered import add_not_offered_routes
from tracegym.trainer.service.rest import add_rest_routes
from tracegym.trainer.service.runs import Run, SeqConflict
from tracegym.trainer.service.sampling_routes import add_sampling_routes
from tracegym.trainer.service.state import SAMPLER_WEIGHTS, ServiceState, tinker_path
from tracegym.trainer.service.wire import (
    PROTO,
    BadInput,
    forward_backward_from_json,
    forward_backward_from_proto,
)

ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}
"""The API's AdamParams defaults (the SDK always sends every field)."""

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False,
                 "fwdbwd_max_chunk_len": 1 << 20, "fwdbwd_max_chunk_bytes_count": 1 << 40}
"""What the SDK is told at start: plain API keys, httpx, one forward_backward request per call, custom
losses run on the client (their gradient comes back as cross_entropy weights)."""



def adam_params(body: dict[str, Any]) -> dict[str, float]:
    """An ``optim_step``'s AdamW settings: ``ADAM_DEFAULTS`` with the request's ``adam_params`` over them
    (``ValueError`` naming what is wrong)."""
    given = body.get("adam_params") or body.get("optim_params") or {}
    if body.get("optimizer_params") is not None or not isinstance(given, dict):
        raise ValueError("optim_step takes adam_params (tracegym trains with adamw)")
    unknown = sorted(set(given) - set(ADAM_DEFAULTS))
    if unknown:
        raise ValueError(f"adam_params has no field {unknown[0]!r}; fields: {', '.join(ADAM_DEFAULTS)}")
    adam = ADAM_DEFAULTS | {k: float(v) for k, v in given.items()}
    if adam["learning_rate"] < 0 or not 0 <= adam["beta1"] < 1 or not 0 <= adam["beta2"] < 1 or adam["eps"] <= 0:
        raise ValueError(f"adam_params out of range: {adam} (learning_rate >= 0, betas in [0, 1), eps > 0)")
    return adam


def build_app(make_state: Callable[[], Any]) -> FastAPI:
    """The app; ``make_state`` is an async context manager factory yielding the ``ServiceState``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with make_state() as state:
            app.state.svc = state
            yield

    app = FastAPI(title="tracegym training service (Tinker API)", lifespan=lifespan)

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, e: HttpError) -> JSONResponse:
        return fail(e.status, str(e))

    def svc(request: Request) -> ServiceState:
        return request.app.state.svc

    add_rest_routes(app, svc)

    async def run_call(request: Request) -> tuple[ServiceState, dict[str, Any], Run]:
        """A call on one training run: the service, the JSON body and the run its ``model_id`` names (404
        when there is none), which the caller's key must be allowed to use (403)."""
        state, body = svc(request), await read_json(request)
        run = get_run(state, body.get("model_id"))
        Access(state, request).need_run(run)
        return state, body, run

    def claim(run: Run, seq_id: Any) -> int:
        """The request's turn in the run: its ``seq_id`` (409 when taken), or the next free one."""
        try:
            return run.claim(seq_id if isinstance(seq_id, int) and seq_id > 0 else None)
        except SeqConflict as e:
            raise HttpError(409, str(e)) from None

    @contextmanager
    def checked(state: ServiceState, run: Run, seq: int) -> Iterator[None]:
        """The checks of a request that holds turn ``seq``: one that fails (400, or the ``HttpError`` it
        raised) passes the turn on unused, so the run's later requests are not held up."""
        try:
            yield
        except (ValueError, UserFault, HttpError) as e:
            async def skip() -> None:
                async with run.ordered(seq, state.cfg.gap_timeout):
                    pass
            state.futures.submit(skip(), "skip", run.model_id)
            if isinstance(e, HttpError):
                raise
            raise HttpError(400, str(e)) from None

    def submit_ordered(state: ServiceState, run: Run, seq: int, kind: str, work: Callable[[], Any]) -> dict[str, Any]:
        """Run ``work()`` in turn ``seq`` of the run as a future owned by the run."""
        async def ordered() -> Any:
            async with run.ordered(seq, state.cfg.gap_timeout):
                return await work()
        return {"request_id": state.futures.submit(ordered(), kind, run.model_id), "model_id": run.model_id}

    # ---------------------------------------------------------------- service, sessions

    @app.get("/api/v1/healthz")
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        Access(svc(request), request)
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        Access(svc(request), request)
        return {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        Access(svc(request), request)
        return {"type": "create_session", "session_id": svc(request).new_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, str]:
        Access(svc(request), request)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Response:
        """Release the session's runs (those this key may use) once their queued requests ran."""
        state = svc(request)
        access = Access(state, request)
        for run in [r for r in state.runs.values()
                    if r.model_id.startswith(f"{session_id}:") and access.may_read(r.model_id)]:
            seq = run.claim(None)

            async def release(run: Run = run, seq: int = seq) -> None:  # after the run's queued requests
                async with run.ordered(seq, state.cfg.gap_timeout):
                    await state.release_run(run)
            state.futures.submit(release(), "finish", None)
        state.sessions.discard(session_id)
        return Response("null", media_type="application/json")

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        Access(svc(request), request)
        return {"status": "accepted"}  # the SDK's own telemetry: accepted and dropped

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        state = svc(request)
        Access(state, request)
        return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_length, "trainable": True,
                                      "sampleable": True} for m in state.cfg.models],
                "losses": _loss_names()}

    # ---------------------------------------------------------------- training runs

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        state, body = svc(request), await read_json(request)
        Access(state, request).need_admin()
        try:
            base_model = state.base_model(body.get("base_model")).name
        except UserFault as e:
            raise HttpError(400, str(e)) from None
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise HttpError(400, f"optimizer {opt!r} is not offered; tracegym trains with adamw")
        lora = body.get("lora_config")
        if lora is not None and (not isinstance(lora.get("rank"), int) or lora["rank"] <= 0):
            raise HttpError(400, "lora_config.rank must be an integer > 0 (lora_config null: full fine-tuning)")
        model_id = f"{body.get('session_id', 'api')}:train:{body.get('model_seq_id', len(state.runs))}"
        if model_id in state.runs:
            raise HttpError(409, f"model_id {model_id!r} exists already: use a new model_seq_id")

        async def work() -> dict[str, Any]:
            run = await state.create_run(model_id, base_model, lora)
            return {"model_id": run.model_id, "type": "create_model"}
        return {"request_id": state.futures.submit(work(), "create_model", None), "model_id": model_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        state, _, run = await run_call(request)
        return {"type": "get_info", "model_id": run.model_id, "is_lora": run.lora_rank is not None,
                "lora_rank": run.lora_rank, "model_name": run.base_model,
                "model_data": {"arch": state.models[run.base_model].arch, "model_name": run.base_model,
                               "tokenizer_id": str(run.model_dir)}}

    @app.get("/api/v1/training_runs/{model_id}/key")
    async def run_key(model_id: str, request: Request) -> dict[str, str]:
        state = svc(request)
        Access(state, request).need_admin()
        return {"model_id": model_id, "key": get_run(state, model_id).key}

    @app.post("/api/v1/forward_backward")
    @app.post("/api/v1/forward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        state = svc(request)
        try:
            if PROTO in request.headers.get("content-type", ""):
                call = forward_backward_from_proto(await request.body(), request.headers.get("content-encoding"))
            else:
                call = forward_backward_from_json(await read_json(request), request.url.path.endswith("/forward"))
        except BadInput as e:
            raise HttpError(400, str(e)) from None
        run = get_run(state, call.model_id)
        Access(state, request).need_run(run)
        seq = claim(run, call.seq_id)
        with checked(state, run, seq):
            state.check_call(run, call)

        async def work() -> bytes | dict[str, Any]:
            outputs, metrics = await state.forward_backward(run, call)
            return {"outputs": outputs, "metrics": metrics}
        return submit_ordered(state, run, seq, "forward_backward", work)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        state, body, run = await run_call(request)
        seq = claim(run, body.get("seq_id"))
        with checked(state, run, seq):
            adam = adam_params(body)

        async def work() -> dict[str, Any]:
            return {"metrics": await state.optim_step(run, adam)}
        return submit_ordered(state, run, seq, "optim_step", work)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        state, body, run = await run_call(request)

        async def work() -> dict[str, Any]:
            return {"path": await state.save_state(run, body.get("path")), "type": "save_weights"}
        return submit_ordered(state, run, claim(run, body.get("seq_id")), "save_weights", work)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        state, body = svc(request), await read_json(request)
        access = Access(state, request)
        path, optimizer = str(body.get("path")), bool(body.get("optimizer"))
        if body.get("session_id") is not None:  # a new training run, from a saved state
            access.need_admin()
            model_id = f"{body['session_id']}:train:{body.get('model_seq_id', len(state.runs))}"
            try:
                _, extra = state.checkpoint_dir(path)
                if body.get("base_model") not in (None, extra.get("base_model")):
                    raise UserFault(f"{path} was trained from {extra.get('base_model')!r}, not "
                                    f"{body.get('base_model')!r}")
                base_model = state.base_model(str(extra.get("base_model"))).name
            except UserFault as e:
                raise HttpError(400, str(e)) from None
            rank = extra.get("lora_rank")

            async def create() -> dict[str, Any]:
                run = await state.create_run(model_id, base_model, None if rank is None else {"rank": rank})
                await state.load_state(run, path, optimizer)
                return {"path": path, "model_id": model_id, "type": "load_weights"}
            return {"request_id": state.futures.submit(create(), "load_weights", None), "model_id": model_id}
        run = get_run(state, body.get("model_id"))
        access.need_run(run)
        seq = claim(run, body.get("seq_id"))
        with checked(state, run, seq):
            access.need_checkpoint(path)

        async def work() -> dict[str, Any]:
            await state.load_state(run, path, optimizer)
            return {"path": path, "model_id": run.model_id, "type": "load_weights"}
        return submit_ordered(state, run, seq, "load_weights", work)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        state, body, run = await run_call(request)
        seq = claim(run, body.get("seq_id"))
        with checked(state, run, seq):
            if body.get("kind", "snapshot") != "snapshot":
                raise ValueError("only kind='snapshot' sampling clients are offered (not 'inflight')")

        async def work() -> dict[str, Any]:
            version = await state.publish(run)
            path = tinker_path(run.model_id, SAMPLER_WEIGHTS, version)
            out: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
            if body.get("sampling_session_seq_id") is not None:
                out["sampling_session_id"] = state.new_sampler(run.base_model, version, run, path).sampler_id
            return out
        return submit_ordered(state, run, seq, "save_weights_for_sampler", work)

    add_sampling_routes(app, svc)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        state, body = svc(request), await read_json(request)
        access = Access(state, request)
        rid = str(body.get("request_id"))
        pending = state.futures.get(rid)
        if pending is None or not access.may_read(pending.owner):  # another run's: as unknown as a made-up one
            raise HttpError(404, f"unknown request_id {rid!r} (results are kept for an hour)")
        item = await state.futures.wait(rid)
        if item is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if item.task.cancelled():
            return JSONResponse({"error": "the request was cancelled (the service is stopping)",
                                 "category": "server"})
        if (e := item.task.exception()) is not None:
            user = isinstance(e, UserFault | ValueError | LookupError | UnknownNameError)
            message = str(e) if user else f"{type(e).__name__}: {e}"
            return JSONResponse({"error": message, "category": "user" if user else "server"})
        result = item.task.result()
        proto = PROTO in request.headers.get("accept", "")
        if item.kind in ("forward_backward", "sample"):
            from tracegym.trainer.service.wire import forward_backward_output, sample_response

            encoded = (forward_backward_output(result["outputs"], result["metrics"], proto)
                       if item.kind == "forward_backward" else sample_response(result, proto))
            if proto:
                return Response(encoded, media_type=PROTO)
            return JSONResponse(encoded)
        return JSONResponse(result)

    add_not_offered_routes(app, svc)  # last: its catch-all answers what no route above does
    return app


def _loss_names() -> list[str]:
    from tracegym.trainer.service.steps import loss_names

    return loss_names()
