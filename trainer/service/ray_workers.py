"""The training service's runs as Ray actors (``tinker-serve --ray``).

The service connects to Ray once, at start, the way ``tracegym train`` does (``workers.ray_cluster.connect``:
a local Ray it starts and stops at the end, or, with an address or ``RAY_ADDRESS``, a running cluster it
joins and leaves running). Every training run is then a ``WorkerGroup`` of ``num_workers`` ranks on that
Ray, driven through the group's calls (``run_on_ranks``, checkpoints, weight export), as the in-process
worker is. The runs share the cluster: each holds its ranks' CPUs and GPUs until its session finishes.
"""

from __future__ import annotations

import logging
import sys
import time

from pydantic import ValidationError

from tracegym.errors import UserError
from tracegym.trainer.service.futures import UserFault
from tracegym.trainer.settings import RayConfig
from tracegym.trainer.workers.ray_cluster import JoinError, bundle, connect

log = logging.getLogger(__name__)

FLAGS_FIX = "lower --num-workers, --cpus-per-worker or --gpus-per-worker"


def ray_settings(*, use_ray: bool, address: str | None, num_workers: int, cpus_per_worker: float | None,
                 gpus_per_worker: float | None) -> RayConfig | None:
    """The cluster and each rank's resources from ``tinker-serve``'s flags; None: one in-process worker per
    run. ``UserError`` for flags that need ``--ray`` without it, or values Ray would not take."""
    if num_workers < 1:
        raise UserError(f"--num-workers must be >= 1, got {num_workers}")
    flags = {"address": ("--ray-address", address), "cpus_per_worker": ("--cpus-per-worker", cpus_per_worker),
             "gpus_per_worker": ("--gpus-per-worker", gpus_per_worker)}
    given = {k: v for k, (_, v) in flags.items() if v is not None}
    if not use_ray:
        named = [f"--num-workers {num_workers}"] * (num_workers != 1) + [flags[k][0] for k in given]
        if named:
            raise UserError(f"{', '.join(named)} place each run's ranks as Ray actors, and --ray is not given",
                            "add --ray (without it each run is one worker in the service's process)")
        return None
    try:
        return RayConfig.model_validate(given)
    except ValidationError as e:
        first = e.errors()[0]
        raise UserError(f"{flags[str(first['loc'][0])][0]}: {first['msg']}") from None


def start_ray(settings: RayConfig, num_workers: int) -> bool:
    """Connect to Ray (``ray_cluster.connect``) and check that one run's ranks fit it; whether this call
    started or joined Ray (``stop_ray`` then ends that). ``UserError`` when the cluster refuses this driver
    or a Ray started here cannot hold one run's ranks (on a joined cluster that is only logged: it may grow)."""
    import ray

    try:
        owns = connect(settings)
    except JoinError as e:
        raise UserError(str(e), "start the cluster, or give --ray-address of one that runs") from None
    problem = shortfall(num_workers, settings, dict(ray.cluster_resources()), "in all")
    if problem is not None and settings.joins_cluster():
        log.warning("%s (waiting for the cluster to grow when a run starts)", problem)
    elif problem is not None:
        stop_ray(owns)
        raise UserError(f"{problem} on the Ray this service starts", FLAGS_FIX)
    return owns


def stop_ray(owns: bool) -> None:
    """``ray.shutdown()`` when ``start_ray`` started or joined Ray: a Ray started here stops, a joined
    cluster keeps running."""
    if owns:
        import ray

        ray.shutdown()


def shortfall(num_workers: int, settings: RayConfig, have: dict[str, float], what: str) -> str | None:
    """What a run's ``num_workers`` ranks need beyond ``have`` (Ray's resources: ``what`` they are), or
    None when they fit."""
    need = {k: v * num_workers for k, v in bundle(settings).items()}
    short = [f"{v:g} {k}s ({have.get(k, 0):g} {what})" for k, v in need.items() if v > have.get(k, 0) + 1e-9]
    return f"a training run's {num_workers} Ray workers need " + " and ".join(short) if short else None


def check_room(num_workers: int, settings: RayConfig, *, wait_s: float = 10.0) -> None:
    """Before a run's ranks are started: on a Ray the service started, ``UserFault`` when they cannot be
    placed now (Ray would keep them pending and the request would never end), after ``wait_s`` seconds for
    the ranks of runs just released to go; on a joined cluster only a warning (its autoscaler may add
    nodes, and the run waits for them)."""
    import ray

    deadline = time.monotonic() + wait_s
    while (problem := shortfall(num_workers, settings, ray.available_resources(), "free")) is not None:
        if settings.joins_cluster():
            log.warning("%s (waiting for the cluster)", problem)
            return
        if time.monotonic() > deadline:
            raise UserFault(f"{problem}; the live runs hold the rest until their sessions finish: finish a "
                            f"session that holds a run, or start the service with {FLAGS_FIX}")
        time.sleep(0.5)


def rank_error(e: BaseException) -> BaseException:
    """The exception a rank raised, out of Ray's ``RayTaskError`` (whose message carries the actor's
    traceback), so that a run on Ray answers the in-process worker's message; ``e`` itself otherwise. A
    ``RayTaskError`` exists only once Ray is imported."""
    exceptions = sys.modules.get("ray.exceptions")
    if exceptions is not None and isinstance(e, exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return e
