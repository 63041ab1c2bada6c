"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A * B?" for a 3-digit A and a 1-digit B (2-9), no
pair in both files.

    python examples/autogen/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(13)
    pairs = rng.sample([(a, b) for a in range(101, 1000) for b in range(2, 10)], 256 + 64)
    here = Path(__file__).parent
    for name, chunk in (("train", pairs[:256]), ("eval", pairs[256:])):
        rows = [{"task_id": f"mul-{a}-{b}", "input": {"question": f"What is {a} * {b}?", "answer": a * b}}
                for a, b in chunk]
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name == "eval":
            (here / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))


if __name__ == "__main__":
    main()
