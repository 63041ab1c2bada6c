"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 3
held-out tasks, to try the agent by hand): "What is A + B?" or "What is A - B?" (A > B) for 3-digit A and
B, no question in both files.

    python examples/langchain/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(11)
    seen: set[str] = set()
    rows = []
    while len(rows) < 256 + 64:
        a, b = rng.randint(101, 999), rng.randint(101, 999)
        if rng.random() < 0.5:
            question, answer, tid = f"What is {a} + {b}?", a + b, f"add-{a}-{b}"
        else:
            a, b = max(a, b), min(a, b)
            question, answer, tid = f"What is {a} - {b}?", a - b, f"sub-{a}-{b}"
        if question not in seen:
            seen.add(question)
            rows.append({"task_id": tid, "input": {"question": question, "answer": answer}})
    here = Path(__file__).parent
    for name, chunk in (("train", rows[:256]), ("eval", rows[256:])):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    (here / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[256:259]))


if __name__ == "__main__":
    main()
