"""The processes a ``tracegym train`` run needs: embedded engine, gateway, runner — started only when the
recipe does not point at running ones, each in its own process group, always stopped.

Keys (docs/security.md): a gateway started here gets a fresh random admin key (``$TRACEGYM_ADMIN_KEY``
if set), written to ``run_dir/admin_key`` (mode 600) for the trace inspector's login (the trainer's clients and
the runner use it; the runner hands each agent its rollout's token) and ``--weights-dir`` = the run's
``weights`` directory, where the trainer writes; an engine started here gets its own random key, which
only the gateway is given. Keys travel in child environments, never on a command line or in a log."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tracegym.errors import USAGE_EXIT_CODE, UserError
from tracegym.procs import ManagedProcess, free_port, start_engines, start_process
from tracegym.trainer.recipe import TrainRecipe


@dataclass
class Services:
    gateway_url: str
    upstream_url: str
    procs: list[ManagedProcess] = field(default_factory=list)
    upstream_urls: list[str] = field(default_factory=list)
    """Every engine (``upstream_url`` first): several make a fleet behind the gateway."""
    admin_key: str | None = None
    """The gateway's admin key when this run started the gateway (else the environment's, if any)."""

    def check_alive(self) -> None:
        """Raise with the log of any child that died (a dead runner would otherwise look like a hang)."""
        for p in self.procs:
            if p.alive():
                continue
            if p.proc.returncode == USAGE_EXIT_CODE:  # a mistake it named in its last lines (a bad agent target)
                problem, _, fix = _last_error(p.log()).partition("\n")
                raise UserError(f"the {p.name} stopped: {problem}", fix or f"its log: {p.log_path}")
            raise RuntimeError(f"{p.name} exited with code {p.proc.returncode}; its log:\n{p.log()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _last_error(log: str) -> str:
    """The one- or two-line error a ``tracegym`` command printed last (``tracegym CMD: problem`` and the
    fix under it), without its ``tracegym CMD:`` prefix."""
    lines = [line for line in log.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("tracegym ") and ": " in line]
    if not starts:
        return lines[-1] if lines else "(no output)"
    return "\n".join(lines[starts[-1]:starts[-1] + 2]).split(": ", 1)[1]


def _engine_args(recipe: TrainRecipe) -> list[str]:
    up = recipe.upstream
    return ["--dtype", up.engine_dtype, "--max-batch-size", str(up.max_batch_size), "--weight-version", "0"]


def _write_key(path: Path, key: str) -> None:
    """The run's admin key, readable by its owner only (what the trace inspector's login form asks for)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


@contextlib.contextmanager
def start_services(recipe: TrainRecipe, model_dir: Path, recipe_dir: Path) -> Iterator[Services]:
    """Yield ``Services`` with every service the recipe needs running; stop what was started on exit."""
    logs = recipe.run_dir / "logs"
    services = Services(gateway_url=recipe.gateway_url or "", upstream_url=recipe.upstream.url or "")
    served_model = recipe.model  # a name the gateway resolves (tracegym.models) or a local directory
    services.upstream_urls = [u for u in (recipe.upstream.url, *recipe.upstream.urls) if u]
    engine_key = None
    try:
        if not services.upstream_url:
            n = recipe.upstream.engines
            # sync mode: generation and training take turns, so the engines may share every core
            cores = str(max(1, (os.cpu_count() or 1) // n))
            engines = start_engines(n, str(model_dir), args=_engine_args(recipe), log_dir=logs,
                                    env={"TRACEGYM_ENGINE_THREADS": cores} if recipe.mode == "sync" else {})
            services.procs.extend(engines.procs)
            services.upstream_urls.extend(engines.urls)
            services.upstream_url = services.upstream_urls[0]
            engine_key = engines.key
        if not services.gateway_url:
            port = free_port()
            argv = ["tracegym", "serve", "--port", str(port),
                    *(a for u in services.upstream_urls for a in ("--upstream", u)),
                    "--upstream-kind", recipe.upstream.kind, "--model", served_model]  # fmt: skip
            services.admin_key = os.environ.get("TRACEGYM_ADMIN_KEY") or secrets.token_urlsafe(32)
            _write_key(recipe.run_dir / "admin_key", services.admin_key)
            env = {"TRACEGYM_ADMIN_KEY": services.admin_key, "TRACEGYM_STORE_URL": recipe.store,  # not in `ps`
                   "TRACEGYM_WEIGHTS_DIR": str((recipe.run_dir / "weights").resolve())}
            if engine_key is not None:
                env["TRACEGYM_UPSTREAM_API_KEY"] = engine_key
            services.procs.append(
                start_process(
                    argv, port=port, log_path=logs / "gateway.log", health_path="/healthz", name="gateway",
                    env=env,
                )
            )
            services.gateway_url = f"http://127.0.0.1:{port}"
        if not recipe.agent.external:
            a = recipe.agent
            argv = ["tracegym", "run", a.target, "--gateway", services.gateway_url,
                    "--concurrency", str(a.concurrency), "--lease-seconds", str(a.lease_seconds), "--follow"]  # fmt: skip
            env = {
                "PYTHONPATH": os.pathsep.join(filter(None, [str(recipe_dir), os.environ.get("PYTHONPATH")])),
                "TRACEGYM_MODEL": served_model,  # the model name agents put in their requests
            }
            if services.admin_key:
                env["TRACEGYM_API_KEY"] = services.admin_key
            services.procs.append(
                start_process(
                    argv, port=None, log_path=logs / "runner.log", cwd=recipe_dir, name="runner", env=env
                )
            )
        yield services
    finally:
        services.stop()
