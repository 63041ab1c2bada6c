"""Where the trainer's Ray workers run: a Ray this process starts, or an existing cluster it joins.

``connect`` is the one place the trainer calls ``ray.init``. Without an address it starts a local Ray
(no dashboard) that ``WorkerGroup.shutdown`` stops again; with one (``ray.address`` in the recipe, e.g.
a KubeRay head) it joins that cluster as a driver, and shutting down only disconnects: the cluster's
processes were not started here and are left running. Ray's own rule still applies without an
address: a ``RAY_ADDRESS`` in the environment is joined (ray.init reads it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from tracegym.trainer.settings import RayConfig

log = logging.getLogger(__name__)


def connect(settings: RayConfig) -> bool:
    """``ray.init`` unless Ray is already initialised in this process (then that Ray is used as it is:
    whoever initialised it chose the cluster, and stops it). Returns whether this call initialised Ray,
    i.e. whether the caller must ``ray.shutdown()`` it: that stops a Ray started here and, for a joined
    cluster, only disconnects this driver (the cluster keeps running). The process's SIGTERM handler is
    kept (ray.init replaces it with its own)."""
    import ray

    if ray.is_initialized():
        if settings.address is not None:
            log.warning("Ray is already initialised in this process; ray.address %s is not used", settings.address)
        return False
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**settings.init_kwargs())
    except ConnectionError as e:
        if not settings.joins_cluster():
            raise
        raise JoinError(join_error_message(settings.address or os.environ["RAY_ADDRESS"], e)) from e
    if previous is not None:  # ray.init puts sys.exit(15) in; keep the caller's (tracegym train: exit 143)
        signal.signal(signal.SIGTERM, previous)
    if settings.joins_cluster():
        log.info("joined the Ray cluster at %s", settings.address or os.environ["RAY_ADDRESS"])
    return True


class JoinError(ConnectionError):
    """The Ray cluster to join did not accept this driver (unreachable, or its token was not given)."""


def join_error_message(address: str, e: BaseException) -> str:
    msg = f"cannot join the Ray cluster at {address}: {e}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        msg += (" (a cluster with token authentication needs RAY_AUTH_MODE=token and its token, RAY_AUTH_TOKEN"
                " or RAY_AUTH_TOKEN_PATH, in the trainer's environment)")
    return msg


class PlacementError(ValueError):
    """The trainer's workers cannot all be placed on the Ray it started (a recipe error: too many ranks)."""


def check_fits(num_workers: int, settings: RayConfig, *, started_here: bool) -> None:
    """Fail now, naming what is missing, when ``num_workers`` actors cannot all be placed on a Ray started
    here (Ray would otherwise keep them pending forever and the trainer would hang); on a joined cluster
    only warn, since its autoscaler may still add nodes."""
    import ray

    total = ray.cluster_resources()
    need = {"CPU": num_workers * settings.cpus_per_worker, "GPU": num_workers * settings.gpus_per_worker}
    short = [f"{need[k]:g} {k}s (the cluster has {total.get(k, 0):g})" for k in need
             if need[k] > total.get(k, 0) + 1e-9]
    if not short:
        return
    msg = (f"{num_workers} trainer workers need " + " and ".join(short)
           + ": lower ray.cpus_per_worker / ray.gpus_per_worker or workers")
    if started_here and not settings.joins_cluster():
        raise PlacementError(msg)
    log.warning("%s (waiting for the cluster to grow)", msg)
