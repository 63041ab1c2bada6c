"""The CLI describes itself: a version, a description of what tracegym is, and help on every option."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tracegym.cli import build_parser


def test_version_and_description() -> None:
    out = subprocess.run([sys.executable, "-m", "tracegym.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("tracegym ") and out.split()[1][0].isdigit()
    assert "reinforcement learning" in build_parser().description


def test_every_option_of_every_command_has_help() -> None:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, parser in sub.choices.items() for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []
    assert all(p.description for p in sub.choices.values())
