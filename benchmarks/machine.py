"""What this machine's speed was while a benchmark ran, printed beside its results.

The machines these benchmarks run on differ (and one machine drifts: the same instruction count has taken
up to 2.5x longer from one session to the next), so absolute rates are only comparable together with a
reference: ``python_loop_ns`` times a fixed pure-Python loop that also allocates (a small list per
iteration, as decoding rows does).
"""

from __future__ import annotations

import os
import time


def python_loop_ns(n: int = 2_000_000) -> float:
    """CPU nanoseconds per iteration of ``for i in range(n): s += len([i, s])`` (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        s = 0
        for i in range(n):
            s += len([i, s])
        best = min(best, time.process_time() - t)
    return best / n * 1e9


def describe() -> str:
    """One line: the reference loop's speed and the load average."""
    return (f"machine: reference Python loop {python_loop_ns():.0f} ns/iter, load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
