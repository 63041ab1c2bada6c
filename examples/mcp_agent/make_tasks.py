"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (64 held-out tasks) and ``tasks.jsonl`` (the first 4
held-out tasks, to try the agent by hand): half "What is A + B?" for 3-digit A and B, half "What is the
capital of X?" for a country of ``server.py``'s table; the held-out countries are not among the training
ones.

    python examples/mcp_agent/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from server import CAPITALS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for the shared _tasks module
from _tasks import write


def tasks(name: str, n: int, countries: list[str], rng: random.Random) -> list[dict]:
    """Odd rows ask for a capital of ``countries``, even rows for a sum."""
    rows = []
    for i in range(n):
        if i % 2:
            country = countries[(i // 2) % len(countries)]
            rows.append(
                {
                    "task_id": f"{name}-capital-{i:03d}-{country}",
                    "input": {
                        "question": f"What is the capital of {country.title()}?",
                        "answer": CAPITALS[country],
                    },
                }
            )
        else:
            a, b = rng.randint(101, 999), rng.randint(101, 999)
            rows.append(
                {
                    "task_id": f"{name}-add-{i:03d}-{a}-{b}",
                    "input": {"question": f"What is {a} + {b}?", "answer": str(a + b)},
                }
            )
    return rows


def main() -> None:
    rng = random.Random(23)
    countries = sorted(CAPITALS)
    rng.shuffle(countries)
    train = tasks("train", 256, countries[:80], rng)
    write(Path(__file__).parent, train, tasks("eval", 64, countries[80:], rng), shown=4)


if __name__ == "__main__":
    main()
