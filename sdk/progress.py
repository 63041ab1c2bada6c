"""Counters of a run and the progress line the runner and the exporter print on stderr; third-party
progress bars kept out of files and logs (``quiet_progress_bars``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TextIO

PROGRESS_BAR_SWITCHES = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
"""The environment that turns off the tqdm bars of transformers ("Loading weights"), huggingface_hub and
datasets (read when they are imported), and of any other tqdm (``TQDM_DISABLE``, tqdm >= 4.66)."""


def quiet_progress_bars(stream: TextIO, environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn third-party progress bars off for this process and the processes it starts, unless ``stream``
    (where they would be drawn: stderr) is a terminal: in a file or a log every redraw is a line of noise.
    A value the user set is kept. Call it before transformers is imported; returns whether they are off."""
    env = os.environ if environ is None else environ
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no terminal
        tty = False
    if tty:
        return False
    for name, value in PROGRESS_BAR_SWITCHES.items():
        env.setdefault(name, value)
    return True


@dataclass
class RunStats:
    """What a runner did: ``done`` completed, ``failed`` reported failed, ``lost`` dropped because the
    lease was lost, ``released`` handed back to the queue on stop, ``running`` in flight now."""

    done: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    running: int = 0
    rewards: list[float] = field(default_factory=list)

    def record_done(self, reward: float | None) -> None:
        self.done += 1
        if reward is not None:
            self.rewards.append(reward)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def line(self) -> str:
        mean = "-" if self.mean_reward is None else f"{self.mean_reward:.3f}"
        extra = "".join(
            f" | {name} {n}" for name, n in (("lost", self.lost), ("released", self.released)) if n
        )
        return f"done {self.done} | failed {self.failed} | running {self.running} | mean reward {mean}{extra}"


class Progress:
    """One line rewritten in place on a TTY (at most every ``tty_interval`` s); otherwise a line every
    ``interval`` seconds when something changed, the first one ``interval`` seconds after the start (so a
    command that ends sooner prints only its final line). ``print`` writes a permanent line (and counts as
    output for the interval); ``close`` prints the final line. ``clock`` is injectable for tests."""

    def __init__(
        self,
        stream: TextIO,
        *,
        interval: float = 10.0,
        tty_interval: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = tty_interval if self.tty else interval
        self.clock = clock
        self._last_time = clock() if not self.tty else -float("inf")
        self._last_text = ""

    def update(self, stats: RunStats | str) -> None:
        text = stats if isinstance(stats, str) else stats.line()
        now = self.clock()
        if text == self._last_text or now - self._last_time < self.interval:
            return
        self._write(text)
        self._last_time, self._last_text = now, text

    def print(self, text: str) -> None:
        """A permanent line (clearing the live line on a TTY); the next live line waits ``interval``."""
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
        self.stream.flush()
        self._last_time, self._last_text = self.clock(), ""

    def close(self, stats: RunStats | str) -> None:
        text = stats if isinstance(stats, str) else stats.line()
        self._write(text)
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
