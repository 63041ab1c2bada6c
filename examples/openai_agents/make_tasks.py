"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A - B?" for 4-digit A > B, no pair in both files.

    python examples/openai_agents/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for the shared _tasks module
from _tasks import arithmetic, write


def main() -> None:
    rng = random.Random(19)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < 256 + 64:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        if a != b:
            pairs.add((max(a, b), min(a, b)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    rows = [arithmetic(a, "-", b) for a, b in ordered]
    write(Path(__file__).parent, rows[:256], rows[256:])


if __name__ == "__main__":
    main()
