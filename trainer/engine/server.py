"""``tracegym engine``: the embedded engine behind the subset of SGLang's native HTTP API that the
gateway and the trainer use, with SGLang's field names and semantics (see shared SGLANG.md §1, §3)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tracegym.trainer.engine.protocol import parse_generate
from tracegym.trainer.engine.runtime import Engine, EngineConfig, set_torch_threads
from tracegym.trainer.engine.weights import read_checkpoint

log = logging.getLogger(__name__)
VERSION = "tracegym-engine-0.1"


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


def create_app(config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = Engine(config)
        engine.start()
        app.state.engine = engine
        log.info(
            "engine ready: %s on %s (weight_version=%s)",
            config.model_path,
            engine.device,
            config.weight_version,
        )
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="tracegym engine", lifespan=lifespan)

    def eng(request: Request) -> Engine:
        return request.app.state.engine

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        engine = eng(request)
        try:
            body = await _json_body(request)
            specs, opts = parse_generate(
                body, engine.tokenizer, vocab_size=engine.vocab_size, max_positions=engine.max_positions
            )
        except ValueError as e:
            return _error(str(e))
        if opts.stream:
            return StreamingResponse(_sse(engine.stream(specs, opts)), media_type="text/event-stream")
        results = await engine.generate(specs, opts)
        err = _http_error_of(results)
        if err is not None:
            return err
        return JSONResponse(results if opts.is_batch else results[0])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        engine = eng(request)
        try:
            body = await _json_body(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise ValueError("`model_path` is required")
            version = body.get("weight_version")
            abort_all = bool(body.get("abort_all_requests", False))
        except ValueError as e:
            return JSONResponse(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400
            )
        async with engine.weight_lock:
            try:
                state = await asyncio.to_thread(read_checkpoint, path, engine.model)
                aborted = await asyncio.wrap_future(
                    engine.scheduler.update_weights(
                        state, None if version is None else str(version), abort_all
                    )
                )
            except Exception as e:  # a failed load keeps the old weights (WeightLoadError, swap errors)
                log.warning("weight update from %s failed: %s", path, e)
                content = {
                    "success": False,
                    "message": f"Failed to update weights: {e}",
                    "num_paused_requests": 0,
                }
                return JSONResponse(content, status_code=400)
            engine.model_path = path
        log.info("weights updated from %s (weight_version=%s)", path, engine.scheduler.weight_version)
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": aborted}
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        try:
            body = await _json_body(request, required=False)
            await asyncio.wrap_future(eng(request).scheduler.pause(str(body.get("mode", "abort"))))
        except ValueError as e:
            return _error(str(e))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await asyncio.wrap_future(eng(request).scheduler.resume())
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> PlainTextResponse:
        # No prefix cache to flush; like SGLang it refuses while requests are running or queued.
        if eng(request).scheduler.busy():
            return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = await _json_body(request, required=False)
        except ValueError as e:
            return _error(str(e))
        await asyncio.wrap_future(
            eng(request).scheduler.abort(
                str(body.get("rid") or ""), abort_all=bool(body.get("abort_all", False))
            )
        )
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request) -> JSONResponse:
        engine = eng(request)
        return JSONResponse(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.tokenizer_path,
                "served_model_name": config.served_model_name,
                "is_generation": True,
                "weight_version": engine.scheduler.weight_version,
                "preferred_sampling_params": None,
                "load_format": "safetensors",
                "tool_call_parser": None,
                "reasoning_parser": None,
            }
        )

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        engine = eng(request)
        args = {
            "model_path": str(config.model_path),
            "served_model_name": config.served_model_name,
            "device": str(engine.device),
            "dtype": config.dtype,
            "max_batch_size": config.max_batch_size,
            "weight_version": config.weight_version,
        }
        return JSONResponse({**args, "internal_states": [engine.scheduler.snapshot()], "version": VERSION})

    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request) -> Response:
        # Unhealthy once the model thread is gone: requests would no longer be served.
        return Response(status_code=200 if eng(request).scheduler.alive() else 503)

    return app


def main(args: argparse.Namespace) -> int:
    """``tracegym engine --model NAME --port 30000``."""
    import uvicorn

    from tracegym.trainer.models import prepare_model

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = set_torch_threads()
    path = prepare_model(args.model)
    log.info("serving %s from %s with %d torch threads", args.model, path, threads)
    config = EngineConfig(
        model_path=path,
        served_model_name=args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
    )
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
