"""`tracegym train` with two trainer workers on Ray, tiny-random, real processes: on a
Ray the trainer starts (and stops) itself, and joined to a running cluster (`ray start --head`), which it
leaves running. Every step must train (the agent's rewards never tie), swap its weights into the engine
and leave no process behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
MARK = "TRACEGYM_TEST_RUN"
"""Set in the trainer's environment: every process the run starts (Ray's included) inherits it."""


def _write_recipe(tmp: Path, steps: int, **extra: object) -> Path:
    tasks = [{"task_id": f"t{i}", "input": {"question": f"Say {i}"}} for i in range(8)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    recipe = {
        "name": "raytest",
        "model": "tiny-random",
        "data": {"path": "train.jsonl", "eval_size": 0},  # no evaluation: only training steps
        "agent": {"target": "tests.e2e.agents.signal_agent:agent", "concurrency": 4},
        "group_size": 2,
        "batch_size": 2,
        "steps": steps,
        "workers": 2,
        "optim": {"lr": 1e-3, "dtype": "float32"},
        "upstream": {"engine_dtype": "float32", "max_batch_size": 4},
        "run_dir": str(tmp / "run"),
        "keep": "checkpoint",  # _check_trained reads each rank's checkpoint after the run
        **extra,
    }
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def _train(recipe: Path, mark: str, ray_tmp: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": str(ROOT), MARK: mark, "RAY_TMPDIR": str(ray_tmp), **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "tracegym.cli", "train", str(recipe)],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip


def _check_trained(run: Path, res: subprocess.CompletedProcess, steps: int) -> None:
    """Every step trained on both ranks with a finite loss, and its weights became the engine's version."""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["rollouts"] == 4 and r["loss_tokens"] > 0 and r["swap_s"] > 0, r
        assert isinstance(r["loss"], float) and r["loss"] == r["loss"] and r["skipped"] == 0, r
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == steps
    assert sorted(p.name for p in (run / "checkpoint").glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]

    from tracegym.gateway.traces.store import Store

    store = Store.open(f"sqlite:///{run / 'tracegym.db'}")
    try:  # each step's swap stamped a version, and the last rollouts were sampled with a swapped one
        assert {str(v) for v in range(1, steps + 1)} <= {v["version"] for v in store.list_weight_versions()}
        done, _ = store.list_rollouts(status="completed", limit=500)
        assert len(done) == 4 * steps
    finally:
        store.close()


def _session_worker_pids(ray_tmp: Path) -> dict[int, str]:
    """Every Ray worker process a session under ``ray_tmp`` started (``RAY_TMPDIR/ray/session_*`` or
    ``--temp-dir/session_*``), from its log file names: Ray writes ``logs/worker-<id>-<job>-<pid>.out``,
    beginning with ``:actor_name:<class>`` once it hosts an actor."""
    out: dict[int, str] = {}
    for f in ray_tmp.rglob("worker-*.out"):
        head = f.read_text(errors="replace")[:200]
        m = re.search(r":actor_name:(\w+)", head)
        out[int(f.stem.rsplit("-", 1)[1])] = m.group(1) if m else ""
    return out


def _processes() -> Iterator[tuple[int, str, bytes]]:
    """Every live process's pid, command line and environment (``/proc``; others' environments are
    unreadable and come back empty)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            env = b""
        if cmd:  # zombies and kernel threads have none
            yield int(d.name), cmd, env


def _leftovers(mark: str, ray_tmp: Path, worker_pids: list[int]) -> list[str]:
    """Processes of the run still alive: anything with the run's mark in its environment or Ray's
    directory on its command line, and the Ray workers the session's logs name (a worker that renamed
    itself ``ray::...`` may no longer show either)."""
    tag = f"{MARK}={mark}".encode()
    found = []
    for pid, cmd, env in _processes():
        ray_worker = pid in worker_pids and (cmd.startswith("ray::") or "default_worker" in cmd)
        if ray_worker or str(ray_tmp) in cmd or tag in env.split(b"\0"):
            found.append(f"{pid} {cmd[:160]}")
    return found


def _none_left(mark: str, ray_tmp: Path, worker_pids: list[int], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while left := _leftovers(mark, ray_tmp, worker_pids):
        if time.monotonic() > deadline:
            pytest.fail("processes left behind:\n" + "\n".join(left))
        time.sleep(0.5)


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A short Ray temp directory (its sockets' paths must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="tg-ray-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_two_ray_workers_train_swap_and_leave_nothing_behind(
    tmp_path: Path, tiny_model_dir: Path, ray_tmp: Path
) -> None:
    mark = uuid.uuid4().hex
    t0 = time.monotonic()
    res = _train(_write_recipe(tmp_path, steps=2), mark, ray_tmp)
    print(f"tracegym train, 2 Ray workers, 2 steps: {time.monotonic() - t0:.1f} s")
    _check_trained(tmp_path / "run", res, steps=2)
    workers = _session_worker_pids(ray_tmp)
    assert sorted(workers.values()).count("TrainWorker") == 2, workers  # the trainer's own Ray ran both ranks
    _none_left(mark, ray_tmp, list(workers))


@contextmanager
def ray_head(temp_dir: Path, log: Path, auth: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real one-node Ray cluster (``ray start --head --block``), on free ports and its own temp dir, with
    token authentication (``auth``: its own token, not the user's ``~/.ray/auth_token``), stopped by
    SIGTERM to that one ``ray start`` process (which stops its own processes; never ``ray stop``, which
    stops every Ray of the user's on the machine)."""
    port = free_port()
    # (no --ray-client-server-port: it needs ray[client], which the project does not install)
    flags = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port", "node-manager-port", "object-manager-port")  # fmt: skip
    argv = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
            "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp_dir}",
            "--disable-usage-stats", *(f"--{f}={free_port()}" for f in flags)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT), **auth}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not come up:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only this cluster's processes
            proc.wait(timeout=10)


def _gcs_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_joined_to_a_running_cluster_the_trainer_leaves_it_running(
    tmp_path: Path, tiny_model_dir: Path, ray_tmp: Path
) -> None:
    cluster_tmp = ray_tmp / "cluster"
    own_tmp = ray_tmp / "own"  # where a Ray the trainer started would be: it must stay empty
    own_tmp.mkdir()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
    with ray_head(cluster_tmp, tmp_path / "ray-head.log", auth) as (address, head):
        mark = uuid.uuid4().hex
        t0 = time.monotonic()
        recipe = _write_recipe(tmp_path, steps=1, ray={"address": address, "namespace": "tg-test"})
        res = _train(recipe, mark, own_tmp, **auth)
        print(f"tracegym train joined to a cluster, 2 Ray workers, 1 step: {time.monotonic() - t0:.1f} s")
        _check_trained(tmp_path / "run", res, steps=1)
        assert f"ray: joined the cluster at {address}" in res.stderr
        assert not list(own_tmp.rglob("session_*")), "the trainer started a Ray of its own"
        workers = _session_worker_pids(cluster_tmp)
        assert sorted(workers.values()).count("TrainWorker") == 2, workers  # both ranks ran on the cluster
        # the cluster is still up, and the trainer's actors (and its other processes) are gone from it
        assert head.poll() is None and _gcs_answers(address), "the trainer stopped a cluster it joined"
        trained = [pid for pid, actor in workers.items() if actor == "TrainWorker"]
        _none_left(mark, own_tmp, trained)
    _none_left(mark, cluster_tmp, list(workers))  # and the test's own cluster is gone with its workers
