"""The recipe's datasets: JSONL tasks read with recipe-level errors, and the held-out split."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from tracegym.trainer.recipe import RecipeError, TrainRecipe

log = logging.getLogger(__name__)

EVAL_FRACTION_CAP = 5
"""Without ``data.eval_path``, at most ``1/EVAL_FRACTION_CAP`` of the tasks are held out for evaluation."""


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The recipe's JSONL tasks (the same format as ``tracegym enqueue``), with recipe-level errors."""
    from tracegym.tasks import read_tasks

    if not path.is_file():
        raise RecipeError(f"dataset not found: {path}")
    try:
        tasks = read_tasks(path)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if not tasks:
        raise RecipeError(f"dataset is empty: {path}")
    return tasks


def split_tasks(recipe: TrainRecipe) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_tasks, eval_tasks)``: ``data.eval_path`` as the held-out set, or else ``data.eval_size``
    tasks split off ``data.path`` (at most a fifth of them; warned about when that cuts ``eval_size``).
    An empty held-out set means no evaluation."""
    train_tasks = load_tasks(recipe.data.path)
    if recipe.data.eval_path:
        return train_tasks, load_tasks(recipe.data.eval_path)
    random.Random(recipe.data.shuffle_seed).shuffle(train_tasks)
    want = recipe.data.eval_size
    n = min(want, len(train_tasks) // EVAL_FRACTION_CAP)
    if n < want:
        log.warning(
            "data.eval_size %d cut to %d: at most 1/%d of the %d tasks in %s are held out%s",
            want, n, EVAL_FRACTION_CAP, len(train_tasks), recipe.data.path,
            "; there will be no evaluation (set data.eval_path)" if n == 0 else "",
        )  # fmt: skip
    return train_tasks[n:], train_tasks[:n]
