"""SGLang's distributed weight update on the embedded engine (shared SGLANG.md §3):
``/init_weights_update_group`` joins a second process group, next to nothing else in this process, as
rank ``rank_offset`` of ``world_size`` (the trainer is rank 0, each engine takes its own offset);
``/update_weights_from_distributed`` receives one ``dist.broadcast(src=0)`` per announced tensor, in order;
``/begin_weight_update`` … ``/end_weight_update`` (SGLang 0.5.23) bracket an update;
``/destroy_weights_update_group`` leaves the group. gloo on CPU (the CI path), NCCL when the engine runs on
CUDA: the same calls, only the tensors' device differs.

Where this departs from SGLang, on purpose:
- Inside begin…end the received buckets are **staged** and the model's parameters are replaced only at
  ``/end_weight_update``, all at once through the same swap as ``/update_weights_from_disk`` (so a
  failed or partial update leaves the old weights serving, and the weight version changes with them).
  ``/end_weight_update {"discard": true}`` closes a session without applying it, so a gateway can keep a
  fleet all or none when a bucket failed on another engine (``/model_info`` says
  ``staged_weight_updates: true``).
  SGLang loads each bucket into the model as it arrives. The cost is one copy of the updated parameters
  in memory until the end.
- Outside a session (SGLang ≤ 0.5.15 callers, which have no begin/end) each call applies its own bucket
  on receipt, atomically for that bucket; SGLang 0.5.23 refuses such calls.
- A bucket naming unknown parameters or with a shape that does not match is still **received** (into the
  announced shapes) before it is refused, so the trainer's broadcast is not left hanging; only a body that
  cannot be received at all (bad dtype, lengths that differ, no group) is refused before any broadcast.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from tracegym.engine.weights import WeightLoadError, checked_tensors
from tracegym.modelfiles.cpu_threads import in_own_thread

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def join_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    backend: str = "nccl", timeout_s: float = 600.0,
) -> Any:
    """Join (as ``rank``) the weight-update group the trainer (rank 0) and every engine build together:
    built the way SGLang builds it (``init_custom_process_group``: TCP rendezvous, store prefixed with the
    group name, torch's private ``_new_process_group_helper``), so no default process group is needed.
    Blocks until all ``world_size`` ranks have joined."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        size, rank, [], backend, c10d.PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


@dataclass(frozen=True)
class GroupRequest:
    """The ``/init_weights_update_group`` body."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    @classmethod
    def parse(cls, body: dict[str, Any]) -> GroupRequest:
        try:
            req = cls(
                master_address=_typed(body, "master_address", str),
                master_port=_typed(body, "master_port", int),
                rank_offset=_typed(body, "rank_offset", int),
                world_size=_typed(body, "world_size", int),
                group_name=_typed(body, "group_name", str, "weight_update_group"),
                backend=_typed(body, "backend", str, "nccl"),
            )
        except KeyError as e:
            raise ValueError(f"`{e.args[0]}` is required") from None
        if req.backend not in BACKENDS:
            raise ValueError(f"backend {req.backend!r} is not supported (supported: {', '.join(BACKENDS)})")
        if not 0 < req.rank_offset < req.world_size:
            raise ValueError(f"rank_offset {req.rank_offset} is not in 1..world_size-1 ({req.world_size})")
        return req


@dataclass(frozen=True)
class Bucket:
    """One ``/update_weights_from_distributed`` body: what rank 0 will broadcast, in order."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Bucket:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise ValueError("`names`, `dtypes` and `shapes` are required lists")
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"`names`, `dtypes` and `shapes` must be non-empty and of one length "
                             f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")
        if body.get("load_format") not in (None, "direct"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported (null)")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("`names` must be strings")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise ValueError("`shapes` must be lists of non-negative integers")
        version = body.get("weight_version")
        return cls(names, [_dtype(d) for d in dtypes], shapes,
                   _typed(body, "group_name", str, "weight_update_group"),
                   None if version is None else str(version), bool(body.get("abort_all_requests", False)))


def _typed(body: dict[str, Any], key: str, kind: type, default: Any = KeyError) -> Any:
    if key not in body or body[key] is None:
        if default is KeyError:
            raise KeyError(key)
        return default
    value = body[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"`{key}` must be {kind.__name__}, got {value!r}")
    return value


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a torch floating-point dtype name (such as 'bfloat16')")
    return dtype


def check_bucket(model: torch.nn.Module, names: list[str], tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The received tensors by name, cast to their parameters' dtypes; ``WeightLoadError`` for a name the
    model does not have, a shape that differs, or a NaN/inf."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = [n for n in names if n not in params]
    if unknown:
        raise WeightLoadError(f"unknown parameter name(s) {unknown[:8]}")
    return checked_tensors(zip(names, tensors, strict=True), params)


@dataclass
class _Session:
    """An open ``/begin_weight_update``: the staged tensors, the version to stamp, the first failure."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    failed: str | None = None
    abort_all: bool = False


class DistWeights:
    """The engine's side of the weight-update group; one receive at a time (``lock``). The broadcasts and
    the rendezvous block, so they run in a worker thread, never on the event loop."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.group: Any = None
        self.group_name: str | None = None
        self.backend: str | None = None
        self.session: _Session | None = None
        self.lock = asyncio.Lock()

    async def init_group(self, req: GroupRequest, timeout_s: float = 600.0) -> None:
        """Join ``req``'s group. Asked to join the group of the name it is in (a trainer that restarted, or
        that lost its side of the group, sets it up again), it leaves that one first, as SGLang replaces
        a group of the same name; a group of another name is refused while it is in one."""
        if self.group is not None and req.group_name != self.group_name:
            raise ValueError(f"already in weight-update group {self.group_name!r}: destroy it first")
        if req.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend nccl needs an engine on CUDA (this one runs on {self.device}); use gloo")
        if self.group is not None:
            log.info("leaving weight-update group %s to join it again", self.group_name)
            await self.destroy(req.group_name)
        async with self.lock:
            self.group = await asyncio.to_thread(
                join_weight_update_group, req.master_address, req.master_port, req.rank_offset,
                req.world_size, req.group_name, req.backend, timeout_s)
        self.group_name, self.backend = req.group_name, req.backend

    async def destroy(self, group_name: str) -> None:
        if self.group is None or group_name != self.group_name:
            raise ValueError(f"not in weight-update group {group_name!r}")
        import torch.distributed as dist

        async with self.lock:
            group, self.group, self.group_name = self.group, None, None
            await asyncio.to_thread(dist.destroy_process_group, group)

    def begin(self) -> None:
        if self.session is not None:
            log.warning("begin_weight_update while an update was open: its %d staged tensor(s) are dropped",
                        len(self.session.staged))
        self.session = _Session()

    async def receive(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """Receive one bucket and check it against the model; inside a session a failure also fails the
        session (its end then applies nothing)."""
        try:
            if self.group is None or bucket.group_name != self.group_name:
                raise ValueError(f"not in weight-update group {bucket.group_name!r}: "
                                 "call /init_weights_update_group first")
            async with self.lock:
                tensors = await in_own_thread(self._receive, bucket)
            return await in_own_thread(check_bucket, self.model, bucket.names, tensors)
        except Exception as e:
            if self.session is not None and self.session.failed is None:
                self.session.failed = str(e)
            raise

    def _receive(self, bucket: Bucket) -> list[torch.Tensor]:
        import torch.distributed as dist

        where = "cuda" if self.backend == "nccl" else "cpu"
        out = []
        for dtype, shape in zip(bucket.dtypes, bucket.shapes, strict=True):
            t = torch.empty(shape, dtype=dtype, device=where)
            dist.broadcast(t, src=0, group=self.group)
            out.append(t)
        return out

    def stage(self, tensors: dict[str, torch.Tensor], bucket: Bucket) -> None:
        assert self.session is not None
        self.session.staged.update(tensors)
        self.session.version = bucket.weight_version or self.session.version
        self.session.abort_all = self.session.abort_all or bucket.abort_all_requests

    def discard(self) -> int:
        """Close the session applying nothing (another engine of the fleet failed a bucket); how many
        staged tensors were dropped. No session open is not an error: there is nothing to apply."""
        session, self.session = self.session, None
        return 0 if session is None else len(session.staged)

    def end(self, version: str | None) -> _Session:
        """Close the session; raises (nothing to apply) if none is open or a bucket of it failed."""
        session, self.session = self.session, None
        if session is None:
            raise ValueError("no weight update is open: call /begin_weight_update first")
        if session.failed is not None:
            raise WeightLoadError(f"a bucket of this update failed, nothing applied: {session.failed}")
        if version is not None:
            session.version = version
        return session
