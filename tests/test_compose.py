"""docker-compose.yml: valid for `docker-compose config`, and every tracegym service runs a real CLI command."""

from __future__ import annotations

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
    res = subprocess.run([exe, "--profile", profile, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


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
