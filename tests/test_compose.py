"""docker-compose.yml and its overrides (two engines, Ray across containers): valid for `docker-compose
config`, every tracegym service runs a real CLI command, and the container helpers in deploy/docker/bin
decide as documented. tests/e2e/test_compose_stack.py and tests/e2e/test_ray_containers.py run them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tracegym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
TWO_ENGINES = ROOT / "docker-compose.two-engines.yml"
RAY = ROOT / "docker-compose.ray.yml"
BIN = ROOT / "deploy/docker/bin"
ENTRYPOINTS = {"tracegym-serve": "serve", "tracegym-train-or-resume": "train", "tracegym-ray-head": "train"}
"""The image's wrappers (deploy/docker/bin) and the tracegym command each ends by running."""


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _config(profile: str, *files: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (.ci/run installs the Debian package)")
    env = {**os.environ, "TRACEGYM_ADMIN_KEY": "compose-test-key"}
    argv = [exe, *(a for f in files for a in ("-f", str(f))), "--profile", profile, "config"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_config_is_valid(profile: str) -> None:
    res = _config(profile)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_two_engines_override_is_valid_and_fronts_both_servers(profile: str) -> None:
    res = _config(profile, COMPOSE, TWO_ENGINES)
    assert res.returncode == 0, res.stderr
    s = yaml.safe_load(res.stdout)["services"]
    gw = s["gateway"]["command"]
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--upstream"] == ["http://sglang:30000", "http://sglang-2:30000"]
    assert s["gateway"]["entrypoint"] == ["tracegym-serve"]
    args = build_parser().parse_args(["serve", *gw])
    assert args.command == "serve"
    assert s["gateway"]["ports"] == ["127.0.0.1:8000:8000/tcp"] and not s["engine-2"].get("ports")
    devices = {n: s[n]["deploy"]["resources"]["reservations"]["devices"] for n in ("sglang", "sglang-2")}
    assert [d["device_ids"] for d in devices["sglang"]] == [["0"]]
    assert [d["device_ids"] for d in devices["sglang-2"]] == [["1"]]  # its own GPU, not GPU 0 too
    assert s["engine"]["networks"]["default"]["aliases"] == ["sglang"]
    assert s["engine-2"]["networks"]["default"]["aliases"] == ["sglang-2"]  # not `sglang` as well


def test_two_engines_second_servers_are_copies_of_the_first() -> None:
    """The override writes its services out (``extends`` would merge lists): they must not drift from
    docker-compose.yml's, apart from the GPU and the network name."""
    base, two = yaml.safe_load(COMPOSE.read_text()), yaml.safe_load(TWO_ENGINES.read_text())
    assert two["x-tracegym"] == base["x-tracegym"]
    b, t = base["services"], two["services"]
    assert set(t) == {"sglang-2", "engine-2", "gateway"} and set(t["gateway"]) == {"command"}
    first, second = dict(b["sglang"]), dict(t["sglang-2"])
    first.pop("deploy"), second.pop("deploy")
    assert second == first
    first, second = dict(b["engine"]), dict(t["engine-2"])
    first.pop("networks"), second.pop("networks")
    assert second == first
    base_gw = b["gateway"]["command"]
    i = base_gw.index("http://sglang:30000") + 1  # the same gateway, with the second server after the first
    assert t["gateway"]["command"] == [*base_gw[:i], "--upstream", "http://sglang-2:30000", *base_gw[i:]]


def test_compose_needs_an_admin_key_and_publishes_loopback_only() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (.ci/run installs the Debian package)")
    env = {k: v for k, v in os.environ.items() if k != "TRACEGYM_ADMIN_KEY"}
    res = subprocess.run([exe, "--profile", "cpu", "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                         env=env)
    assert res.returncode != 0 and "TRACEGYM_ADMIN_KEY" in res.stderr
    s = _services()
    assert s["gateway"]["ports"] == ["127.0.0.1:${TRACEGYM_PORT:-8000}:8000"]
    assert all(not svc.get("ports") for name, svc in s.items() if name != "gateway")
    env_of = yaml.safe_load(COMPOSE.read_text())["x-tracegym"]["environment"]
    for var in ("TRACEGYM_ADMIN_KEY", "TRACEGYM_ENGINE_API_KEY", "TRACEGYM_UPSTREAM_API_KEY"):
        assert env_of[var].startswith("${TRACEGYM_ADMIN_KEY:?"), var
    assert env_of["TRACEGYM_WEIGHTS_DIR"] == "/weights"


def _tracegym_argv(svc: dict) -> list[str]:
    """The tracegym command line a service runs (its defaults for ${VAR:-default})."""
    cmd = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", c) for c in svc["command"]]
    entry = svc.get("entrypoint")
    return [ENTRYPOINTS[entry[0]], *cmd] if entry else cmd


def test_every_tracegym_service_command_parses() -> None:
    from tracegym.trainer.recipe import load_recipe

    parser = build_parser()
    checked = []
    for name, svc in _services().items():
        if "tracegym" in svc.get("image", "") or "build" in svc:
            cmd = _tracegym_argv(svc)
            args = parser.parse_args(cmd)  # SystemExit (a test failure) on an unknown command or flag
            assert args.command == cmd[0]
            if args.command == "train":
                load_recipe(ROOT / args.recipe)
            checked.append(name)
    assert {"engine", "gateway", "trainer", "runner"} <= set(checked)


def test_wrappers_exist_and_the_image_has_them() -> None:
    for name in ENTRYPOINTS:
        assert os.access(BIN / name, os.X_OK), name
    assert "COPY deploy/docker/bin/ /usr/local/bin/" in (ROOT / "Dockerfile").read_text()


def test_restart_policies() -> None:
    """Every long-lived service comes back after a crash or `docker kill`; the trainer after a failure
    (a finished run stays finished)."""
    s = _services()
    for name in ("postgres", "engine", "gateway", "runner"):
        assert s[name]["restart"] == "unless-stopped", name
    assert s["trainer"]["restart"] == "on-failure"
    assert s["trainer"]["entrypoint"] == ["tracegym-train-or-resume"]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_ray_override_puts_the_trainer_on_a_two_node_cluster(profile: str) -> None:
    from tracegym.trainer.recipe import load_recipe

    res = _config(profile, COMPOSE, RAY)
    assert res.returncode == 0, res.stderr
    s = yaml.safe_load(res.stdout)["services"]
    assert s["trainer"]["entrypoint"] == ["tracegym-ray-head"]
    args = build_parser().parse_args(_tracegym_argv(s["trainer"]))
    recipe = load_recipe(ROOT / args.recipe)
    assert recipe.workers == 2 and recipe.ray is not None and recipe.ray.address == "trainer:6379"
    assert recipe.ray.cpus_per_worker == 1 and recipe.ray.placement == "STRICT_SPREAD"  # one rank per node
    assert s["trainer"]["environment"]["RAY_HEAD_CPUS"] == "1"
    assert "--address=trainer:6379" in s["ray-worker"]["command"][0]
    assert "--num-cpus=${RAY_WORKER_CPUS:-1}" in yaml.safe_load(RAY.read_text())["services"]["ray-worker"]["command"][0]
    assert yaml.safe_load(RAY.read_text())["x-tracegym"] == yaml.safe_load(COMPOSE.read_text())["x-tracegym"]


def _train_or_resume(tmp: Path, run_dir: str, steps: int = 8) -> list[str]:
    """The `tracegym train` argv that deploy/docker/bin/tracegym-train-or-resume would exec."""
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "tracegym").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "tracegym").chmod(0o755)
    (tmp / "train.jsonl").write_text('{"input": {"question": "1+1"}}\n')
    recipe = {"name": "t", "model": "tiny-random", "data": {"path": "train.jsonl"}, "steps": steps,
              "agent": {"target": "agent:agent", "external": True}, "gateway_url": "http://gateway:8000",
              "upstream": {"url": "http://sglang:30000"}, "run_dir": run_dir}
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, str(BIN / "tracegym-train-or-resume"), str(tmp / "r.yaml")],
                         capture_output=True, text=True, env=env, check=True)
    return res.stdout.strip().splitlines()[-1].split()


def _checkpoint(d: Path, step: int) -> None:
    (d / "checkpoint").mkdir(parents=True)
    (d / "checkpoint/trainer_state.json").write_text(json.dumps({"step": step, "extra": {"step": step}}))


def test_train_or_resume_resumes_only_an_unfinished_run(tmp_path: Path) -> None:
    per_run = str(tmp_path / "runs/{timestamp}")
    assert _train_or_resume(tmp_path, per_run)[-1].endswith("r.yaml")  # no run yet: a new one
    run = tmp_path / "runs/20260101-000000"
    run.mkdir(parents=True)
    (tmp_path / "runs/latest").symlink_to(run.name)
    assert _train_or_resume(tmp_path, per_run)[-1].endswith("r.yaml")  # stopped before its first checkpoint
    _checkpoint(run, 3)
    assert _train_or_resume(tmp_path, per_run)[-1] == "--resume"
    (run / "checkpoint").rename(run / ".checkpoint.old")  # a save interrupted between its renames
    assert _train_or_resume(tmp_path, per_run)[-1] == "--resume"
    shutil.rmtree(run / ".checkpoint.old")
    _checkpoint(run, 8)
    assert _train_or_resume(tmp_path, per_run)[-1].endswith("r.yaml")  # finished: a new run
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "metrics.jsonl").write_text("")
    assert _train_or_resume(tmp_path, str(fixed))[-1] == "--overwrite"  # no checkpoint: start again


def test_profiles_never_mix_the_two_inference_servers() -> None:
    s = _services()
    assert s["sglang"]["profiles"] == ["gpu"]
    assert s["engine"]["profiles"] == ["cpu"]
    assert "sglang" in s["engine"]["networks"]["default"]["aliases"]
    for name in ("gateway", "trainer", "runner"):
        assert set(s[name]["profiles"]) == {"gpu", "cpu"}


def test_compose_recipe_and_agent_exist() -> None:
    from tracegym.trainer.recipe import load_recipe

    recipe = load_recipe(ROOT / "examples/quickstart/recipe-compose.yaml")
    assert recipe.gateway_url == "http://gateway:8000" and recipe.agent.external
    assert recipe.checkpoint_interval > 0  # the trainer container continues from it after a crash
    for name in ("recipe-compose-short.yaml", "recipe-compose-ray.yaml"):
        other = load_recipe(ROOT / "examples/quickstart" / name)
        assert other.gateway_url == recipe.gateway_url and other.upstream.url == recipe.upstream.url
        assert other.algorithm == recipe.algorithm and other.optim == recipe.optim
    assert (ROOT / "examples/quickstart/agent.py").is_file()


def test_kuberay_manifest_matches_the_compose_ray_layout() -> None:
    """deploy/kuberay/raycluster.yaml (not run on Kubernetes here): well-formed, the image's Ray version,
    the driver's head offering no rank a CPU or GPU, one rank per worker pod, one shared volume everywhere."""
    import ray

    docs = list(yaml.safe_load_all((ROOT / "deploy/kuberay/raycluster.yaml").read_text()))
    pvc, rc = docs
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["spec"]["rayVersion"] == ray.__version__
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"num-gpus": "0", "num-cpus": "0"}
    pods = [head["template"]["spec"]] + [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]
    for pod in pods:
        (c,) = pod["containers"]
        assert c["image"] == "tracegym:latest" and c["command"] == ["/bin/bash", "-lc", "--"]
        assert c["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
        assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}}]
    (gpu,) = rc["spec"]["workerGroupSpecs"]
    assert gpu["replicas"] == gpu["minReplicas"] == gpu["maxReplicas"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_images_script_names_the_step_that_failed() -> None:
    """scripts/docker_images.sh without a Docker engine: the failed step and what to do, exit non-zero."""
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    res = subprocess.run(["bash", "scripts/docker_images.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode != 0
    assert 'docker_images.sh: step "docker engine" failed. Start it' in res.stderr


def test_the_gateway_is_unhealthy_once_its_wait_for_the_engine_is_over() -> None:
    """tracegym-serve waits TRACEGYM_UPSTREAM_WAIT for the inference server; the gateway's healthcheck
    counts failures only after the same time, so `docker-compose up` stops then, naming the gateway
    (tests/e2e/test_compose_engine.py runs it with an engine that never becomes healthy)."""
    env = yaml.safe_load(COMPOSE.read_text())["x-tracegym"]["environment"]
    assert env["TRACEGYM_UPSTREAM_WAIT"] == "${TRACEGYM_UPSTREAM_WAIT:-600}"
    check = _services()["gateway"]["healthcheck"]
    assert check["start_period"] == "${TRACEGYM_UPSTREAM_WAIT:-600}s" and check["retries"] == 3
    assert "wait_s=${TRACEGYM_UPSTREAM_WAIT:-600}" in (BIN / "tracegym-serve").read_text()


def test_tracegym_serve_reports_a_silent_upstream_and_serves_once_it_answers(tmp_path: Path) -> None:
    import time

    from tests.procs import free_port

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tracegym").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "tracegym").chmod(0o755)
    (tmp_path / "www").mkdir()
    (tmp_path / "www/health").write_text("ok")
    port = free_port()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "TRACEGYM_UPSTREAM_WAIT": "2"}
    serve = subprocess.Popen(["sh", str(BIN / "tracegym-serve"), "--upstream", f"http://127.0.0.1:{port}", "--port",
                              "8000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    assert serve.poll() is None  # still waiting: no gateway started to fail and be restarted
    upstream = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                cwd=tmp_path / "www", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = serve.communicate(timeout=60)
    finally:
        upstream.kill()
        upstream.wait()
    assert serve.returncode == 0
    assert f"the inference server http://127.0.0.1:{port} has not answered /health in 2s; the gateway stays down" \
        in err and "in 4s;" in err
    assert f"http://127.0.0.1:{port} answers /health now" in err
    assert out.split() == ["serve", "--upstream", f"http://127.0.0.1:{port}", "--port", "8000"]
