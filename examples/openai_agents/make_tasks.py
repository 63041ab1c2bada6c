"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A - B?" for 4-digit A > B, no pair in both files.

    python examples/openai_agents/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(19)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < 256 + 64:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        if a != b:
            pairs.add((max(a, b), min(a, b)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    here = Path(__file__).parent
    for name, chunk in (("train", ordered[:256]), ("eval", ordered[256:])):
        rows = [{"task_id": f"sub-{a}-{b}", "input": {"question": f"What is {a} - {b}?", "answer": a - b}}
                for a, b in chunk]
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name == "eval":
            (here / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))


if __name__ == "__main__":
    main()
