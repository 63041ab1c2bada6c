"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A + B?" or "What is A - B?" (A > B) for 3-digit A and
B, no question in both files.

    python examples/langchain/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for the shared _tasks module
from _tasks import arithmetic, distinct, write


def task(rng: random.Random) -> dict:
    """A sum, or a difference of the larger minus the smaller."""
    a, b = rng.randint(101, 999), rng.randint(101, 999)
    return arithmetic(a, "+", b) if rng.random() < 0.5 else arithmetic(max(a, b), "-", min(a, b))


def main() -> None:
    rng = random.Random(11)
    rows = distinct(lambda: task(rng), 256 + 64)
    write(Path(__file__).parent, rows[:256], rows[256:])


if __name__ == "__main__":
    main()
