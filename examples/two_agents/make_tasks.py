"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A times B?" for 2-digit A and B, "What is A plus B?"
and "What is A minus B?" (A > B) for 3-digit A and B, the operation in words; no question in both files.

    python examples/two_agents/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for the shared _tasks module
from _tasks import arithmetic, distinct, write

WORDS = {"*": "times", "+": "plus", "-": "minus"}


def task(rng: random.Random) -> dict:
    """One question, its operation in words."""
    op = rng.choice("*+-")
    if op == "*":
        a, b = rng.randint(11, 99), rng.randint(11, 99)
    else:
        a, b = sorted((rng.randint(101, 999), rng.randint(101, 999)), reverse=True)
    row = arithmetic(a, op, b)
    row["input"]["question"] = f"What is {a} {WORDS[op]} {b}?"
    return row


def main() -> None:
    rng = random.Random(29)
    rows = distinct(lambda: task(rng), 256 + 64)
    write(Path(__file__).parent, rows[:256], rows[256:])


if __name__ == "__main__":
    main()
