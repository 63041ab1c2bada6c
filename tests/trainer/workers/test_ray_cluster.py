"""Where the trainer's Ray workers run (``trainer/workers/ray_cluster.py``): the recipe's ``ray`` section reaches
``ray.init``, a joined cluster is never started nor stopped by the trainer, and workers that cannot be
placed fail at once instead of hanging. ``ray.init`` is replaced here; the real clusters run in
``tests/e2e/test_train_ray.py``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracegym.trainer.recipe import load_recipe
from tracegym.trainer.settings import RayConfig
from tracegym.trainer.workers.ray_cluster import PlacementError, check_fits, connect
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
