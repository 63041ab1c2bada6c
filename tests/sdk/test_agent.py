"""The agent function as the runner sees it: loading a target, reading its return value as a reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sdk import agents
from tracegym.agent import as_reward, load_target


def test_load_target(tmp_path: Path) -> None:
    assert load_target("tests.sdk.agents:echo_reward") is agents.echo_reward
    f = tmp_path / "my_agent.py"
    f.write_text("def agent(task, base_url):\n    return 1.0\n")
    assert load_target(f"{f}:agent")({}, "") == 1.0
    for bad, err in [
        ("nocolon", ValueError),
        (f"{f}:missing", AttributeError),
        ("x.py:f", FileNotFoundError),
    ]:
        with pytest.raises(err):
            load_target(bad)


def test_as_reward() -> None:
    assert as_reward(None) is None and as_reward(1) == 1.0 and as_reward(0.5) == 0.5
    for bad, err in [
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("1", TypeError),
    ]:
        with pytest.raises(err, match="expected a float or None"):
            as_reward(bad)
