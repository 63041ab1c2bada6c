"""Writes ``train.jsonl`` and ``eval.jsonl``: each task is a small table of boxes with secret codes (the
tool's data) and the box asked about. The held-out split asks about colours the training split never
names, so what it measures is the protocol (look up, then answer), not memorised codes.

    python examples/tool_agent/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_COLOURS = [
    "red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey", "gold",
    "silver", "violet", "cyan", "olive", "navy", "teal", "maroon", "beige", "coral", "ivory", "lime", "plum",
]
EVAL_COLOURS = ["amber", "indigo", "scarlet", "crimson", "azure", "bronze", "copper", "jade", "lilac", "ruby",
                "tan", "mint"]
BOXES_PER_TASK = 4


def tasks(colours: list[str], n: int, rng: random.Random, prefix: str) -> list[dict]:
    out = []
    for i in range(n):
        names = rng.sample(colours, BOXES_PER_TASK)
        codes = {c: rng.randint(1000, 9999) for c in names}
        asked = names[0]
        out.append({"task_id": f"{prefix}-{i:03d}-{asked}",
                    "input": {"colour": asked, "codes": codes, "answer": codes[asked]}})
    return out


def main() -> None:
    rng = random.Random(18)
    here = Path(__file__).parent
    for name, colours, n in (("train", TRAIN_COLOURS, 256), ("eval", EVAL_COLOURS, 64)):
        rows = tasks(colours, n, rng, name)
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
