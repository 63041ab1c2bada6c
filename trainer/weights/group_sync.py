"""The distributed weight sync as a training run uses it (``upstream.weight_sync: distributed``): the
``distributed`` module's group and push, plus what a long run needs around them.

- **Set up on the first push**, with the engines the gateway has in its rotation (``GET /api/upstreams``,
  ``engine_ranks`` ranks each): rank 0 of the trainer is rank 0 of the group, its rendezvous a free port
  on rank 0's node at the address the engines reach it by (``address``, else Ray's node address of rank
  0, else, in-process, this machine's address on the route to the first engine); gloo when rank 0 trains
  on the CPU, NCCL on CUDA.
- **Set up again when the engines lost it.** Before each push the engines' versions are asked: an engine
  that does not serve the version this sync pushed last has restarted (it serves the version it was
  started with) and is in no group, so the group is set up anew before the push. A push that fails all
  the same (the group broken some other way: the trainer's side lost, the gateway restarted mid-push)
  is logged, the group set up again and the push repeated once; a second failure is the step's error.
  There is no fallback to disk: the engines may see no filesystem of the trainer's.
- The trainer's model is not written anywhere by a push: ``save_last`` writes the last version into the
  run directory, as the disk sync leaves it there.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tracegym.client import GatewayError
from tracegym.trainer.weights.disk import SwapResult
from tracegym.trainer.weights.distributed import DistributedWeightSync, init_distributed, push_distributed
from tracegym.trainer.weights.gateway import WeightSyncError, weights_client

log = logging.getLogger(__name__)

UPSTREAMS_ROUTE = "/api/upstreams"
WEIGHTS_ROUTE = "/api/weights"


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (what ``host`` sees connections come from,
    without NAT). No packet is sent: connecting a UDP socket only picks the route."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def _endpoint_on_rank(worker: Any, engine_host: str) -> tuple[str, int, str] | None:
    """On rank 0: its node's address (Ray's node IP; in-process, the route to ``engine_host``), a free
    port there, and the device it trains on."""
    if worker.rank != 0:
        return None
    ip, port = worker.address()
    if ip.startswith("127.") and engine_host:  # in-process: no Ray node address
        ip = route_address(engine_host)
    return ip, port, worker.device.type


def _leave_on_rank(worker: Any) -> None:
    """Rank 0 leaves its side of the group (its name is taken in the process until then)."""
    if worker.rank == 0 and worker.weight_group is not None:
        import torch.distributed as dist

        group, worker.weight_group = worker.weight_group, None
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # an already broken group: gone all the same
            log.warning("leaving the weight-update group: %s", e)


class GroupWeightSync:
    """``push(group, version)`` and ``close()`` as ``DiskWeightSync`` has them, over a weight-update group
    (``group``: a ``WorkerGroup``)."""

    def __init__(
        self,
        sync: DistributedWeightSync,
        root: Path,
        *,
        address: str | None = None,
        engine_ranks: int = 1,
        save_dtype: str | None = None,
        say: Callable[[str], None] = log.info,
    ) -> None:
        """``sync``: the gateway, dtype and bucket settings (its backend is chosen at set-up); ``root``:
        where ``save_last`` writes; ``address``: the rendezvous address the engines reach rank 0 at
        (None = found as the module says); ``say``: where the set-ups are reported."""
        self.sync, self.root, self.address, self.engine_ranks = sync, Path(root), address, engine_ranks
        self.save_dtype, self.say = save_dtype, say
        self.pushed: str | None = None
        """The version this sync pushed last; None until the group is set up."""
        self.setups = 0
        self._client = weights_client(sync.gateway_url, sync.api_key, sync.timeout_s)

    def push(self, group: Any, version: str | int) -> SwapResult:
        version = str(version)
        why = self._lost()
        if why is not None:
            self.setup(group, why)
        try:
            result = push_distributed(group, self.sync, version)
        except Exception as e:
            log.warning("the distributed weight push to version %s failed: %s", version, e)
            self.setup(group, f"the push to version {version} failed ({_first_line(e)}): pushing once more")
            result = push_distributed(group, self.sync, version)
        self.pushed = version
        return result

    def _lost(self) -> str | None:
        """Why the group must be set up (again) before the next push, or None."""
        if self.pushed is None:
            return "first push"
        stale = {e["url"]: e.get("weight_version") for e in self._engines() if e.get("weight_version") != self.pushed}
        if stale:
            return f"engine(s) {stale} do not serve version {self.pushed}, pushed last: restarted, not in the group"
        return None

    def _engines(self) -> list[dict[str, Any]]:
        """The engines in the gateway's rotation (``GET /api/upstreams``), asked now."""
        body = self._get(UPSTREAMS_ROUTE)
        if body.get("kind") != "sglang":
            raise WeightSyncError(f"the gateway's upstream is of kind {body.get('kind')!r}: the distributed weight"
                                  " sync needs SGLang or the embedded engine")
        return [e for e in body["engines"] if e.get("healthy")]

    def _get(self, route: str) -> dict[str, Any]:
        try:
            return self._client.get(route, route)
        except GatewayError as e:
            raise WeightSyncError(str(e)) from e

    def _wait_idle(self) -> None:
        """Until the gateway runs no swap (a failed push's may still be ending), at most the sync's timeout."""
        deadline = time.monotonic() + self.sync.timeout_s
        while self._get(WEIGHTS_ROUTE).get("swapping"):
            if time.monotonic() > deadline:
                raise WeightSyncError(f"the gateway was still swapping weights after {self.sync.timeout_s:.0f} s")
            time.sleep(0.5)

    def setup(self, group: Any, why: str) -> None:
        """(Re)build the weight-update group: rank 0 leaves its old side, then joins with every engine of
        the rotation through the gateway."""
        t0 = time.perf_counter()
        group.run_on_ranks(_leave_on_rank)
        self._wait_idle()
        engines = self._engines()
        if not engines:
            raise WeightSyncError("the gateway has no engine in its rotation to set up the weight-update group with")
        host = urlsplit(engines[0]["url"]).hostname or ""
        ip, port, device = next(r for r in group.run_on_ranks(_endpoint_on_rank, host) if r is not None)
        address = self.address or ip
        self.sync = replace(self.sync, backend="nccl" if device == "cuda" else "gloo")
        ranks = len(engines) * self.engine_ranks
        init_distributed(group, self.sync, address, port, engine_world_size=ranks)
        self.setups += 1
        self.say(f"weight sync: distributed ({self.sync.backend}), rank 0 at {address}:{port} with {len(engines)} "
                 f"engine(s) of {self.engine_ranks} rank(s), set up in {time.perf_counter() - t0:.2f}s ({why})")

    def save_last(self, group: Any, version: str | int) -> Path:
        """Write ``version`` (the trainer's current weights) as ``root/v<version>``: the run's trained model."""
        return group.save_weights(self.root / f"v{version}", self.save_dtype)

    def close(self) -> None:
        self._client.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
