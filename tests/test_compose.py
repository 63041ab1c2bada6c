"""docker-compose.yml (and its two-engines override): valid for `docker-compose config`, and every tracegym
service runs a real CLI command."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tracegym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
TWO_ENGINES = ROOT / "docker-compose.two-engines.yml"


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
    args = build_parser().parse_args(gw)
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
    assert s["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    assert all(not svc.get("ports") for name, svc in s.items() if name != "gateway")
    env_of = yaml.safe_load(COMPOSE.read_text())["x-tracegym"]["environment"]
    for var in ("TRACEGYM_ADMIN_KEY", "TRACEGYM_ENGINE_API_KEY", "TRACEGYM_UPSTREAM_API_KEY"):
        assert env_of[var].startswith("${TRACEGYM_ADMIN_KEY:?"), var
    assert env_of["TRACEGYM_WEIGHTS_DIR"] == "/weights"


def test_every_tracegym_service_command_parses() -> None:
    parser = build_parser()
    checked = []
    for name, svc in _services().items():
        if svc.get("image", "").startswith("tracegym") or "build" in svc:
            cmd = [c.replace("${MODEL:-smollm2-135m}", "smollm2-135m") for c in svc["command"]]
            args = parser.parse_args(cmd)  # SystemExit (a test failure) on an unknown command or flag
            assert args.command == cmd[0]
            checked.append(name)
    assert {"engine", "gateway", "trainer", "runner"} <= set(checked)


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
    assert (ROOT / "examples/quickstart/agent.py").is_file()
