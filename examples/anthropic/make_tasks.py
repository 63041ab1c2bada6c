"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A / B?" for a 4-digit A that a 2-digit B divides, no
pair in both files.

    python examples/anthropic/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(17)
    pairs = [(b * q, b) for b in range(11, 100) for q in range(11, 100) if 1000 <= b * q <= 9999]
    pairs = rng.sample(pairs, 256 + 64)
    here = Path(__file__).parent
    for name, chunk in (("train", pairs[:256]), ("eval", pairs[256:])):
        rows = [{"task_id": f"div-{a}-{b}", "input": {"question": f"What is {a} / {b}?", "answer": a // b}}
                for a, b in chunk]
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name == "eval":
            (here / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))


if __name__ == "__main__":
    main()
