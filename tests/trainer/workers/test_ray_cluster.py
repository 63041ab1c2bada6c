"""Where the trainer's Ray workers run (``trainer/workers/ray_cluster.py``): the recipe's ``ray`` section reaches
``ray.init``, a joined cluster is never started nor stopped by the trainer, workers that cannot be
placed fail at once instead of hanging, and ``ray.placement`` reserves the ranks as one placement group.
``ray.init`` is replaced here, but for the slow test, which places two ranks on a real cluster of two
nodes; ``tests/e2e/test_train_ray.py`` and ``tests/e2e/test_ray_containers.py`` run whole trainings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracegym.trainer.recipe import RecipeError, load_recipe
from tracegym.trainer.settings import RayConfig
from tracegym.trainer.workers.ray_cluster import PlacementError, check_fits, connect, placement_problem
from tracegym.trainer.workers.train_config import TrainConfig


def _settings(tmp: Path, ray: dict[str, Any] | None) -> RayConfig:
    (tmp / "t.jsonl").write_text('{"task_id": "t0", "input": {}}\n')
    fields = {"model": "tiny-random", "data": {"path": "t.jsonl"}, "agent": {"target": "a:a"}}
    (tmp / "r.yaml").write_text(yaml.safe_dump(fields | ({"ray": ray} if ray is not None else {})))
    return load_recipe(tmp / "r.yaml").ray or RayConfig()


class FakeRay:
    """Records what the trainer asks of ``ray``; ``init`` fails after recording (no cluster here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, initialised: bool = False) -> None:
        import ray

        self.calls: list[tuple[str, Any]] = []
        self.initialised = initialised
        monkeypatch.setattr(ray, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(ray, "init", self.init)
        monkeypatch.setattr(ray, "shutdown", lambda: self.calls.append(("shutdown", None)))
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})

    def init(self, **kwargs: Any) -> None:
        self.calls.append(("init", kwargs))
        raise ConnectionError("no cluster in a unit test")


def test_the_recipe_address_reaches_ray_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tracegym.trainer.workers.group import WorkerGroup

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake = FakeRay(monkeypatch)
    rs = _settings(tmp_path, {"address": "10.1.2.3:6379", "namespace": "exp", "runtime_env": {"env_vars": {"A": "1"}}})
    with pytest.raises(ConnectionError):
        WorkerGroup(tmp_path, num_workers=2, train_cfg=TrainConfig(), use_ray=True, ray_settings=rs)
    # joined, not started: no dashboard or resource options (ray.init refuses them for a running
    # cluster), and a failed join stops nothing
    assert fake.calls == [("init", {"address": "10.1.2.3:6379", "namespace": "exp",
                                    "runtime_env": {"env_vars": {"A": "1"}}, "log_to_driver": True})]  # fmt: skip


def test_unset_starts_a_local_ray_without_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake = FakeRay(monkeypatch)
    for rs in (_settings(tmp_path, None), _settings(tmp_path, {"cpus_per_worker": 0.5})):
        with pytest.raises(ConnectionError):
            connect(rs)
    assert fake.calls == [("init", {"include_dashboard": False, "log_to_driver": True})] * 2
    assert not rs.joins_cluster()
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")  # Ray's own rule: ray.init joins it
    assert rs.joins_cluster()


def test_connect_owns_only_a_ray_it_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    fake = FakeRay(monkeypatch, initialised=True)
    assert connect(RayConfig(address="head:6379")) is False  # the caller's Ray, the caller's to stop
    assert fake.calls == []
    fake.initialised = False
    monkeypatch.setattr(ray, "init", lambda **kw: fake.calls.append(("init", kw)))
    assert connect(RayConfig(address="head:6379")) is True  # ray.shutdown() then only disconnects
    assert fake.calls == [("init", {"address": "head:6379", "log_to_driver": True})]


def test_workers_that_cannot_be_placed_fail_at_once_on_a_local_ray(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    FakeRay(monkeypatch)  # a local Ray with 2 CPUs and no GPU
    check_fits(2, RayConfig(), started_here=True)
    check_fits(4, RayConfig(cpus_per_worker=0.5), started_here=True)
    with pytest.raises(PlacementError, match=r"^3 trainer workers need 3 CPUs \(the cluster has 2\): lower"):
        check_fits(3, RayConfig(), started_here=True)
    with pytest.raises(PlacementError, match=r"need 2 GPUs \(the cluster has 0\)"):
        check_fits(2, RayConfig(gpus_per_worker=1), started_here=True)
    # a joined cluster may still grow (autoscaler): a warning, and Ray waits for the nodes
    with caplog.at_level(logging.WARNING, logger="tracegym.trainer.workers.ray_cluster"):
        check_fits(2, RayConfig(address="head:6379", gpus_per_worker=1), started_here=True)
    assert "need 2 GPUs (the cluster has 0)" in caplog.text and "waiting for the cluster to grow" in caplog.text


def test_connect_keeps_the_callers_sigterm_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init installs ``sys.exit(15)`` for SIGTERM; ``tracegym train``'s own (unwind, exit 143) must stay."""
    import signal

    import ray

    fake = FakeRay(monkeypatch)

    def init(**kwargs: Any) -> None:  # what ray.init does to the handler
        fake.calls.append(("init", kwargs))
        signal.signal(signal.SIGTERM, lambda *_: None)

    def ours(*_: Any) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(ray, "init", init)
    before = signal.signal(signal.SIGTERM, ours)
    try:
        assert connect(RayConfig(address="head:6379")) is True
        assert signal.getsignal(signal.SIGTERM) is ours and len(fake.calls) == 1
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
    ("ray", "workers", "use_ray"),
    [(None, 1, False), (None, 2, True), ({"address": "head:6379", "gpus_per_worker": 1}, 1, True)],
)
def test_the_trainer_hands_the_ray_section_to_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray: dict[str, Any] | None, workers: int, use_ray: bool
) -> None:
    """`tracegym train` builds its WorkerGroup from the recipe: a `ray` section means Ray workers (even
    one), with its settings; and ranks that do not fit are a recipe error (one line, exit 2)."""
    import tracegym.trainer.run.loop as loop
    import tracegym.trainer.workers.group as workers_mod
    from tests.trainer.run.test_loop import FakeControl, _write
    from tracegym.trainer.recipe import RecipeError
    from tracegym.trainer.workers.ray_cluster import PlacementError

    seen: list[dict[str, Any]] = []

    class Group:
        def __init__(self, model_dir: Path, **kw: Any) -> None:
            seen.append(kw)
            raise PlacementError("3 trainer workers need 3 CPUs (the cluster has 2): lower ...")

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(workers_mod, "WorkerGroup", Group)
    monkeypatch.setattr(loop, "ControlClient", lambda _url, **_kw: FakeControl())
    recipe = load_recipe(_write(tmp_path, workers=workers, **({"ray": ray} if ray else {})))
    recipe.run_dir.mkdir(parents=True)
    services = loop.Services(gateway_url="http://unused", upstream_url="http://unused")
    with pytest.raises(RecipeError, match=r"^3 trainer workers need 3 CPUs"):
        loop.Trainer(recipe, services, tmp_path, resume=False, train_cfg=TrainConfig())
    (kw,) = seen
    assert kw["num_workers"] == workers and kw["use_ray"] is use_ray
    assert kw["ray_settings"] == (None if ray is None else RayConfig(**ray))


def test_a_cluster_that_refuses_the_driver_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ray.init raises for a wrong address or a missing token (Ray 2.60: ConnectionError, the
    authentication error as its cause), named with the address and, without RAY_AUTH_MODE=token, the hint."""
    from tracegym.trainer.workers.ray_cluster import JoinError

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    FakeRay(monkeypatch)  # its init raises ConnectionError("no cluster in a unit test")
    with pytest.raises(JoinError) as err:
        connect(RayConfig(address="head:6379"))
    assert str(err.value).startswith("cannot join the Ray cluster at head:6379: no cluster in a unit test (a"
                                     " cluster with token authentication needs RAY_AUTH_MODE=token")  # fmt: skip
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(JoinError, match=r"^cannot join the Ray cluster at head:6379: no cluster in a unit test$"):
        connect(RayConfig(address="head:6379"))
    with pytest.raises(ConnectionError) as plain:  # a local Ray that fails to start is not a join error
        connect(RayConfig())
    assert type(plain.value) is ConnectionError


def test_placement_is_one_of_rays_strategies(tmp_path: Path) -> None:
    assert _settings(tmp_path, None).placement is None  # Ray places each rank on its own
    for strategy in ("STRICT_SPREAD", "SPREAD", "STRICT_PACK", "PACK"):
        assert _settings(tmp_path, {"placement": strategy}).placement == strategy
    with pytest.raises(RecipeError, match=r"ray\.placement.*'STRICT_SPREAD', 'SPREAD', 'STRICT_PACK' or 'PACK'"):
        _settings(tmp_path, {"placement": "spread"})


NODE = {"CPU": 2.0, "memory": 1e9}


@pytest.mark.parametrize(("workers", "ray", "nodes", "problem"), [
    (2, {"placement": "STRICT_SPREAD"}, [NODE, NODE], None),
    (3, {"placement": "STRICT_SPREAD"}, [NODE, NODE], "STRICT_SPREAD puts each of the 3 trainer workers on a node"
     " of its own, and 2 of the cluster's 2 nodes offer 1 CPU: add nodes, lower workers, or unset ray.placement"),
    (2, {"placement": "STRICT_SPREAD", "cpus_per_worker": 2}, [NODE, {"CPU": 1.0}, {"CPU": 1.0}], "and 1 of the"
     " cluster's 3 nodes offer 2 CPU"),
    (2, {"placement": "STRICT_SPREAD", "gpus_per_worker": 1}, [NODE | {"GPU": 1.0}, NODE | {"GPU": 1.0}], None),
    (4, {"placement": "STRICT_PACK"}, [NODE, NODE], "STRICT_PACK puts all 4 trainer workers on one node, and no"
     " node offers 4 x 1 CPU: lower workers, or use PACK"),
    (2, {"placement": "STRICT_PACK"}, [{"CPU": 1.0}, NODE], None),
    (4, {"placement": "PACK"}, [NODE, NODE], None),  # as far as possible: the totals are enough
    (4, {"placement": "SPREAD"}, [NODE, {"CPU": 1.0}], "4 trainer workers need 4 CPUs (the cluster has 3)"),
    (3, {}, [NODE, NODE], None),
])
def test_what_a_placement_needs_of_the_nodes(
    tmp_path: Path, workers: int, ray: dict[str, Any], nodes: list[dict[str, float]], problem: str | None
) -> None:
    got = placement_problem(workers, _settings(tmp_path, ray), nodes)
    assert got == problem if problem is None else problem in (got or "")


def test_a_strict_spread_that_a_local_ray_cannot_hold_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Ray the trainer starts is one node: STRICT_SPREAD over two ranks is an error (exit 2), not a
    placement group that stays pending; a joined cluster may still add nodes (a warning)."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    FakeRay(monkeypatch)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}},
                                               {"Alive": False, "Resources": {"CPU": 2.0}}])
    check_fits(2, RayConfig(placement="STRICT_PACK"), started_here=True)
    with pytest.raises(PlacementError, match=r"STRICT_SPREAD puts each of the 2 trainer workers on a node of its"
                                             r" own, and 1 of the cluster's 1 nodes offer 1 CPU"):
        check_fits(2, RayConfig(placement="STRICT_SPREAD"), started_here=True)
    with caplog.at_level(logging.WARNING, logger="tracegym.trainer.workers.ray_cluster"):
        check_fits(2, RayConfig(address="head:6379", placement="STRICT_SPREAD"), started_here=True)
    assert "STRICT_SPREAD puts each" in caplog.text and "waiting for the cluster to grow" in caplog.text


def _node_id(_worker: Any) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_strict_spread_puts_the_ranks_on_two_nodes_that_ray_would_pack(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real cluster of two nodes with 4 CPUs each (``ray.cluster_utils.Cluster``: two raylets on this
    machine), two ranks of one CPU joined to it: Ray's default scheduling packs them on one node, and
    ``placement: STRICT_SPREAD`` puts them on both; its placement group is gone after ``shutdown``."""
    import sys

    import ray
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from tracegym.trainer.settings import OptimConfig
    from tracegym.trainer.workers.group import WorkerGroup

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import tests/
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4)
        cluster.wait_for_nodes()
        cfg = TrainConfig(optim=OptimConfig(dtype="float32"), torch_threads=1)
        placed = {}
        for placement in (None, "STRICT_SPREAD"):
            rs = RayConfig(address=cluster.address, placement=placement)
            group = WorkerGroup(tiny_model_dir, num_workers=2, train_cfg=cfg, use_ray=True, ray_settings=rs)
            try:
                placed[placement] = group.run_on_ranks(_node_id)
                assert len(group.nodes) == 2
            finally:
                group.shutdown()
        assert len(set(placed[None])) == 1, placed  # packed: the test below can fail
        assert len(set(placed["STRICT_SPREAD"])) == 2, placed
        ray.init(address=cluster.address)
        try:
            tables = ray.util.placement_group_table().values()
            assert [t["state"] for t in tables] == ["REMOVED"], tables
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
