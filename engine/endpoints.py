"""The embedded engine's HTTP routes: the subset of SGLang's native API that the gateway and the trainer
use, with SGLang's field names and semantics (shared SGLANG.md §1, §3). With a key set
(``TRACEGYM_ENGINE_API_KEY``, like SGLang's ``--api-key``) the routes that change the engine (weights,
pause/continue, flush, abort) need it as a Bearer token; with ``TRACEGYM_ENGINE_WEIGHTS_DIR`` weights and
adapters load only from under that directory. Each route gets the app's
``Engine`` through ``EngineDep``; the app's lifespan (``server.create_app``) owns it."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tracegym.engine.adapters import load_response
from tracegym.engine.dist_weights import Bucket, GroupRequest
from tracegym.engine.protocol import parse_generate
from tracegym.engine.runtime import Engine

log = logging.getLogger(__name__)
VERSION = "tracegym-engine-0.1"

router = APIRouter()


# ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in its thread pool.
async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]


async def require_key(request: Request) -> None:
    """401 unless the request carries the engine's key (``app.state.api_key``; None: no key needed)."""
    key: str | None = request.app.state.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise HTTPException(401, "this engine route needs the engine's key (Authorization: Bearer)",
                            headers={"WWW-Authenticate": "Bearer"})


Keyed = [Depends(require_key)]


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ValueError("the request body is empty; a JSON object is expected")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def _http_error_of(results: list[dict[str, Any]]) -> JSONResponse | None:
    """SGLang turns aborts with a status code >= 400 (engine errors) into HTTP errors."""
    for r in results:
        fr = r["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort" and (fr.get("status_code") or 0) >= 400:
            return _error(fr.get("message", "aborted"), fr["status_code"])
    return None


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SGLang's event stream; an engine error mid-stream arrives as ``data: {"error": ...}``."""
    async for chunk in chunks:
        fr = chunk["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort" and (fr.get("status_code") or 0) >= 400:
            chunk = {
                "error": {"message": fr.get("message"), "type": "engine_error", "code": fr["status_code"]}
            }
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, engine: EngineDep) -> Response:
    try:
        body = await _json_body(request)
        specs, opts = parse_generate(
            body, engine.tokenizer, vocab_size=engine.vocab_size, max_positions=engine.max_positions
        )
        engine.check_adapters(specs)
    except ValueError as e:
        return _error(str(e))
    if opts.stream:
        return StreamingResponse(_sse(engine.stream(specs, opts)), media_type="text/event-stream")
    results = await engine.generate(specs, opts)
    err = _http_error_of(results)
    if err is not None:
        return err
    return JSONResponse(results if opts.is_batch else results[0])


def _weights_failure(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)


def _check_root(request: Request, path: str) -> None:
    """ValueError for a path outside the engine's weights root (``TRACEGYM_ENGINE_WEIGHTS_DIR``), if set."""
    root = request.app.state.weights_root
    if root is None:
        return
    base, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([base, real]) != base:
        raise ValueError(f"{path} is outside this engine's weights root")


@router.post("/update_weights_from_disk", dependencies=Keyed)
async def update_weights_from_disk(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("`model_path` is required")
        version = body.get("weight_version")
        abort_all = bool(body.get("abort_all_requests", False))
        _check_root(request, path)
    except ValueError as e:
        return _weights_failure(str(e))
    try:
        aborted = await engine.load_weights(path, None if version is None else str(version), abort_all)
    except Exception as e:  # a failed load keeps the old weights (WeightLoadError, swap errors)
        log.warning("weight update from %s failed: %s", path, e)
        return _weights_failure(f"Failed to update weights: {e}")
    log.info("weights updated from %s (weight_version=%s)", path, engine.scheduler.weight_version)
    return JSONResponse(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": aborted}
    )


def _done(message: str) -> JSONResponse:
    return JSONResponse({"success": True, "message": message})


def _failed(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


@router.post("/init_weights_update_group", dependencies=Keyed)
async def init_weights_update_group(request: Request, engine: EngineDep) -> JSONResponse:
    """Blocks (off the event loop) until every rank of the group has joined the rendezvous."""
    try:
        req = GroupRequest.parse(await _json_body(request))
        await engine.dist.init_group(req)
    except Exception as e:  # a bad body, or torch's rendezvous timing out or refusing: reported, not raised
        log.warning("init_weights_update_group failed: %s", e)
        return _failed(f"Failed to init group: {e}")
    log.info("joined weight-update group %s as rank %d of %d (%s)", req.group_name, req.rank_offset,
             req.world_size, req.backend)
    return _done("Succeeded to initialize custom process group.")


@router.post("/update_weights_from_distributed", dependencies=Keyed)
async def update_weights_from_distributed(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        bucket = Bucket.parse(await _json_body(request))
    except ValueError as e:
        return _failed(str(e))
    try:
        await engine.update_from_distributed(bucket)
    except Exception as e:  # a refused or failed bucket: the old weights keep serving
        log.warning("update_weights_from_distributed failed: %s", e)
        return _failed(f"Failed to update parameter online: {e}")
    staged = engine.dist.session is not None
    return _done(f"Succeeded to {'receive' if staged else 'update'} {len(bucket.names)} tensor(s).")


@router.post("/begin_weight_update", dependencies=Keyed)
async def begin_weight_update(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        await _json_body(request, required=False)  # ``selector``: one model here, so always "all"
    except ValueError as e:
        return _failed(str(e))
    engine.dist.begin()
    return _done("Weight update begun.")


@router.post("/end_weight_update", dependencies=Keyed)
async def end_weight_update(request: Request, engine: EngineDep) -> JSONResponse:
    """Applies what the session received (see ``dist_weights``); ``weight_version`` may also come here.
    ``{"discard": true}`` (not SGLang's: a gateway sends it only to engines whose ``/model_info`` says
    ``staged_weight_updates``) closes the session applying nothing, after a bucket failed elsewhere."""
    try:
        body = await _json_body(request, required=False)
        if body.get("discard") is True:  # our extension (model_info's staged_weight_updates)
            dropped = engine.dist.discard()
            log.info("distributed weight update discarded (%d staged tensor(s))", dropped)
            return _done(f"Weight update discarded: {dropped} staged tensor(s) dropped, nothing applied.")
        version = body.get("weight_version")
        await engine.end_weight_update(None if version is None else str(version))
    except Exception as e:
        log.warning("end_weight_update failed: %s", e)
        return _failed(f"Failed to end weight update: {e}")
    log.info("distributed weight update applied (weight_version=%s)", engine.scheduler.weight_version)
    return _done("Weight update ended.")


@router.post("/destroy_weights_update_group", dependencies=Keyed)
async def destroy_weights_update_group(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        body = await _json_body(request, required=False)
        await engine.dist.destroy(str(body.get("group_name") or "weight_update_group"))
    except ValueError as e:
        return _failed(str(e))
    return _done("Succeeded to destroy custom process group.")


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request, engine: EngineDep) -> JSONResponse:
    """SGLang's ``{name, truncate_size=100}``: the parameter's first values, flattened (for checks)."""
    try:
        body = dict(request.query_params) if request.method == "GET" else await _json_body(request)
        name, size = body.get("name"), int(body.get("truncate_size", 100))
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        if name not in params:
            raise ValueError(f"no parameter named {name!r}")
    except ValueError as e:
        return _error(str(e))
    values = await asyncio.wrap_future(
        engine.scheduler.call(lambda: params[name].detach().flatten()[:size].float().cpu().tolist()))
    return JSONResponse(values)


@router.post("/load_lora_adapter", dependencies=Keyed)
async def load_lora_adapter(request: Request, engine: EngineDep) -> JSONResponse:
    """SGLang's body ``{lora_name, lora_path, pinned}`` (``pinned`` has no meaning here: nothing is
    evicted) and answer ``{success, error_message, loaded_adapters}``."""
    try:
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("`lora_name` and `lora_path` are required strings")
        _check_root(request, path)
        await engine.load_lora(name, path)
    except ValueError as e:  # AdapterLoadError too: the adapters loaded before stay served
        log.warning("LoRA adapter load refused: %s", e)
        return JSONResponse(load_response(engine.lora, False, str(e)), status_code=400)
    log.info("LoRA adapter %s loaded from %s", name, path)
    return JSONResponse(load_response(engine.lora, True, None))


@router.post("/unload_lora_adapter", dependencies=Keyed)
async def unload_lora_adapter(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ValueError("`lora_name` is a required string")
        await engine.unload_lora(name)
    except ValueError as e:
        return JSONResponse(load_response(engine.lora, False, str(e)), status_code=400)
    return JSONResponse(load_response(engine.lora, True, None))


@router.post("/update_weight_version", dependencies=Keyed)
async def update_weight_version(request: Request, engine: EngineDep) -> JSONResponse:
    """SGLang's ``{new_version, abort_all_requests=true}``; here nothing is aborted unless asked."""
    try:
        body = await _json_body(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise ValueError("`new_version` is a required string")
    except ValueError as e:
        return JSONResponse({"success": False, "message": str(e)}, status_code=400)
    if body.get("abort_all_requests", True):
        await asyncio.wrap_future(engine.scheduler.abort("", abort_all=True))
    await engine.set_weight_version(version)
    return JSONResponse({"success": True, "message": "Weight version updated.", "new_version": version})


@router.post("/pause_generation", dependencies=Keyed)
async def pause_generation(request: Request, engine: EngineDep) -> JSONResponse:
    try:
        body = await _json_body(request, required=False)
        await asyncio.wrap_future(engine.scheduler.pause(str(body.get("mode", "abort"))))
    except ValueError as e:
        return _error(str(e))
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation", dependencies=Keyed)
async def continue_generation(engine: EngineDep) -> JSONResponse:
    await asyncio.wrap_future(engine.scheduler.resume())
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"], dependencies=Keyed)
async def flush_cache(engine: EngineDep) -> PlainTextResponse:
    # No prefix cache to flush; like SGLang it refuses while requests are running or queued.
    if engine.scheduler.busy():
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request", dependencies=Keyed)
async def abort_request(request: Request, engine: EngineDep) -> Response:
    try:
        body = await _json_body(request, required=False)
    except ValueError as e:
        return _error(str(e))
    rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
    await asyncio.wrap_future(engine.scheduler.abort(rid, abort_all=abort_all))
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(engine: EngineDep) -> JSONResponse:
    return JSONResponse(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.config.served_model_name,
            "is_generation": True,
            "weight_version": engine.scheduler.weight_version,
            "preferred_sampling_params": None,
            "load_format": "safetensors",
            "tool_call_parser": None,
            "reasoning_parser": None,
            # the rest of SGLang 0.5.23's keys (http_server.py ``model_info``): a text-only, colocated model
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(engine.model.config, "model_type", None),
            "architectures": getattr(engine.model.config, "architectures", None),
            # ours: a distributed update's buckets wait for /end_weight_update, which can discard them
            "staged_weight_updates": True,
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(engine: EngineDep) -> JSONResponse:
    config = engine.config
    args = {
        "model_path": str(config.model_path),
        "served_model_name": config.served_model_name,
        "device": str(engine.device),
        "dtype": config.dtype,
        "max_batch_size": config.max_batch_size,
        "weight_version": config.weight_version,
    }
    return JSONResponse({**args, "internal_states": [engine.scheduler.snapshot()], "version": VERSION})


@router.get("/health")
@router.get("/health_generate")
async def health(engine: EngineDep) -> Response:
    # Unhealthy once the model thread is gone: requests would no longer be served.
    return Response(status_code=200 if engine.scheduler.alive() else 503)
