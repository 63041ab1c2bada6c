"""docker-compose.yml: valid for `docker-compose config`, and every tracegym service runs a real CLI command."""

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


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_config_is_valid(profile: str) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (.ci/run installs the Debian package)")
    env = {**os.environ, "TRACEGYM_ADMIN_KEY": "compose-test-key"}
    res = subprocess.run([exe, "--profile", profile, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                         env=env)
    assert res.returncode == 0, res.stderr


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
    from tracegym.trainer.config import load_recipe

    recipe = load_recipe(ROOT / "examples/quickstart/recipe-compose.yaml")
    assert recipe.gateway_url == "http://gateway:8000" and recipe.agent.external
    assert (ROOT / "examples/quickstart/agent.py").is_file()
