"""The processes a ``tracegym train`` run needs: embedded engine, gateway, runner — started only when the
recipe does not point at running ones, each in its own process group, always stopped."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tracegym.procs import ManagedProcess, free_port, start_process
from tracegym.trainer.config import TrainRecipe


@dataclass
class Infra:
    gateway_url: str
    upstream_url: str
    procs: list[ManagedProcess] = field(default_factory=list)

    def check_alive(self) -> None:
        """Raise with the log of any child that died (a dead runner would otherwise look like a hang)."""
        for p in self.procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with code {p.proc.returncode}; its log:\n{p.log()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _engine_argv(recipe: TrainRecipe, model_dir: Path, port: int) -> list[str]:
    up = recipe.upstream
    return ["tracegym", "engine", "--model", str(model_dir), "--port", str(port), "--dtype", up.engine_dtype,
            "--max-batch-size", str(up.max_batch_size), "--weight-version", "0"]  # fmt: skip


@contextlib.contextmanager
def start_infra(recipe: TrainRecipe, model_dir: Path, recipe_dir: Path) -> Iterator[Infra]:
    """Yield an ``Infra`` with every service the recipe needs running; stop what was started on exit."""
    logs = recipe.run_dir / "logs"
    infra = Infra(gateway_url=recipe.gateway_url or "", upstream_url=recipe.upstream.url or "")
    served_model = recipe.model  # a name the gateway resolves (tracegym.models) or a local directory
    try:
        if not infra.upstream_url:
            port = free_port()
            # sync mode: generation and training take turns, so the engine may use every core
            threads = {"TRACEGYM_ENGINE_THREADS": str(os.cpu_count() or 1)} if recipe.mode == "sync" else None
            infra.procs.append(
                start_process(
                    _engine_argv(recipe, model_dir, port),
                    port=port,
                    log_path=logs / "engine.log",
                    health_path="/health",
                    name="embedded engine",
                    env=threads,
                )
            )
            infra.upstream_url = f"http://127.0.0.1:{port}"
        if not infra.gateway_url:
            port = free_port()
            argv = ["tracegym", "serve", "--port", str(port), "--upstream", infra.upstream_url,
                    "--upstream-kind", recipe.upstream.kind, "--model", served_model, "--store", recipe.store]  # fmt: skip
            infra.procs.append(
                start_process(
                    argv, port=port, log_path=logs / "gateway.log", health_path="/healthz", name="gateway"
                )
            )
            infra.gateway_url = f"http://127.0.0.1:{port}"
        if not recipe.agent.external:
            a = recipe.agent
            argv = ["tracegym", "run", a.target, "--gateway", infra.gateway_url,
                    "--concurrency", str(a.concurrency), "--lease-seconds", str(a.lease_seconds)]  # fmt: skip
            env = {
                "PYTHONPATH": os.pathsep.join(filter(None, [str(recipe_dir), os.environ.get("PYTHONPATH")])),
                "TRACEGYM_MODEL": served_model,  # the model name agents put in their requests
            }
            infra.procs.append(
                start_process(
                    argv, port=None, log_path=logs / "runner.log", cwd=recipe_dir, name="runner", env=env
                )
            )
        yield infra
    finally:
        infra.stop()
