"""The task file: JSONL, one task a line, read by ``tracegym enqueue`` and by the training recipe's
dataset (``data.path``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASK_FIELDS = ("task_id", "input", "split", "metadata")


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks of a JSONL file: a line with an ``"input"`` key is a task (``task_id``, ``input``,
    ``split``, ``metadata``); any other JSON value is the input itself. Blank lines are skipped."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON: {e}") from e
            tasks.append(_as_task(obj, f"{path}:{n}"))
    return tasks


def _as_task(obj: Any, where: str) -> dict[str, Any]:
    if not (isinstance(obj, dict) and "input" in obj):
        return {"input": obj}
    extra = set(obj) - set(TASK_FIELDS)
    if extra:
        raise ValueError(
            f"{where}: unknown task fields {sorted(extra)} (a task line has task_id, input, "
            "split, metadata; put anything else inside input or metadata)"
        )
    return {k: obj[k] for k in TASK_FIELDS if obj.get(k) is not None}
