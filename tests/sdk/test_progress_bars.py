"""Third-party progress bars (transformers' "Loading weights", huggingface_hub's downloads) stay out of
files and logs: the CLI turns them off unless stderr is a terminal, before any command imports
transformers, and the processes it starts (the engine writing its log file) inherit that."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

from tracegym.progress import PROGRESS_BAR_SWITCHES, quiet_progress_bars

ROOT = Path(__file__).resolve().parents[2]

# what a command sees once tracegym.cli has run: are transformers' bars (and tqdm's) on?
PROBE = """
import sys
from tracegym.cli import main
from tracegym import cli
cli._load = lambda command: (lambda args: 0)  # the command itself is not needed, only what main sets up
main(["export", "--out", "x.jsonl"])
from transformers.utils import logging
import tqdm
bar = tqdm.tqdm(range(3), desc="Loading weights")
shown = not bar.disable
list(bar)
print("enabled" if logging.is_progress_bar_enabled() and shown else "disabled")
"""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_unless_a_terminal() -> None:
    env: dict[str, str] = {}
    assert quiet_progress_bars(io.StringIO(), env) and env == PROGRESS_BAR_SWITCHES
    env = {}
    assert not quiet_progress_bars(_Tty(), env) and env == {}
    env = {"TQDM_DISABLE": "0"}  # the user's choice stands
    quiet_progress_bars(io.StringIO(), env)
    assert env["TQDM_DISABLE"] == "0" and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PROGRESS_BAR_SWITCHES}


def test_no_bar_in_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with log.open("w") as f:
        res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, stdout=subprocess.PIPE, stderr=f,
                             text=True, env=_clean_env(), timeout=120)
    assert res.returncode == 0, log.read_text()
    assert res.stdout.strip() == "disabled"
    assert "Loading weights" not in log.read_text()


def test_bars_stay_on_a_terminal() -> None:
    leader, follower = pty.openpty()
    try:
        res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, stdout=subprocess.PIPE, stderr=follower,
                             text=True, env=_clean_env(), timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert res.returncode == 0 and res.stdout.strip() == "enabled"
