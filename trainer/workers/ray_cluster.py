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
from typing import Any

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


def bundle(settings: RayConfig) -> dict[str, float]:
    """What one rank reserves (the resources of its actor, or of its placement group bundle)."""
    res = {"CPU": settings.cpus_per_worker, "GPU": settings.gpus_per_worker}
    return {k: v for k, v in res.items() if v > 0}


def _fits(node: dict[str, float], need: dict[str, float], times: int = 1) -> bool:
    return all(times * v <= node.get(k, 0) + 1e-9 for k, v in need.items())


def placement_problem(num_workers: int, settings: RayConfig, nodes: list[dict[str, float]]) -> str | None:
    """Why ``num_workers`` ranks cannot be placed on alive nodes with these total resources, or None.
    Without a strict placement only the cluster's totals count; ``STRICT_SPREAD`` needs a node for each
    rank, ``STRICT_PACK`` one node for all."""
    need = bundle(settings)
    total = {k: sum(n.get(k, 0) for n in nodes) for k in ("CPU", "GPU")}
    short = [f"{num_workers * v:g} {k}s (the cluster has {total[k]:g})" for k, v in need.items()
             if num_workers * v > total.get(k, 0) + 1e-9]
    if short:
        return (f"{num_workers} trainer workers need " + " and ".join(short)
                + ": lower ray.cpus_per_worker / ray.gpus_per_worker or workers")
    want = _describe(need)
    if settings.placement == "STRICT_SPREAD":
        fit = sum(_fits(n, need) for n in nodes)
        if fit < num_workers:
            return (f"ray.placement STRICT_SPREAD puts each of the {num_workers} trainer workers on a node of its"
                    f" own, and {fit} of the cluster's {len(nodes)} nodes offer {want}: add nodes, lower workers,"
                    " or unset ray.placement")
    if settings.placement == "STRICT_PACK" and not any(_fits(n, need, num_workers) for n in nodes):
        return (f"ray.placement STRICT_PACK puts all {num_workers} trainer workers on one node, and no node offers"
                f" {num_workers} x {want}: lower workers, or use PACK")
    return None


def _describe(need: dict[str, float]) -> str:
    return " and ".join(f"{v:g} {k}" for k, v in need.items()) or "nothing"


def check_fits(num_workers: int, settings: RayConfig, *, started_here: bool) -> None:
    """Fail now, naming what is missing, when ``num_workers`` actors cannot all be placed on a Ray started
    here (Ray would otherwise keep them pending forever and the trainer would hang); on a joined cluster
    only warn, since its autoscaler may still add nodes."""
    import ray

    if settings.placement in ("STRICT_SPREAD", "STRICT_PACK"):
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    else:  # the totals are enough, and one node standing for them gives the same answer
        nodes = [dict(ray.cluster_resources())]
    msg = placement_problem(num_workers, settings, nodes)
    if msg is None:
        return
    if started_here and not settings.joins_cluster():
        raise PlacementError(msg)
    log.warning("%s (waiting for the cluster to grow)", msg)


def reserve(num_workers: int, settings: RayConfig, *, wait_log_s: float = 30.0) -> Any:
    """The placement group of ``num_workers`` bundles (one per rank) with ``settings.placement``'s strategy,
    once Ray has reserved it (on a joined cluster that may wait for nodes: logged every ``wait_log_s``)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([bundle(settings)] * num_workers, strategy=settings.placement)
    waited = 0.0
    try:
        while not ray.wait([pg.ready()], timeout=wait_log_s)[0]:
            waited += wait_log_s
            log.warning("the %d trainer workers' placement group (%s, %s each) is not reserved after %.0f s:"
                        " waiting for nodes", num_workers, settings.placement, _describe(bundle(settings)), waited)
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def scheduling(pg: Any, rank: int) -> dict[str, Any]:
    """The actor options that put ``rank`` in its bundle of ``pg`` (none without a placement group)."""
    if pg is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)}
