"""Writes ``train.jsonl`` (256 tasks), ``eval.jsonl`` (32 held-out tasks, no pair of numbers in both) and
``demos.jsonl``: 32 demonstrations, each a whole conversation on a training task in OpenAI message form,
the calculator call and its result included, as `tracegym import` takes them.

    python examples/tool_agent_sft/make_tasks.py      # deterministic: the committed files are its output
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from agent import TOOLS  # noqa: E402
from multiply_task import calculator, question  # noqa: E402

N_TRAIN, N_EVAL, N_DEMOS = 256, 32, 32


def demonstration(a: int, b: int, k: int) -> dict:
    """The conversation the agent should have: one call with the right expression, then the result."""
    expression = f"{a} * {b}"
    call_id = f"call_{k:03d}"
    result = calculator(expression)
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": question(a, b)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "calculator",
                            "arguments": json.dumps({"expression": expression}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": result},
            {"role": "assistant", "content": result},
        ],
    }


def main() -> None:
    rng = random.Random(11)
    pairs = rng.sample([(a, b) for a in range(11, 100) for b in range(11, 100)], N_TRAIN + N_EVAL)
    splits = {"train": pairs[:N_TRAIN], "eval": pairs[N_TRAIN:]}
    for name, chunk in splits.items():
        rows = [{"task_id": f"mul-{a}-{b}", "input": {"a": a, "b": b, "answer": a * b}} for a, b in chunk]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = [demonstration(a, b, k) for k, (a, b) in enumerate(splits["train"][:N_DEMOS])]
    (HERE / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))


if __name__ == "__main__":
    main()
