"""The README's generated parts match the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_reference_is_generated_from_the_config() -> None:
    res = subprocess.run([sys.executable, "scripts/gen_readme_reference.py", "--check"], cwd=ROOT)
    assert res.returncode == 0, "README recipe table is stale: run python scripts/gen_readme_reference.py"


def test_readme_names_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "tracegym train examples/quickstart/recipe.yaml" in text
    assert "bash .ci/run" in text
    assert (ROOT / "scripts/install.sh").is_file() and (ROOT / "scripts/test.sh").is_file()
