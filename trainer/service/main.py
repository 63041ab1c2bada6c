"""``tracegym tinker-serve``: the training service (the Tinker API) on one or more base models (``--model``,
repeatable), each with its own gateway and embedded engine started as children at start (or, for one model,
an existing gateway given with ``--gateway``), and with ``--ray`` its runs' workers as Ray actors on a Ray it
starts or joins (``ray_workers``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from tracegym.errors import UserError

if TYPE_CHECKING:
    from tracegym.trainer.service.models import InferenceByModel


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
    from tracegym.trainer.service.inference import Inference
    from tracegym.trainer.service.models import BaseModel, InferenceByModel
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
    names = check_model_names(args.model, args.gateway)
    ray_cfg = ray_settings(use_ray=args.ray, address=args.ray_address, num_workers=args.num_workers,
                           cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker)
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    models = [BaseModel.read(name, prepare_model(name)) for name in names]
    cfg = ServiceConfig(models=models, state_dir=state_dir, admin_key=admin_key,
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
            engines = InferenceByModel({names[0]: Inference(args.gateway, key, Path(args.gateway_weights_dir) / "tinker",
                                                   names[0], keep=args.keep)})
        else:
            store = args.store or os.environ.get("TRACEGYM_STORE_URL") or f"sqlite:///{state_dir / 'tracegym.db'}"
            engines = _start_engines(names, state_dir, store, args.keep)
        state = ServiceState(cfg, engines)
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
        print(f"tracegym tinker-serve: {', '.join(names)} on http://{args.host}:{args.port} (the tinker SDK: "
              f"base_url=that URL, api_key='tml-' + the admin key)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                    lifespan="on", timeout_graceful_shutdown=10)
    finally:
        stop_ray(owns_ray)
    return 0


def check_model_names(given: list[str], gateway: str | None) -> list[str]:
    """The ``--model`` names, checked: each once, and only one with ``--gateway``."""
    dup = next((m for m in given if given.count(m) > 1), None)
    if dup is not None:
        raise UserError(f"--model {dup} is given twice", "name each base model once")
    if gateway and len(given) > 1:
        raise UserError(f"--gateway samples one model; {len(given)} --model given",
                        "give one --model with --gateway, or leave --gateway out to start a gateway per model")
    return given


def _start_engines(names: list[str], state_dir: Path, store: str, keep: int) -> InferenceByModel:
    """A gateway with its embedded engine per model (``inference.start_gateways``), their addresses printed
    and their admin key written to ``state_dir/gateway_key``; weight versions numbered across them."""
    from tracegym.trainer.service.inference import Inference, start_gateways
    from tracegym.trainer.service.models import InferenceByModel

    procs, key, root = start_gateways(names, state_dir, store)
    _write_private(state_dir / "gateway_key", key)
    versions = itertools.count(1)
    for name, proc in procs.items():
        print(f"gateway (the store, the trace inspector at /ui): {proc.base_url} for {name} "
              f"(admin key in {state_dir / 'gateway_key'})", flush=True)
    return InferenceByModel({name: Inference(proc.base_url, key, root, name, keep=keep, proc=proc, versions=versions)
                    for name, proc in procs.items()})


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
