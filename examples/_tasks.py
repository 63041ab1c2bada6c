"""What the examples' ``make_tasks.py`` scripts share: an arithmetic task row, and the three task files.

Each script imports it with ``examples/`` on ``sys.path`` and stays the one place that says what its
example's tasks are.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from pathlib import Path

OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "+": ("add", operator.add), "-": ("sub", operator.sub), "*": ("mul", operator.mul), "/": ("div", operator.floordiv),
}  # fmt: skip


def arithmetic(a: int, op: str, b: int) -> dict:
    """The task "What is A op B?" with its answer, e.g. ``{"task_id": "mul-23-41", "input": {...}}``."""
    name, apply = OPS[op]
    return {
        "task_id": f"{name}-{a}-{b}",
        "input": {"question": f"What is {a} {op} {b}?", "answer": apply(a, b)},
    }


def distinct(draw: Callable[[], dict], n: int) -> list[dict]:
    """``n`` tasks from ``draw()``, no question twice (the first draw of each is kept)."""
    rows: dict[str, dict] = {}
    while len(rows) < n:
        row = draw()
        rows.setdefault(row["input"]["question"], row)
    return list(rows.values())


def write(here: Path, train: list[dict], held_out: list[dict], shown: int = 3) -> None:
    """``train.jsonl``, ``eval.jsonl`` (the held-out tasks) and ``tasks.jsonl`` (the first ``shown`` held-out
    tasks, to try the agent by hand) in ``here``."""
    for name, rows in (("train", train), ("eval", held_out), ("tasks", held_out[:shown])):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
