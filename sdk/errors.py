"""``UserError``: a mistake the user can fix (a wrong model name, a missing database or task file, a port in
use). The CLI prints it as one or two lines, the problem and then the fix, and exits with code 2 without a
traceback (``tracegym --debug ...`` or ``TRACEGYM_DEBUG=1`` shows it)."""

from __future__ import annotations

USAGE_EXIT_CODE = 2
"""What every ``tracegym`` command exits with on a ``UserError`` (argparse uses it for bad arguments too)."""


class UserError(Exception):
    """``problem``: what is wrong, naming the thing (file, URL, name); ``fix``: what to do about it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem}\n{self.fix}" if self.fix else self.problem
