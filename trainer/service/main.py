"""``tracegym tinker-serve``: the training service (the Tinker API) on one base model, with its gateway and
embedded engine started as children (or an existing gateway given with ``--gateway``), and with ``--ray``
its runs' workers as Ray actors on a Ray it starts or joins (``ray_workers``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from tracegym.errors import UserError


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from tracegym.modelfiles.prepare import prepare_model
    from tracegym.trainer.service.app import build_app
    from tracegym.trainer.service.inference import Inference, start_gateway
    from tracegym.trainer.service.ray_workers import ray_settings, start_ray, stop_ray
    from tracegym.trainer.service.state import ServiceConfig, ServiceState
    from tracegym.trainer.settings import OptimConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    admin_key = args.admin_key or os.environ.get("TRACEGYM_ADMIN_KEY") or None
    if admin_key is None and not _loopback(args.host) and not args.insecure:
        raise UserError(f"--host {args.host} without an admin key would let anyone on the network train and "
                        "sample", "set TRACEGYM_ADMIN_KEY (or --admin-key), or pass --insecure")
    if bool(args.gateway) != bool(args.gateway_weights_dir):
        raise UserError("--gateway and --gateway-weights-dir go together",
                        "give both (the gateway's URL and its --weights-dir), or neither to start one")
    ray_cfg = ray_settings(use_ray=args.ray, address=args.ray_address, num_workers=args.num_workers,
                           cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker)
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.model)
    cfg = ServiceConfig(model=args.model, model_dir=model_dir, state_dir=state_dir, admin_key=admin_key,
                        torch_threads=args.torch_threads,
                        optim=OptimConfig(dtype=args.dtype, micro_batch_tokens=args.micro_batch_tokens),
                        ray=ray_cfg, num_workers=args.num_workers)
    if args.dtype == "bfloat16":
        from tracegym.modelfiles.load import decide_cpu_bf16

        decide_cpu_bf16()  # one bf16-or-fp32 decision for the workers and the engine the gateway starts

    @contextlib.asynccontextmanager
    async def make_state() -> AsyncIterator[ServiceState]:
        if args.gateway:
            key = os.environ.get("TRACEGYM_GATEWAY_KEY") or os.environ.get("TRACEGYM_API_KEY")
            inference = Inference(args.gateway, key, Path(args.gateway_weights_dir) / "tinker", args.model,
                                  keep=args.keep)
        else:
            store = args.store or os.environ.get("TRACEGYM_STORE_URL") or f"sqlite:///{state_dir / 'tracegym.db'}"
            proc, key, root = start_gateway(args.model, state_dir, store)
            print(f"gateway (the store, the trace inspector at /ui): {proc.base_url} "
                  f"(admin key in {state_dir / 'gateway_key'})", flush=True)
            _write_private(state_dir / "gateway_key", key)
            inference = Inference(proc.base_url, key, root, args.model, keep=args.keep, proc=proc)
        state = ServiceState(cfg, inference)
        await asyncio.to_thread(_warm_imports)
        try:
            yield state
        finally:
            await state.close()

    app = build_app(make_state)
    owns_ray = False if ray_cfg is None else start_ray(ray_cfg, args.num_workers)
    try:
        if ray_cfg is not None:
            address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
            where = f"the Ray cluster at {address}" if address else "a Ray it started"
            print(f"ray: each training run is {args.num_workers} rank(s) on {where}", flush=True)
        print(f"tracegym tinker-serve: {args.model} on http://{args.host}:{args.port} (the tinker SDK: "
              f"base_url=that URL, api_key='tml-' + the admin key)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                    lifespan="on", timeout_graceful_shutdown=10)
    finally:
        stop_ray(owns_ray)
    return 0


def _warm_imports() -> None:
    """Import what creating the first training run needs (transformers' model classes, peft), before the
    service answers: the first ``create_model`` then costs only the model load."""
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from tracegym.trainer.workers.group import WorkerGroup  # noqa: F401


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
