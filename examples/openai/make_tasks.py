"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A * B?" for 2-digit A and B, no pair in both files.

    python examples/openai/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for the shared _tasks module
from _tasks import arithmetic, write


def main() -> None:
    rng = random.Random(7)
    pairs = rng.sample([(a, b) for a in range(11, 100) for b in range(11, 100)], 256 + 64)
    rows = [arithmetic(a, "*", b) for a, b in pairs]
    write(Path(__file__).parent, rows[:256], rows[256:])


if __name__ == "__main__":
    main()
