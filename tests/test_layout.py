"""The layout promises of README's map of the code: small files, a thin gateway top level, and import
contracts that cover every SDK module (``scripts/lint_imports.sh`` checks the contracts themselves)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdk", "gateway", "trainer", "engine", "modelfiles")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_no_python_file_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_gateway_top_level_holds_at_most_8_modules() -> None:
    modules = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(modules) <= 8, modules


NUMPY_SDK_MODULES = {"tracegym.arrays"}
"""SDK modules that import numpy, for the gateway and the trainer: left out of "nothing heavy" only."""


def test_sdk_contracts_name_every_sdk_module() -> None:
    modules = {"tracegym"} | {f"tracegym.{p.stem}" for p in (ROOT / "sdk").glob("*.py") if p.stem != "__init__"}
    sdk_contracts = [c for c in _contracts() if c["name"].startswith("The SDK")]
    assert len(sdk_contracts) == 2
    for contract in sdk_contracts:
        light = "heavy" in contract["name"]
        assert set(contract["source_modules"]) == (modules - NUMPY_SDK_MODULES if light else modules), \
            contract["name"]


def _layers(container: str) -> list[str]:
    [layers] = [c for c in _contracts() if c["type"] == "layers" and c["containers"] == [container]]
    return layers["layers"]


def _rooms(folder: str) -> list[str]:
    return sorted(p.parent.name for p in (ROOT / folder).glob("*/__init__.py"))


def test_gateway_rooms_are_layered() -> None:
    assert _layers("tracegym.gateway") == ["api", "proxy", "traces"]
    assert _rooms("gateway") == ["api", "proxy", "traces"]


def test_trainer_rooms_are_layered_and_each_has_its_tests() -> None:
    """run and the training service over workers and weights over algorithms; the top level holds only the
    recipe and its sections."""
    assert _layers("tracegym.trainer") == ["run | service", "workers | weights", "algorithms"]
    assert _rooms("trainer") == ["algorithms", "run", "service", "weights", "workers"]
    assert sorted(p.name for p in (ROOT / "trainer").glob("*.py")) == ["__init__.py", "recipe.py", "settings.py"]
    for room in _rooms("trainer"):
        assert (ROOT / "tests" / "trainer" / room / "__init__.py").is_file(), room
