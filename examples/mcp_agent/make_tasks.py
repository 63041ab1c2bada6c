"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 4
held-out tasks, to try the agent by hand): half "What is A + B?" for 3-digit A and B, half "What is the
capital of X?" for a country of ``server.py``'s table; the held-out countries are not among the training
ones.

    python examples/mcp_agent/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from server import CAPITALS


def main() -> None:
    rng = random.Random(23)
    countries = sorted(CAPITALS)
    rng.shuffle(countries)
    split = {"train": countries[:80], "eval": countries[80:]}
    here = Path(__file__).parent
    for name, n in (("train", 256), ("eval", 64)):
        rows = []
        for i in range(n):
            if i % 2:
                country = split[name][(i // 2) % len(split[name])]
                rows.append({"task_id": f"{name}-capital-{i:03d}-{country}",
                             "input": {"question": f"What is the capital of {country.title()}?",
                                       "answer": CAPITALS[country]}})
            else:
                a, b = rng.randint(101, 999), rng.randint(101, 999)
                rows.append({"task_id": f"{name}-add-{i:03d}-{a}-{b}",
                             "input": {"question": f"What is {a} + {b}?", "answer": str(a + b)}})
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name == "eval":
            (here / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))


if __name__ == "__main__":
    main()
