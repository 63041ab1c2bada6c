"""Slow: two recipes of tinker-cookbook (PyPI, 0.6.1), ``recipes/sl_loop.py`` and ``recipes/rl_loop.py``, run
as published against ``tracegym tinker-serve`` on SmolLM2-135M-Instruct (``cookbook_recipe.py`` points their
tokenizer, renderer and dataset lookups at local ones). The supervised recipe's loss must fall; the RL
recipe, started from the supervised recipe's saved state (its answers in the ``\\boxed{}`` form the RL
recipe's grader reads), must raise its reward.

tinker-cookbook 0.6.1 requires ``tml-renderers>=0.4.1``, which the package index does not serve, so it cannot
be a dependency of the project (``pip check`` would fail): this test installs it and the few packages these
two recipes import, pinned and without their dependencies, into a folder of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ManagedProcess
from tests.trainer.service.conftest import SMOLLM2_KEY

pytestmark = [pytest.mark.slow, pytest.mark.learns]

COOKBOOK = ["tinker-cookbook==0.6.1", "chz==0.4.0", "blobfile==3.3.0", "lxml==6.1.3", "pycryptodomex==3.24.2",
            "termcolor==3.3.0", "pyrage==1.4.0", "pylatexenc==2.11", "math-verify==0.9.0",
            "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2"]
"""The cookbook and what sl_loop and rl_loop import beyond this project's own dependencies."""
HERE = Path(__file__).resolve().parent
RL_STEPS = 9


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("cookbook")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *COOKBOOK],
                   check=True, timeout=600)
    return target


def _run(kind: str, service: ManagedProcess, cookbook: Path, log: Path, steps: int,
         start: str | None = None) -> list[dict]:
    from tracegym.modelfiles.prepare import prepare_model

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cookbook), os.environ.get("PYTHONPATH", "")]),
           "TINKER_API_KEY": "tml-" + SMOLLM2_KEY, "TINKER_TELEMETRY": "0"}
    out = subprocess.run([sys.executable, str(HERE / "cookbook_recipe.py"), kind, service.base_url, "smollm2-135m",
                          str(prepare_model("smollm2-135m")), str(log), str(steps), *([start] if start else [])],
                         env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sl_run(smollm2_service: ManagedProcess, cookbook: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("cookbook") / "sl"
    _run("sl", smollm2_service, cookbook, log, steps=10)
    return log


def test_cookbook_sl_loop_loss_falls(sl_run: Path) -> None:
    rows = [json.loads(line) for line in (sl_run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    print(f"cookbook sl_loop train_mean_nll: {[round(x, 3) for x in nll]}")
    assert len(nll) == 10
    assert sum(nll[-3:]) / 3 < 0.6 * sum(nll[:3]) / 3, nll


@pytest.mark.timeout(1800)
def test_cookbook_rl_loop_from_the_sl_state_raises_its_reward(smollm2_service: ManagedProcess, cookbook: Path,
                                                              sl_run: Path, tmp_path: Path) -> None:
    [state] = [json.loads(line)["state_path"] for line in (sl_run / "checkpoints.jsonl").read_text().splitlines()
               if "state_path" in line]
    rows = _run("rl", smollm2_service, cookbook, tmp_path / "rl", steps=RL_STEPS, start=state)
    rewards = [r["reward/total"] for r in rows if "reward/total" in r]
    print(f"cookbook rl_loop reward/total: {[round(r, 3) for r in rewards]}")
    assert len(rewards) == RL_STEPS
    third = RL_STEPS // 3
    assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third + 0.05, rewards
