"""The layout promises of README's architecture map: small files, a thin gateway top level, and import
contracts that cover every SDK module (``scripts/lint_imports.sh`` checks the contracts themselves)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sdk", "gateway", "trainer")


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


def test_gateway_rooms_are_layered() -> None:
    [layers] = [c for c in _contracts() if c["type"] == "layers"]
    assert layers["containers"] == ["tracegym.gateway"] and layers["layers"] == ["api", "proxy", "traces"]
    rooms = sorted(p.parent.name for p in (ROOT / "gateway").glob("*/__init__.py"))
    assert rooms == ["api", "proxy", "traces"]
