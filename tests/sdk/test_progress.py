"""The progress line off a terminal: a line every ``interval`` seconds, none before the first interval (a
quick export printed a stray 'exported 1' before its final line), and the final line always."""

from __future__ import annotations

import io

from tracegym.progress import Progress


def test_off_a_terminal_the_first_line_waits_an_interval_and_the_last_always_comes() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(out, interval=5.0, clock=lambda: now[0])
    bar.update("exported 1")  # at once: nothing yet
    now[0] = 4.9
    bar.update("exported 2")
    assert out.getvalue() == ""
    now[0] = 5.0
    bar.update("exported 3")
    bar.update("exported 4")  # within the interval: nothing
    now[0] = 10.0
    bar.update("exported 3")  # unchanged: nothing
    bar.print("a permanent line")
    now[0] = 14.0
    bar.update("exported 5")  # 4 s after the permanent line: nothing
    bar.close("exported 5 records")
    assert out.getvalue().splitlines() == ["exported 3", "a permanent line", "exported 5 records"]
