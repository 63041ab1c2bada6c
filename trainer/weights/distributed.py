"""Distributed (SGLang on GPUs with NCCL; gloo on CPU is the same code): once, ``POST
/api/weights/distributed/init`` in the background while rank 0 joins the same rendezvous
(``weight_update_group``), since the engine's side of the init returns only once both have joined. Each
push plans buckets from the parameters' names and shapes (no gather needed), posts them all to ``POST
/api/weights/distributed/update``, and, as the gateway's NDJSON answer announces each bucket (it is
asking the engine for it at that moment), gathers that bucket and broadcasts it from rank 0. So the
trainer never broadcasts a bucket the engine was not asked to receive; a failure before a bucket (pause,
flush, begin) ends the push without any collective left pending. A failure *during* a bucket's receive
can leave this side's broadcast waiting until the group's timeout: the group is then unusable and must
be set up again.

``tracegym train`` pushes this way with ``upstream.weight_sync: distributed`` (``group_sync``: the group
set up on the first push, and again when the engines lost it).

What runs here: the distributed path against the real gateway and a fake SGLang, over a real gloo group
whose receiving end is a test stand-in built the way SGLang builds its side (``init_custom_process_group``,
read from its source), and over gloo into the real embedded engine (one or two, with one or two trainer
ranks; inside ``tracegym train``; across containers). Not run here: NCCL, GPUs, and SGLang's own
receiving code.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tracegym.trainer.weights.disk import SwapResult
from tracegym.trainer.weights.gateway import WeightSyncError, post_checked, stream_checked, weights_client

INIT_ROUTE = "/api/weights/distributed/init"
UPDATE_ROUTE = "/api/weights/distributed/update"

Spec = tuple[str, list[int]]
"""A parameter's name and full (unsharded) shape."""


def plan_buckets(
    specs: Iterable[tuple[str, Sequence[int]]], itemsize: int, bucket_bytes: int
) -> list[list[Spec]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone), order kept."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Spec]] = []
    size = 0
    for name, shape in specs:
        n = itemsize
        for d in shape:
            n *= d
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, list(shape)))
        size += n
    return buckets


def bucket_body(bucket: list[Spec], dtype: str) -> dict[str, Any]:
    """One bucket as the gateway takes it (SGLang's field names)."""
    return {"names": [n for n, _ in bucket], "dtypes": [dtype] * len(bucket),
            "shapes": [s for _, s in bucket]}


@dataclass
class DistributedWeightSync:
    """The trainer's side of a distributed push: plans buckets, asks the gateway, broadcasts on cue.
    Picklable (settings only; HTTP clients are made per call) so a Ray actor can run it on rank 0."""

    gateway_url: str
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    broadcast_dtype: str = "bfloat16"
    """What the tensors are cast to before the broadcast (and announced as)."""
    bucket_bytes: int = 512 << 20
    timeout_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    """The gateway's admin key (default ``$TRACEGYM_API_KEY`` / ``$TRACEGYM_ADMIN_KEY``)."""


    def init_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        join: Callable[[], Any],
        rank_offset: int = 1,
    ) -> Any:
        """Ask the gateway to have the engines join the group while ``join()`` (rank 0's rendezvous) runs,
        each in a thread of its own (the engines' side answers only once every rank has joined), and
        return what ``join`` returned. Whichever fails first raises at once: a refusal (the gateway's or an
        engine's, such as NCCL asked of an engine on the CPU) does not wait out the rendezvous' timeout,
        which the abandoned thread then does on its own."""
        body = {
            "master_address": master_address, "master_port": master_port, "world_size": world_size,
            "rank_offset": rank_offset, "group_name": self.group_name, "backend": self.backend,
        }

        def ask() -> None:
            with weights_client(self.gateway_url, self.api_key, self.timeout_s) as client:
                # not repeated once sent: a second init would wait for a rendezvous nobody joins
                post_checked(client, INIT_ROUTE, body, idempotent=False)

        done: queue.Queue[tuple[str, Any, BaseException | None]] = queue.Queue()

        def run(name: str, fn: Callable[[], Any]) -> None:
            try:
                done.put((name, fn(), None))
            except BaseException as e:  # handed to the caller's thread
                done.put((name, None, e))

        for name, fn in (("engines", ask), ("join", join)):
            threading.Thread(target=run, args=(name, fn), name=f"weight-update group: {name}", daemon=True).start()
        got: dict[str, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < 2:
            try:
                name, value, error = done.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise WeightSyncError(f"the weight-update group was not set up in {self.timeout_s:.0f} s "
                                      f"(waiting for: {'the engines' if 'engines' not in got else 'rank 0'})") from None
            if error is not None:
                raise error
            got[name] = value
        return got["join"]

    def push(
        self,
        specs: Sequence[tuple[str, Sequence[int]]],
        params: Iterator[tuple[str, torch.Tensor]],
        version: str | int,
        broadcast: Callable[[list[torch.Tensor]], None],
    ) -> SwapResult:
        """One update. ``specs``: every parameter's (name, full shape), in ``params`` order; ``params``:
        the gathered tensors, lazily (consumed to the end whatever happens: the other ranks take part in
        every gather); ``broadcast(tensors)`` sends one bucket from rank 0 of the group, in order."""
        version = str(version)
        to = getattr(torch, self.broadcast_dtype)
        buckets = plan_buckets(specs, torch.empty((), dtype=to).element_size(), self.bucket_bytes)
        body = {"weight_version": version, "group_name": self.group_name,
                "buckets": [bucket_body(b, self.broadcast_dtype) for b in buckets]}
        t0 = time.perf_counter()
        send_s, sent, done = 0.0, 0, None
        try:
            with (weights_client(self.gateway_url, self.api_key, self.timeout_s) as client,
                  contextlib.closing(stream_checked(client, UPDATE_ROUTE, body)) as events):
                for event in events:
                    if event["event"] == "done":
                        done = event
                        break
                    if event["index"] != sent:
                        raise WeightSyncError(
                            f"the gateway announced bucket {event['index']}, expected {sent}"
                        )
                    ts = time.perf_counter()
                    broadcast(_take(params, buckets[sent], to))
                    send_s += time.perf_counter() - ts
                    sent += 1
        finally:
            for _ in params:
                pass
        total = time.perf_counter() - t0
        if done is None:
            raise WeightSyncError(f"the gateway's answer ended after {sent} bucket(s), before the swap did")
        if not done["success"]:
            raise WeightSyncError(f"distributed weight update to {version} failed after {sent} of "
                                  f"{len(buckets)} bucket(s): {done['message']}")
        return SwapResult(version, None, send_s, total - send_s, total)


def _take(
    params: Iterator[tuple[str, torch.Tensor]], bucket: list[Spec], to: torch.dtype
) -> list[torch.Tensor]:
    out = []
    for name, shape in bucket:
        got = next(params, None)
        if got is None or got[0] != name or list(got[1].shape) != shape:
            raise WeightSyncError(f"expected parameter {name} {shape}, got "
                                  f"{None if got is None else (got[0], list(got[1].shape))}")
        out.append(got[1].to(to))
    return out


def weight_update_group(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl",
    timeout_s: float = 600.0,
) -> Any:
    """The trainer's side (rank 0) of the weight-update group the engine joins in
    ``/init_weights_update_group`` (the embedded engine with ``join_weight_update_group`` too, SGLang with
    its ``init_custom_process_group``, which builds it the same way): a second, independent process group
    next to the trainer's own."""
    from tracegym.engine.dist_weights import join_weight_update_group

    return join_weight_update_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)


def group_broadcast(pg: Any, device: str) -> Callable[[list[torch.Tensor]], None]:
    """Broadcast each tensor of a bucket from rank 0 of ``pg``, in order (what SGLang receives); on
    ``cuda`` for NCCL, on ``cpu`` for gloo."""
    import torch.distributed as dist

    def send(tensors: list[torch.Tensor]) -> None:
        on_device = [t.to(device).contiguous() for t in tensors]  # kept alive until every broadcast is done
        handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in on_device]
        for h in handles:
            h.wait()
        if device == "cuda":
            torch.cuda.synchronize()

    return send


def init_distributed(
    group: Any, sync: DistributedWeightSync, master_address: str, master_port: int, engine_world_size: int
) -> None:
    """Set up the weight-update group between rank 0 of ``group`` (a ``WorkerGroup``) and the engine's
    ``engine_world_size`` ranks, through the gateway."""
    group.run_on_ranks(_init_on_rank, sync, master_address, master_port, engine_world_size + 1)


def push_distributed(group: Any, sync: DistributedWeightSync, version: str | int) -> SwapResult:
    """All ranks gather; rank 0 broadcasts on the gateway's cue (after ``init_distributed``)."""
    return group.run_on_ranks(_push_on_rank, sync, str(version))[0]


def _init_on_rank(worker: Any, sync: DistributedWeightSync, addr: str, port: int, world_size: int) -> None:
    if worker.rank == 0:
        worker.weight_group = sync.init_group(
            addr, port, world_size,
            lambda: weight_update_group(
                addr, port, world_size, sync.group_name, sync.backend, sync.timeout_s
            ),
        )


def _push_on_rank(worker: Any, sync: DistributedWeightSync, version: str) -> SwapResult | None:
    params = worker.rank0_full_params()  # the other ranks only take part in the gathers
    if params is None:
        return None
    if worker.weight_group is None:
        for _ in params:
            pass
        raise WeightSyncError("rank 0 has no weight-update group: run init_distributed first")
    device = "cuda" if sync.backend == "nccl" else "cpu"
    return sync.push(worker.param_specs(), params, version, group_broadcast(worker.weight_group, device))
