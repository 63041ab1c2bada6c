"""Pushing the trainer's weights into the inference server, stamped with a ``weight_version``.

Disk (everywhere; what every test run exercises): gather the full weights, write a directory the engine
can ``from_pretrained`` (``model.safetensors`` + config/tokenizer files copied from the model dir) into a
fresh ``v<version>`` directory — written under a temporary name and renamed, so a load never reads a
half-written file — then ``POST /update_weights_from_disk {model_path, weight_version}``. Only the last
``keep`` version directories are kept. Optionally ``pause_generation`` … ``continue_generation`` around
the load (AReaL's order); without it SGLang itself drains in-flight requests before swapping.

NCCL (SGLang on GPUs; see SGLANG.md §3–4): ``/init_weights_update_group`` is posted in the background
while the trainer joins the same rendezvous as rank 0; an update is ``pause_generation`` → ``flush_cache``
(retried until the server is idle) → ``begin_weight_update`` (SGLang ≥ 0.5.23) → per bucket:
``/update_weights_from_distributed {names, dtypes, shapes, ...}`` posted asynchronously *while* the
bucket's tensors are broadcast from rank 0 → ``end_weight_update`` → ``continue_generation`` (always,
also after an error). **This path is unverified on hardware**: there are no GPUs here. Its HTTP sequence
and payloads are unit-tested against the documented fields with the broadcast injected as a function;
``nccl_group``/``nccl_broadcast`` below mirror how SGLang builds its side of the group, from reading
its source only.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from tracegym.trainer.models import replace_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".index.json")


class WeightSyncError(RuntimeError):
    """The inference server refused or failed a weight update; the message carries its answer."""


@dataclass(slots=True)
class SwapResult:
    version: str
    path: Path | None
    save_s: float
    """Gathering + writing (disk) or gathering + broadcasting (NCCL)."""
    update_s: float
    """The server's update call(s)."""
    total_s: float


# ---------------------------------------------------------------------------------------------- disk


def write_weights_dir(tensors: dict[str, torch.Tensor], model_dir: Path, out_dir: Path) -> Path:
    """``out_dir`` = ``tensors`` as ``model.safetensors`` + the non-weight files of ``model_dir``, created
    atomically (temp sibling + rename; an existing ``out_dir`` is replaced)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, tmp / f.name)
        if not (tmp / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json to copy next to the weights")
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _check(resp: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        body = {"text": resp.text}
    if resp.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
        raise WeightSyncError(f"{what} failed: HTTP {resp.status_code}: {body}")
    return body if isinstance(body, dict) else {"body": body}


class DiskWeightSync:
    """Save → ``/update_weights_from_disk`` → prune. ``push(group, version)`` with any object that has
    ``save_weights(out_dir) -> Path`` (a ``WorkerGroup``).

    ``url`` is the engine, or a gateway with ``update_path="/api/weights/update"``: the gateway then
    pauses generation around the load and continues the requests the pause aborted (same body and
    answer shape), so ``pause`` must stay False there."""

    def __init__(
        self,
        engine_url: str,
        root: Path,
        *,
        keep: int = 2,
        pause: bool = False,
        timeout: float = 600.0,
        save_dtype: str | None = None,
        update_path: str = "/update_weights_from_disk",
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.update_path = update_path
        self.engine_url, self.root, self.keep, self.pause = engine_url.rstrip("/"), Path(root), keep, pause
        self.save_dtype = save_dtype
        self._client = httpx.Client(base_url=self.engine_url, timeout=timeout)
        # directories of earlier runs (a resumed loop) count towards ``keep`` too, oldest first
        earlier = [p for p in self.root.glob("v*") if p.is_dir()] if self.root.is_dir() else []
        self._written: list[Path] = sorted(earlier, key=lambda p: p.stat().st_mtime)

    def version_dir(self, version: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", version):
            raise ValueError(f"weight_version {version!r} must match [A-Za-z0-9._-]+ (it names a directory)")
        return self.root / f"v{version}"

    def push(self, group: Any, version: str | int) -> SwapResult:
        version = str(version)
        t0 = time.perf_counter()
        path = group.save_weights(self.version_dir(version), self.save_dtype)
        t1 = time.perf_counter()
        self.load(path, version)
        t2 = time.perf_counter()
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        self._prune()
        return SwapResult(version, path, t1 - t0, t2 - t1, t2 - t0)

    def load(self, path: Path, version: str) -> dict[str, Any]:
        """``/update_weights_from_disk`` (between ``pause_generation``/``continue_generation`` if asked)."""
        body = {"model_path": str(path), "weight_version": version}
        if not self.pause:
            return _check(self._client.post(self.update_path, json=body), self.update_path)
        _check(self._client.post("/pause_generation", json={}), "pause_generation")
        try:
            body["abort_all_requests"] = True
            return _check(
                self._client.post("/update_weights_from_disk", json=body), "update_weights_from_disk"
            )
        finally:
            _check(self._client.post("/continue_generation", json={}), "continue_generation")

    def _prune(self) -> None:
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def close(self) -> None:
        self._client.close()


# ---------------------------------------------------------------------------------------------- NCCL


def bucket_tensors(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone), order kept."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def bucket_payload(
    bucket: list[tuple[str, torch.Tensor]], *, group_name: str, version: str
) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body for one bucket (SGLang's field names)."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": False,
        "weight_version": version,
    }


@dataclass
class NcclWeightSync:
    """The SGLang NCCL update sequence (unverified on hardware, see module docstring).

    Picklable (it holds settings only; HTTP clients are made per call) so a Ray actor can run it."""

    engine_url: str
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    begin_end: bool = True
    """Wrap the buckets in ``/begin_weight_update`` … ``/end_weight_update`` (required on SGLang ≥ 0.5.23,
    absent before)."""
    bucket_bytes: int = 512 << 20
    flush_retries: int = 60
    flush_interval_s: float = 1.0
    timeout_s: float = 600.0
    requests: list[str] = field(default_factory=list)
    """Paths posted, in order (for logs and tests)."""

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self.engine_url.rstrip("/"), timeout=self.timeout_s)

    def _post(self, client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(path)
        return _check(client.post(path, json=body), path.lstrip("/"))

    def init_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        join: Callable[[], Any],
        rank_offset: int = 1,
    ) -> Any:
        """Post ``/init_weights_update_group`` in the background (it blocks until the trainer joins),
        run ``join()`` (the trainer's rank-0 rendezvous) meanwhile, and return what ``join`` returned."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }
        with self._client() as client, ThreadPoolExecutor(1) as pool:
            fut = pool.submit(self._post, client, "/init_weights_update_group", body)
            joined = join()
            fut.result(timeout=self.timeout_s)
        return joined

    def flush_cache(self, client: httpx.Client) -> None:
        for _ in range(self.flush_retries):
            self.requests.append("/flush_cache")
            if client.post("/flush_cache").status_code == 200:
                return
            time.sleep(self.flush_interval_s)
        raise WeightSyncError(f"flush_cache did not succeed after {self.flush_retries} tries")

    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: str | int,
        broadcast: Callable[[list[torch.Tensor]], None],
    ) -> SwapResult:
        """One update. ``broadcast(tensors)`` sends one bucket from rank 0 of the group, in order."""
        version = str(version)
        t0 = time.perf_counter()
        update_s = 0.0
        with self._client() as client, ThreadPoolExecutor(1) as pool:
            self._post(client, "/pause_generation", {})
            try:
                self.flush_cache(client)
                if self.begin_end:
                    self._post(client, "/begin_weight_update", {"selector": "all"})
                try:
                    for bucket in bucket_tensors(named, self.bucket_bytes):
                        body = bucket_payload(bucket, group_name=self.group_name, version=version)
                        fut = pool.submit(self._post, client, "/update_weights_from_distributed", body)
                        broadcast([t for _, t in bucket])
                        tw = time.perf_counter()
                        fut.result(timeout=self.timeout_s)
                        update_s += time.perf_counter() - tw
                finally:
                    if self.begin_end:
                        self._post(client, "/end_weight_update", {})
            finally:
                self._post(client, "/continue_generation", {})
        total = time.perf_counter() - t0
        return SwapResult(version, None, total - update_s, update_s, total)


def nccl_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    rank: int = 0,
) -> Any:
    """The trainer's side (rank 0) of the weight-update group that SGLang joins in
    ``/init_weights_update_group``: a second, independent process group next to the trainer's own,
    built the way SGLang builds its side (``init_custom_process_group``: TCP rendezvous, store prefixed
    with the group name, torch's private ``_new_process_group_helper``). Unverified on hardware."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(minutes=10)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        size, rank, [], backend, c10d.PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


def nccl_broadcast(pg: Any) -> Callable[[list[torch.Tensor]], None]:
    """Broadcast each tensor of a bucket from rank 0 of ``pg``, in order (what SGLang receives)."""
    import torch.distributed as dist

    def send(tensors: list[torch.Tensor]) -> None:
        on_gpu = [t.cuda().contiguous() for t in tensors]  # kept alive until every broadcast is done
        handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in on_gpu]
        for h in handles:
            h.wait()
        torch.cuda.synchronize()

    return send


def push_nccl(group: Any, sync: NcclWeightSync, version: str | int, dtype: str = "bfloat16") -> SwapResult:
    """All ranks gather; rank 0 broadcasts to the engine (its group must be set up with
    ``init_nccl_on_rank0``). ``group`` is a ``WorkerGroup``."""
    return group.run_on_ranks(_push_on_rank, sync, str(version), dtype)[0]


def init_nccl_on_rank0(
    group: Any, sync: NcclWeightSync, master_address: str, master_port: int, engine_world_size: int
) -> None:
    group.run_on_ranks(_init_on_rank, sync, master_address, master_port, engine_world_size + 1)


def _init_on_rank(worker: Any, sync: NcclWeightSync, addr: str, port: int, world_size: int) -> None:
    if worker.rank == 0:
        worker.engine_pg = sync.init_group(
            addr, port, world_size, lambda: nccl_group(addr, port, world_size, sync.group_name)
        )


def _push_on_rank(worker: Any, sync: NcclWeightSync, version: str, dtype: str) -> SwapResult | None:
    params = worker.rank0_full_params()  # the other ranks only take part in the gathers
    if params is None:
        return None
    to = getattr(torch, dtype)
    return sync.push(((n, t.to(to)) for n, t in params), version, nccl_broadcast(worker.engine_pg))
