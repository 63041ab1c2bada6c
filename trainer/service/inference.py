"""The inference side of one base model: the gateway (with its engine) that its samples are drawn through,
so each is a span in the store, and the weight versions the service publishes into that engine (a service
of several base models has one of these per model: ``models.InferenceByModel``).

One engine serves one set of weights at a time. A sampler is bound to a version; a sample for a version
the engine does not serve waits until the samples in flight are done, then the service swaps that
version's files back in (the gateway's swap path, ``weights.disk`` / ``weights.adapters``, version
stamped) and samples. The service keeps the files of the last ``keep`` versions; a sampler of an older one
is refused. ``base`` is the base model as the engine started with it: it can be sampled only until the
first publish."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tracegym.procs import ManagedProcess, free_ports, spawn_process, wait_ready
from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.service.runs import Run
from tracegym.trainer.service.sampling import SampleAsk, completion_body, read_completion
from tracegym.trainer.service.wire import SampleResult
from tracegym.trainer.settings import LoraConfig
from tracegym.trainer.weights.adapters import AdapterSync
from tracegym.trainer.weights.disk import DiskWeightSync

BASE = "base"


@dataclass(slots=True)
class Published:
    version: str
    run: Run
    files: Any
    """What the sync's ``load`` takes: the weights directory, or ``{adapter: directory}``."""
    path: Path
    """The version's directory (removed when pruned)."""


class Inference:
    """One engine (behind its gateway), the model it serves and the weight versions kept for it.
    ``versions`` numbers its versions; the service shares one counter among its engines, so that version
    names are unique across the service."""

    def __init__(self, gateway_url: str, admin_key: str | None, weights_root: Path, served_model: str, *,
                 keep: int = 4, proc: ManagedProcess | None = None, timeout: float = 600.0,
                 versions: Iterator[int] | None = None) -> None:
        self.gateway_url, self.admin_key, self.root = gateway_url.rstrip("/"), admin_key, weights_root
        self.served_model, self.keep, self.proc, self.timeout = served_model, keep, proc, timeout
        self.serving = BASE
        self.mode: str | None = None
        """``lora`` or ``full``: what this engine's versions are, fixed by the first publish."""
        self.published: dict[str, Published] = {}
        self._order: list[str] = []
        self._versions = itertools.count(1) if versions is None else versions
        self._cond = asyncio.Condition()
        self._inflight = 0
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.AsyncClient(base_url=self.gateway_url, headers=headers, timeout=timeout)

    # ---------------------------------------------------------------- versions

    def sync_for(self, run: Run) -> Any:
        if run.sync is None:
            root = self.root / run.safe_id
            if run.lora_rank is None:
                run.sync = DiskWeightSync(self.gateway_url, root, timeout=self.timeout, api_key=self.admin_key)
            else:
                run.sync = AdapterSync(self.gateway_url, root, LoraConfig(rank=run.lora_rank),
                                       timeout=self.timeout, api_key=self.admin_key)
        return run.sync

    async def publish(self, run: Run) -> str:
        """Write ``run``'s weights as a new version and swap it in; the version. The engine's versions are
        all adapters or all full weights (the first publish decides): a disk swap leaves the gateway's
        adapter routes in place and an adapter applies to whatever base the engine holds, so mixing the two
        kinds would sample from weights no run trained."""
        kind = "full" if run.lora_rank is None else "lora"
        if self.mode not in (None, kind):
            raise UserFault(f"this service's engine serves {self.mode} weight versions and cannot also serve "
                            f"{kind} ones (the adapters would apply to another run's weights): publish from "
                            f"{'LoRA' if self.mode == 'lora' else 'full fine-tuning'} runs here, or start another "
                            "service for this run")
        self.mode = kind
        version = str(next(self._versions))
        sync = self.sync_for(run)
        out = sync.version_dir(version)
        files = await asyncio.to_thread(sync.save, run.group, out)
        self.published[version] = Published(version, run, files, out)
        self._order.append(version)
        run.published.append(version)
        await self._swap_to(version)
        self._prune()
        return version

    def _prune(self) -> None:
        while len(self._order) > self.keep:
            old = next((v for v in self._order if v != self.serving), None)
            if old is None:
                return
            self._order.remove(old)
            shutil.rmtree(self.published.pop(old).path, ignore_errors=True)

    def delete(self, version: str) -> None:
        """Remove a published version and its files (``LookupError`` if it has none; ``UserFault`` for the
        version the engine serves now, whose files a swap back would need)."""
        if version not in self.published:
            raise LookupError(f"no weight version {version!r} is kept (kept: {self.kept()})")
        if version == self.serving:
            raise UserFault(f"weight version {version} is the one the engine serves now: publish another version "
                            "before deleting it")
        self._order.remove(version)
        shutil.rmtree(self.published.pop(version).path, ignore_errors=True)

    def check_version(self, version: str) -> None:
        """``UserFault`` unless ``version`` can be sampled."""
        if version == BASE:
            if self.serving != BASE:
                raise UserFault(f"the base model can be sampled only until the first publish; the engine now "
                                f"serves version {self.serving}: sample a published version, or start another "
                                "service for the base model")
            return
        if version not in self.published:
            raise UserFault(f"weight version {version!r} was never published or its files were pruned (the "
                            f"service keeps the last {self.keep}; kept: {self.kept()}): publish with "
                            "save_weights_for_sampler / save_weights_and_get_sampling_client")

    def kept(self) -> str:
        """The kept versions, oldest first, as text."""
        return ", ".join(self._order) or "none yet"

    async def _swap_to(self, version: str) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self._inflight == 0)
            if self.serving != version:
                p = self.published[version]
                await asyncio.to_thread(self.sync_for(p.run).load, p.files, version)
                self.serving = version

    # ---------------------------------------------------------------- sampling

    async def sample(self, version: str, ask: SampleAsk, rollout_id: str) -> SampleResult:
        self.check_version(version)
        async with self._cond:
            while self.serving != version:
                await self._cond.wait_for(lambda: self._inflight == 0)
                if self.serving != version:
                    self.check_version(version)
                    p = self.published[version]
                    await asyncio.to_thread(self.sync_for(p.run).load, p.files, version)
                    self.serving = version
            self._inflight += 1
        try:
            return await self._complete(ask, rollout_id)
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    async def _complete(self, ask: SampleAsk, rollout_id: str) -> SampleResult:
        resp = await self._http.post("/v1/completions", json=completion_body(ask, self.served_model),
                                     headers={"X-Rollout-Id": rollout_id})
        if resp.status_code != 200:
            raise RuntimeError(f"the gateway answered {resp.status_code}: {resp.text[:500]}")
        return read_completion(resp.json(), ask)

    async def close(self) -> None:
        await self._http.aclose()
        for p in self.published.values():
            if p.run.sync is not None:
                p.run.sync.close()
        if self.proc is not None:
            self.proc.stop()


def start_gateways(models: list[str], state_dir: Path, store: str, *, log_level: str = "warning"
                   ) -> tuple[dict[str, ManagedProcess], str, Path]:
    """A gateway with its embedded engine (``tracegym serve --engine embedded --model MODEL``) for each of
    ``models``, started at once, all on one store, one admin key and one weights root: (each
    model's process, the key, the root). The key travels in the children's environment, never on a command
    line. Logs: ``logs/gateway.log`` for the first model, ``logs/gateway-MODEL.log`` for the others. If one
    fails to start, those already started are stopped and the error raised."""
    key = secrets.token_urlsafe(32)
    root = (state_dir / "weights").resolve()
    root.mkdir(parents=True, exist_ok=True)
    env = {"TRACEGYM_ADMIN_KEY": key, "TRACEGYM_STORE_URL": store, "TRACEGYM_WEIGHTS_DIR": str(root)}
    env |= {k: v for k in ("TRACEGYM_ENGINE_THREADS",) if (v := os.environ.get(k))}
    procs: dict[str, ManagedProcess] = {}
    try:
        for i, (model, port) in enumerate(zip(models, free_ports(len(models)), strict=True)):
            argv = ["tracegym", "serve", "--engine", "embedded", "--model", model, "--port", str(port),
                    "--log-level", log_level]
            log = "gateway.log" if i == 0 else f"gateway-{re.sub(r'[^A-Za-z0-9._-]', '_', model)}.log"
            procs[model] = spawn_process(argv, port=port, log_path=state_dir / "logs" / log,
                                         name=f"gateway of {model}", env=env)
        for proc in procs.values():
            wait_ready(proc, "/healthz", timeout=300)
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    return procs, key, root
