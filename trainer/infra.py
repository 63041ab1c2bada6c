"""The processes a ``tracegym train`` run needs: embedded engine, gateway, runner — started only when the
recipe does not point at running ones, each in its own process group, always stopped."""

from __future__ import annotations

import contextlib
import os
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


@contextlib.contextmanager
def start_infra(recipe: TrainRecipe, model_dir: Path, recipe_dir: Path):
    """Yield an ``Infra`` with every service the recipe needs running; stop what was started on exit."""
    logs = recipe.run_dir / "logs"
    infra = Infra(gateway_url=recipe.gateway_url or "", upstream_url=recipe.upstream.url or "")
    try:
        if not infra.upstream_url:
            port = free_port()
            infra.procs.append(
                start_process(
                    [
                        "tracegym",
                        "engine",
                        "--model",
                        str(model_dir),
                        "--port",
                        str(port),
                        "--dtype",
                        recipe.upstream.engine_dtype,
                        "--max-batch-size",
                        str(recipe.upstream.max_batch_size),
                        "--weight-version",
                        "0",
                    ],
                    port=port,
                    log_path=logs / "engine.log",
                    health_path="/health",
                    name="embedded engine",
                )
            )
            infra.upstream_url = f"http://127.0.0.1:{port}"
        if not infra.gateway_url:
            port = free_port()
            infra.procs.append(
                start_process(
                    [
                        "tracegym",
                        "serve",
                        "--port",
                        str(port),
                        "--upstream",
                        infra.upstream_url,
                        "--upstream-kind",
                        recipe.upstream.kind,
                        "--model",
                        str(model_dir),
                        "--store",
                        recipe.store,
                    ],
                    port=port,
                    log_path=logs / "gateway.log",
                    health_path="/healthz",
                    name="gateway",
                )
            )
            infra.gateway_url = f"http://127.0.0.1:{port}"
        if not recipe.agent.external:
            infra.procs.append(
                start_process(
                    [
                        "tracegym",
                        "run",
                        recipe.agent.target,
                        "--gateway",
                        infra.gateway_url,
                        "--concurrency",
                        str(recipe.agent.concurrency),
                        "--lease-seconds",
                        str(recipe.agent.lease_seconds),
                    ],
                    port=None,
                    log_path=logs / "runner.log",
                    cwd=recipe_dir,
                    name="runner",
                    env={
                        "PYTHONPATH": os.pathsep.join(
                            filter(None, [str(recipe_dir), os.environ.get("PYTHONPATH")])
                        )
                    },
                )
            )
        yield infra
    finally:
        infra.stop()
