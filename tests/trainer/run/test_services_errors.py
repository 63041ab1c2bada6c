"""A child of ``tracegym train`` that stops on a usage error (exit code 2: a bad agent target, a task file)
surfaces as the user error it printed, not as a traceback with its whole log."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tracegym.errors import UserError
from tracegym.procs import start_process
from tracegym.trainer.run.services import Services

ERROR = ("import sys; print('claiming...'); "
         "print('tracegym run: agent target nope:agent: no module named nope', file=sys.stderr); "
         "print('pass MODULE:FUNCTION, importable from the recipe folder', file=sys.stderr); sys.exit({code})")


def _dead_child(tmp_path: Path, code: int):
    p = start_process([sys.executable, "-c", ERROR.format(code=code)], port=None, log_path=tmp_path / "runner.log",
                      name="runner")
    deadline = time.monotonic() + 30
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not p.alive()
    return p


def test_a_usage_error_of_a_child_is_its_own_two_lines(tmp_path: Path) -> None:
    services = Services(gateway_url="", upstream_url="", procs=[_dead_child(tmp_path, 2)])
    with pytest.raises(UserError) as e:
        services.check_alive()
    assert str(e.value) == ("the runner stopped: agent target nope:agent: no module named nope\n"
                            "pass MODULE:FUNCTION, importable from the recipe folder")


def test_any_other_exit_keeps_the_childs_log(tmp_path: Path) -> None:
    services = Services(gateway_url="", upstream_url="", procs=[_dead_child(tmp_path, 1)])
    with pytest.raises(RuntimeError, match=r"runner exited with code 1; its log:\n(.|\n)*claiming"):
        services.check_alive()
